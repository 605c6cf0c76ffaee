// The engine's checkpoint shard format, for tools that read shard files
// without an engine (zero-ckpt, consolidation): one safetensors file per
// rank, written by Engine::save_state, with the training state's metadata
// under "zero.engine".
#pragma once

#include <cstdint>
#include <string>

#include "zero/core/layout.hpp"

namespace zero {

namespace io {
class SafeTensorsFile;
}

/// What Engine::save_state records in a shard file's "zero.engine" metadata.
struct SavedShard {
  int rank = 0;
  int world_size = 1;
  int stage = 0;
  std::int64_t step = 0;  // optimizer steps applied
  /// Optimizer steps skipped for non-finite gradients (0 in files written
  /// before they were counted): step + skipped_steps is every step taken.
  std::int64_t skipped_steps = 0;
  std::string param_dtype;  // fp32, bf16, fp16
  std::string optimizer;    // adamw, sgd, lion
  int state_slots = 0;
  double loss_scale = 1;
  /// The saved placement rebuilt: parameters in order (with their shapes
  /// where the writer recorded them), buckets, world size and alignment.
  FlatLayout layout;
  /// The frozen parameters' placement (tensor "frozen": their model-dtype
  /// values widened to fp32); no bucket when nothing was frozen.
  FlatLayout frozen_layout;
  /// The layout as recorded (canonical JSON text): equal text, same placement.
  std::string layout_text;
};

/// Reads and checks the metadata of a file written by Engine::save_state:
/// every key present with its type, and a layout that rebuilds to the padded
/// size recorded. Throws zero::IoError naming the file and the key.
SavedShard read_saved_shard(const io::SafeTensorsFile& file);

}  // namespace zero
