#include "prepare_images.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>

#include "zero/core/error.hpp"

// stb_image's implementation lives in this file only. JPEG and PNG are the
// formats prepare reads with it; the others stay out of the binary.
#define STB_IMAGE_IMPLEMENTATION
#define STB_IMAGE_STATIC
#define STBI_ONLY_JPEG
#define STBI_ONLY_PNG
#define STBI_NO_STDIO
#define STBI_FAILURE_USERMSG
#include <stb_image.h>

#ifdef ZERO_HAVE_WEBP
#include <webp/decode.h>
#endif

namespace sdxl::prepare {
namespace {

std::string lower(std::string text) {
  for (char& c : text) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return text;
}

ImageResult bad(std::string why) { return ImageResult{std::nullopt, std::move(why)}; }

std::string too_large(std::int64_t width, std::int64_t height, const ImageLimits& limits) {
  std::ostringstream out;
  out << "too large: " << width << " x " << height << " pixels, more than the limit of " << limits.max_pixels
      << " (--max_image_pixels)";
  return out.str();
}

// RGBA (4 channels) to RGB over a white background.
RgbImage composite_on_white(const std::uint8_t* rgba, std::int64_t height, std::int64_t width) {
  RgbImage image{height, width, std::vector<std::uint8_t>(static_cast<std::size_t>(height * width * 3))};
  for (std::int64_t p = 0; p < height * width; ++p) {
    const unsigned alpha = rgba[4 * p + 3];
    for (int c = 0; c < 3; ++c) {
      const unsigned value = rgba[4 * p + c];
      // Rounded: (v * a + 255 * (255 - a)) / 255.
      image.rgb[3 * p + c] = static_cast<std::uint8_t>((value * alpha + 255u * (255u - alpha) + 127u) / 255u);
    }
  }
  return image;
}

// JPEG structure checks stb_image does not make: the component count of the
// frame (4 = CMYK or YCCK, which stb converts with guessed colours) and an
// end-of-image marker after the last scan (stb decodes a truncated file
// without complaint, filling the missing part with grey).
std::string jpeg_problem(const std::vector<unsigned char>& bytes, const ImageLimits& limits) {
  std::size_t pos = 2;
  int components = -1;
  while (pos + 4 <= bytes.size()) {
    if (bytes[pos] != 0xFF) return "corrupt JPEG (marker expected at byte " + std::to_string(pos) + ")";
    const unsigned marker = bytes[pos + 1];
    if (marker == 0xFF) {  // fill byte
      ++pos;
      continue;
    }
    if (marker == 0xDA) break;  // start of scan: entropy-coded data follows
    const std::size_t length = (static_cast<std::size_t>(bytes[pos + 2]) << 8) | bytes[pos + 3];
    const bool start_of_frame = marker >= 0xC0 && marker <= 0xCF && marker != 0xC4 && marker != 0xC8 && marker != 0xCC;
    if (start_of_frame && pos + 9 < bytes.size()) {
      components = bytes[pos + 9];
      const std::int64_t height = (bytes[pos + 5] << 8) | bytes[pos + 6];
      const std::int64_t width = (bytes[pos + 7] << 8) | bytes[pos + 8];
      if (width * height > limits.max_pixels) return too_large(width, height, limits);
    }
    pos += 2 + length;
  }
  if (components == 4) return "CMYK (or YCCK) JPEG: 4 colour components; convert it to RGB";
  if (components < 0) return "truncated or corrupt JPEG (no frame header before the image data)";
  // EOI (FF D9) cannot occur inside entropy-coded data (an FF there is
  // followed by 00 or a restart marker), so the last EOI must come after the
  // last start of scan. (An EXIF thumbnail carries an EOI of its own, but
  // before the main image's scans.)
  std::size_t last_scan = 0, last_end = 0;
  for (std::size_t i = 0; i + 1 < bytes.size(); ++i) {
    if (bytes[i] != 0xFF) continue;
    if (bytes[i + 1] == 0xDA) last_scan = i;
    if (bytes[i + 1] == 0xD9) last_end = i;
  }
  if (last_scan == 0) return "truncated JPEG (no image data)";
  if (last_end < last_scan) return "truncated JPEG (no end-of-image marker after the image data)";
  return {};
}

ImageResult decode_with_stb(const std::vector<unsigned char>& bytes, bool is_jpeg, const ImageLimits& limits) {
  const int size = static_cast<int>(bytes.size());
  if (is_jpeg) {
    if (std::string problem = jpeg_problem(bytes, limits); !problem.empty()) return bad(problem);
  } else if (bytes.size() >= 24) {
    // The size from IHDR (bytes 16-23, big-endian) before stb looks: its own
    // refusal of a huge image reads as an unknown format.
    auto be32 = [&](std::size_t at) {
      return (std::int64_t{bytes[at]} << 24) | (bytes[at + 1] << 16) | (bytes[at + 2] << 8) | bytes[at + 3];
    };
    const std::int64_t width = be32(16), height = be32(20);
    if (width * height > limits.max_pixels) return bad(too_large(width, height, limits));
  }
  int width = 0, height = 0, channels = 0;
  if (!stbi_info_from_memory(bytes.data(), size, &width, &height, &channels))
    return bad(std::string("corrupt ") + (is_jpeg ? "JPEG" : "PNG") + " header (" + stbi_failure_reason() + ")");
  if (!is_jpeg && stbi_is_16_bit_from_memory(bytes.data(), size))
    return bad("16 bits per channel PNG; save it with 8 bits per channel");
  if (width <= 0 || height <= 0) return bad("zero width or height");
  if (static_cast<std::int64_t>(width) * height > limits.max_pixels) return bad(too_large(width, height, limits));
  unsigned char* pixels = stbi_load_from_memory(bytes.data(), size, &width, &height, &channels, 4);
  if (pixels == nullptr)
    return bad(std::string("cannot decode ") + (is_jpeg ? "JPEG" : "PNG") + " (" + stbi_failure_reason() +
               "): truncated or corrupt");
  RgbImage image = composite_on_white(pixels, height, width);
  stbi_image_free(pixels);
  return ImageResult{std::move(image), {}};
}

ImageResult decode_webp(const std::vector<unsigned char>& bytes, const ImageLimits& limits) {
#ifdef ZERO_HAVE_WEBP
  WebPBitstreamFeatures features;
  if (WebPGetFeatures(bytes.data(), bytes.size(), &features) != VP8_STATUS_OK)
    return bad("corrupt or truncated WebP header");
  if (features.has_animation) return bad("animated WebP: not supported");
  if (static_cast<std::int64_t>(features.width) * features.height > limits.max_pixels)
    return bad(too_large(features.width, features.height, limits));
  int width = 0, height = 0;
  std::uint8_t* pixels = WebPDecodeRGBA(bytes.data(), bytes.size(), &width, &height);
  if (pixels == nullptr) return bad("cannot decode WebP: truncated or corrupt");
  RgbImage image = composite_on_white(pixels, height, width);
  WebPFree(pixels);
  return ImageResult{std::move(image), {}};
#else
  (void)bytes;
  (void)limits;
  return bad("WebP: this build has no WebP support (libwebp was not found at build time)");
#endif
}

}  // namespace

FileKind classify_file(const std::filesystem::path& path) {
  static const std::set<std::string> images{".jpg", ".jpeg", ".png", ".webp"};
  static const std::set<std::string> unsupported{".gif", ".bmp", ".tif", ".tiff", ".avif", ".heic", ".heif", ".jxl"};
  const std::string ext = lower(path.extension().string());
  if (images.count(ext)) return FileKind::image;
  if (unsupported.count(ext)) return FileKind::unsupported_image;
  return FileKind::other;
}

ImageResult read_image(const std::filesystem::path& path, const ImageLimits& limits) {
  std::ifstream in(path, std::ios::binary);
  if (!in) ZERO_THROW(zero::IoError, "image '", path.string(), "': cannot be opened: ", std::strerror(errno));
  std::vector<unsigned char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) ZERO_THROW(zero::IoError, "image '", path.string(), "': read error");
  if (bytes.empty()) return bad("empty file (0 bytes)");
  if (bytes.size() > static_cast<std::size_t>(INT32_MAX)) return bad("file larger than 2 GiB");
  auto starts_with = [&](std::initializer_list<unsigned char> magic, std::size_t at = 0) {
    if (bytes.size() < at + magic.size()) return false;
    return std::equal(magic.begin(), magic.end(), bytes.begin() + static_cast<std::ptrdiff_t>(at));
  };
  if (starts_with({0xFF, 0xD8, 0xFF})) return decode_with_stb(bytes, true, limits);
  if (starts_with({0x89, 'P', 'N', 'G', 0x0D, 0x0A, 0x1A, 0x0A})) return decode_with_stb(bytes, false, limits);
  if (starts_with({'R', 'I', 'F', 'F'}) && starts_with({'W', 'E', 'B', 'P'}, 8)) return decode_webp(bytes, limits);
  return bad("unsupported format: not a JPEG, PNG or WebP file (by its first bytes)");
}

