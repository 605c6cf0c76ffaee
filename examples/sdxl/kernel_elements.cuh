// Conversions between the UNet's storage types (fp32, bf16, fp16) and the
// fp32 the fused kernels compute in, shared by geglu_kernels.cu and
// group_norm_nhwc_kernels.cu. Round to nearest even, as LibTorch stores.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

namespace sdxl::cuda {

template <typename T>
__device__ __forceinline__ float to_float(T v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(v);
  else return __half2float(v);
}

template <typename T>
__device__ __forceinline__ T from_float(float v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(v);
  else return __float2half_rn(v);
}

}  // namespace sdxl::cuda
