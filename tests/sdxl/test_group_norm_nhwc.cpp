// Tests of sdxl::group_norm_act (examples/sdxl/group_norm_nhwc.hpp): on the
// CPU it is torch::group_norm (+ torch::silu) bit for bit; on CUDA the fused
// NHWC kernels match LibTorch's GroupNorm computed in fp32 (fp64 for the
// large-mean case) from the same inputs, forward and the three gradients, for
// the 16-byte path (C % 8 == 0), the one-channel path (C % 8 != 0, misaligned
// data), several tiles per image, SDXL sizes and beyond 2^31 elements; plus
// channels_last outputs, the NCHW fallback, determinism, create_graph and CUDA
// graph capture.
//
// Run with --gpu for the CUDA cases ("group_norm_act cuda*"): exits 77
// (skipped) when no CUDA device is visible.

#include <torch/torch.h>

#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "group_norm_nhwc.hpp"

#if defined(SDXL_GROUP_NORM_TEST_CUDA) && __has_include(<ATen/cuda/CUDAGraph.h>)
#define GN_TEST_CUDA 1
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

#include "gpu_test_main.hpp"  // doctest, after LibTorch; and main()
#include "tensor_compare.hpp"


using torch::Tensor;

namespace {

constexpr auto kChannelsLast = torch::MemoryFormat::ChannelsLast;

struct Case {
  std::vector<std::int64_t> shape;  // N, C, H, W
  std::int64_t groups;
};

std::string describe(const Tensor& x, std::int64_t groups, bool silu) {
  std::string s = std::string(c10::toString(x.scalar_type())) + " [";
  for (std::int64_t i = 0; i < x.dim(); ++i) {
    if (i > 0) s += ',';
    s += std::to_string(x.size(i));
  }
  s += "] groups " + std::to_string(groups) + (silu ? " silu" : " identity");
  s += x.is_contiguous(kChannelsLast) ? " channels_last" : " nchw";
  return s;
}

Tensor composite(const Tensor& x, std::int64_t groups, const Tensor& w, const Tensor& b, double eps, bool silu) {
  Tensor y = torch::group_norm(x, groups, w, b, eps);
  return silu ? torch::silu(y) : y;
}

struct Result {
  Tensor y, dx, dw, db;
};

// Forward and backward of f on fresh leaf copies (same memory format) with
// incoming gradient dy.
template <typename F>
Result run(F f, const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& dy) {
  Tensor xl = x.detach().clone().requires_grad_(true);
  Tensor wl = w.detach().clone().requires_grad_(true);
  Tensor bl = b.detach().clone().requires_grad_(true);
  Tensor y = f(xl, wl, bl);
  y.backward(dy);
  return {y.detach(), xl.grad(), wl.grad(), bl.grad()};
}

Result run_fused(const Tensor& x, std::int64_t groups, const Tensor& w, const Tensor& b, const Tensor& dy,
                 double eps, bool silu) {
  return run([&](const Tensor& xl, const Tensor& wl, const Tensor& bl) {
    return sdxl::group_norm_act(xl, groups, wl, bl, eps, silu);
  }, x, w, b, dy);
}

// The reference: LibTorch's GroupNorm (+ SiLU) in `type` from the same values.
Result run_reference(const Tensor& x, std::int64_t groups, const Tensor& w, const Tensor& b, const Tensor& dy,
                     double eps, bool silu, torch::ScalarType type = torch::kFloat32) {
  return run([&](const Tensor& xl, const Tensor& wl, const Tensor& bl) {
    return composite(xl, groups, wl, bl, eps, silu);
  }, x.to(type).contiguous(), w.to(type), b.to(type), dy.to(type).contiguous());
}

// max |got - ref| <= max_rel * max|ref| and mean |got - ref| <= mean_rel * max|ref|.
void check_close(const Tensor& got, const Tensor& ref, double max_rel, double mean_rel, const std::string& what) {
  INFO(what);
  REQUIRE(got.defined());
  REQUIRE(ref.defined());
  REQUIRE(got.sizes() == ref.sizes());
  // In fp64 on got's device: only scalars come back to the host.
  const Tensor g = got.detach().to(torch::kFloat64);
  const Tensor r = ref.detach().to(g.device()).to(torch::kFloat64);
  REQUIRE(torch::isfinite(r).all().item<bool>());
  REQUIRE(torch::isfinite(g).all().item<bool>());
  const double scale = r.abs().max().item<double>();
  const Tensor diff = (g - r).abs();
  const double max_err = diff.max().item<double>(), mean_err = diff.mean().item<double>();
  INFO("max |ref| " << scale << ", max |diff| " << max_err << ", mean |diff| " << mean_err);
  CHECK(max_err <= max_rel * scale + 1e-30);
  CHECK(mean_err <= mean_rel * scale + 1e-30);
}

struct Tolerance {
  double max_rel, mean_rel;
};
Tolerance tolerance(torch::ScalarType type) {
  if (type == torch::kFloat32) return {1e-4, 1e-5};
  if (type == torch::kFloat16) return {5e-3, 1e-3};
  return {2e-2, 3e-3};  // bf16: 8 significant bits
}

void check_result(const Result& got, const Result& ref, const Tolerance& t, const std::string& what) {
  check_close(got.y, ref.y, t.max_rel, t.mean_rel, what + ": forward");
  check_close(got.dx, ref.dx, t.max_rel, t.mean_rel, what + ": grad x");
  check_close(got.dw, ref.dw, t.max_rel, t.mean_rel, what + ": grad weight");
  check_close(got.db, ref.db, t.max_rel, t.mean_rel, what + ": grad bias");
}
void check_result(const Result& got, const Result& ref, torch::ScalarType type, const std::string& what) {
  check_result(got, ref, tolerance(type), what);
}

struct Inputs {
  Tensor x, w, b, dy;
};

// x = offset + scale * randn (channels_last unless told), weight around 1,
// bias around 0, dy = randn; parameters in param_type.
Inputs random_inputs(const std::vector<std::int64_t>& shape, torch::ScalarType type, torch::ScalarType param_type,
                     torch::Device device, double offset = 3.0, double scale = 1.0, bool channels_last = true) {
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(device);
  Inputs in;
  in.x = (torch::randn(shape, f32) * scale + offset).to(type);
  if (channels_last) in.x = in.x.contiguous(kChannelsLast);
  in.w = (1.0 + 0.5 * torch::randn({shape[1]}, f32)).to(param_type);
  in.b = (0.5 * torch::randn({shape[1]}, f32)).to(param_type);
  in.dy = torch::randn(shape, f32).to(type);
  return in;
}

bool cuda_available() {
  if (torch::cuda::is_available()) return true;
  MESSAGE("no CUDA device visible: nothing checked");
  return false;
}

const std::vector<Case> kCases = {
    {{2, 64, 16, 16}, 32},   // cpg 2: a 16-byte chunk spans 4 groups
    {{1, 320, 32, 32}, 32},  // SDXL's first stage, cpg 10
    {{2, 40, 7, 9}, 4},      // odd HW
    {{2, 20, 5, 6}, 4},      // C % 8 != 0, cpg 5: one channel a thread
    {{3, 4, 9, 11}, 2},      // C = 4
    {{1, 24, 3, 5}, 3},      // cpg 8
    {{1, 960, 12, 10}, 32},  // cpg 30
    {{2, 1280, 8, 8}, 32},   // 160 chunks a pixel
    {{2, 2560, 4, 4}, 32},   // 320 chunks a pixel, cpg 80
    {{1, 7, 5, 3}, 7},       // cpg 1, odd everything
};

}  // namespace

