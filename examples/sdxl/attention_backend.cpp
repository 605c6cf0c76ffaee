#include "attention_backend.hpp"

#include <ATen/Context.h>
#include <torch/version.h>

#include <stdexcept>

namespace sdxl {

std::string attention_backend_choices() { return "default, flash, efficient, cudnn or math"; }

void select_attention_backend(std::string_view name, std::string_view option) {
  if (name == "default") return;
  const bool known = name == "flash" || name == "efficient" || name == "cudnn" || name == "math";
  if (!known)
    throw std::invalid_argument(std::string(option) + ": unknown attention kernel '" + std::string(name) +
                                "' (expected " + attention_backend_choices() + ")");
#if TORCH_VERSION_MAJOR >= 2 && (TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 3)
  auto& context = at::globalContext();
  context.setSDPUseFlash(name == "flash");
  context.setSDPUseMemEfficient(name == "efficient");
  context.setSDPUseCuDNN(name == "cudnn");
  // The math kernel stays allowed as the fallback for shapes the chosen one
  // does not take; "math" alone forces it.
  context.setSDPUseMath(true);
#else
  // LibTorch before 2.3 (1.13 here): the UNet computes attention with plain
  // matrix products, which is the math kernel.
  if (name != "math")
    throw std::invalid_argument(std::string(option) + ": attention kernel '" + std::string(name) +
                                "' needs LibTorch 2.3 or newer (this one is " TORCH_VERSION ")");
#endif
}

}  // namespace sdxl
