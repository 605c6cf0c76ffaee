// Activation checkpointing (reentrant, as torch.utils.checkpoint with
// use_reentrant=True): LibTorch's C++ API has none.
#pragma once

#include <torch/torch.h>

#include <functional>

namespace sdxl {

/// Runs `fn(inputs)` so that autograd keeps only `inputs` and recomputes fn in
/// backward (reentrant checkpointing). Parameters used by fn receive their
/// gradients during that recompute. fn must be deterministic (no dropout).
/// Without grad mode this is a plain call.
torch::autograd::variable_list checkpoint(
    std::function<torch::autograd::variable_list(const torch::autograd::variable_list&)> fn,
    const torch::autograd::variable_list& inputs);

}  // namespace sdxl