std::vector<Bucket> make_buckets(std::int64_t resolution, std::int64_t step, double max_aspect_ratio) {
  ZERO_CHECK(resolution > 0 && step > 0 && resolution % step == 0, "--resolution ", resolution,
             " must be a positive multiple of --bucket_step ", step);
  ZERO_CHECK(max_aspect_ratio >= 1.0, "--max_aspect_ratio must be at least 1, got ", max_aspect_ratio);
  std::set<Bucket> buckets;
  const std::int64_t area = resolution * resolution;
  for (std::int64_t width = step; width <= area / step; width += step) {
    const std::int64_t height = area / width / step * step;
    if (height < step) break;
    const double ratio = static_cast<double>(std::max(height, width)) / static_cast<double>(std::min(height, width));
    if (ratio > max_aspect_ratio + 1e-9) continue;
    buckets.insert({height, width});
    buckets.insert({width, height});
  }
  return {buckets.begin(), buckets.end()};
}

std::vector<Bucket> parse_buckets(const std::string& text, std::int64_t multiple_of) {
  std::set<Bucket> buckets;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    long long height = 0, width = 0;
    char x = 0, extra = 0;
    if (std::sscanf(item.c_str(), " %lld %c %lld %c", &height, &x, &width, &extra) != 3 || (x != 'x' && x != 'X'))
      ZERO_THROW(zero::InvalidArgument, "--buckets: '", item, "' is not HEIGHTxWIDTH (e.g. 1024x1024,832x1216)");
    if (height <= 0 || width <= 0 || height % multiple_of || width % multiple_of)
      ZERO_THROW(zero::InvalidArgument, "--buckets: ", height, "x", width, " needs positive sides that are multiples of ",
                 multiple_of, " (the VAE's downsampling factor)");
    buckets.insert({height, width});
  }
  ZERO_CHECK(!buckets.empty(), "--buckets: no bucket given");
  return {buckets.begin(), buckets.end()};
}

