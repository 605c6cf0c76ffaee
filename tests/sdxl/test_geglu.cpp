// Tests of sdxl::geglu (examples/sdxl/geglu.hpp): on the CPU it is the
// composite value * gelu(gate) bit for bit; on CUDA the fused kernels match
// the composite on the same device (fp32 to 1e-6, bf16/fp16 to the last bit
// nearly everywhere), forward and backward, for the 16-byte path, the
// one-element path (inner % 8 != 0, misaligned data), beyond 2^31 elements,
// with create_graph and under CUDA graph capture.
//
// Run with --gpu for the CUDA cases ("geglu cuda*"): exits 77 (skipped) when
// no CUDA device is visible.

#include <torch/torch.h>

#include <cstdio>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "geglu.hpp"

#if defined(SDXL_GEGLU_TEST_CUDA) && __has_include(<ATen/cuda/CUDAGraph.h>)
#define GEGLU_TEST_CUDA 1
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

#include "gpu_test_main.hpp"  // doctest, after LibTorch; and main()
#include "tensor_compare.hpp"

using torch::Tensor;

namespace {

Tensor composite(const Tensor& h) {
  auto parts = h.chunk(2, -1);
  return parts[0] * torch::gelu(parts[1]);
}

struct Result {
  Tensor out, grad;
};

// Forward and backward of f on a fresh leaf copy of h, with incoming gradient dy.
template <typename F>
Result run(F f, const Tensor& h, const Tensor& dy) {
  Tensor leaf = h.detach().clone().requires_grad_(true);
  Tensor out = f(leaf);
  out.backward(dy);
  return {out.detach(), leaf.grad()};
}

// Same, on h itself (keeping its strides and storage offset).
template <typename F>
Result run_in_place(F f, const Tensor& h, const Tensor& dy) {
  Tensor leaf = h.detach().requires_grad_(true);
  Tensor out = f(leaf);
  out.backward(dy);
  return {out.detach(), leaf.grad()};
}

// |a - b| <= atol_rel * max|b| + rtol * |b| everywhere, and at least
// min_exact of the elements identical.
void check_close(const Tensor& a, const Tensor& b, double rtol, double atol_rel, double min_exact,
                 const std::string& what) {
  INFO(what);
  REQUIRE(bool(a.sizes() == b.sizes()));
  REQUIRE(bool(a.scalar_type() == b.scalar_type()));
  if (b.numel() == 0) return;
  const Tensor x = a.detach().cpu().to(torch::kFloat64);
  const Tensor y = b.detach().cpu().to(torch::kFloat64);
  REQUIRE(torch::isfinite(y).all().item<bool>());
  const double scale = y.abs().max().item<double>();
  const Tensor bad = (x - y).abs() > atol_rel * scale + rtol * y.abs();
  const auto n_bad = bad.sum().item<std::int64_t>();
  const double exact = (x == y).to(torch::kFloat64).mean().item<double>();
  INFO("max |ref| " << scale << ", max |diff| " << (x - y).abs().max().item<double>() << ", outside tolerance "
                    << n_bad << " of " << y.numel() << ", identical " << exact);
  CHECK(n_bad == 0);
  CHECK(exact >= min_exact);
}

std::string describe(const Tensor& h) {
  std::ostringstream s;
  s << c10::toString(h.scalar_type()) << " " << h.sizes() << " offset " << h.storage_offset();
  return s.str();
}

// Gates spread over [-9, 9] or so, so gelu's tails and the zero of its
// derivative near -0.75 are all exercised.
Tensor random_input(torch::IntArrayRef shape, torch::ScalarType type, torch::Device device) {
  return torch::randn(shape, torch::TensorOptions().dtype(torch::kFloat32).device(device)).mul_(3).to(type);
}

Tensor random_grad(const Tensor& h) {
  std::vector<std::int64_t> sizes = h.sizes().vec();
  sizes.back() /= 2;
  return torch::randn(sizes, torch::TensorOptions().dtype(torch::kFloat32).device(h.device())).to(h.scalar_type());
}

// A contiguous tensor whose data starts one element past a 16-byte boundary.
Tensor misaligned_input(torch::IntArrayRef shape, torch::ScalarType type, torch::Device device) {
  std::int64_t n = 1;
  for (const auto s : shape) n *= s;
  Tensor base = random_input({n + 1}, type, device);
  return base.narrow(0, 1, n).view(shape);
}

const std::vector<std::vector<std::int64_t>> kShapes = {
    {3, 77, 80},   // inner 40: 16-byte chunks
    {1000, 1280},  // inner 640
    {5, 7, 40},    // inner 20: not a multiple of 8, one element at a time
    {33, 18},      // inner 9, odd
    {2, 0, 80},    // empty
};

bool cuda_available() {
  if (torch::cuda::is_available()) return true;
  MESSAGE("no CUDA device visible: nothing checked");
  return false;
}

}  // namespace

