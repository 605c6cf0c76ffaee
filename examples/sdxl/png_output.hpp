// Decoded images out as PNG files, as diffusers' pipeline turns the VAE's
// output into a PIL image: [-1, 1] -> (x / 2 + 0.5).clamp(0, 1) -> x * 255
// rounded -> uint8 (VaeImageProcessor.postprocess + numpy_to_pil). Written
// with stb_image_write (Debian's libstb-dev; image_libs.cmake).
#pragma once

#include <torch/torch.h>

#include <filesystem>
#include <string>

namespace sdxl {

/// One decoded image [3, H, W] (any dtype/device, values in [-1, 1]) as
/// uint8 [H, W, 3] on the CPU, rounded as the pipeline does.
torch::Tensor to_uint8_hwc(const torch::Tensor& image);

/// The PNG file bytes of a uint8 [H, W, C] image (C = 1, 3 or 4).
/// zero::Error naming `what` when the encoder fails.
std::string encode_png(const torch::Tensor& hwc, const std::string& what);

/// encode_png written to `path` atomically (temp name, fsync, rename).
void write_png(const std::filesystem::path& path, const torch::Tensor& hwc);

}  // namespace sdxl
