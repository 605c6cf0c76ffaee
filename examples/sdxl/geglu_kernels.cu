// Fused GEGLU forward and backward (see geglu_kernels.hpp).
//
// The composite value * gelu(gate) on chunk() views reads and writes the
// projection output about 9 times over in forward+backward (strided, hence
// non-vectorized, elementwise kernels plus a cat for the gradient); these
// kernels touch it 4 times: forward reads h and writes out, backward reads h
// and grad_out and writes grad_h in place of the cat.
//
// Numerics follow the unfused LibTorch composite for bf16/fp16: math in fp32,
// with the results the composite stores in the storage type (gelu's output,
// the gradient of mul w.r.t. gelu's output) rounded to it here too, so the two
// agree to the last bit nearly everywhere. Built with nvcc's default fp
// contraction (--fmad=true), as LibTorch's own kernels are: gelu's derivative
// cdf + x * pdf then becomes the same fma there and here.
//
// Launch scheme: one chunk of 8 consecutive columns per thread, loaded and
// stored with 16-byte accesses (one uint4 for 16-bit types, two for fp32), in
// a grid sized to the data; a one-element-per-thread kernel takes shapes or
// pointers that do not allow that (inner % 8 != 0, misaligned data).
// Offsets are 64-bit, so tensors past 2^31 elements work; the row/column
// split divides in 32 bits while the work item count fits (all SDXL shapes).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "geglu_kernels.hpp"
#include "zero/core/error.hpp"
#include "zero/cuda/elements.cuh"

namespace sdxl::cuda {
namespace {

using zero::cuda::from_float;
using zero::cuda::to_float;

constexpr int kChunk = 8;
constexpr int kThreads = 256;
constexpr std::int64_t kMaxBlocks = 0x7fffffff;  // grid.x limit; larger spans stride
constexpr std::int64_t kNarrowItems = 0xffffffff;  // up to here, 32-bit index division

constexpr float kSqrtHalf = 0.70710678118654752440f;    // 1 / sqrt(2)
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;  // 1 / sqrt(2 pi)

// The value the composite would hold after storing v as a T tensor.
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return to_float(from_float<T>(v));
}

// out = value * gelu(gate), before the final rounding to T; gelu's result is
// rounded to T first, as the composite stores it.
template <typename T>
__device__ __forceinline__ float forward_element(float value, float gate) {
  return value * round_to<T>(gate * 0.5f * (1.0f + erff(gate * kSqrtHalf)));
}

// The two input gradients for incoming gradient dy, before the final rounding.
// The composite's backward: mul gives dy * gelu(gate) for value and
// T(dy * value) for gelu's output, then gelu's exact backward scales the latter
// by d gelu / dx = cdf(x) + x * pdf(x).
template <typename T>
__device__ __forceinline__ void backward_element(float dy, float value, float gate, float& d_value, float& d_gate) {
  const float erf_term = 1.0f + erff(gate * kSqrtHalf);
  const float cdf = 0.5f * erf_term;
  const float pdf = expf(-0.5f * gate * gate) * kInvSqrt2Pi;
  d_value = dy * round_to<T>(gate * 0.5f * erf_term);  // gelu(gate) as forward stored it
  d_gate = round_to<T>(dy * value) * (cdf + gate * pdf);
}

// ---------------------------------------------------------------- 16-byte chunks

__device__ __forceinline__ float bf16_bits_to_float(unsigned bits) { return __uint_as_float(bits << 16); }
__device__ __forceinline__ float half_bits_to_float(unsigned bits) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}

template <typename T>
__device__ __forceinline__ unsigned pack_pair(float low, float high) {
  unsigned lo = 0, hi = 0;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    lo = __bfloat16_as_ushort(__float2bfloat16_rn(low));
    hi = __bfloat16_as_ushort(__float2bfloat16_rn(high));
  } else {
    lo = __half_as_ushort(__float2half_rn(low));
    hi = __half_as_ushort(__float2half_rn(high));
  }
  return lo | (hi << 16);
}

template <typename T>
__device__ __forceinline__ void load_chunk(const T* p, float (&v)[kChunk]) {
  if constexpr (std::is_same_v<T, float>) {
    const float4 a = reinterpret_cast<const float4*>(p)[0];
    const float4 b = reinterpret_cast<const float4*>(p)[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
    v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
    const uint4 w = *reinterpret_cast<const uint4*>(p);
    const unsigned words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        v[2 * k] = bf16_bits_to_float(words[k] & 0xffffu);
        v[2 * k + 1] = bf16_bits_to_float(words[k] >> 16);
      } else {
        v[2 * k] = half_bits_to_float(words[k] & 0xffffu);
        v[2 * k + 1] = half_bits_to_float(words[k] >> 16);
      }
    }
  }
}

