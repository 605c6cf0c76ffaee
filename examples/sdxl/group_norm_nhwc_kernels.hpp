// GroupNorm (+ optional SiLU) over channels-last activations, forward and
// backward (group_norm_nhwc_kernels.cu). A plain C++ API on raw device
// pointers, free of LibTorch, so that the .cu builds with nvcc alone;
// group_norm_nhwc.cpp wraps it as a LibTorch autograd function.
//
// Layout: x is N x HW x C in memory (NCHW logical, channels_last physical):
// element (n, c, p) at (n * HW + p) * C + c. Groups of cpg = C / G consecutive
// channels; statistics over the HW * cpg elements of (n, g), in fp32, biased
// variance, as torch.nn.GroupNorm. Results are deterministic: no atomics, all
// partial sums are combined in a fixed order.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace sdxl::cuda {

enum class GroupNormDtype : int { kFloat32, kBFloat16, kFloat16 };

struct GroupNormShape {
  std::int64_t n = 0;       // batch
  std::int64_t hw = 0;      // pixels per image (H * W)
  std::int64_t c = 0;       // channels
  std::int64_t groups = 0;  // G, divides c
};

/// Bytes of scratch that group_norm_nhwc_forward needs (a few KiB to a few
/// MiB); may be 0. Depends on the shape only.
std::size_t group_norm_nhwc_forward_workspace_bytes(const GroupNormShape& shape);

/// y = act((x - mean[n,g]) * rstd[n,g] * gamma[c] + beta[c]), act = SiLU when
/// `silu`, else identity. x and y (same dtype, NHWC, not overlapping) hold
/// N*HW*C elements; gamma and beta C elements of param_dtype; mean and rstd
/// (fp32, N x G) receive the statistics for the backward, rstd =
/// 1 / sqrt(var + eps). `workspace` holds at least
/// group_norm_nhwc_forward_workspace_bytes(shape) bytes (4-byte aligned).
/// Runs on `stream` (three kernels); no host synchronization, no allocation, so
/// it can be captured in a CUDA graph. Throws std::invalid_argument for a bad
/// shape and std::runtime_error when a launch fails.
void group_norm_nhwc_forward(const void* x, const void* gamma, const void* beta, void* y, float* mean, float* rstd,
                             void* workspace, const GroupNormShape& shape, double eps, bool silu,
                             GroupNormDtype dtype, GroupNormDtype param_dtype, cudaStream_t stream);

/// Bytes of scratch that group_norm_nhwc_backward needs. Depends on the shape only.
std::size_t group_norm_nhwc_backward_workspace_bytes(const GroupNormShape& shape);

/// Gradients of the forward above for the incoming gradient dy (NHWC, x's
/// dtype), from x, the saved mean/rstd and gamma/beta (beta only matters with
/// `silu`: the activation's derivative is evaluated at the recomputed
/// pre-activation). Writes dx (x's dtype, NHWC; must not overlap dy or x),
/// dgamma and dbeta (C elements each, param_dtype; sums accumulated in fp32).
/// Same conditions as the forward (four kernels).
void group_norm_nhwc_backward(const void* dy, const void* x, const float* mean, const float* rstd, const void* gamma,
                              const void* beta, void* dx, void* dgamma, void* dbeta, void* workspace,
                              const GroupNormShape& shape, bool silu, GroupNormDtype dtype,
                              GroupNormDtype param_dtype, cudaStream_t stream);

}  // namespace sdxl::cuda
