// GEGLU's elementwise part, value * gelu(gate) with (value, gate) = h.chunk(2, -1),
// as one autograd operation: fused CUDA kernels where the build has them,
// else LibTorch's composite.
#pragma once

#include <torch/torch.h>

namespace sdxl {

/// h.chunk(2, -1)[0] * gelu(h.chunk(2, -1)[1]) with exact (erf) GELU, as
/// diffusers' GEGLU. Contiguous CUDA tensors of fp32/bf16/fp16 take the fused
/// kernels (forward and backward; backward saves only h); anything else
/// (CPU, other dtypes, non-contiguous h, builds without them) runs the
/// composite, so CPU results are those of the composite bit for bit.
torch::Tensor geglu(const torch::Tensor& h);

/// True when geglu(h) takes the fused kernels.
bool geglu_is_fused(const torch::Tensor& h);

/// True when this build has the fused CUDA kernels.
bool geglu_has_fused_kernels();

}  // namespace sdxl
