// A Linear layer's weight and bias gradients in one cuBLASLt GEMM: the bias
// gradient (the sum of the output gradient over tokens) is reduced in the
// epilogue of dW = dY^T X (CUBLASLT_EPILOGUE_BGRADB) instead of by a separate
// pass over dY. A plain C++ API on raw device pointers, free of LibTorch;
// linear.cpp wraps it as the backward of sdxl::linear.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace sdxl::cuda {

enum class LtDtype : int { kBFloat16, kFloat16 };

/// Row-major, on the current device, all of `dtype`:
///   x  [tokens, in]  with row stride ldx (>= in, elements),
///   dy [tokens, out] with row stride ldy (>= out),
///   dw [out, in] contiguous, db [out].
/// Writes dw = dy^T x and db = sum over tokens of dy (fp32 accumulation, one
/// rounding) on `stream`, with `workspace` (workspace_bytes, may be 0) as
/// cuBLASLt's scratch. Returns false, having queued nothing, when cuBLASLt has
/// no algorithm for this shape and alignment (the caller computes both
/// another way); throws zero::DeviceError on any other cuBLASLt failure.
/// Algorithms are chosen once per shape, alignment and device, and cached.
bool weight_and_bias_grad(const void* x, std::int64_t ldx, const void* dy, std::int64_t ldy, void* dw, void* db,
                          std::int64_t tokens, std::int64_t in, std::int64_t out, LtDtype dtype, void* workspace,
                          std::size_t workspace_bytes, cudaStream_t stream);

}  // namespace sdxl::cuda
