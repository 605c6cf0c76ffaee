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

namespace sdxl {

/// The trained model's prediction on fixed inputs (seed 7), which rank 0
/// writes to output_dir/export_check.safetensors next to the export, so that
/// anyone can check the exported UNet reproduces it (unet_forward). Every
/// rank runs the forward: under stage 3 it gathers parameters.
void write_export_check(const TrainConfig& c, UNet2DConditionModel& model, const data::TextDims& text,
                        torch::Device device, torch::ScalarType compute_type, bool leader);

/// A UNet of `ucfg` holding `weights` (fp32, in the order of `names`), saved
/// to the folder `where` (and `where`.safetensors with export_single_file).
void export_weights(const TrainConfig& c, const UNetConfig& ucfg, const std::vector<std::vector<float>>& weights,
                    const std::filesystem::path& where, const std::vector<std::string>& names);

/// output_dir/loss.svg from the loss column of output_dir/metrics.jsonl.
void write_loss_plot(const TrainConfig& c);

}  // namespace sdxl
