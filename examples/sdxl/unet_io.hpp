// Loading and saving the UNet's weights in safetensors form only.
//
// Accepted model paths:
//   * a .safetensors file whose "config" metadata entry holds the diffusers
//     config JSON (as written by save_unet(path.safetensors));
//   * a diffusers folder: config.json plus diffusion_pytorch_model.safetensors,
//     or its sharded form (diffusion_pytorch_model.safetensors.index.json), or
//     the fp16 variant (diffusion_pytorch_model.fp16.safetensors and
//     diffusion_pytorch_model.safetensors.index.fp16.json); a pipeline root
//     with a unet/ subfolder works too;
//   * an original (Stability AI) single-file SDXL checkpoint, whose UNet keys
//     are "model.diffusion_model.*": mapped to diffusers names; other
//     components in the file (VAE, text encoders) are ignored; without a
//     "config" metadata entry the SDXL 1.0 base config is assumed.
// Pickle-based checkpoints (.ckpt, .bin, .pt, .pth) are refused: unpickling
// can run arbitrary code.
#pragma once

#include <torch/torch.h>

#include <filesystem>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "unet.hpp"
#include "unet_config.hpp"
#include "zero/io/safetensors.hpp"

namespace sdxl {

/// The config of the model at `path` (see the header comment for the forms).
UNetConfig read_unet_config(const std::filesystem::path& path);

/// Copies the weights at `path` into `model`'s parameters, converting dtype
/// and device. Strict: when names or shapes differ, nothing is copied and
/// zero::IoError lists the missing, unexpected and misshapen tensors (the
/// first 20 of each, then a count).
void load_unet_weights(UNet2DConditionModelImpl& model, const std::filesystem::path& path);

/// Builds the model described at `path` with parameters of `options`
/// (dtype/device) and loads its weights.
UNet2DConditionModel load_unet(const std::filesystem::path& path,
                               torch::TensorOptions options = torch::TensorOptions().dtype(torch::kFloat32));
/// The same with the architecture given (e.g. an original single file of a
/// model other than SDXL 1.0, which records no config).
UNet2DConditionModel load_unet(const std::filesystem::path& path, torch::TensorOptions options,
                               const UNetConfig& config);

/// Layout of a saved checkpoint.
enum class CheckpointFormat {
  kDiffusers,       // diffusers parameter names
  kOriginalSingleFile,  // Stability AI names under "model.diffusion_model."
};

/// Saves the weights (in `dtype`, default: as they are).
///  * path ending in ".safetensors": one file, the config JSON in its
///    "config" metadata entry;
///  * otherwise a diffusers folder (created if needed): config.json and
///    diffusion_pytorch_model.safetensors (kDiffusers only).
/// Files are replaced atomically.
void save_unet(const UNet2DConditionModelImpl& model, const std::filesystem::path& path,
               std::optional<torch::ScalarType> dtype = std::nullopt,
               CheckpointFormat format = CheckpointFormat::kDiffusers);

/// Diffusers name -> original single-file name ("model.diffusion_model.…")
/// for every parameter of a model with this config, in state-dict order.
/// Throws zero::InvalidArgument for configs the original layout cannot express.
std::vector<std::pair<std::string, std::string>> original_checkpoint_names(const UNet2DConditionModelImpl& model);

/// The safetensors dtype that stores `type` (F64/F32/F16/BF16 and the
/// integer types); zero::InvalidArgument for others.
zero::io::TensorDType safetensors_dtype_of(torch::ScalarType type);

/// Every tensor of a safetensors file, copied to CPU tensors of the stored
/// dtype (F64/F32/F16/BF16/I64/I32/I16/I8/U8/BOOL).
std::map<std::string, torch::Tensor> read_tensors(const std::filesystem::path& path);

/// The whole file as text (IoError naming it when it cannot be opened or
/// read). Callers check the size first where the file may be large.
std::string read_text_file(const std::filesystem::path& path);

/// A CPU tensor of the stored dtype holding a copy of one tensor of `file`
/// (its data is only byte-aligned, so it is copied rather than wrapped).
torch::Tensor copy_out(const zero::io::SafeTensorsFile& file, const zero::io::TensorInfo& info);

/// "[a, b, c]": a shape in error messages.
std::string shape_text(torch::IntArrayRef shape);

/// Appends "\n  N what:" and the first 20 names (then "... and K more") to an
/// error message; nothing when `names` is empty.
void append_list(std::ostringstream& out, const char* what, const std::vector<std::string>& names);

/// Writes CPU copies of `tensors` to a safetensors file, atomically.
void write_tensors(const std::filesystem::path& path, const std::map<std::string, torch::Tensor>& tensors,
                   const std::map<std::string, std::string>& metadata = {});

}  // namespace sdxl
