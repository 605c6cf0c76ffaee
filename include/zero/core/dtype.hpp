// Element types at the API boundary. Kernels are templated inside src/; the
// public API passes a runtime DType so that one engine serves every precision.
#pragma once

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "zero/core/error.hpp"

namespace zero {

enum class DType : std::uint8_t { fp32 = 0, bf16 = 1, fp16 = 2 };

inline constexpr DType kAllDTypes[] = {DType::fp32, DType::bf16, DType::fp16};

constexpr std::size_t size_of(DType dtype) {
  switch (dtype) {
    case DType::fp32: return 4;
    case DType::bf16: return 2;
    case DType::fp16: return 2;
  }
  return 0;
}

constexpr std::string_view name_of(DType dtype) {
  switch (dtype) {
    case DType::fp32: return "fp32";
    case DType::bf16: return "bf16";
    case DType::fp16: return "fp16";
  }
  return "unknown";
}

inline std::ostream& operator<<(std::ostream& out, DType dtype) { return out << name_of(dtype); }

/// True when the value is one of the enumerators (guards casts from integers,
/// e.g. a dtype read from a file).
constexpr bool is_valid(DType dtype) {
  return dtype == DType::fp32 || dtype == DType::bf16 || dtype == DType::fp16;
}

/// Parses "fp32"/"float32", "bf16"/"bfloat16", "fp16"/"float16"/"half".
/// `what` names the option or key in the error message.
inline DType parse_dtype(std::string_view text, std::string_view what = "dtype") {
  if (text == "fp32" || text == "float32" || text == "float") return DType::fp32;
  if (text == "bf16" || text == "bfloat16") return DType::bf16;
  if (text == "fp16" || text == "float16" || text == "half") return DType::fp16;
  ZERO_THROW(InvalidArgument, what, ": unknown dtype '", text, "' (expected fp32, bf16 or fp16)");
}

inline void check_dtype(DType dtype, std::string_view what) {
  ZERO_CHECK(is_valid(dtype), what, ": unknown dtype value ", static_cast<int>(dtype),
             " (expected fp32, bf16 or fp16)");
}

// ---------------------------------------------------------------------------
// Host conversions, round to nearest even, NaN kept NaN. The CUDA kernels use
// the device intrinsics, which round the same way.

inline float bf16_bits_to_float(std::uint16_t bits) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

inline std::uint16_t float_to_bf16_bits(float value) {
  std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<std::uint16_t>(bits >> 16);
}

inline float fp16_bits_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exponent = (h >> 10) & 0x1fu;
  std::uint32_t mantissa = h & 0x3ffu;
  std::uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exponent = 127 - 15 + 1;
      while ((mantissa & 0x400u) == 0) {
        mantissa <<= 1;
        --exponent;
      }
      mantissa &= 0x3ffu;
      bits = sign | (exponent << 23) | (mantissa << 13);
    }
  } else if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  }
  return std::bit_cast<float>(bits);
}

inline std::uint16_t float_to_fp16_bits(float value) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  const std::uint16_t sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
  const std::uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7e00u;          // NaN
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;         // overflow -> inf (>= 65520)
  if (magnitude < 0x38800000u) {                               // subnormal or zero in fp16
    // Scale by 2^24 so the fp16 subnormal grid becomes integers, then round.
    const float scaled = std::bit_cast<float>(magnitude) * 16777216.0f;
    return sign | static_cast<std::uint16_t>(std::nearbyint(scaled));
  }
  std::uint32_t rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u);
  rounded -= (127u - 15u) << 23;
  return sign | static_cast<std::uint16_t>(rounded >> 13);
}

/// Reads element i of a buffer of the given dtype as float.
inline float load_as_float(const void* data, std::size_t i, DType dtype) {
  switch (dtype) {
    case DType::fp32: return static_cast<const float*>(data)[i];
    case DType::bf16: return bf16_bits_to_float(static_cast<const std::uint16_t*>(data)[i]);
    case DType::fp16: return fp16_bits_to_float(static_cast<const std::uint16_t*>(data)[i]);
  }
  return 0.0f;
}

/// Writes value (rounded to nearest even) as element i of a buffer of the given dtype.
inline void store_from_float(void* data, std::size_t i, DType dtype, float value) {
  switch (dtype) {
    case DType::fp32: static_cast<float*>(data)[i] = value; return;
    case DType::bf16: static_cast<std::uint16_t*>(data)[i] = float_to_bf16_bits(value); return;
    case DType::fp16: static_cast<std::uint16_t*>(data)[i] = float_to_fp16_bits(value); return;
  }
}

/// Rounds a float to the nearest value representable in dtype.
inline float round_to(DType dtype, float value) {
  switch (dtype) {
    case DType::fp32: return value;
    case DType::bf16: return bf16_bits_to_float(float_to_bf16_bits(value));
    case DType::fp16: return fp16_bits_to_float(float_to_fp16_bits(value));
  }
  return value;
}

}  // namespace zero
