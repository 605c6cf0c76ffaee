// [lora]: the trainer's side of LoRA. The UNet gets adapters on the layers
// [lora] targets names (unet.hpp), every other parameter is frozen (the
// engine holds only its model-dtype values: no gradient, master weights,
// optimizer state or EMA), and the export writes the adapters in diffusers
// and kohya naming (lora_io.hpp), optionally merged into a full UNet.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "train_config.hpp"
#include "unet.hpp"

namespace sdxl {

inline bool lora_enabled(const TrainConfig& c) { return c.lora_rank > 0; }

/// alpha / rank as the adapters apply it ([lora] alpha = 0 means alpha = rank).
double lora_alpha(const TrainConfig& c);

/// The adapters [lora] asks for (rank, alpha, dropout, targets).
LoraOptions lora_options(const TrainConfig& c);

/// Adds the adapters (A drawn from [train] seed, the same on every rank) and,
/// with [lora] init_from, loads their starting values.
void add_lora_adapters(const TrainConfig& c, UNet2DConditionModelImpl& unet);

/// True for a LoRA parameter name ("….lora_A.weight", "….lora_B.weight").
bool is_lora_parameter(const std::string& name);

/// What the adapters train, for the start of the run.
std::string describe_lora(const TrainConfig& c, const UNet2DConditionModelImpl& unet,
                          const std::vector<std::string>& names, const std::vector<std::int64_t>& numels);

/// Seeds LibTorch's default generator for one micro-step's LoRA dropout from
/// (seed, step, micro-step, rank): a resumed run draws the masks the
/// uninterrupted one did. Nothing happens without dropout.
void seed_lora_dropout(const TrainConfig& c, std::int64_t step, std::int64_t micro, int rank);

/// The UNet with the adapters merged into its weights: fp32, by name.
struct MergedUNet {
  std::vector<std::string> names;
  std::vector<std::vector<float>> weights;
};

/// Writes `where`/pytorch_lora_weights.safetensors (diffusers/PEFT naming) and
/// `where`/lora_kohya.safetensors in [output] export_dtype from `weights`
/// (fp32, in the order of `names`, as the engine gathers them); with
/// [output] merge_lora returns the merged UNet (else nothing), for the
/// trainer's UNet exports.
MergedUNet export_lora(const TrainConfig& c, const UNetConfig& ucfg, const std::vector<std::vector<float>>& weights,
                       const std::vector<std::string>& names, const std::filesystem::path& where);

}  // namespace sdxl
