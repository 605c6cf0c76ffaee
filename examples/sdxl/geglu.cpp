// geglu(): the fused CUDA kernels as a LibTorch autograd function, and the
// composite everywhere else.
//
// The fused path needs the kernels (CMake compiles geglu_kernels.cu and
// defines SDXL_GEGLU_CUDA_KERNELS only when zero builds CUDA and LibTorch has
// CUDA) and LibTorch's CUDA headers. CPU-only LibTorch builds (Debian's 1.13,
// CI) compile the composite alone.

#include "geglu.hpp"

#include <stdexcept>
#include <string>
#include <vector>

#if defined(ZERO_WITH_CUDA) && defined(SDXL_GEGLU_CUDA_KERNELS) && __has_include(<ATen/cuda/CUDAContext.h>) && \
    __has_include(<c10/cuda/CUDAGuard.h>)
#define SDXL_GEGLU_FUSED 1
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "geglu_kernels.hpp"
#endif

namespace sdxl {

using torch::Tensor;

namespace {

Tensor composite(const Tensor& h) {
  auto parts = h.chunk(2, -1);
  return parts[0] * torch::gelu(parts[1]);  // exact (erf) GELU, as F.gelu
}

#ifdef SDXL_GEGLU_FUSED

cuda::GegluDtype kernel_dtype(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float: return cuda::GegluDtype::kFloat32;
    case c10::ScalarType::BFloat16: return cuda::GegluDtype::kBFloat16;
    case c10::ScalarType::Half: return cuda::GegluDtype::kFloat16;
    default: break;
  }
  throw std::invalid_argument("geglu: no fused kernel for " + std::string(c10::toString(type)));
}

// h viewed as [rows, 2 * inner].
struct Rows {
  std::int64_t rows, inner;
};
Rows rows_of(const Tensor& h) {
  const std::int64_t width = h.size(-1);
  return {width == 0 ? 0 : h.numel() / width, width / 2};
}

Tensor fused_forward(const Tensor& h) {
  const c10::cuda::CUDAGuard device(h.device());
  const Rows shape = rows_of(h);
  std::vector<std::int64_t> sizes = h.sizes().vec();
  sizes.back() = shape.inner;
  Tensor out = at::empty(sizes, h.options());
  cuda::geglu_forward(h.data_ptr(), out.data_ptr(), shape.rows, shape.inner, kernel_dtype(h.scalar_type()),
                      at::cuda::getCurrentCUDAStream(h.device().index()).stream());
  return out;
}

Tensor fused_backward(const Tensor& grad_out, const Tensor& h) {
  const c10::cuda::CUDAGuard device(h.device());
  const Rows shape = rows_of(h);
  Tensor grad_h = at::empty(h.sizes(), h.options());
  cuda::geglu_backward(grad_out.data_ptr(), h.data_ptr(), grad_h.data_ptr(), shape.rows, shape.inner,
                       kernel_dtype(h.scalar_type()), at::cuda::getCurrentCUDAStream(h.device().index()).stream());
  return grad_h;
}

// The composite's gradient in differentiable ops, for backward with create_graph.
Tensor composite_backward(const Tensor& grad_out, const Tensor& h) {
  auto parts = h.chunk(2, -1);
  return torch::cat({grad_out * torch::gelu(parts[1]), at::gelu_backward(grad_out * parts[0], parts[1])}, -1);
}

// Saves only h: the composite keeps gelu's output as well.
struct GegluFunction : torch::autograd::Function<GegluFunction> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& h) {
    ctx->save_for_backward({h});
    return fused_forward(h);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const Tensor h = ctx->get_saved_variables()[0];
    if (at::GradMode::is_enabled()) return {composite_backward(grads[0], h)};
    const Tensor grad_out = grads[0].to(h.scalar_type()).contiguous();
    return {fused_backward(grad_out, h)};
  }
};

#endif  // SDXL_GEGLU_FUSED

}  // namespace

bool geglu_has_fused_kernels() {
#ifdef SDXL_GEGLU_FUSED
  return true;
#else
  return false;
#endif
}

bool geglu_is_fused(const Tensor& h) {
#ifdef SDXL_GEGLU_FUSED
  if (!h.defined() || !h.is_cuda() || h.layout() != torch::kStrided || h.dim() == 0) return false;
  const auto type = h.scalar_type();
  return (type == torch::kFloat32 || type == torch::kBFloat16 || type == torch::kFloat16) &&
         h.size(-1) % 2 == 0 && h.is_contiguous();
#else
  (void)h;
  return false;
#endif
}

Tensor geglu(const Tensor& h) {
#ifdef SDXL_GEGLU_FUSED
  if (geglu_is_fused(h)) return GegluFunction::apply(h);
#endif
  return composite(h);
}

}  // namespace sdxl