// ---------------------------------------------------------------- CPU: LibTorch itself

TEST_CASE("group_norm_act cpu: equals torch::group_norm (+ silu) bit for bit") {
  torch::manual_seed(1);
  for (const auto type : {torch::kFloat32, torch::kBFloat16, torch::kFloat64}) {
    for (const auto& c : kCases) {
      for (const bool channels_last : {false, true}) {
        for (const bool silu : {false, true}) {
          const Inputs in = random_inputs(c.shape, type, type, torch::kCPU, 3.0, 1.0, channels_last);
          INFO(describe(in.x, c.groups, silu));
          CHECK_FALSE(sdxl::group_norm_act_is_fused(in.x, c.groups, in.w, in.b));
          const Result got = run_fused(in.x, c.groups, in.w, in.b, in.dy, 1e-5, silu);
          const Result ref = run([&](const Tensor& x, const Tensor& w, const Tensor& b) {
            return composite(x, c.groups, w, b, 1e-5, silu);
          }, in.x, in.w, in.b, in.dy);
          CHECK(bitwise_equal(got.y, ref.y));
          CHECK(bitwise_equal(got.dx, ref.dx));
          CHECK(bitwise_equal(got.dw, ref.dw));
          CHECK(bitwise_equal(got.db, ref.db));
        }
      }
    }
  }
}

