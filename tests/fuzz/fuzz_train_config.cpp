// libFuzzer target for the SDXL trainer's TOML configuration
// (sdxl::train_config_from_toml in examples/sdxl/train_config.cpp).
// Any input must either give a validated TrainConfig or raise a zero::Error
// (InvalidArgument naming the key); every other exception, crash, sanitizer
// report, leak or hang is a bug. A configuration that is accepted must also
// survive its own record: to_toml() is what checkpoints store and what
// saved_freeze() reads back on resume, so it must parse to the same lists.
// Built by tests/fuzz/CMakeLists.txt (see README.md there).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "train_config.hpp"
#include "zero/core/error.hpp"

namespace {

bool same_lists(const sdxl::TrainConfig& a, const sdxl::TrainConfig& b) {
  if (a.freeze != b.freeze || a.lora_targets != b.lora_targets || a.no_weight_decay != b.no_weight_decay)
    return false;
  if (a.optimizer_groups.size() != b.optimizer_groups.size()) return false;
  for (std::size_t i = 0; i < a.optimizer_groups.size(); ++i)
    if (a.optimizer_groups[i].name != b.optimizer_groups[i].name ||
        a.optimizer_groups[i].params != b.optimizer_groups[i].params)
      return false;
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  sdxl::TrainConfig config;
  try {
    config = sdxl::train_config_from_toml(text, "fuzz-input");
  } catch (const zero::Error&) {
    return 0;  // refused with a message, as expected for a bad configuration
  }
  // Accepted: what a checkpoint records must read back as the same configuration.
  const std::string saved = config.to_toml();
  const sdxl::TrainConfig again = sdxl::train_config_from_toml(saved, "fuzz-saved");
  if (!same_lists(config, again) || again.to_toml() != saved) std::abort();
  const auto freeze = sdxl::saved_freeze(saved);
  if (!freeze || *freeze != config.freeze) std::abort();
  return 0;
}
