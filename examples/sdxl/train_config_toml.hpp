// A trainer configuration's TOML text, read so that toml++ can neither run
// out of memory nor reach its undefined behaviour: the text's size and value
// count are bounded before a node is built, the code points toml++ 3.3
// mishandles are shielded (train_config_toml.cpp says which and why), and a
// syntax error names the text's origin. Internal to the trainer's
// configuration (train_config.cpp).
#pragma once

#include <string>
#include <string_view>

#define TOML_HEADER_ONLY 1
#define TOML_EXCEPTIONS 1
#include <toml++/toml.h>

namespace sdxl::detail {

/// Refuses a text too large or with too many values for a configuration
/// (zero::InvalidArgument naming `origin`), before toml++ sees it.
void check_config_bounds(std::string_view text, const std::string& origin);

/// A string read from a table that parse_toml() gave, as the text wrote it.
std::string unshield(std::string_view text);

/// toml::parse on the shielded text; a syntax error is an InvalidArgument naming origin:line:column.
toml::table parse_toml(std::string_view text, const std::string& origin);

/// The text of a configuration file, its size checked before it is read.
std::string read_config_text(const std::string& path);

/// `text` as a TOML basic string ("..."), with '"', '\\' and every control
/// character escaped: any text, a newline or "'''" included, reads back as
/// itself. (toml++ 3.3's own printer writes a string holding a newline as a
/// multi-line literal, which "'''" inside it breaks.)
std::string toml_string(std::string_view text);

}  // namespace sdxl::detail