// ---------------------------------------------------------------- CUDA: the fused kernels

TEST_CASE("group_norm_act cuda: fused forward and backward match LibTorch in fp32") {
  if (!cuda_available()) return;
  REQUIRE(sdxl::group_norm_act_has_fused_kernels());
  torch::manual_seed(2);
  const torch::Device cuda(torch::kCUDA);
  for (const auto type : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
    for (const auto& c : kCases) {
      for (const bool silu : {false, true}) {
        const Inputs in = random_inputs(c.shape, type, type, cuda);
        const std::string what = describe(in.x, c.groups, silu);
        INFO(what);
        REQUIRE(sdxl::group_norm_act_is_fused(in.x, c.groups, in.w, in.b));
        const Result got = run_fused(in.x, c.groups, in.w, in.b, in.dy, 1e-5, silu);
        CHECK((got.y.scalar_type() == type));
        CHECK(got.y.is_contiguous(kChannelsLast));
        CHECK(got.dx.is_contiguous(kChannelsLast));
        CHECK((got.dw.scalar_type() == type));
        check_result(got, run_reference(in.x, c.groups, in.w, in.b, in.dy, 1e-5, silu), type, what);
      }
    }
  }
}

TEST_CASE("group_norm_act cuda: bf16 activations with fp32 and fp16 parameters") {
  if (!cuda_available()) return;
  torch::manual_seed(3);
  for (const auto param_type : {torch::kFloat32, torch::kFloat16}) {
    for (const auto& c : {kCases[1], kCases[3]}) {
      const Inputs in = random_inputs(c.shape, torch::kBFloat16, param_type, torch::kCUDA);
      const std::string what = describe(in.x, c.groups, true) + " params " + c10::toString(param_type);
      INFO(what);
      REQUIRE(sdxl::group_norm_act_is_fused(in.x, c.groups, in.w, in.b));
      const Result got = run_fused(in.x, c.groups, in.w, in.b, in.dy, 1e-6, true);
      CHECK((got.dw.scalar_type() == param_type));
      CHECK((got.db.scalar_type() == param_type));
      check_result(got, run_reference(in.x, c.groups, in.w, in.b, in.dy, 1e-6, true), torch::kBFloat16, what);
    }
  }
}

TEST_CASE("group_norm_act cuda: many tiles per image, SDXL sizes") {
  if (!cuda_available()) return;
  torch::manual_seed(4);
  const std::vector<Case> big = {
      {{8, 320, 128, 128}, 32},  // SDXL 1024px, first stage
      {{2, 640, 64, 64}, 32},
      {{8, 2560, 32, 32}, 32},   // the widest up-block input
      {{1, 44, 100, 60}, 4},     // 16-byte path with an odd tile count
      {{1, 36, 50, 70}, 6},      // C % 8 != 0, many tiles
  };
  for (const auto& c : big) {
    for (const auto type : {torch::kBFloat16, torch::kFloat32}) {
      const Inputs in = random_inputs(c.shape, type, type, torch::kCUDA);
      const std::string what = describe(in.x, c.groups, true);
      INFO(what);
      const Result got = run_fused(in.x, c.groups, in.w, in.b, in.dy, 1e-5, true);
      check_result(got, run_reference(in.x, c.groups, in.w, in.b, in.dy, 1e-5, true), type, what);
    }
  }
}

