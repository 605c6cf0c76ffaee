#pragma once
// Which fused kernel scaled-dot-product attention uses on the GPU. LibTorch
// picks one per call from those enabled; this narrows the choice so that the
// kernels can be compared (unet_bench --attention) and the fastest pinned
// (the trainer's [device] attention).

#include <string>
#include <string_view>

namespace sdxl {

/// "default" (LibTorch's own order), "flash", "efficient" (memory-efficient),
/// "cudnn" or "math". Throws std::invalid_argument naming `option` for any
/// other value, or for a kernel this LibTorch does not have.
void select_attention_backend(std::string_view name, std::string_view option);

/// The accepted names, for help texts.
std::string attention_backend_choices();

}  // namespace sdxl