// ---------------------------------------------------------------- CPU: the composite

TEST_CASE("geglu cpu: equals the composite bit for bit") {
  torch::manual_seed(1);
  // (No fp16: LibTorch 1.13 has no CPU gelu for it.)
  for (const auto type : {torch::kFloat32, torch::kBFloat16, torch::kFloat64}) {
    for (const auto& shape : kShapes) {
      const Tensor h = random_input(shape, type, torch::kCPU);
      INFO(describe(h));
      CHECK_FALSE(sdxl::geglu_is_fused(h));
      const Tensor dy = random_grad(h);
      const Result fused = run(sdxl::geglu, h, dy);
      const Result ref = run(composite, h, dy);
      CHECK(bitwise_equal(fused.out, ref.out));
      CHECK(bitwise_equal(fused.grad, ref.grad));
    }
  }
  // Non-contiguous input too.
  const Tensor h = random_input({80, 12}, torch::kFloat32, torch::kCPU).t();
  const Tensor dy = random_grad(h);
  CHECK(bitwise_equal(run(sdxl::geglu, h, dy).out, run(composite, h, dy).out));
}

// ---------------------------------------------------------------- CUDA: the fused kernels

TEST_CASE("geglu cuda: fused forward and backward match the composite") {
  if (!cuda_available()) return;
  REQUIRE(sdxl::geglu_has_fused_kernels());
  torch::manual_seed(2);
  const torch::Device cuda(torch::kCUDA);
  for (const auto type : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
    // fp32: within 1e-6; 16-bit: within about one ulp, and nearly all identical.
    const bool fp32 = type == torch::kFloat32;
    const double tol = fp32 ? 1e-6 : 1e-2, min_exact = fp32 ? 0.0 : 0.95;
    std::vector<Tensor> inputs;
    for (const auto& shape : kShapes) inputs.push_back(random_input(shape, type, cuda));
    inputs.push_back(misaligned_input({64, 128}, type, cuda));
    for (const Tensor& h : inputs) {
      INFO(describe(h));
      REQUIRE(h.is_contiguous());
      REQUIRE(sdxl::geglu_is_fused(h));
      const Tensor dy = random_grad(h);
      {
        const Tensor leaf = h.detach().requires_grad_(true);
        const Tensor out = sdxl::geglu(leaf);
        REQUIRE(out.grad_fn());
        INFO("grad_fn " << out.grad_fn()->name());
        CHECK(out.grad_fn()->name().find("Geglu") != std::string::npos);
      }
      const Result fused = run_in_place(sdxl::geglu, h, dy);
      const Result ref = run(composite, h, dy);
      check_close(fused.out, ref.out, tol, tol, min_exact, "forward");
      check_close(fused.grad, ref.grad, tol, tol, min_exact, "backward");
    }
  }
}

TEST_CASE("geglu cuda: non-contiguous gradient, inference mode") {
  if (!cuda_available()) return;
  torch::manual_seed(3);
  const Tensor h = random_input({40, 256}, torch::kBFloat16, torch::kCUDA);
  const Tensor dy = random_grad(h).t().contiguous().t();  // [40, 128] with transposed strides
  REQUIRE_FALSE(dy.is_contiguous());
  const Result fused = run(sdxl::geglu, h, dy);
  const Result ref = run(composite, h, dy);
  check_close(fused.out, ref.out, 1e-2, 1e-2, 0.95, "forward");
  check_close(fused.grad, ref.grad, 1e-2, 1e-2, 0.95, "backward");
  torch::NoGradGuard no_grad;
  CHECK(bitwise_equal(sdxl::geglu(h), fused.out));
}

TEST_CASE("geglu cuda: the composite where the kernels do not apply") {
  if (!cuda_available()) return;
  torch::manual_seed(4);
  const Tensor transposed = random_input({80, 12}, torch::kBFloat16, torch::kCUDA).t();
  const Tensor fp64 = random_input({12, 80}, torch::kFloat64, torch::kCUDA);
  for (const Tensor& h : {transposed, fp64}) {
    INFO(describe(h));
    CHECK_FALSE(sdxl::geglu_is_fused(h));
    const Tensor dy = random_grad(h);
    const Result fused = run(sdxl::geglu, h, dy);
    const Result ref = run(composite, h, dy);
    CHECK(bitwise_equal(fused.out, ref.out));
    CHECK(bitwise_equal(fused.grad, ref.grad));
  }
}

