// zero's CPU AdamW (the kernel an offloaded optimizer runs) side by side with
// LibTorch's CPU AdamW paths, in one process on the same data:
//   - zero vectorized: SIMD (AVX-512/AVX2 chosen at run time) + OpenMP threads
//   - zero reference: the one-thread plain loop that defines the math
//   - torch fused: at::_fused_adamw_ on CPU tensors (LibTorch >= 2.4)
//   - torch foreach: the op sequence torch.optim.AdamW(foreach=True) runs
//     (LibTorch >= 2.0)
//   - memory copy of the same bytes (the ceiling a memory-bound step can reach)
// All in fp32 (params, grads, moments), as LibTorch's CPU paths take them;
// zero's mixed-precision form (bf16 grads in, bf16 model copy out) is a
// further column. Before timing, one step of each torch path is compared with
// zero's on identical inputs (max relative difference, printed as a counter).
//   bench_cpu_adamw_vs_torch --benchmark_out=adamw-cpu.json --benchmark_out_format=json
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <vector>

#include "zero/optim/optimizer.hpp"

#if defined(TORCH_VERSION_MAJOR) && (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4))
#define ZERO_BENCH_TORCH_FUSED 1
#endif
#if defined(TORCH_VERSION_MAJOR) && TORCH_VERSION_MAJOR >= 2
#define ZERO_BENCH_TORCH_FOREACH 1
#endif

