// Bounds on JSON text, checked before a document is built from it: a DOM
// costs 10-40 times the bytes of its text (a node per number, a map node per
// key), so a file within a size limit can still ask for gigabytes once parsed.
#pragma once

#include <cstddef>
#include <string_view>

namespace zero::io {

struct JsonLimits {
  std::size_t max_bytes = 0;   // of the text
  std::size_t max_values = 0;  // every number, string, boolean, null, array and object counts one
  std::size_t max_depth = 0;   // nesting of arrays and objects; a top-level object is depth 1
};

/// Reads `text` once without building anything (constant memory) and throws
/// zero::IoError naming `what` (e.g. "UNet config 'x.json'") and the limit
/// when the text is over a limit or is not JSON.
void check_json_limits(std::string_view text, const JsonLimits& limits, std::string_view what);

}  // namespace zero::io
