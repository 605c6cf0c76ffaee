// Reading image files for examples/sdxl/prepare, and the SDXL aspect-ratio
// buckets. No LibTorch. Images are decoded with stb_image (JPEG, PNG) and
// libwebp (WebP, when built with it: ZERO_HAVE_WEBP); every file is checked
// before its pixels are decoded, so a bad file is a reason in words (truncated,
// CMYK, 16-bit, too large, unsupported format), never a crash.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace sdxl::prepare {

/// Decoded pixels: height x width x 3, 8-bit RGB, row-major. Alpha is
/// composited onto white (a transparent background becomes white, not the
/// undefined colour stored under it).
struct RgbImage {
  std::int64_t height = 0;
  std::int64_t width = 0;
  std::vector<std::uint8_t> rgb;
};

/// Limits a file must meet before it is decoded.
struct ImageLimits {
  /// Width x height above this is refused before decoding ("huge"): a
  /// 100000 x 100000 header would otherwise ask for 40 GB.
  std::int64_t max_pixels = 100'000'000;
};

/// Either the image or why it cannot be used.
struct ImageResult {
  std::optional<RgbImage> image;
  std::string problem;  // set when image is empty
};

/// Reads and decodes `path`. Never throws for a bad file (the reason is in
/// `problem`); throws zero::IoError only when the file cannot be read at all
/// (permissions, I/O error).
ImageResult read_image(const std::filesystem::path& path, const ImageLimits& limits);

/// Whether `path` names a file prepare considers: .jpg .jpeg .png .webp (any
/// case) are images; other common image extensions (.gif .bmp .tif .tiff
/// .avif .heic .jxl) are reported as unsupported; anything else is ignored.
enum class FileKind { image, unsupported_image, other };
FileKind classify_file(const std::filesystem::path& path);

/// An aspect-ratio bucket in image pixels.
struct Bucket {
  std::int64_t height = 0;
  std::int64_t width = 0;
  auto operator<=>(const Bucket&) const = default;
};

/// SDXL-style buckets: for every width w that is a multiple of `step`, the
/// height h = floor(resolution^2 / w / step) * step (area at most
/// resolution^2), kept when max(h, w) / min(h, w) <= max_aspect_ratio; and the
/// transpose of each. Sorted by (height, width).
std::vector<Bucket> make_buckets(std::int64_t resolution, std::int64_t step, double max_aspect_ratio);

/// Parses "HxW,HxW,...". Throws zero::InvalidArgument naming the option.
std::vector<Bucket> parse_buckets(const std::string& text, std::int64_t multiple_of);

/// The bucket whose aspect ratio is nearest to the image's in log scale
/// (a 2:1 image is as far from 1:1 as from 4:1); ties go to the larger area,
/// then to the smaller height.
Bucket nearest_bucket(std::int64_t height, std::int64_t width, const std::vector<Bucket>& buckets);

/// How an image of (height, width) is fitted to `bucket`: resized by the
/// smallest factor that covers the bucket (each side rounded, at least the
/// bucket's), then cropped at the centre.
struct Placement {
  std::int64_t resized_height = 0, resized_width = 0;
  std::int64_t crop_top = 0, crop_left = 0;
};
Placement place_in_bucket(std::int64_t height, std::int64_t width, const Bucket& bucket);

}  // namespace sdxl::prepare
