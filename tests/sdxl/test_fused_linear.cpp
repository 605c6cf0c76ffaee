// Tests of sdxl::linear (examples/sdxl/fused_linear.hpp): on the CPU it is
// torch::linear bit for bit, forward and backward. On CUDA the fused backward
// (weight and bias gradients in one cuBLASLt GEMM) runs for the UNet's Linear
// shapes and is as close to an fp32 reference as LibTorch's own GEMM + sum,
// the output and input gradient are LibTorch's bit for bit, and it works with
// non-contiguous inputs and gradients, with create_graph, with frozen weights
// and under CUDA graph capture.
//
// Run with --gpu for the CUDA cases ("linear cuda*"): exits 77 (skipped) when
// no CUDA device is visible.

#include <torch/torch.h>

#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "fused_linear.hpp"

#if defined(SDXL_LINEAR_TEST_CUDA) && __has_include(<ATen/cuda/CUDAGraph.h>)
#define LINEAR_TEST_CUDA 1
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "gpu_test_main.hpp"  // doctest, after LibTorch; and main()
#include "tensor_compare.hpp"

using torch::Tensor;

namespace {

struct Result {
  Tensor y, dx, dw, db;
};

// Forward and backward of f on fresh leaves, with incoming gradient dy.
template <typename F>
Result run(F f, const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& dy) {
  const Tensor xl = x.detach().clone().requires_grad_(true);
  const Tensor wl = w.detach().clone().requires_grad_(true);
  const Tensor bl = b.detach().clone().requires_grad_(true);
  const Tensor y = f(xl, wl, bl);
  y.backward(dy);
  return {y.detach(), xl.grad(), wl.grad(), bl.grad()};
}

Tensor reference_linear(const Tensor& x, const Tensor& w, const Tensor& b) { return torch::linear(x, w, b); }

struct Shape {
  std::vector<std::int64_t> x;  // [..., in]
  std::int64_t out;
};

// The UNet's kinds of Linear: attention and feed-forward projections over the
// tokens of a 64x64 and a 32x32 latent level (ff.net.0.proj is 8x wide),
// time_emb_proj over the batch alone, and odd sizes.
const std::vector<Shape> kShapes = {
    {{2, 1024, 640}, 640}, {{1, 256, 1280}, 10240}, {{2, 1280}, 640}, {{8, 2816}, 1280}, {{3, 77, 40}, 24},
};

Tensor random(torch::IntArrayRef shape, torch::ScalarType type, torch::Device device) {
  return torch::randn(shape, torch::TensorOptions().dtype(torch::kFloat32).device(device)).to(type);
}

std::string describe(const Shape& s, torch::ScalarType type) {
  std::ostringstream o;
  o << c10::toString(type) << " x " << torch::IntArrayRef(s.x) << " out " << s.out;
  return o.str();
}

[[maybe_unused]] bool cuda_available() {
  if (torch::cuda::is_available()) return true;
  MESSAGE("no CUDA device visible: nothing checked");
  return false;
}

}  // namespace

// ---------------------------------------------------------------- CPU: torch::linear

TEST_CASE("linear cpu: is torch::linear bit for bit") {
  torch::manual_seed(1);
  for (const auto type : {torch::kFloat32, torch::kBFloat16}) {
    for (const Shape& s : kShapes) {
      INFO(describe(s, type));
      const Tensor x = random(s.x, type, torch::kCPU);
      const Tensor w = random({s.out, s.x.back()}, type, torch::kCPU).div_(8);
      const Tensor b = random({s.out}, type, torch::kCPU);
      {
        const Tensor wl = w.detach().requires_grad_(true), bl = b.detach().requires_grad_(true);
        CHECK_FALSE(sdxl::linear_backward_is_fused(x, wl, bl));
      }
      std::vector<std::int64_t> y_shape = s.x;
      y_shape.back() = s.out;
      const Tensor dy = random(y_shape, type, torch::kCPU);
      const Result ours = run(sdxl::linear, x, w, b, dy);
      const Result ref = run(reference_linear, x, w, b, dy);
      CHECK(bitwise_equal(ours.y, ref.y));
      CHECK(bitwise_equal(ours.dx, ref.dx));
      CHECK(bitwise_equal(ours.dw, ref.dw));
      CHECK(bitwise_equal(ours.db, ref.db));
    }
  }
}

