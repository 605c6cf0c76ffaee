#include "png_output.hpp"

#include <cstdint>
#include <cstring>
#include <span>

#define STB_IMAGE_WRITE_IMPLEMENTATION
#define STB_IMAGE_WRITE_STATIC
#include <stb_image_write.h>

#include "zero/core/error.hpp"
#include "zero/io/atomic_file.hpp"

namespace sdxl {

torch::Tensor to_uint8_hwc(const torch::Tensor& image) {
  ZERO_CHECK(image.dim() == 3, "to_uint8_hwc: expected an image [C, H, W], got ", image.dim(), " dimensions");
  torch::Tensor x = (image.to(torch::kCPU, torch::kFloat32) / 2 + 0.5).clamp(0, 1);
  return (x * 255).round().to(torch::kUInt8).permute({1, 2, 0}).contiguous();
}

std::string encode_png(const torch::Tensor& hwc, const std::string& what) {
  ZERO_CHECK(hwc.dim() == 3 && hwc.scalar_type() == torch::kUInt8 && hwc.is_contiguous() && hwc.device().is_cpu(),
             "encode_png (", what, "): expected a contiguous uint8 [H, W, C] CPU tensor");
  const int h = static_cast<int>(hwc.size(0)), w = static_cast<int>(hwc.size(1)), c = static_cast<int>(hwc.size(2));
  ZERO_CHECK(c == 1 || c == 3 || c == 4, "encode_png (", what, "): ", c, " channels (expected 1, 3 or 4)");
  int length = 0;
  unsigned char* png = stbi_write_png_to_mem(hwc.data_ptr<std::uint8_t>(), w * c, w, h, c, &length);
  ZERO_CHECK(png != nullptr && length > 0, "could not encode the PNG for ", what);
  std::string bytes(reinterpret_cast<const char*>(png), static_cast<std::size_t>(length));
  STBIW_FREE(png);
  return bytes;
}

void write_png(const std::filesystem::path& path, const torch::Tensor& hwc) {
  const std::string png = encode_png(hwc, "'" + path.string() + "'");
  zero::io::write_file_atomically(path, std::span<const std::byte>(reinterpret_cast<const std::byte*>(png.data()),
                                                                   png.size()));
}

}  // namespace sdxl
