// What the trainer leaves behind at the end of a run: the UNet in diffusers'
// layout (and optionally one original-format file), a prediction on fixed
// inputs to check the export against, and the loss curve.
#pragma once

#include <torch/torch.h>

#include <filesystem>
#include <string>
#include <vector>

#include "data/dataset.hpp"
#include "train_config.hpp"
#include "unet.hpp"
#include "zero/engine/engine.hpp"

namespace sdxl {

/// The UNet a run starts from: PyTorch's initialisation drawn from [train]
/// seed, then (when set) the weights of [model] model_weights, in fp32 on the
/// host. The trainer hands it to the engine; the export builds it again for
/// the exact values of frozen parameters (exact_frozen_values).
UNet2DConditionModel starting_unet(const TrainConfig& c, const UNetConfig& ucfg);

/// An uninitialised UNet of `ucfg` in `options`' dtype and device (with
/// LoRA adapters when `lora` is given), and its parameters in the order of
/// `names` (the engine's, as Engine::gather_* and visit_params hand them
/// out), to be filled by the caller. zero::Error when the names do not match.
struct UNetInOrder {
  UNet2DConditionModel unet;
  std::vector<torch::Tensor> parameters;
};
UNetInOrder unet_in_order(const UNetConfig& ucfg, const std::vector<std::string>& names,
                          torch::TensorOptions options = torch::TensorOptions().dtype(torch::kFloat32),
                          const LoraOptions* lora = nullptr);

/// A fp32 UNet of `ucfg` holding `weights` (in the order of `names`).
UNet2DConditionModel unet_holding(const UNetConfig& ucfg, const std::vector<std::vector<float>>& weights,
                                  const std::vector<std::string>& names);

/// Frozen parameters keep their starting values, but the engine holds only
/// their rounding to the model dtype (bf16, fp16), which is what
/// Engine::gather_*_params returns for them. For each of `exports` (engine
/// order, as those return it) this puts back the exact starting values of
/// every frozen parameter, so that an exported UNet's frozen tensors equal
/// model_weights bit for bit. Throws zero::Error naming the parameter when a
/// starting value does not round to what the engine holds (model_weights or
/// the seed changed since the run that saved the checkpoint started).
/// With an fp32 model nothing is rounded and nothing is done.
void use_exact_frozen_values(const TrainConfig& c, const UNetConfig& ucfg, const zero::Engine& engine,
                             const std::vector<std::vector<std::vector<float>>*>& exports);

/// The trained model's prediction on fixed inputs (seed 7), which rank 0
/// writes to output_dir/export_check.safetensors next to the export, so that
/// anyone can check the exported UNet reproduces it (unet_forward). Every
/// rank runs the forward: under stage 3 it gathers parameters.
void write_export_check(const TrainConfig& c, UNet2DConditionModel& model, const data::TextDims& text,
                        torch::Device device, torch::ScalarType compute_type, bool leader);

/// Checked before training, so that a run does not train for hours and then
/// fail at its export: [output] export_full_checkpoint's base must be a
/// safetensors file holding `model`'s UNet in the original layout
/// (check_full_checkpoint_base). Rank 0 (`leader`) says what will be exported.
void check_export_options(const TrainConfig& c, const UNet2DConditionModelImpl& model, bool leader);

/// Refuses (zero::Error naming the tensor of `which` UNet and its largest
/// |value|) weights that export_dtype cannot hold: a finite value that would
/// round to infinity (fp16: |x| >= 65520). fp32 holds everything.
void check_export_range(const TrainConfig& c, const std::vector<std::vector<float>>& weights,
                        const std::vector<std::string>& names, const std::string& which);

/// A UNet of `ucfg` holding `weights` (fp32, in the order of `names`), saved
/// in export_dtype to the folder `where` (and `where`.safetensors in the
/// original layout with export_single_file); each file's size and CRC32C printed.
void export_weights(const TrainConfig& c, const UNetConfig& ucfg, const std::vector<std::vector<float>>& weights,
                    const std::filesystem::path& where, const std::vector<std::string>& names);

/// Every export of a finished run (rank 0), in export_dtype, each file
/// written atomically and reported with its size and CRC32C:
/// output_dir/unet (export_weights), the same for `ema` as unet_ema when not
/// empty, and with export_full_checkpoint output_dir/full_checkpoint.safetensors
/// holding the UNet export_full_checkpoint_unet names.
/// `weights` and `ema` (fp32) follow the order of `names`. Both are checked
/// with check_export_range before anything is written.
void export_unets(const TrainConfig& c, const UNetConfig& ucfg, const std::vector<std::vector<float>>& weights,
                  const std::vector<std::vector<float>>& ema, const std::vector<std::string>& names);

/// output_dir/loss.svg from the loss column of output_dir/metrics.jsonl.
void write_loss_plot(const TrainConfig& c);

}  // namespace sdxl
