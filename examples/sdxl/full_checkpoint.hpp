// The full single-file checkpoint that AUTOMATIC1111, Forge and ComfyUI load
// with their checkpoint loaders: a base SDXL checkpoint in the original
// (Stability AI) layout, e.g. sd_xl_base_1.0.safetensors, with its UNet
// ("model.diffusion_model.*", named by original_checkpoint_names) replaced by
// a trained one, and everything else (VAE "first_stage_model.*", text
// encoders "conditioner.embedders.*", anything more) copied byte for byte,
// with the base's metadata.
//
// The base is several GB: it is never loaded. Its tensors are copied as byte
// ranges (pread, in chunks) into a SafeTensorsStreamWriter (temporary file,
// fsync, rename), and the result is read back and compared with what was
// meant to be written before it is reported.
#pragma once

#include <torch/torch.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>

#include "unet.hpp"

namespace sdxl {

/// What check_full_checkpoint_base found in a base checkpoint.
struct FullCheckpointBase {
  std::size_t tensors = 0;       // every tensor of the base
  std::size_t unet_tensors = 0;  // of which the UNet's ("model.diffusion_model.*")
  std::uint64_t file_size = 0;
};

/// Checks that `base` is a readable safetensors file whose UNet tensors are
/// exactly those original_checkpoint_names(model) produces, each with the
/// model's shape, and that it holds more than a UNet. Throws zero::IoError
/// naming `base` (and the missing, misshapen or unexpected tensors, the first
/// 20 of each) otherwise. Reads the header only.
FullCheckpointBase check_full_checkpoint_base(const std::filesystem::path& base,
                                              const UNet2DConditionModelImpl& model);

/// What write_full_checkpoint wrote.
struct FullCheckpointWritten {
  std::uint64_t file_size = 0;
  std::uint32_t crc32c = 0;       // of the whole file, as read back
  std::size_t tensors = 0;
  std::size_t unet_tensors = 0;   // replaced by the model's parameters
  std::uint64_t copied_bytes = 0; // tensor bytes copied from the base
};

/// Writes `out` (atomically): the tensors of `base` in its order, with its
/// metadata; its UNet tensors replaced by `model`'s parameters converted to
/// `dtype` (round to nearest even), the others copied byte for byte. Checks
/// the base again first (check_full_checkpoint_base). Then reads `out` back:
/// the same names, shapes and dtypes as planned, every UNet tensor equal to
/// the bytes written and every other byte-identical to the base (CRC32C of
/// each byte range); a mismatch removes `out` and throws zero::IoError.
FullCheckpointWritten write_full_checkpoint(const std::filesystem::path& base, const UNet2DConditionModelImpl& model,
                                            torch::ScalarType dtype, const std::filesystem::path& out);

}  // namespace sdxl