template <typename T>
__device__ __forceinline__ void store_chunk(T* p, const float (&v)[kChunk]) {
  if constexpr (std::is_same_v<T, float>) {
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
    *reinterpret_cast<uint4*>(p) =
        make_uint4(pack_pair<T>(v[0], v[1]), pack_pair<T>(v[2], v[3]), pack_pair<T>(v[4], v[5]),
                   pack_pair<T>(v[6], v[7]));
  }
}

__device__ __forceinline__ std::int64_t first_index() {
  return static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ std::int64_t grid_stride() { return static_cast<std::int64_t>(gridDim.x) * blockDim.x; }

// i / n. 64-bit division is a long software sequence on the GPU; Index is
// 32-bit whenever the work item count fits (every SDXL shape).
template <typename Index>
__device__ __forceinline__ std::int64_t divide(std::int64_t i, std::int64_t n) {
  return static_cast<std::int64_t>(static_cast<Index>(i) / static_cast<Index>(n));
}

// ---------------------------------------------------------------- kernels

template <typename T, typename Index>
__global__ void __launch_bounds__(kThreads)
    forward_chunks(const T* __restrict__ h, T* __restrict__ out, std::int64_t rows, std::int64_t inner) {
  const std::int64_t per_row = inner / kChunk;
  const std::int64_t total = rows * per_row;
  for (std::int64_t i = first_index(); i < total; i += grid_stride()) {
    const std::int64_t row = divide<Index>(i, per_row);
    const std::int64_t col = (i - row * per_row) * kChunk;
    const T* value_ptr = h + row * 2 * inner + col;
    float value[kChunk], gate[kChunk], result[kChunk];
    load_chunk(value_ptr, value);
    load_chunk(value_ptr + inner, gate);
#pragma unroll
    for (int k = 0; k < kChunk; ++k) result[k] = forward_element<T>(value[k], gate[k]);
    store_chunk(out + row * inner + col, result);
  }
}

template <typename T, typename Index>
__global__ void __launch_bounds__(kThreads)
    forward_elements(const T* __restrict__ h, T* __restrict__ out, std::int64_t rows, std::int64_t inner) {
  const std::int64_t total = rows * inner;
  for (std::int64_t i = first_index(); i < total; i += grid_stride()) {
    const std::int64_t row = divide<Index>(i, inner);
    const std::int64_t col = i - row * inner;
    const T* value_ptr = h + row * 2 * inner + col;
    out[i] = from_float<T>(forward_element<T>(to_float(value_ptr[0]), to_float(value_ptr[inner])));
  }
}

template <typename T, typename Index>
__global__ void __launch_bounds__(kThreads)
    backward_chunks(const T* __restrict__ grad_out, const T* __restrict__ h, T* __restrict__ grad_h,
                    std::int64_t rows, std::int64_t inner) {
  const std::int64_t per_row = inner / kChunk;
  const std::int64_t total = rows * per_row;
  for (std::int64_t i = first_index(); i < total; i += grid_stride()) {
    const std::int64_t row = divide<Index>(i, per_row);
    const std::int64_t col = (i - row * per_row) * kChunk;
    const std::int64_t value_offset = row * 2 * inner + col;
    float dy[kChunk], value[kChunk], gate[kChunk], d_value[kChunk], d_gate[kChunk];
    load_chunk(grad_out + row * inner + col, dy);
    load_chunk(h + value_offset, value);
    load_chunk(h + value_offset + inner, gate);
#pragma unroll
    for (int k = 0; k < kChunk; ++k) backward_element<T>(dy[k], value[k], gate[k], d_value[k], d_gate[k]);
    store_chunk(grad_h + value_offset, d_value);
    store_chunk(grad_h + value_offset + inner, d_gate);
  }
}

template <typename T, typename Index>
__global__ void __launch_bounds__(kThreads)
    backward_elements(const T* __restrict__ grad_out, const T* __restrict__ h, T* __restrict__ grad_h,
                      std::int64_t rows, std::int64_t inner) {
  const std::int64_t total = rows * inner;
  for (std::int64_t i = first_index(); i < total; i += grid_stride()) {
    const std::int64_t row = divide<Index>(i, inner);
    const std::int64_t value_offset = row * 2 * inner + (i - row * inner);
    float d_value = 0, d_gate = 0;
    backward_element<T>(to_float(grad_out[i]), to_float(h[value_offset]), to_float(h[value_offset + inner]),
                        d_value, d_gate);
    grad_h[value_offset] = from_float<T>(d_value);
    grad_h[value_offset + inner] = from_float<T>(d_gate);
  }
}

// ---------------------------------------------------------------- launch

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

unsigned blocks_for(std::int64_t work_items) {
  return static_cast<unsigned>(std::min<std::int64_t>((work_items + kThreads - 1) / kThreads, kMaxBlocks));
}

void check_launch(const char* kernel) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess)
    ZERO_THROW(::zero::DeviceError, kernel, " launch failed: ", cudaGetErrorName(status), " (",
               cudaGetErrorString(status), ")");
}

