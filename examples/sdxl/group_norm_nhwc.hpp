// GroupNorm followed by an optional SiLU as one autograd operation: fused
// CUDA kernels for channels-last activations where the build has them, else
// LibTorch's group_norm (+ silu).
#pragma once

#include <torch/torch.h>

#include <cstdint>

namespace sdxl {

/// silu(group_norm(x, groups, weight, bias, eps)) when `silu`, else the plain
/// group_norm, for x [N, C, H, W]. A CUDA x that is contiguous in
/// channels_last (fp32/bf16/fp16, weight and bias defined, fp32/bf16/fp16 of
/// one dtype) takes the fused NHWC kernels: the output (and x's gradient) is
/// channels_last, statistics in fp32, backward saves x, weight, bias and the
/// statistics (not the output), and nothing synchronizes with the host, so it
/// can be captured in a CUDA graph. Anything else runs torch::group_norm and
/// torch::silu, so those results (all of them on the CPU) are LibTorch's bit
/// for bit.
torch::Tensor group_norm_act(const torch::Tensor& x, std::int64_t groups, const torch::Tensor& weight,
                             const torch::Tensor& bias, double eps, bool silu);

/// True when group_norm_act with these arguments takes the fused kernels.
bool group_norm_act_is_fused(const torch::Tensor& x, std::int64_t groups, const torch::Tensor& weight,
                             const torch::Tensor& bias);

/// True when this build has the fused CUDA kernels.
bool group_norm_act_has_fused_kernels();

}  // namespace sdxl
