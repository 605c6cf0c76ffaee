// Writes the fixture image folder of the prepare tests (check_prepare.py):
// tiny images of many sizes, aspect ratios and formats (JPEG, PNG, WebP,
// grey, with alpha), most with .txt captions, and broken files of every kind
// prepare must report: truncated, zero-size, CMYK JPEG, 16-bit PNG, a huge
// header, an unsupported format, garbage under an image name. Generated at
// test time (deterministic), so nothing binary is committed.
//
//   make_images OUTDIR
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#define STB_IMAGE_WRITE_IMPLEMENTATION
#define STB_IMAGE_WRITE_STATIC
#include <stb_image_write.h>

#ifdef ZERO_HAVE_WEBP
#include <webp/encode.h>
#endif

namespace fs = std::filesystem;

namespace {

fs::path out_dir;

void write_bytes(const std::string& name, const std::vector<unsigned char>& bytes) {
  std::ofstream out(out_dir / name, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

std::vector<unsigned char> read_bytes(const std::string& name) {
  std::ifstream in(out_dir / name, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void caption(const std::string& stem, const std::string& text) {
  std::ofstream(out_dir / (stem + ".txt")) << text << "\n";
}

// A smooth pattern that differs per image: gradients and waves, so that
// resizing, cropping and flipping change the pixels (a flat image would hide
// a wrong crop).
std::vector<unsigned char> pattern(int width, int height, int channels, int seed) {
  std::vector<unsigned char> pixels(static_cast<std::size_t>(width * height * channels));
  for (int y = 0; y < height; ++y)
    for (int x = 0; x < width; ++x)
      for (int c = 0; c < channels; ++c) {
        const double v = 0.5 + 0.25 * std::sin(0.21 * x * (1 + (seed + c) % 3) + 0.7 * seed) +
                         0.25 * std::cos(0.17 * y * (1 + (seed + 2 * c) % 4) - 0.3 * c);
        double value = 255.0 * v * (0.6 + 0.4 * x / width);
        if (c == 3) value = 128 + 127 * std::sin(0.1 * (x + y));  // alpha
        pixels[static_cast<std::size_t>((y * width + x) * channels + c)] =
            static_cast<unsigned char>(std::lround(std::fmin(255.0, std::fmax(0.0, value))));
      }
  return pixels;
}

void png(const std::string& name, int width, int height, int channels, int seed) {
  const auto pixels = pattern(width, height, channels, seed);
  stbi_write_png((out_dir / name).c_str(), width, height, channels, pixels.data(), width * channels);
}

void jpeg(const std::string& name, int width, int height, int channels, int seed) {
  const auto pixels = pattern(width, height, channels, seed);
  stbi_write_jpg((out_dir / name).c_str(), width, height, channels, pixels.data(), 95);
}

bool webp(const std::string& name, int width, int height, int seed) {
#ifdef ZERO_HAVE_WEBP
  const auto pixels = pattern(width, height, 3, seed);
  std::uint8_t* encoded = nullptr;
  const std::size_t size = WebPEncodeRGB(pixels.data(), width, height, width * 3, 90.0f, &encoded);
  if (size == 0) return false;
  write_bytes(name, std::vector<unsigned char>(encoded, encoded + size));
  WebPFree(encoded);
  return true;
#else
  (void)name, (void)width, (void)height, (void)seed;
  return false;
#endif
}

// PNG chunks by hand for what stb_image_write cannot make (16-bit, a header
// alone): length, type, data, CRC-32 of type + data.
std::uint32_t crc32(const std::vector<unsigned char>& data) {
  std::uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char byte : data) {
    crc ^= byte;
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
  }
  return crc ^ 0xFFFFFFFFu;
}

void put32(std::vector<unsigned char>& out, std::uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<unsigned char>(v >> shift));
}

void chunk(std::vector<unsigned char>& out, const char* type, const std::vector<unsigned char>& data) {
  put32(out, static_cast<std::uint32_t>(data.size()));
  std::vector<unsigned char> typed(type, type + 4);
  typed.insert(typed.end(), data.begin(), data.end());
  out.insert(out.end(), typed.begin(), typed.end());
  put32(out, crc32(typed));
}

std::vector<unsigned char> png_header(std::uint32_t width, std::uint32_t height, unsigned char bit_depth) {
  std::vector<unsigned char> out{0x89, 'P', 'N', 'G', 0x0D, 0x0A, 0x1A, 0x0A};
  std::vector<unsigned char> ihdr;
  put32(ihdr, width);
  put32(ihdr, height);
  ihdr.insert(ihdr.end(), {bit_depth, 2, 0, 0, 0});  // RGB, deflate, no filter, no interlace
  chunk(out, "IHDR", ihdr);
  return out;
}

void png16(const std::string& name, int width, int height) {
  std::vector<unsigned char> out = png_header(width, height, 16);
  std::vector<unsigned char> raw;
  for (int y = 0; y < height; ++y) {
    raw.push_back(0);  // filter: none
    for (int x = 0; x < width * 3; ++x) {
      raw.push_back(static_cast<unsigned char>(x * 7 + y));
      raw.push_back(static_cast<unsigned char>(x + y * 3));
    }
  }
  int zlen = 0;
  unsigned char* z = stbi_zlib_compress(raw.data(), static_cast<int>(raw.size()), &zlen, 8);
  chunk(out, "IDAT", std::vector<unsigned char>(z, z + zlen));
  STBIW_FREE(z);
  chunk(out, "IEND", {});
  write_bytes(name, out);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_images OUTDIR\n");
    return 2;
  }
  out_dir = argv[1];
  fs::create_directories(out_dir / "sub");
  int count = 0;
  // Good images: (width, height) pairs of many aspect ratios, in three formats.
  const int sizes[][2] = {{24, 24}, {32, 48}, {48, 32}, {64, 64}, {96, 40}, {40, 96}, {80, 48}, {48, 80},
                          {72, 72}, {96, 96}, {30, 90}, {90, 30}, {56, 64}, {64, 56}, {37, 53}, {53, 37}};
  for (int i = 0; i < 16; ++i) {
    const int w = sizes[i][0], h = sizes[i][1];
    char stem[32];
    std::snprintf(stem, sizeof stem, "img%02d", i);
    png(std::string(stem) + ".png", w, h, 3, i);
    caption(stem, "a png picture number " + std::to_string(i));
    std::snprintf(stem, sizeof stem, "photo%02d", i);
    jpeg(std::string(stem) + ".jpg", w, h, 3, 100 + i);
    caption(stem, "A JPEG photo, #" + std::to_string(i) + "!");
    count += 2;
  }
  for (int i = 0; i < 6; ++i) {
    char stem[32];
    std::snprintf(stem, sizeof stem, "sub/web%02d", i);
    if (webp(std::string(stem) + ".webp", 32 + 8 * i, 64 - 4 * i, 200 + i)) {
      if (i % 2 == 0) caption(stem, "webp image " + std::to_string(i));  // odd ones: no caption
      ++count;
    }
  }
  png("grey.png", 40, 40, 1, 7);
  png("alpha.png", 44, 60, 4, 8);
  jpeg("grey.jpg", 60, 44, 1, 9);
  caption("grey", "grey");
  count += 3;  // (alpha.png has no caption)
  // The sample the test re-encodes itself: no resize (16 high, like its
  // bucket 16x48 at --resolution 32), a 2-pixel crop on each side (52 -> 48).
  png("exact.png", 52, 16, 3, 42);
  caption("exact", "the reference image");
  ++count;

  // Broken files.
  jpeg("truncated.jpg", 64, 64, 3, 300);
  {
    auto bytes = read_bytes("truncated.jpg");
    bytes.resize(bytes.size() / 2);
    write_bytes("truncated.jpg", bytes);
  }
  png("truncated.png", 64, 64, 3, 301);
  {
    auto bytes = read_bytes("truncated.png");
    bytes.resize(bytes.size() * 2 / 3);
    write_bytes("truncated.png", bytes);
  }
  write_bytes("empty.png", {});
  // A CMYK JPEG's frame header: 4 components (the scan never starts).
  write_bytes("cmyk.jpg", {0xFF, 0xD8, 0xFF, 0xC0, 0x00, 0x14, 0x08, 0x00, 0x10, 0x00, 0x10, 0x04, 0x01, 0x11, 0x00,
                           0x02, 0x11, 0x00, 0x03, 0x11, 0x00, 0x04, 0x11, 0x00, 0xFF, 0xD9});
  png16("deep.png", 16, 16);
  {
    auto bytes = png_header(100000, 100000, 8);  // huge: the header alone
    chunk(bytes, "IEND", {});
    write_bytes("huge.png", bytes);
  }
  write_bytes("anim.gif", {'G', 'I', 'F', '8', '9', 'a', 1, 0, 1, 0, 0, 0, 0, ';'});
  write_bytes("garbage.png", {'n', 'o', 't', ' ', 'a', 'n', ' ', 'i', 'm', 'a', 'g', 'e'});
  if (webp("truncated.webp", 48, 48, 302)) {
    auto bytes = read_bytes("truncated.webp");
    bytes.resize(bytes.size() / 2);
    write_bytes("truncated.webp", bytes);
  }
  std::printf("%d good images\n", count);
  return 0;
}