// ---------------------------------------------------------------- CUDA: the fused backward

#ifdef LINEAR_TEST_CUDA

TEST_CASE("linear cuda: one GEMM for weight and bias gradients, as close as LibTorch's") {
  if (!cuda_available()) return;
  REQUIRE(sdxl::linear_has_fused_backward());
  torch::manual_seed(2);
  const torch::Device cuda(torch::kCUDA);
  for (const auto type : {torch::kBFloat16, torch::kFloat16}) {
    for (const Shape& s : kShapes) {
      INFO(describe(s, type));
      const Tensor x = random(s.x, type, cuda);
      const Tensor w = random({s.out, s.x.back()}, type, cuda).div_(8);
      const Tensor b = random({s.out}, type, cuda);
      std::vector<std::int64_t> y_shape = s.x;
      y_shape.back() = s.out;
      const Tensor dy = random(y_shape, type, cuda);
      {
        const Tensor wl = w.detach().requires_grad_(true), bl = b.detach().requires_grad_(true);
        REQUIRE(sdxl::linear_backward_is_fused(x, wl, bl));
        const Tensor y = sdxl::linear(x, wl, bl);
        REQUIRE(y.grad_fn());
        CHECK(y.grad_fn()->name().find("LinearFunction") != std::string::npos);
      }
      const auto before = sdxl::linear_backward_counts();
      const Result ours = run(sdxl::linear, x, w, b, dy);
      const auto after = sdxl::linear_backward_counts();
      // cuBLASLt has an algorithm for every shape the UNet trains with (tokens:
      // a latent level's positions); for a handful of rows it may not, and the
      // two gradients are then computed apart.
      const std::int64_t tokens = x.numel() / s.x.back();
      if (tokens >= 64) CHECK(after.fused == before.fused + 1);
      else MESSAGE("tokens " << tokens << ": " << (after.fused > before.fused ? "fused" : "fell back"));
      CHECK(after.fused + after.fallback == before.fused + before.fallback + 1);
      const Result ref = run(reference_linear, x, w, b, dy);
      // The forward and the input gradient are LibTorch's own.
      CHECK(bitwise_equal(ours.y, ref.y));
      CHECK(bitwise_equal(ours.dx, ref.dx));
      // Weight and bias gradients against fp32 on the same inputs: no worse
      // than LibTorch's GEMM and sum (plus half a 16-bit ulp of slack).
      const Tensor x2 = x.reshape({-1, s.x.back()}).to(torch::kFloat32);
      const Tensor dy2 = dy.reshape({-1, s.out}).to(torch::kFloat32);
      const Tensor dw32 = dy2.t().mm(x2), db32 = dy2.sum(0);
      const double ulp = type == torch::kBFloat16 ? 1.0 / 256 : 1.0 / 2048;
      INFO("dW error ours " << relative_error(ours.dw, dw32) << ", LibTorch " << relative_error(ref.dw, dw32));
      INFO("db error ours " << relative_error(ours.db, db32) << ", LibTorch " << relative_error(ref.db, db32));
      CHECK(relative_error(ours.dw, dw32) <= relative_error(ref.dw, dw32) + ulp);
      CHECK(relative_error(ours.db, db32) <= relative_error(ref.db, db32) + ulp);
      CHECK(relative_error(ours.dw, dw32) < 4 * ulp);
      CHECK(relative_error(ours.db, db32) < 4 * ulp);
    }
  }
}

TEST_CASE("linear cuda: non-contiguous input and output gradient") {
  if (!cuda_available()) return;
  torch::manual_seed(3);
  const torch::Device cuda(torch::kCUDA);
  const Tensor x = random({640, 2, 300}, torch::kBFloat16, cuda).permute({1, 2, 0});  // [2, 300, 640], strided
  const Tensor w = random({320, 640}, torch::kBFloat16, cuda).div_(8);
  const Tensor b = random({320}, torch::kBFloat16, cuda);
  const Tensor dy = random({320, 2, 300}, torch::kBFloat16, cuda).permute({1, 2, 0});
  REQUIRE_FALSE(x.is_contiguous());
  REQUIRE_FALSE(dy.is_contiguous());
  const Result ours = run(sdxl::linear, x, w, b, dy);
  const Result ref = run(reference_linear, x, w, b, dy);
  CHECK(bitwise_equal(ours.y, ref.y));
  CHECK(relative_error(ours.dw, ref.dw) < 2.0 / 256);
  CHECK(relative_error(ours.db, ref.db) < 2.0 / 256);
}