TEST_CASE("group_norm_act cuda: a mean far from zero keeps its precision") {
  if (!cuda_available()) return;
  torch::manual_seed(5);
  // fp32: mean/std = 1000, where E[x^2] - E[x]^2 in fp32 loses all digits of
  // the variance (errors ~1e-2 and up); bf16: as far as its 8 bits allow.
  // Against fp64. fp32 gets a wider bound: the mean itself, stored in fp32,
  // is only known to ulp(1000) = 6e-5 (measured ~5e-5 max, ~1e-5 mean in an
  // emulation of the kernels).
  struct Far {
    torch::ScalarType type;
    double offset, scale;
    Tolerance tol;
  };
  for (const Far& f : {Far{torch::kFloat32, 1000.0, 1.0, {5e-4, 1e-4}},
                       Far{torch::kBFloat16, 300.0, 4.0, tolerance(torch::kBFloat16)}}) {
    for (const auto& c : {Case{{2, 320, 24, 24}, 32}, Case{{2, 20, 16, 16}, 4}}) {
      const Inputs in = random_inputs(c.shape, f.type, f.type, torch::kCUDA, f.offset, f.scale);
      const std::string what = describe(in.x, c.groups, true) + " offset " + std::to_string(f.offset);
      INFO(what);
      const Result got = run_fused(in.x, c.groups, in.w, in.b, in.dy, 1e-5, true);
      check_result(got, run_reference(in.x, c.groups, in.w, in.b, in.dy, 1e-5, true, torch::kFloat64), f.tol, what);
    }
  }
}

TEST_CASE("group_norm_act cuda: misaligned channels_last data takes the one-channel path") {
  if (!cuda_available()) return;
  torch::manual_seed(6);
  const std::vector<std::int64_t> shape = {2, 64, 6, 10};
  const Inputs in = random_inputs(shape, torch::kBFloat16, torch::kBFloat16, torch::kCUDA);
  // Same values, stored NHWC one element past a 16-byte boundary.
  const std::int64_t n = in.x.numel();
  Tensor storage = torch::empty({n + 1}, in.x.options().memory_format(torch::MemoryFormat::Contiguous));
  Tensor x = storage.narrow(0, 1, n).view({shape[0], shape[2], shape[3], shape[1]}).permute({0, 3, 1, 2});
  x.copy_(in.x);
  REQUIRE(x.is_contiguous(kChannelsLast));
  REQUIRE(reinterpret_cast<std::uintptr_t>(x.data_ptr()) % 16 != 0);
  REQUIRE(sdxl::group_norm_act_is_fused(x, 32, in.w, in.b));
  Tensor xl = x.detach().requires_grad_(true);  // keeps the offset (run() would clone it aligned)
  Tensor wl = in.w.detach().clone().requires_grad_(true), bl = in.b.detach().clone().requires_grad_(true);
  Tensor y = sdxl::group_norm_act(xl, 32, wl, bl, 1e-5, true);
  y.backward(in.dy);
  const Result got{y.detach(), xl.grad(), wl.grad(), bl.grad()};
  check_result(got, run_reference(in.x, 32, in.w, in.b, in.dy, 1e-5, true), torch::kBFloat16, "misaligned");
}

