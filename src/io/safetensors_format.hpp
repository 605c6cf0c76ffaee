// What the safetensors reader and writer share about the format: the 8-byte
// little-endian header length, the header size limit, tensor byte sizes and
// shapes in messages.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "zero/io/safetensors.hpp"

// Tensor bytes are handed out, converted and written as they lie in memory,
// and the format defines them as little-endian.
static_assert(std::endian::native == std::endian::little,
              "zero::io reads safetensors data in place and needs a little-endian host");

namespace zero::io::detail {

// The reference implementation's limit: a larger header is far more likely a
// corrupt length than a real checkpoint, and parsing it would cost gigabytes.
inline constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;

inline std::uint64_t load_le64(const std::byte* p) {
  std::uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | std::to_integer<std::uint64_t>(p[i]);
  return value;
}

inline void store_le64(std::byte* p, std::uint64_t value) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<std::byte>((value >> (8 * i)) & 0xffu);
}

/// The bytes of a tensor of `dtype` and `shape` (dimensions >= 0); nothing when
/// they overflow 64 bits. Zero if any dimension is zero, whatever the others:
/// [0, 2^40, 2^40] is a valid empty tensor, not an overflow.
inline std::optional<std::uint64_t> tensor_byte_size(TensorDType dtype, std::span<const std::int64_t> shape) {
  std::uint64_t bytes = size_of(dtype);
  bool overflow = false;
  for (std::int64_t d : shape) {
    if (d == 0) return 0;
    if (!overflow) overflow = __builtin_mul_overflow(bytes, static_cast<std::uint64_t>(d), &bytes);
  }
  if (overflow) return std::nullopt;
  return bytes;
}

inline std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) text += ", ";
    text += std::to_string(shape[i]);
  }
  return text + "]";
}

}  // namespace zero::io::detail
