// CPU optimizer kernels: the vectorized multi-threaded kernel against the
// plain reference loop and against a memory-copy ceiling (memcpy of the same
// bytes the step moves), in parameters/s and GB/s (1e9 bytes, read + write).
//   bench_cpu_optimizer --benchmark_out=bench/results/cpu-optimizer.json --benchmark_out_format=json
#include <benchmark/benchmark.h>

#include <cstring>
#include <random>
#include <vector>

#include "zero/optim/optimizer.hpp"

using namespace zero;

namespace {

struct Buffers {
  std::vector<float> master, m, v, grad32;
  std::vector<std::uint16_t> grad16, copy16;
  explicit Buffers(std::size_t n) : master(n), m(n), v(n), grad32(n), grad16(n), copy16(n) {
    std::mt19937 rng(1);
    std::normal_distribution<float> normal;
    for (std::size_t i = 0; i < n; ++i) {
      master[i] = normal(rng);
      grad32[i] = normal(rng);
      grad16[i] = float_to_bf16_bits(grad32[i]);
      v[i] = 1e-3f;
    }
  }
};

// Bytes one step moves per parameter: fp32 grads: p, g, m, v read and p, m, v
// written (28); bf16 grads + bf16 copy: g is 2, the copy adds 2 written (26).
std::size_t bytes_per_param(bool mixed) { return mixed ? 26 : 28; }

// The whole of `b` as one span: mixed, bf16 gradients in and a bf16 copy
// out (the engine's bf16 training); else fp32 gradients and no copy.
ShardUpdate whole(Buffers& b, bool mixed) {
  ShardUpdate u;
  u.master = b.master.data();
  u.state0 = b.m.data();
  u.state1 = b.v.data();
  u.count = b.master.size();
  if (mixed) {
    u.grad = b.grad16.data();
    u.grad_dtype = DType::bf16;
    u.model_copy = b.copy16.data();
    u.model_dtype = DType::bf16;
  } else {
    u.grad = b.grad32.data();
    u.grad_dtype = DType::fp32;
  }
  return u;
}

void run(benchmark::State& state, CpuKernel kernel, bool mixed) {
  const std::size_t n = static_cast<std::size_t>(state.range(0));
  Buffers b(n);
  OptimizerOptions o;
  const ShardUpdate u = whole(b, mixed);
  std::int64_t step = 1;
  for (auto _ : state) {
    cpu_optimizer_step(o, make_step_scalars(o, step++, 1e-4, 1.0), u, kernel);
    benchmark::ClobberMemory();
  }
  state.counters["params/s"] = benchmark::Counter(static_cast<double>(n), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GB/s"] = benchmark::Counter(static_cast<double>(n * bytes_per_param(mixed)) / 1e9,
                                              benchmark::Counter::kIsIterationInvariantRate);
}

// Parameter groups: the engine updates each bucket slice as runs of one
// group (ShardedModel lays a unit out by group), one kernel call per run with
// that group's scalars. Here every 4 Mi-element bucket is cut the way the
// SDXL trainer's groups cut a UNet unit (no_weight_decay on biases and norms,
// a block at another lr): a 96% run and three 1-2% runs, four groups.
void per_bucket(benchmark::State& state, int group_count) {
  const std::size_t n = static_cast<std::size_t>(state.range(0));
  Buffers b(n);
  OptimizerOptions base;
  std::vector<OptimizerOptions> groups(4, base);
  groups[1].weight_decay = 0;
  groups[2].beta1 = 0.8;
  groups[3].eps = 1e-6;
  const double lr_scale[4] = {1.0, 1.0, 0.5, 2.0};
  struct Run {
    std::size_t begin, count;
    int group;
  };
  std::vector<Run> runs;
  const std::size_t bucket = std::size_t{1} << 22;
  for (std::size_t at = 0; at < n; at += bucket) {
    const std::size_t len = std::min(bucket, n - at);
    const std::size_t cuts[4] = {len * 96 / 100, len * 15 / 1000, len * 10 / 1000, 0};
    std::size_t used = 0;
    for (int g = 0; g < group_count; ++g) {
      const std::size_t c = g == group_count - 1 ? len - used : cuts[g];
      runs.push_back({at + used, c, g});
      used += c;
    }
  }
  std::int64_t step = 1;
  for (auto _ : state) {
    for (const Run& r : runs) {
      ShardUpdate u;
      u.master = b.master.data() + r.begin;
      u.state0 = b.m.data() + r.begin;
      u.state1 = b.v.data() + r.begin;
      u.count = r.count;
      u.grad = b.grad16.data() + r.begin;
      u.grad_dtype = DType::bf16;
      u.model_copy = b.copy16.data() + r.begin;
      u.model_dtype = DType::bf16;
      const OptimizerOptions& o = groups[static_cast<std::size_t>(r.group)];
      cpu_optimizer_step(o, make_step_scalars(o, step, 1e-4 * lr_scale[r.group], 1.0), u, CpuKernel::vectorized);
    }
    ++step;
    benchmark::ClobberMemory();
  }
  state.counters["params/s"] = benchmark::Counter(static_cast<double>(n), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GB/s"] = benchmark::Counter(static_cast<double>(n * bytes_per_param(true)) / 1e9,
                                              benchmark::Counter::kIsIterationInvariantRate);
}

// The same without groups: one call per bucket slice, as the engine updates it.
void BM_AdamW_Vectorized_bf16_1group(benchmark::State& s) { per_bucket(s, 1); }
void BM_AdamW_Vectorized_bf16_4groups(benchmark::State& s) { per_bucket(s, 4); }

void BM_AdamW_Reference_fp32(benchmark::State& s) { run(s, CpuKernel::reference, false); }
void BM_AdamW_Vectorized_fp32(benchmark::State& s) { run(s, CpuKernel::vectorized, false); }
void BM_AdamW_Reference_bf16grads_bf16copy(benchmark::State& s) { run(s, CpuKernel::reference, true); }
void BM_AdamW_Vectorized_bf16grads_bf16copy(benchmark::State& s) { run(s, CpuKernel::vectorized, true); }

// AdamW + EMA as the offloaded update runs it (bf16 gradients in, bf16 copy
// out, the fp32 EMA read and written: 26 + 8 = 34 bytes a parameter).
// two_pass: the update then cpu_ema_update over the new master, in 2M-element
// slices so the second pass reads the master from cache (the engine before
// 2026-12-05); fused: the EMA in the update's pass (ShardUpdate::ema).
// bf16_state: m and v held as bf16 (OptimizerOptions::state_dtype), rounded
// stochastically: 8 bytes of state a parameter instead of 16 (26 in all).
void adamw_ema(benchmark::State& state, bool fused, bool bf16_state = false) {
  const std::size_t n = static_cast<std::size_t>(state.range(0));
  Buffers b(n);
  std::vector<float> ema(b.master);
  OptimizerOptions o;
  ShardUpdate u = whole(b, /*mixed=*/true);
  std::vector<std::uint16_t> m16, v16;
  if (bf16_state) {
    o.state_dtype = DType::bf16;
    m16.assign(n, float_to_bf16_bits(0.0f));
    v16.assign(n, float_to_bf16_bits(1e-3f));
    u.state0 = m16.data();
    u.state1 = v16.data();
    u.state_dtype = DType::bf16;
  }
  constexpr std::size_t kSlice = std::size_t{2} << 20;
  std::int64_t step = 1;
  for (auto _ : state) {
    const StepScalars scalars = make_step_scalars(o, step++, 1e-4, 1.0);
    if (fused) {
      u.ema = ema.data();
      u.ema_decay = 0.9999;
      cpu_optimizer_step(o, scalars, u, CpuKernel::vectorized);
    } else {
      for (std::size_t lo = 0; lo < n; lo += kSlice) {
        const ShardUpdate part = u.slice(lo, std::min(kSlice, n - lo));
        cpu_optimizer_step(o, scalars, part, CpuKernel::vectorized);
        cpu_ema_update(ema.data() + lo, part.master, part.count, 0.9999);
      }
    }
    benchmark::ClobberMemory();
  }
  state.counters["params/s"] = benchmark::Counter(static_cast<double>(n), benchmark::Counter::kIsIterationInvariantRate);
  const std::size_t bytes = bytes_per_param(true) + 8 - (bf16_state ? 8 : 0);
  state.counters["GB/s"] = benchmark::Counter(static_cast<double>(n * bytes) / 1e9,
                                              benchmark::Counter::kIsIterationInvariantRate);
}
void BM_AdamW_EMA_bf16_two_pass(benchmark::State& s) { adamw_ema(s, false); }
void BM_AdamW_EMA_bf16_fused(benchmark::State& s) { adamw_ema(s, true); }
void BM_AdamW_EMA_bf16_fused_bf16state(benchmark::State& s) { adamw_ema(s, true, true); }

// The ceiling: memcpy moving the same bytes (half read, half written) on
// every core, as the vectorized kernel uses them.
void BM_Memcpy_Ceiling(benchmark::State& state) {
  const std::size_t n = static_cast<std::size_t>(state.range(0));
  const std::size_t bytes = n * bytes_per_param(false) / 2;
  std::vector<char> src(bytes, 1), dst(bytes);
  const std::size_t chunk = 1 << 20;
  for (auto _ : state) {
#pragma omp parallel for schedule(static)
    for (std::size_t off = 0; off < bytes; off += chunk)
      std::memcpy(dst.data() + off, src.data() + off, std::min(chunk, bytes - off));
    benchmark::ClobberMemory();
  }
  state.counters["GB/s"] = benchmark::Counter(static_cast<double>(2 * bytes) / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

void GradStats_bf16(benchmark::State& state) {
  const std::size_t n = static_cast<std::size_t>(state.range(0));
  Buffers b(n);
  for (auto _ : state) benchmark::DoNotOptimize(cpu_grad_stats(b.grad16.data(), n, DType::bf16));
  state.counters["GB/s"] = benchmark::Counter(static_cast<double>(2 * n) / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

}  // namespace

BENCHMARK(BM_Memcpy_Ceiling)->Arg(1 << 20)->Arg(1 << 24)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AdamW_Reference_fp32)->Arg(1 << 20)->Arg(1 << 24)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AdamW_Vectorized_fp32)->Arg(1 << 20)->Arg(1 << 24)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AdamW_Reference_bf16grads_bf16copy)->Arg(1 << 20)->Arg(1 << 24)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AdamW_Vectorized_bf16grads_bf16copy)->Arg(1 << 20)->Arg(1 << 24)->Arg(1 << 27)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AdamW_Vectorized_bf16_1group)->Arg(1 << 24)->Arg(1 << 27)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AdamW_Vectorized_bf16_4groups)->Arg(1 << 24)->Arg(1 << 27)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AdamW_EMA_bf16_two_pass)->Arg(1 << 24)->Arg(1 << 27)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AdamW_EMA_bf16_fused)->Arg(1 << 24)->Arg(1 << 27)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AdamW_EMA_bf16_fused_bf16state)->Arg(1 << 24)->Arg(1 << 27)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(GradStats_bf16)->Arg(1 << 24)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK_MAIN();