namespace {

using zero::CpuKernel;
using zero::DType;

constexpr double kLr = 1e-4, kBeta1 = 0.9, kBeta2 = 0.999, kEps = 1e-8, kWeightDecay = 1e-2;

zero::OptimizerOptions adamw_options() {
  zero::OptimizerOptions o;
  o.kind = zero::OptimizerKind::adamw;
  o.lr = kLr;
  o.beta1 = kBeta1;
  o.beta2 = kBeta2;
  o.eps = kEps;
  o.weight_decay = kWeightDecay;
  return o;
}

// One set of AdamW tensors; every benchmark gets its own copy of the same values.
struct State {
  torch::Tensor param, grad, exp_avg, exp_avg_sq;
  explicit State(std::int64_t n) {
    torch::manual_seed(1);
    param = torch::randn({n});
    grad = torch::randn({n});
    exp_avg = torch::randn({n}) * 0.1;
    exp_avg_sq = torch::rand({n}) * 1e-2;
  }
  State clone() const {
    State s(0);
    s.param = param.clone();
    s.grad = grad.clone();
    s.exp_avg = exp_avg.clone();
    s.exp_avg_sq = exp_avg_sq.clone();
    return s;
  }
};

const State& source(std::int64_t n) {
  static std::map<std::int64_t, State> cache;
  auto it = cache.find(n);
  if (it == cache.end()) it = cache.emplace(n, State(n)).first;
  return it->second;
}

void zero_step(State& s, std::int64_t step, CpuKernel kernel) {
  zero::ShardUpdate u;
  u.master = s.param.data_ptr<float>();
  u.grad = s.grad.data_ptr<float>();
  u.grad_dtype = DType::fp32;
  u.state0 = s.exp_avg.data_ptr<float>();
  u.state1 = s.exp_avg_sq.data_ptr<float>();
  u.count = static_cast<std::size_t>(s.param.numel());
  const auto o = adamw_options();
  zero::cpu_optimizer_step(o, zero::make_step_scalars(o, step, kLr, 1.0), u, kernel);
}

#ifdef ZERO_BENCH_TORCH_FUSED
void torch_fused_step(State& s, torch::Tensor& step) {
  step.add_(1);
  at::_fused_adamw_({s.param}, {s.grad}, {s.exp_avg}, {s.exp_avg_sq}, {}, {step}, kLr, kBeta1, kBeta2, kWeightDecay,
                    kEps, /*amsgrad=*/false, /*maximize=*/false);
}
#endif

#ifdef ZERO_BENCH_TORCH_FOREACH
// What torch.optim.AdamW(foreach=True) does per step (non-capturable path).
void torch_foreach_step(State& s, std::int64_t step) {
  std::vector<torch::Tensor> params{s.param}, grads{s.grad}, avgs{s.exp_avg}, sqs{s.exp_avg_sq};
  at::_foreach_mul_(params, 1.0 - kLr * kWeightDecay);
  at::_foreach_lerp_(avgs, grads, 1.0 - kBeta1);
  at::_foreach_mul_(sqs, kBeta2);
  at::_foreach_addcmul_(sqs, grads, grads, 1.0 - kBeta2);
  const double bias1 = 1.0 - std::pow(kBeta1, static_cast<double>(step));
  const double bias2_sqrt = std::sqrt(1.0 - std::pow(kBeta2, static_cast<double>(step)));
  auto denom = at::_foreach_sqrt(sqs);
  at::_foreach_div_(denom, bias2_sqrt);
  at::_foreach_add_(denom, kEps);
  at::_foreach_addcdiv_(params, avgs, denom, -kLr / bias1);
}
#endif

double max_relative_difference(const torch::Tensor& a, const torch::Tensor& b) {
  return ((a - b).abs() / b.abs().clamp_min(1e-30)).max().item<double>();
}

// fp32 AdamW moves p, g, m, v in and p, m, v out: 28 bytes per parameter.
void set_counters(benchmark::State& state, std::int64_t n, std::size_t bytes_per_param = 28) {
  state.counters["params/s"] = benchmark::Counter(static_cast<double>(n), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GB/s"] = benchmark::Counter(static_cast<double>(n) * static_cast<double>(bytes_per_param) / 1e9,
                                              benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = static_cast<double>(at::get_num_threads());
}

void BM_ZeroVectorized(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  State s = source(n).clone();
  std::int64_t step = 1;
  for (auto _ : state) {
    zero_step(s, step++, CpuKernel::vectorized);
    benchmark::ClobberMemory();
  }
  set_counters(state, n);
}

void BM_ZeroReference(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  State s = source(n).clone();
  std::int64_t step = 1;
  for (auto _ : state) {
    zero_step(s, step++, CpuKernel::reference);
    benchmark::ClobberMemory();
  }
  set_counters(state, n);
}

// zero's offload form: bf16 gradients in, fp32 master + moments updated, bf16
// model copy out (26 bytes per parameter).
void BM_ZeroVectorized_bf16grads_bf16copy(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  State s = source(n).clone();
  torch::Tensor grad16 = s.grad.to(torch::kBFloat16), copy16 = torch::empty({n}, torch::kBFloat16);
  const auto o = adamw_options();
  std::int64_t step = 1;
  for (auto _ : state) {
    zero::ShardUpdate u;
    u.master = s.param.data_ptr<float>();
    u.grad = grad16.data_ptr();
    u.grad_dtype = DType::bf16;
    u.state0 = s.exp_avg.data_ptr<float>();
    u.state1 = s.exp_avg_sq.data_ptr<float>();
    u.model_copy = copy16.data_ptr();
    u.model_dtype = DType::bf16;
    u.count = static_cast<std::size_t>(n);
    zero::cpu_optimizer_step(o, zero::make_step_scalars(o, step++, kLr, 1.0), u, CpuKernel::vectorized);
    benchmark::ClobberMemory();
  }
  set_counters(state, n, 26);
}

#ifdef ZERO_BENCH_TORCH_FUSED
void BM_TorchFused(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  {  // one step from the same inputs as zero's: the two must agree
    State a = source(n).clone(), b = source(n).clone();
    torch::Tensor step = torch::zeros({}, torch::kFloat32);
    torch_fused_step(a, step);
    zero_step(b, 1, CpuKernel::vectorized);
    state.counters["max_rel_diff_vs_zero"] = max_relative_difference(a.param, b.param);
  }
  State s = source(n).clone();
  torch::Tensor step = torch::zeros({}, torch::kFloat32);
  for (auto _ : state) {
    torch_fused_step(s, step);
    benchmark::ClobberMemory();
  }
  set_counters(state, n);
}
#endif

#ifdef ZERO_BENCH_TORCH_FOREACH
void BM_TorchForeach(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  {
    State a = source(n).clone(), b = source(n).clone();
    torch_foreach_step(a, 1);
    zero_step(b, 1, CpuKernel::vectorized);
    state.counters["max_rel_diff_vs_zero"] = max_relative_difference(a.param, b.param);
  }
  State s = source(n).clone();
  std::int64_t step = 1;
  for (auto _ : state) {
    torch_foreach_step(s, step++);
    benchmark::ClobberMemory();
  }
  set_counters(state, n);
}
#endif

// The ceiling: copying 14 bytes per parameter on every thread, i.e. the same
// 28 bytes per parameter of traffic (half read, half written) as the step.
void BM_CopyCeiling(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  const std::int64_t floats = n * 14 / 4;
  torch::Tensor src = torch::rand({floats}), dst = torch::empty({floats});
  for (auto _ : state) {
    dst.copy_(src);  // LibTorch's parallel copy over all intra-op threads
    benchmark::ClobberMemory();
  }
  set_counters(state, n);
}

void sizes(benchmark::internal::Benchmark* b) {
  b->Arg(std::int64_t{1} << 24)->Arg(std::int64_t{1} << 27)->UseRealTime()->Unit(benchmark::kMillisecond);
}

}  // namespace

BENCHMARK(BM_CopyCeiling)->Apply(sizes);
BENCHMARK(BM_ZeroVectorized)->Apply(sizes);
BENCHMARK(BM_ZeroVectorized_bf16grads_bf16copy)->Apply(sizes);
#ifdef ZERO_BENCH_TORCH_FUSED
BENCHMARK(BM_TorchFused)->Apply(sizes);
#endif
#ifdef ZERO_BENCH_TORCH_FOREACH
BENCHMARK(BM_TorchForeach)->Apply(sizes);
#endif
BENCHMARK(BM_ZeroReference)->Apply(sizes);

BENCHMARK_MAIN();