TEST_CASE("group_norm_act cuda: NCHW and other inputs fall back to LibTorch bit for bit") {
  if (!cuda_available()) return;
  torch::manual_seed(7);
  const Inputs nchw = random_inputs({2, 64, 8, 8}, torch::kBFloat16, torch::kBFloat16, torch::kCUDA, 3.0, 1.0,
                                    /*channels_last=*/false);
  const Inputs fp64 = random_inputs({2, 64, 8, 8}, torch::kFloat64, torch::kFloat64, torch::kCUDA);
  for (const Inputs* in : {&nchw, &fp64}) {
    for (const bool silu : {false, true}) {
      INFO(describe(in->x, 32, silu));
      CHECK_FALSE(sdxl::group_norm_act_is_fused(in->x, 32, in->w, in->b));
      const Result got = run_fused(in->x, 32, in->w, in->b, in->dy, 1e-5, silu);
      const Result ref = run([&](const Tensor& x, const Tensor& w, const Tensor& b) {
        return composite(x, 32, w, b, 1e-5, silu);
      }, in->x, in->w, in->b, in->dy);
      CHECK(bitwise_equal(got.y, ref.y));
      CHECK(bitwise_equal(got.dx, ref.dx));
      CHECK(bitwise_equal(got.dw, ref.dw));
      CHECK(bitwise_equal(got.db, ref.db));
    }
  }
  // No weight: the fallback too.
  const Inputs cl = random_inputs({2, 64, 8, 8}, torch::kBFloat16, torch::kBFloat16, torch::kCUDA);
  CHECK_FALSE(sdxl::group_norm_act_is_fused(cl.x, 32, Tensor(), Tensor()));
  CHECK(bitwise_equal(sdxl::group_norm_act(cl.x, 32, Tensor(), Tensor(), 1e-5, true),
                      composite(cl.x, 32, Tensor(), Tensor(), 1e-5, true)));
}

TEST_CASE("group_norm_act cuda: deterministic, autograd node, no-grad forward") {
  if (!cuda_available()) return;
  torch::manual_seed(8);
  const Inputs in = random_inputs({4, 640, 32, 32}, torch::kBFloat16, torch::kBFloat16, torch::kCUDA);
  const Result a = run_fused(in.x, 32, in.w, in.b, in.dy, 1e-5, true);
  const Result b = run_fused(in.x, 32, in.w, in.b, in.dy, 1e-5, true);
  CHECK(bitwise_equal(a.y, b.y));
  CHECK(bitwise_equal(a.dx, b.dx));
  CHECK(bitwise_equal(a.dw, b.dw));
  CHECK(bitwise_equal(a.db, b.db));
  {
    const Tensor leaf = in.x.detach().requires_grad_(true);
    const Tensor y = sdxl::group_norm_act(leaf, 32, in.w, in.b, 1e-5, true);
    REQUIRE(y.grad_fn());
    INFO("grad_fn " << y.grad_fn()->name());
    CHECK(y.grad_fn()->name().find("GroupNormAct") != std::string::npos);
  }
  torch::NoGradGuard no_grad;
  CHECK(bitwise_equal(sdxl::group_norm_act(in.x, 32, in.w, in.b, 1e-5, true), a.y));
}

TEST_CASE("group_norm_act cuda: double backward (create_graph) matches LibTorch") {
  if (!cuda_available()) return;
  torch::manual_seed(9);
  const Inputs in = random_inputs({2, 32, 6, 6}, torch::kFloat32, torch::kFloat32, torch::kCUDA);
  const Tensor probe = torch::randn(in.x.sizes(), in.x.options());
  auto second = [&](auto f) {
    Tensor xl = in.x.detach().clone().requires_grad_(true);
    Tensor wl = in.w.detach().clone().requires_grad_(true);
    Tensor bl = in.b.detach().clone().requires_grad_(true);
    Tensor g = torch::autograd::grad({f(xl, wl, bl)}, {xl}, {in.dy}, /*retain_graph=*/true,
                                     /*create_graph=*/true)[0];
    (g * probe).sum().backward();
    return Result{g.detach(), xl.grad(), wl.grad(), bl.grad()};
  };
  const Result got = second([&](const Tensor& x, const Tensor& w, const Tensor& b) {
    return sdxl::group_norm_act(x, 8, w, b, 1e-5, true);
  });
  const Result ref = second([&](const Tensor& x, const Tensor& w, const Tensor& b) {
    return composite(x, 8, w, b, 1e-5, true);
  });
  check_result(got, ref, torch::kFloat32, "second derivatives");
}