void check_shape(std::int64_t rows, std::int64_t inner) {
  ZERO_CHECK(rows >= 0 && inner >= 0, "geglu: negative shape (rows ", rows, ", inner ", inner, ")");
}

// Calls body with a null pointer of the storage type for dtype.
template <typename Body>
void dispatch(GegluDtype dtype, Body&& body) {
  switch (dtype) {
    case GegluDtype::kFloat32: body(static_cast<float*>(nullptr)); return;
    case GegluDtype::kBFloat16: body(static_cast<__nv_bfloat16*>(nullptr)); return;
    case GegluDtype::kFloat16: body(static_cast<__half*>(nullptr)); return;
  }
  ZERO_THROW(::zero::InvalidArgument, "geglu: unknown dtype ", static_cast<int>(dtype));
}

}  // namespace

void geglu_forward(const void* h, void* out, std::int64_t rows, std::int64_t inner, GegluDtype dtype,
                   cudaStream_t stream) {
  check_shape(rows, inner);
  if (rows == 0 || inner == 0) return;
  ZERO_CHECK(h != nullptr && out != nullptr, "geglu_forward: null pointer");
  const bool chunks = inner % kChunk == 0 && aligned16(h) && aligned16(out);
  const std::int64_t items = chunks ? rows * (inner / kChunk) : rows * inner;
  const bool narrow = items <= kNarrowItems;
  const unsigned blocks = blocks_for(items);
  dispatch(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* hp = static_cast<const T*>(h);
    T* op = static_cast<T*>(out);
    if (chunks && narrow) forward_chunks<T, std::uint32_t><<<blocks, kThreads, 0, stream>>>(hp, op, rows, inner);
    else if (chunks) forward_chunks<T, std::uint64_t><<<blocks, kThreads, 0, stream>>>(hp, op, rows, inner);
    else if (narrow) forward_elements<T, std::uint32_t><<<blocks, kThreads, 0, stream>>>(hp, op, rows, inner);
    else forward_elements<T, std::uint64_t><<<blocks, kThreads, 0, stream>>>(hp, op, rows, inner);
  });
  check_launch("geglu forward");
}

void geglu_backward(const void* grad_out, const void* h, void* grad_h, std::int64_t rows, std::int64_t inner,
                    GegluDtype dtype, cudaStream_t stream) {
  check_shape(rows, inner);
  if (rows == 0 || inner == 0) return;
  ZERO_CHECK(grad_out != nullptr && h != nullptr && grad_h != nullptr, "geglu_backward: null pointer");
  const bool chunks = inner % kChunk == 0 && aligned16(grad_out) && aligned16(h) && aligned16(grad_h);
  const std::int64_t items = chunks ? rows * (inner / kChunk) : rows * inner;
  const bool narrow = items <= kNarrowItems;
  const unsigned blocks = blocks_for(items);
  dispatch(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* dyp = static_cast<const T*>(grad_out);
    const T* hp = static_cast<const T*>(h);
    T* dhp = static_cast<T*>(grad_h);
    if (chunks && narrow)
      backward_chunks<T, std::uint32_t><<<blocks, kThreads, 0, stream>>>(dyp, hp, dhp, rows, inner);
    else if (chunks)
      backward_chunks<T, std::uint64_t><<<blocks, kThreads, 0, stream>>>(dyp, hp, dhp, rows, inner);
    else if (narrow)
      backward_elements<T, std::uint32_t><<<blocks, kThreads, 0, stream>>>(dyp, hp, dhp, rows, inner);
    else
      backward_elements<T, std::uint64_t><<<blocks, kThreads, 0, stream>>>(dyp, hp, dhp, rows, inner);
  });
  check_launch("geglu backward");
}

}  // namespace sdxl::cuda