Bucket nearest_bucket(std::int64_t height, std::int64_t width, const std::vector<Bucket>& buckets) {
  const double ratio = std::log(static_cast<double>(width) / static_cast<double>(height));
  const Bucket* best = nullptr;
  double best_distance = 0;
  for (const Bucket& b : buckets) {
    const double distance = std::abs(std::log(static_cast<double>(b.width) / static_cast<double>(b.height)) - ratio);
    const bool better = best == nullptr || distance < best_distance - 1e-12 ||
                        (std::abs(distance - best_distance) <= 1e-12 &&
                         (b.height * b.width > best->height * best->width ||
                          (b.height * b.width == best->height * best->width && b.height < best->height)));
    if (better) {
      best = &b;
      best_distance = distance;
    }
  }
  return *best;
}

Placement place_in_bucket(std::int64_t height, std::int64_t width, const Bucket& bucket) {
  const double scale = std::max(static_cast<double>(bucket.height) / static_cast<double>(height),
                                static_cast<double>(bucket.width) / static_cast<double>(width));
  Placement p;
  p.resized_height = std::max(bucket.height, static_cast<std::int64_t>(std::llround(static_cast<double>(height) * scale)));
  p.resized_width = std::max(bucket.width, static_cast<std::int64_t>(std::llround(static_cast<double>(width) * scale)));
  p.crop_top = (p.resized_height - bucket.height) / 2;
  p.crop_left = (p.resized_width - bucket.width) / 2;
  return p;
}

}  // namespace sdxl::prepare