TEST_CASE("group_norm_act cuda: CUDA graph capture and replay") {
  if (!cuda_available()) return;
#ifdef GN_TEST_CUDA
  torch::manual_seed(10);
  const Inputs in = random_inputs({2, 320, 16, 16}, torch::kBFloat16, torch::kBFloat16, torch::kCUDA);
  const Tensor x = in.x.clone().requires_grad_(true);
  const Tensor w = in.w.clone().requires_grad_(true), b = in.b.clone().requires_grad_(true);
  const Tensor dy = in.dy.contiguous(kChannelsLast);
  Tensor y, dx, dw, db;
  auto step = [&] {
    y = sdxl::group_norm_act(x, 32, w, b, 1e-5, true);
    const auto g = torch::autograd::grad({y}, {x, w, b}, {dy});
    dx = g[0], dw = g[1], db = g[2];
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
    const Inputs next = random_inputs({2, 320, 16, 16}, torch::kBFloat16, torch::kBFloat16, torch::kCUDA);
    {
      torch::NoGradGuard no_grad;
      x.copy_(next.x);
      w.copy_(next.w);
      b.copy_(next.b);
      dy.copy_(next.dy);
    }
    graph.replay();
    torch::cuda::synchronize();
    const Result eager = run_fused(next.x, 32, next.w, next.b, dy, 1e-5, true);
    CHECK(bitwise_equal(y, eager.y));
    CHECK(bitwise_equal(dx, eager.dx));
    CHECK(bitwise_equal(dw, eager.dw));
    CHECK(bitwise_equal(db, eager.db));
    check_result({y, dx, dw, db}, run_reference(next.x, 32, next.w, next.b, dy, 1e-5, true), torch::kBFloat16,
                 "replay");
  }
#else
  MESSAGE("built without the CUDA test parts");
#endif
}

TEST_CASE("group_norm_act cuda: beyond 2^31 elements (64-bit indexing)") {
  if (!cuda_available()) return;
#ifdef GN_TEST_CUDA
  std::size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess || free_bytes < (std::size_t{80} << 30)) {
    MESSAGE("less than 80 GiB free on the GPU: not checked");
    return;
  }
  torch::manual_seed(11);
  // 3 x 1280 x 768 x 768 = 2.26e9 elements; image 2 crosses 2^31.
  const std::vector<std::int64_t> shape = {3, 1280, 768, 768};
  const std::int64_t groups = 32;
  Inputs in = random_inputs(shape, torch::kBFloat16, torch::kBFloat16, torch::kCUDA);
  REQUIRE(in.x.numel() > (std::int64_t{1} << 31));
  const Result got = run_fused(in.x, groups, in.w, in.b, in.dy, 1e-5, true);
  // GroupNorm is per image: reference image by image, parameter gradients summed.
  Tensor dw = torch::zeros({shape[1]}, in.w.options().dtype(torch::kFloat32));
  Tensor db = torch::zeros_like(dw);
  for (std::int64_t n = 0; n < shape[0]; ++n) {
    INFO("image " << n);
    const Result ref = run_reference(in.x.narrow(0, n, 1), groups, in.w, in.b, in.dy.narrow(0, n, 1), 1e-5, true);
    const Tolerance t = tolerance(torch::kBFloat16);
    check_close(got.y.narrow(0, n, 1), ref.y, t.max_rel, t.mean_rel, "forward");
    check_close(got.dx.narrow(0, n, 1), ref.dx, t.max_rel, t.mean_rel, "grad x");
    dw += ref.dw;
    db += ref.db;
  }
  const Tolerance t = tolerance(torch::kBFloat16);
  check_close(got.dw, dw, t.max_rel, t.mean_rel, "grad weight");
  check_close(got.db, db, t.max_rel, t.mean_rel, "grad bias");
#else
  MESSAGE("built without the CUDA test parts");
#endif
}