TEST_CASE("linear cuda: frozen weight or bias, no bias, switched off: torch::linear") {
  if (!cuda_available()) return;
  const torch::Device cuda(torch::kCUDA);
  const Tensor x = random({4, 64}, torch::kBFloat16, cuda);
  const Tensor w = random({32, 64}, torch::kBFloat16, cuda).requires_grad_(true);
  const Tensor b = random({32}, torch::kBFloat16, cuda).requires_grad_(true);
  CHECK(sdxl::linear_backward_is_fused(x, w, b));
  CHECK_FALSE(sdxl::linear_backward_is_fused(x, w.detach(), b));
  CHECK_FALSE(sdxl::linear_backward_is_fused(x, w, b.detach()));
  CHECK_FALSE(sdxl::linear_backward_is_fused(x, w, Tensor()));
  CHECK_FALSE(sdxl::linear_backward_is_fused(x.to(torch::kFloat32), w.to(torch::kFloat32).detach().requires_grad_(),
                                             b.to(torch::kFloat32).detach().requires_grad_()));
  {
    torch::NoGradGuard no_grad;
    CHECK_FALSE(sdxl::linear_backward_is_fused(x, w, b));
  }
  sdxl::set_linear_backward_fused(false);
  CHECK_FALSE(sdxl::linear_backward_is_fused(x, w, b));
  sdxl::set_linear_backward_fused(true);
}

TEST_CASE("linear cuda: double backward (create_graph) matches torch::linear") {
  if (!cuda_available()) return;
  torch::manual_seed(4);
  const torch::Device cuda(torch::kCUDA);
  auto grad_norm_of_w = [&](auto f) {
    const Tensor x = random({16, 32}, torch::kFloat32, cuda).to(torch::kBFloat16).requires_grad_(true);
    torch::manual_seed(5);
    const Tensor w = random({8, 32}, torch::kBFloat16, cuda).requires_grad_(true);
    const Tensor b = random({8}, torch::kBFloat16, cuda).requires_grad_(true);
    const Tensor y = f(x, w, b);
    const auto g = torch::autograd::grad({y.square().sum()}, {w}, {}, /*retain_graph=*/true, /*create_graph=*/true);
    const auto gg = torch::autograd::grad({g[0].to(torch::kFloat32).square().sum()}, {x});
    return gg[0];
  };
  torch::manual_seed(6);
  const Tensor ours = grad_norm_of_w(sdxl::linear);
  torch::manual_seed(6);
  const Tensor ref = grad_norm_of_w(reference_linear);
  CHECK(relative_error(ours, ref) < 4.0 / 256);
}

TEST_CASE("linear cuda: CUDA graph capture and replay") {
  if (!cuda_available()) return;
  torch::manual_seed(7);
  const torch::Device cuda(torch::kCUDA);
  const Tensor x = random({2, 1024, 640}, torch::kBFloat16, cuda);
  const Tensor w = random({640, 640}, torch::kBFloat16, cuda).div_(8).requires_grad_(true);
  const Tensor b = random({640}, torch::kBFloat16, cuda).requires_grad_(true);
  const Tensor dy = random({2, 1024, 640}, torch::kBFloat16, cuda);
  auto step = [&] {
    w.mutable_grad().reset();
    b.mutable_grad().reset();
    sdxl::linear(x, w, b).backward(dy);
    return std::pair<Tensor, Tensor>{w.grad(), b.grad()};
  };
  const auto eager = step();
  const Tensor dw_eager = eager.first.clone(), db_eager = eager.second.clone();
  const auto side = c10::cuda::getStreamFromPool();
  c10::cuda::CUDAStreamGuard on_side(side);
  step();  // warm-up on the capture stream
  at::cuda::CUDAGraph graph;
  graph.capture_begin();
  const auto captured = step();
  graph.capture_end();
  captured.first.zero_();
  captured.second.zero_();
  graph.replay();
  torch::cuda::synchronize();
  CHECK(bitwise_equal(captured.first, dw_eager));
  CHECK(bitwise_equal(captured.second, db_eager));
}

#endif  // LINEAR_TEST_CUDA
