// LoRA adapter files in the two namings that SDXL tools load:
//
//  * diffusers/PEFT (StableDiffusionXLPipeline.load_lora_weights, the
//    `pytorch_lora_weights.safetensors` that diffusers' scripts write):
//    "unet.<diffusers module>.lora_A.weight" [rank, in] and ".lora_B.weight"
//    [out, rank], and PEFT's LoraConfig in the "lora_adapter_metadata" header
//    entry ("unet.r", "unet.lora_alpha", "unet.target_modules").
//  * kohya (sd-scripts; what AUTOMATIC1111/Forge and ComfyUI load):
//    "lora_unet_<original module, '.' -> '_'>.lora_down.weight" [rank, in],
//    ".lora_up.weight" [out, rank] and ".alpha" (a scalar), with the module
//    named as in the original SDXL checkpoint ("input_blocks.4.1.…").
//
// Both apply W x + (alpha / rank) B A x. Loaders that predate the metadata
// entry take alpha = rank for the diffusers naming, so that file stores B
// with alpha / rank already multiplied in and says alpha = rank: every
// loader computes the same function.
#pragma once

#include <torch/torch.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "unet.hpp"

namespace sdxl {

/// The adapters of a model, fp32 on the host, in module order.
struct LoraWeights {
  std::int64_t rank = 0;
  double alpha = 0;  // the scale is alpha / rank
  std::vector<std::string> modules;  // diffusers module names ("down_blocks.1.…attn1.to_q")
  std::vector<torch::Tensor> down;   // A: [rank, in]
  std::vector<torch::Tensor> up;     // B: [out, rank]
};

enum class LoraNaming { kDiffusers, kKohya };

/// Writes `lora` (in `dtype`) atomically. `base` names the modules in the
/// original layout for kohya naming (any model of the same config).
void write_lora_file(const std::filesystem::path& path, const LoraWeights& lora, LoraNaming naming,
                     const UNet2DConditionModelImpl& base, torch::ScalarType dtype = torch::kFloat32);

/// Reads a LoRA file of either naming for a model of `base`'s config
/// (detected from the keys). zero::IoError / InvalidArgument name the file
/// and the key for unknown modules, missing halves, ranks that differ
/// between modules, and files that are neither naming.
LoraWeights read_lora_file(const std::filesystem::path& path, const UNet2DConditionModelImpl& base);

/// Weight of each adapted module plus (alpha / rank) B A, in fp32, into
/// `weights` (diffusers parameter names "<module>.weight").
void merge_lora(const LoraWeights& lora, std::map<std::string, torch::Tensor>& weights);

/// Copies `lora` into the adapters of `model` (which must adapt exactly the
/// same modules with the same rank), rescaling B so that the model's own
/// alpha / rank gives the file's function.
void load_lora_into(UNet2DConditionModelImpl& model, const LoraWeights& lora, double model_alpha,
                    const std::string& origin);

}  // namespace sdxl
