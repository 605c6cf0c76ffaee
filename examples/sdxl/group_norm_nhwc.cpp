// group_norm_act(): the NHWC GroupNorm(+SiLU) kernels as a LibTorch autograd
// function, and torch::group_norm (+ torch::silu) everywhere else.
//
// The fused path needs the kernels (CMake compiles group_norm_nhwc_kernels.cu
// and defines SDXL_GROUP_NORM_CUDA_KERNELS only when zero builds CUDA and
// LibTorch has CUDA) and LibTorch's CUDA headers. CPU-only LibTorch builds
// (Debian's 1.13, CI) compile the fallback alone.

#include "group_norm_nhwc.hpp"

#include <stdexcept>
#include <string>
#include <vector>

#if defined(ZERO_WITH_CUDA) && defined(SDXL_GROUP_NORM_CUDA_KERNELS) && __has_include(<ATen/cuda/CUDAContext.h>) && \
    __has_include(<c10/cuda/CUDAGuard.h>)
#define SDXL_GROUP_NORM_FUSED 1
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "group_norm_nhwc_kernels.hpp"
#endif

namespace sdxl {

using torch::Tensor;

namespace {

// What the UNet ran before: LibTorch's GroupNorm, then SiLU.
Tensor composite(const Tensor& x, std::int64_t groups, const Tensor& weight, const Tensor& bias, double eps,
                 bool silu) {
  Tensor y = torch::group_norm(x, groups, weight, bias, eps);
  return silu ? torch::silu(y) : y;
}

#ifdef SDXL_GROUP_NORM_FUSED

bool supported_dtype(c10::ScalarType type) {
  return type == torch::kFloat32 || type == torch::kBFloat16 || type == torch::kFloat16;
}

cuda::GroupNormDtype kernel_dtype(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float: return cuda::GroupNormDtype::kFloat32;
    case c10::ScalarType::BFloat16: return cuda::GroupNormDtype::kBFloat16;
    case c10::ScalarType::Half: return cuda::GroupNormDtype::kFloat16;
    default: break;
  }
  throw std::invalid_argument("group_norm_act: no fused kernel for " + std::string(c10::toString(type)));
}

cuda::GroupNormShape shape_of(const Tensor& x, std::int64_t groups) {
  return {x.size(0), x.size(2) * x.size(3), x.size(1), groups};
}

Tensor scratch(std::size_t bytes, const Tensor& like) {
  return at::empty({static_cast<std::int64_t>(bytes)}, like.options().dtype(torch::kUInt8));
}

struct GroupNormActFunction : torch::autograd::Function<GroupNormActFunction> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x, const Tensor& weight,
                        const Tensor& bias, std::int64_t groups, double eps, bool silu) {
    const c10::cuda::CUDAGuard device(x.device());
    const cuda::GroupNormShape shape = shape_of(x, groups);
    const Tensor w = weight.contiguous(), b = bias.contiguous();
    Tensor y = at::empty(x.sizes(), x.options().memory_format(torch::MemoryFormat::ChannelsLast));
    Tensor mean = at::empty({shape.n, groups}, x.options().dtype(torch::kFloat32));
    Tensor rstd = at::empty({shape.n, groups}, x.options().dtype(torch::kFloat32));
    Tensor ws = scratch(cuda::group_norm_nhwc_forward_workspace_bytes(shape), x);
    cuda::group_norm_nhwc_forward(x.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr(), mean.data_ptr<float>(),
                                  rstd.data_ptr<float>(), ws.data_ptr(), shape, eps, silu,
                                  kernel_dtype(x.scalar_type()), kernel_dtype(w.scalar_type()),
                                  at::cuda::getCurrentCUDAStream(x.get_device()).stream());
    ctx->save_for_backward({x, weight, bias, mean, rstd});
    ctx->saved_data["groups"] = groups;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["silu"] = silu;
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &weight = saved[1], &bias = saved[2], &mean = saved[3], &rstd = saved[4];
    const std::int64_t groups = ctx->saved_data["groups"].toInt();
    const bool silu = ctx->saved_data["silu"].toBool();
    const Tensor none;
    if (!grads[0].defined()) return {none, none, none, none, none, none};
    // backward with create_graph: differentiate the composite instead, whose
    // gradient is itself differentiable.
    if (torch::GradMode::is_enabled())
      return composite_backward(x, weight, bias, grads[0], groups, ctx->saved_data["eps"].toDouble(), silu);

    const c10::cuda::CUDAGuard device(x.device());
    const cuda::GroupNormShape shape = shape_of(x, groups);
    const Tensor dy = grads[0].to(x.scalar_type()).contiguous(torch::MemoryFormat::ChannelsLast);
    const Tensor w = weight.contiguous(), b = bias.contiguous();
    Tensor dx = at::empty(x.sizes(), x.options().memory_format(torch::MemoryFormat::ChannelsLast));
    Tensor dw = at::empty({shape.c}, w.options());
    Tensor db = at::empty({shape.c}, b.options());
    Tensor ws = scratch(cuda::group_norm_nhwc_backward_workspace_bytes(shape), x);
    cuda::group_norm_nhwc_backward(dy.data_ptr(), x.data_ptr(), mean.data_ptr<float>(), rstd.data_ptr<float>(),
                                   w.data_ptr(), b.data_ptr(), dx.data_ptr(), dw.data_ptr(), db.data_ptr(),
                                   ws.data_ptr(), shape, silu, kernel_dtype(x.scalar_type()),
                                   kernel_dtype(w.scalar_type()),
                                   at::cuda::getCurrentCUDAStream(x.get_device()).stream());
    return {dx, dw.view(weight.sizes()), db.view(bias.sizes()), none, none, none};
  }

  static torch::autograd::variable_list composite_backward(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                                           const Tensor& dy, std::int64_t groups, double eps,
                                                           bool silu) {
    std::vector<Tensor> inputs;
    std::vector<int> slot;
    const Tensor params[3] = {x, weight, bias};
    for (int i = 0; i < 3; ++i) {
      if (params[i].requires_grad()) {
        inputs.push_back(params[i]);
        slot.push_back(i);
      }
    }
    torch::autograd::variable_list out(6);
    if (inputs.empty()) return out;
    const Tensor y = composite(x, groups, weight, bias, eps, silu);
    const auto g = torch::autograd::grad({y}, inputs, {dy}, /*retain_graph=*/true, /*create_graph=*/true,
                                         /*allow_unused=*/true);
    for (std::size_t i = 0; i < slot.size(); ++i) out[slot[i]] = g[i];
    return out;
  }
};

