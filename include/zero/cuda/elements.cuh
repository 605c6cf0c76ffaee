// Conversions between the storage types kernels read and write (fp32, bf16,
// fp16) and the fp32 they compute in. Round to nearest even, as LibTorch
// stores: zero's optimizer kernels and a model's own fused kernels (the example's) give
// bit-identical results because they all convert here.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

namespace zero::cuda {

/// fp32, __nv_bfloat16 or __half -> fp32 (exact).
template <typename T>
__device__ __forceinline__ float to_float(T value) {
  if constexpr (std::is_same_v<T, float>) return value;
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(value);
  else return __half2float(value);
}

/// fp32 -> fp32, __nv_bfloat16 or __half, rounded to nearest even.
template <typename T>
__device__ __forceinline__ T from_float(float value) {
  if constexpr (std::is_same_v<T, float>) return value;
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(value);
  else return __float2half_rn(value);
}

}  // namespace zero::cuda
