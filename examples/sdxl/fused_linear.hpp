// The UNet's Linear: torch::linear, except that on CUDA its backward computes
// the weight and bias gradients in one GEMM (the bias gradient reduced in the
// GEMM's epilogue by cuBLASLt) instead of a GEMM and a separate sum over every
// token of the output gradient.
#pragma once

#include <torch/torch.h>

#include <cstdint>

namespace sdxl {

/// x w^T + b, as torch::linear. Where the fused backward applies (this build
/// has it, x, w and b are CUDA bf16/fp16, b is defined, and w and b both need
/// gradients) its backward takes it; the output, the input gradient and
/// everything else are torch::linear's. Elsewhere it is torch::linear.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b);

/// True when linear(x, w, b) records the fused backward.
bool linear_backward_is_fused(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b);

/// True when this build has the fused backward (CUDA LibTorch and cuBLASLt).
bool linear_has_fused_backward();

/// Off: linear() is torch::linear everywhere (to compare the two in one
/// process). Default on; the environment variable SDXL_UNFUSED_LINEAR_BACKWARD=1
/// starts a process with it off.
void set_linear_backward_fused(bool enabled);

/// How many fused backward calls ran the one GEMM, and how many found no
/// cuBLASLt algorithm for their shape and computed the two gradients apart.
struct LinearBackwardCounts {
  std::int64_t fused = 0, fallback = 0;
};
LinearBackwardCounts linear_backward_counts();

}  // namespace sdxl
