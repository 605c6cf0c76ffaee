// libFuzzer target for the checkpoint manifest reader (zero::io::parse_manifest).
// Any input must either parse or raise zero::IoError; every other exception,
// crash, sanitizer report, leak or hang is a bug. A manifest that parses as
// version 2 must also write back (manifest_to_json) and read back the same.
// Built by tests/fuzz/CMakeLists.txt (see README.md there).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "zero/core/error.hpp"
#include "zero/checkpoint/checkpoint.hpp"

namespace {

bool same(const zero::io::CheckpointManifest& a, const zero::io::CheckpointManifest& b) {
  if (a.files.size() != b.files.size()) return false;
  for (std::size_t i = 0; i < a.files.size(); ++i)
    if (a.files[i].file != b.files[i].file || a.files[i].bytes != b.files[i].bytes ||
        a.files[i].crc32c != b.files[i].crc32c)
      return false;
  const auto& o = a.optimizer;
  const auto& p = b.optimizer;
  return a.version == b.version && a.step == b.step && a.world_size == b.world_size && a.stage == b.stage &&
         a.param_dtype == b.param_dtype && o.name == p.name && o.lr == p.lr && o.beta1 == p.beta1 &&
         o.beta2 == p.beta2 && o.eps == p.eps && o.weight_decay == p.weight_decay && o.momentum == p.momentum &&
         o.dampening == p.dampening && o.nesterov == p.nesterov && o.state_slots == p.state_slots &&
         a.loss_scale == b.loss_scale && a.layout.param_count == b.layout.param_count &&
         a.layout.param_numel == b.layout.param_numel && a.layout.padded_numel == b.layout.padded_numel &&
         a.layout.alignment == b.layout.alignment && a.layout.bucket_count == b.layout.bucket_count &&
         a.data_position == b.data_position && a.seed == b.seed && a.config == b.config;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  zero::io::CheckpointManifest manifest;
  try {
    manifest = zero::io::parse_manifest(text, "fuzz-input");
  } catch (const zero::IoError&) {
    return 0;  // malformed input, reported properly
  }
  if (manifest.version < 2) return 0;  // version 1 is read only, never written
  // Whatever the reader accepts, the writer must write and the reader take back unchanged.
  const auto again = zero::io::parse_manifest(zero::io::manifest_to_json(manifest), "fuzz-rewritten");
  if (!same(manifest, again)) std::abort();
  return 0;
}
