// Helpers shared by the GPU tests: an RAII device buffer, host random data in
// any dtype, and comparisons with stated tolerances.
#pragma once

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "zero/core/dtype.hpp"
#include "zero/cuda/check.hpp"

namespace zero::test {

/// Device memory with `margin` guard bytes on both sides, filled with a
/// sentinel so that writes outside the span can be detected.
class DeviceBuffer {
 public:
  static constexpr std::size_t kMargin = 256;
  static constexpr unsigned char kSentinel = 0xA5;

  explicit DeviceBuffer(std::size_t bytes) : bytes_(bytes) {
    ZERO_CHECK_CUDA(cudaMalloc(&base_, bytes + 2 * kMargin));
    ZERO_CHECK_CUDA(cudaMemset(base_, kSentinel, bytes + 2 * kMargin));
  }
  ~DeviceBuffer() { (void)cudaFree(base_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  /// The usable region starts kMargin bytes into the allocation (256-aligned).
  void* data() { return static_cast<unsigned char*>(base_) + kMargin; }
  std::size_t bytes() const { return bytes_; }

  void upload(const void* host, std::size_t bytes, std::size_t offset = 0) {
    ZERO_CHECK_CUDA(cudaMemcpy(static_cast<unsigned char*>(data()) + offset, host, bytes,
                               cudaMemcpyHostToDevice));
    // cudaMemcpy from pageable memory may return before the data lands, and
    // work on non-blocking streams is not ordered after it: wait here.
    ZERO_CHECK_CUDA(cudaDeviceSynchronize());
  }
  void download(void* host, std::size_t bytes, std::size_t offset = 0) {
    ZERO_CHECK_CUDA(cudaMemcpy(host, static_cast<unsigned char*>(data()) + offset, bytes,
                               cudaMemcpyDeviceToHost));
  }
  /// True when every byte outside [offset, offset + used) still holds the sentinel.
  bool guards_intact(std::size_t offset, std::size_t used) {
    std::vector<unsigned char> all(bytes_ + 2 * kMargin);
    ZERO_CHECK_CUDA(cudaMemcpy(all.data(), base_, all.size(), cudaMemcpyDeviceToHost));
    for (std::size_t i = 0; i < all.size(); ++i) {
      const bool inside = i >= kMargin + offset && i < kMargin + offset + used;
      if (!inside && all[i] != kSentinel) return false;
    }
    return true;
  }

 private:
  void* base_ = nullptr;
  std::size_t bytes_;
};

/// Host values of a dtype, stored as raw bytes, with float views.
struct HostArray {
  DType dtype = DType::fp32;
  std::vector<unsigned char> bytes;

  HostArray() = default;
  HostArray(DType d, std::size_t count) : dtype(d), bytes(count * size_of(d)) {}
  std::size_t count() const { return bytes.size() / size_of(dtype); }
  float get(std::size_t i) const { return load_as_float(bytes.data(), i, dtype); }
  void set(std::size_t i, float v) { store_from_float(bytes.data(), i, dtype, v); }
  void* data() { return bytes.data(); }
};

inline HostArray random_array(std::mt19937_64& rng, DType dtype, std::size_t count, float low,
                              float high) {
  std::uniform_real_distribution<float> dist(low, high);
  HostArray a(dtype, count);
  for (std::size_t i = 0; i < count; ++i) a.set(i, dist(rng));
  return a;
}

/// ||out - ref|| / max(||ref||, ||scale||) (0 when all are zero); NaN if out
/// has a NaN. `scale` is the input the step started from: when terms cancel
/// (m = b1*m + (1-b1)*g near zero) the float error is relative to the terms,
/// not to the tiny result, and with few elements the norm cannot hide that.
inline double relative_error(const std::vector<double>& out, const std::vector<double>& ref,
                             const std::vector<double>& scale) {
  double diff = 0, norm = 0, scale_norm = 0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    if (std::isnan(out[i])) return std::nan("");
    diff += (out[i] - ref[i]) * (out[i] - ref[i]);
    norm += ref[i] * ref[i];
    scale_norm += scale[i] * scale[i];
  }
  norm = std::max(norm, scale_norm);
  if (norm == 0) return diff == 0 ? 0 : std::sqrt(diff);
  return std::sqrt(diff / norm);
}

/// The spacing of the 16-bit dtype's values around x (one rounding step).
inline double step16(DType dtype, double x) {
  const int mantissa_bits = dtype == DType::bf16 ? 7 : 10;
  const int min_exponent = dtype == DType::bf16 ? -126 : -14;
  int exponent = x == 0 ? min_exponent : std::ilogb(x);
  exponent = std::max(exponent, min_exponent);
  return std::ldexp(1.0, exponent - mantissa_bits);
}

/// The 16-bit pattern of value in a 16-bit dtype.
inline std::uint16_t bits16(DType dtype, float value) {
  return dtype == DType::bf16 ? float_to_bf16_bits(value) : float_to_fp16_bits(value);
}

/// True when got (a dtype value) is the dtype rounding of ref or one of its two
/// neighbours: "within one rounding step of the rounded fp64 result".
inline bool within_one_step(DType dtype, float got, double ref) {
  if (dtype == DType::fp32) return got == static_cast<float>(ref);
  const std::uint16_t r = bits16(dtype, static_cast<float>(ref));
  const std::uint16_t g = bits16(dtype, got);
  if (g == r) return true;
  // Same sign: neighbours differ by one in the magnitude bits.
  if ((g & 0x8000u) == (r & 0x8000u)) return (g > r ? g - r : r - g) == 1;
  // Across zero: both must be the smallest magnitudes.
  return (g & 0x7fffu) <= 1 && (r & 0x7fffu) <= 1;
}

inline std::uint64_t fresh_seed() {
  static std::random_device device;
  return (static_cast<std::uint64_t>(device()) << 32) ^ device();
}

}  // namespace zero::test