#endif  // SDXL_GROUP_NORM_FUSED

}  // namespace

bool group_norm_act_has_fused_kernels() {
#ifdef SDXL_GROUP_NORM_FUSED
  return true;
#else
  return false;
#endif
}

bool group_norm_act_is_fused(const Tensor& x, std::int64_t groups, const Tensor& weight, const Tensor& bias) {
#ifdef SDXL_GROUP_NORM_FUSED
  if (!x.defined() || !x.is_cuda() || x.layout() != torch::kStrided || x.dim() != 4 || x.numel() == 0) return false;
  if (!supported_dtype(x.scalar_type()) || !x.is_contiguous(torch::MemoryFormat::ChannelsLast)) return false;
  const std::int64_t c = x.size(1);
  if (groups <= 0 || c % groups != 0 || x.size(0) > 65535) return false;
  for (const Tensor* p : {&weight, &bias}) {
    if (!p->defined() || p->device() != x.device() || p->layout() != torch::kStrided || p->dim() != 1 ||
        p->numel() != c || p->scalar_type() != weight.scalar_type())
      return false;
  }
  return supported_dtype(weight.scalar_type());
#else
  (void)x, (void)groups, (void)weight, (void)bias;
  return false;
#endif
}

Tensor group_norm_act(const Tensor& x, std::int64_t groups, const Tensor& weight, const Tensor& bias, double eps,
                      bool silu) {
#ifdef SDXL_GROUP_NORM_FUSED
  if (group_norm_act_is_fused(x, groups, weight, bias))
    return GroupNormActFunction::apply(x, weight, bias, groups, eps, silu);
#endif
  return composite(x, groups, weight, bias, eps, silu);
}

}  // namespace sdxl
