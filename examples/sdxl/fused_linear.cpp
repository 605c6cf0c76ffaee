// sdxl::linear: torch::linear with the weight and bias gradients in one
// cuBLASLt GEMM on CUDA (linear_backward_lt.hpp), torch::linear elsewhere.
//
// The fused path needs the cuBLASLt wrapper (CMake builds linear_backward_lt.cpp
// and defines SDXL_LINEAR_LT only when zero builds CUDA and LibTorch has CUDA)
// and LibTorch's CUDA headers. CPU-only LibTorch builds (Debian's 1.13, CI)
// have torch::linear alone.
//
// Why: at batch 1 the separate sums over dY were 390 reduction kernels and
// 4.7 ms of a 111 ms step on an H100 (docs/perf-notes.md, session 23's trace);
// in the GEMM's epilogue they read nothing more than the GEMM already does.

#include "fused_linear.hpp"

#include <atomic>

#if defined(ZERO_WITH_CUDA) && defined(SDXL_LINEAR_LT) && __has_include(<ATen/cuda/CUDAContext.h>) && \
    __has_include(<c10/cuda/CUDAGuard.h>)
#define SDXL_LINEAR_FUSED 1
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "linear_backward_lt.hpp"
#endif

#include "env_flag.hpp"

namespace sdxl {

using torch::Tensor;

namespace {

std::atomic<bool>& fused_enabled() {
  static std::atomic<bool> enabled{!env_flag("SDXL_UNFUSED_LINEAR_BACKWARD")};
  return enabled;
}

std::atomic<std::int64_t> fused_calls{0}, fallback_calls{0};

#ifdef SDXL_LINEAR_FUSED

// cuBLASLt's scratch for the one GEMM; from the caching allocator, so that it
// comes from the graph's pool under CUDA graph capture.
constexpr std::size_t kWorkspaceBytes = std::size_t{4} << 20;

// The two gradients apart (what LibTorch's linear does: a GEMM and a sum).
void unfused_weight_and_bias(const Tensor& dy2, const Tensor& x2, bool need_w, bool need_b, Tensor& dw, Tensor& db) {
  if (need_w) dw = dy2.t().mm(x2);
  if (need_b) db = dy2.sum(0);
}

struct LinearFunction : torch::autograd::Function<LinearFunction> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x, const Tensor& w, const Tensor& b) {
    ctx->save_for_backward({x, w});
    return torch::linear(x, w, b);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor& x = saved[0];
    const Tensor& w = saved[1];
    const bool need_x = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(1),
               need_b = ctx->needs_input_grad(2);
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor()};
    const std::int64_t in = w.size(1), out = w.size(0);
    Tensor dx, dw, db;
    if (at::GradMode::is_enabled()) {
      // create_graph: differentiable ops (double backward through them).
      const Tensor dy2 = grads[0].reshape({-1, out});
      if (need_x) dx = grads[0].matmul(w);
      unfused_weight_and_bias(dy2, x.reshape({-1, in}), need_w, need_b, dw, db);
      return {dx, dw, db};
    }
    const Tensor dy = grads[0].to(w.scalar_type());
    if (need_x) dx = dy.matmul(w);
    Tensor dy2 = dy.reshape({-1, out});
    Tensor x2 = x.reshape({-1, in});
    if (dy2.stride(1) != 1 || dy2.stride(0) < out) dy2 = dy2.contiguous();
    if (x2.stride(1) != 1 || x2.stride(0) < in) x2 = x2.contiguous();
    if (need_w && need_b) {
      const c10::cuda::CUDAGuard device(w.device());
      dw = at::empty({out, in}, w.options());
      db = at::empty({out}, w.options());
      const Tensor workspace = at::empty({static_cast<std::int64_t>(kWorkspaceBytes)}, w.options().dtype(at::kByte));
      const auto dtype = w.scalar_type() == at::kBFloat16 ? cuda::LtDtype::kBFloat16 : cuda::LtDtype::kFloat16;
      if (cuda::weight_and_bias_grad(x2.data_ptr(), x2.stride(0), dy2.data_ptr(), dy2.stride(0), dw.data_ptr(),
                                     db.data_ptr(), x2.size(0), in, out, dtype, workspace.data_ptr(), kWorkspaceBytes,
                                     at::cuda::getCurrentCUDAStream(w.device().index()).stream())) {
        ++fused_calls;
        return {dx, dw, db};
      }
      ++fallback_calls;
    }
    unfused_weight_and_bias(dy2, x2, need_w, need_b, dw, db);
    return {dx, dw, db};
  }
};

#endif  // SDXL_LINEAR_FUSED

}  // namespace

bool linear_has_fused_backward() {
#ifdef SDXL_LINEAR_FUSED
  return true;
#else
  return false;
#endif
}

void set_linear_backward_fused(bool enabled) { fused_enabled() = enabled; }

LinearBackwardCounts linear_backward_counts() { return {fused_calls.load(), fallback_calls.load()}; }

bool linear_backward_is_fused(const Tensor& x, const Tensor& w, const Tensor& b) {
#ifdef SDXL_LINEAR_FUSED
  if (!fused_enabled() || !torch::GradMode::is_enabled()) return false;
  if (!x.defined() || !w.defined() || !b.defined()) return false;
  if (!w.requires_grad() || !b.requires_grad()) return false;
  if (!x.is_cuda() || !w.is_cuda() || !b.is_cuda() || x.dim() == 0 || w.dim() != 2) return false;
  const auto type = w.scalar_type();
  return (type == at::kBFloat16 || type == at::kHalf) && x.scalar_type() == type && b.scalar_type() == type &&
         x.layout() == torch::kStrided && w.is_contiguous() && b.is_contiguous();
#else
  (void)x;
  (void)w;
  (void)b;
  return false;
#endif
}

Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b) {
#ifdef SDXL_LINEAR_FUSED
  if (linear_backward_is_fused(x, w, b)) return LinearFunction::apply(x, w, b);
#endif
  return torch::linear(x, w, b);
}

}  // namespace sdxl