TEST_CASE("geglu cuda: double backward (create_graph) matches the composite") {
  if (!cuda_available()) return;
  torch::manual_seed(5);
  const Tensor h = random_input({16, 96}, torch::kFloat32, torch::kCUDA);
  const Tensor dy = random_grad(h);
  const Tensor w = torch::randn(h.sizes(), h.options());
  auto second = [&](auto f) {
    Tensor leaf = h.detach().clone().requires_grad_(true);
    Tensor g = torch::autograd::grad({f(leaf)}, {leaf}, {dy}, /*retain_graph=*/true, /*create_graph=*/true)[0];
    (g * w).sum().backward();
    return std::make_pair(g.detach(), leaf.grad());
  };
  const auto fused = second(sdxl::geglu);
  const auto ref = second(composite);
  check_close(fused.first, ref.first, 1e-6, 1e-6, 0.0, "first derivative");
  check_close(fused.second, ref.second, 1e-6, 1e-6, 0.0, "second derivative");
}

TEST_CASE("geglu cuda: beyond 2^31 elements (64-bit indexing)") {
  if (!cuda_available()) return;
#ifdef GEGLU_TEST_CUDA
  const std::int64_t inner = 10240, rows = (std::int64_t{1} << 31) / (2 * inner) + 8;
  std::size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess || free_bytes < (std::size_t{32} << 30)) {
    MESSAGE("less than 32 GiB free on the GPU: not checked");
    return;
  }
  torch::manual_seed(6);
  Result fused;
  Tensor h, dy;
  {
    h = random_input({rows, 2 * inner}, torch::kBFloat16, torch::kCUDA);
    dy = random_grad(h);
    REQUIRE(sdxl::geglu_is_fused(h));
    Tensor leaf = h.detach().requires_grad_(true);
    fused.out = sdxl::geglu(leaf);
    fused.grad = torch::autograd::grad({fused.out}, {leaf}, {dy})[0];
  }
  for (const std::int64_t start : {std::int64_t{0}, rows / 2, rows - 16}) {
    INFO("rows " << start << "..");
    const Result ref = run(composite, h.narrow(0, start, 16), dy.narrow(0, start, 16));
    check_close(fused.out.narrow(0, start, 16), ref.out, 1e-2, 1e-2, 0.95, "forward");
    check_close(fused.grad.narrow(0, start, 16), ref.grad, 1e-2, 1e-2, 0.95, "backward");
  }
#else
  MESSAGE("built without the CUDA test parts");
#endif
}

TEST_CASE("geglu cuda: CUDA graph capture and replay") {
  if (!cuda_available()) return;
#ifdef GEGLU_TEST_CUDA
  torch::manual_seed(7);
  const Tensor h = random_input({300, 1280}, torch::kBFloat16, torch::kCUDA).requires_grad_(true);
  const Tensor dy = random_grad(h);
  Tensor out, grad;
  auto step = [&] {
    out = sdxl::geglu(h);
    grad = torch::autograd::grad({out}, {h}, {dy})[0];
  };
  at::cuda::CUDAGraph graph;
  {
    // Capture needs a side stream; warm up there first.
    const c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());
    for (int i = 0; i < 2; ++i) step();
    torch::cuda::synchronize();
    graph.capture_begin();
    step();
    graph.capture_end();
  }
  torch::cuda::synchronize();
  for (int i = 0; i < 2; ++i) {
    {
      torch::NoGradGuard no_grad;
      h.copy_(random_input(h.sizes(), h.scalar_type(), h.device()));
      dy.copy_(random_grad(h));
    }
    graph.replay();
    torch::cuda::synchronize();
    const Result eager = run(sdxl::geglu, h, dy);
    CHECK(bitwise_equal(out, eager.out));
    CHECK(bitwise_equal(grad, eager.grad));
    const Result ref = run(composite, h, dy);
    check_close(out, ref.out, 1e-2, 1e-2, 0.95, "forward");
    check_close(grad, ref.grad, 1e-2, 1e-2, 0.95, "backward");
  }
#else
  MESSAGE("built without the CUDA test parts");
#endif
}
