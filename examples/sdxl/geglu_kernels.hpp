// Fused GEGLU kernels (geglu_kernels.cu): out = value * gelu(gate) over
// h = [value | gate], and its backward straight into grad_h. A plain C++ API on
// raw device pointers, free of LibTorch, so that the .cu builds with nvcc alone.
// geglu.cpp wraps it as a LibTorch autograd function.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace sdxl::cuda {

enum class GegluDtype : int { kFloat32, kBFloat16, kFloat16 };

/// out[r, j] = value * gelu_erf(gate), value = h[r, j], gate = h[r, inner + j].
/// h is [rows, 2 * inner] and out [rows, inner], both row-major and contiguous
/// on the current device. Runs on `stream`; no host synchronization, no
/// allocation. Throws zero::DeviceError when the launch fails (cudaGetLastError).
void geglu_forward(const void* h, void* out, std::int64_t rows, std::int64_t inner, GegluDtype dtype,
                   cudaStream_t stream);

/// grad_h[r, j] = d out / d value and grad_h[r, inner + j] = d out / d gate for
/// the incoming gradient grad_out [rows, inner]; grad_h is [rows, 2 * inner] and
/// must not overlap h or grad_out. Same conditions as geglu_forward.
void geglu_backward(const void* grad_out, const void* h, void* grad_h, std::int64_t rows, std::int64_t inner,
                    GegluDtype dtype, cudaStream_t stream);

}  // namespace sdxl::cuda
