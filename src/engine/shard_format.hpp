// The checkpoint shard file's format, apart from the engine's buffers:
// the "zero.engine" metadata that Engine::save_state writes beside the
// tensors, the saved layouts rebuilt and checked, and how a saved placement
// maps onto this run's (by position when it is the same, else by name).
// Internal to src/engine.
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <string>
#include <vector>

#include "zero/core/layout.hpp"
#include "zero/io/safetensors.hpp"

namespace zero::detail {

inline constexpr const char* kShardFormat = "zero.engine.shard";
inline constexpr int kShardVersion = 1;

// A layout as save_state records it in the metadata.
nlohmann::json layout_json(const FlatLayout& layout);

// The "zero.engine" metadata of a shard, parsed; IoError naming the file.
nlohmann::json shard_metadata(const io::SafeTensorsFile& file, const std::string& path);

// Both layouts of a shard as save_state placed them: the trainable one and,
// where the shard has frozen parameters, the frozen one (else no bucket).
struct SavedLayouts {
  FlatLayout trainable, frozen;
  bool has_frozen = false;
};

// Where this run's parameters are in a checkpoint: its layouts, and for each
// parameter (of either kind) the index of the same one in the checkpoint's.
struct SavedPlacement {
  SavedLayouts old;
  std::vector<std::size_t> old_index, old_frozen_index;
  bool same = false;  // placed exactly as here: load_state's own file alone will do
};

// The checkpoint must hold the same parameters (names, sizes, shapes, groups,
// the same ones frozen); their order, units, alignment and world size may differ.
SavedPlacement match_saved(const nlohmann::json& state, const FlatLayout& here, const FlatLayout& here_frozen,
                           const std::string& path);

// Rank's shard of `now`, filled from the old ranks' shards (`sources`, in
// rank order) of the same parameters placed as `old`, in any units and order:
// parameter p of `now` is parameter old_index[p] of `old`. Padding is zero.
std::vector<float> reshard(const FlatLayout& now, const FlatLayout& old, const std::vector<std::size_t>& old_index,
                           int rank, const std::vector<const float*>& sources);

// The F32 tensor `name` of `count` elements, or null where the file lacks it;
// IoError naming the file where it has another type or size.
const float* shard_tensor(const io::SafeTensorsFile& file, const std::string& path, const char* name, std::size_t count);

}  // namespace zero::detail
