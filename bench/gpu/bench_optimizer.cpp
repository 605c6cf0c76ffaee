// gpu_bench_optimizer: how close zero's fused optimizer kernels come to the
// GPU's memory bandwidth, and to LibTorch's fused AdamW, in one process.
//
//   1. device-to-device copy bandwidth (cudaMemcpyAsync; bytes read + written)
//      - the ceiling every streaming kernel is measured against;
//   2. zero's fused AdamW on 2^N fp32 params with fp32 grads (reads p, g, m, v;
//      writes p, m, v: 28 bytes/param), over a sweep of launch shapes, the
//      library default reported separately;
//   3. the mixed variant: bf16 grads and a bf16 model copy written in the same
//      pass, fp32 master/m/v (also 28 bytes/param), plus SGD-momentum and Lion;
//   4. LibTorch's at::_fused_adamw_ on the same buffers, when built with it.
//
// Warm-up runs are excluded; each figure is the median of --iters runs timed
// with CUDA events. GB = 1e9 bytes. Usage: see usage() below.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "zero/cuda/check.hpp"
#include "zero/cuda/kernels.hpp"

#if defined(ZERO_BENCH_WITH_TORCH)
#include <ATen/ATen.h>
#include <torch/version.h>
#if TORCH_VERSION_MAJOR >= 2
#define ZERO_BENCH_TORCH_FUSED_ADAMW 1  // at::_fused_adamw_ exists from 2.0 on
#endif
#endif

namespace {

// ---------------------------------------------------------------- options

struct Options {
  int log2_params = 30;
  int iters = 20;
  int warmup = 3;
  bool sweep = true;
  std::string json_path;
};

void usage() {
  std::printf(
      "usage: gpu_bench_optimizer [options]\n"
      "  --log2-params N   parameters per tensor = 2^N (default 30: 4 GiB per fp32 tensor)\n"
      "  --iters N         timed runs per figure, median reported (default 20, at least 10)\n"
      "  --warmup N        untimed runs first (default 3)\n"
      "  --no-sweep        time only the library's default launch shape\n"
      "  --json PATH       write all results as JSON\n");
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        usage();
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--log2-params") o.log2_params = std::stoi(next());
    else if (arg == "--iters") o.iters = std::stoi(next());
    else if (arg == "--warmup") o.warmup = std::stoi(next());
    else if (arg == "--no-sweep") o.sweep = false;
    else if (arg == "--json") o.json_path = next();
    else if (arg == "--help" || arg == "-h") {
      usage();
      std::exit(0);
    } else {
      std::fprintf(stderr, "unknown option %s\n", arg.c_str());
      usage();
      std::exit(2);
    }
  }
  o.iters = std::max(o.iters, 10);
  return o;
}

// ---------------------------------------------------------------- timing

/// Median milliseconds of `iters` runs of body on the legacy default stream.
double median_ms(const std::function<void()>& body, int warmup, int iters) {
  for (int i = 0; i < warmup; ++i) body();
  ZERO_CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<cudaEvent_t> marks(static_cast<std::size_t>(iters) + 1);
  for (auto& e : marks) ZERO_CHECK_CUDA(cudaEventCreate(&e));
  ZERO_CHECK_CUDA(cudaEventRecord(marks[0], nullptr));
  for (int i = 0; i < iters; ++i) {
    body();
    ZERO_CHECK_CUDA(cudaEventRecord(marks[static_cast<std::size_t>(i) + 1], nullptr));
  }
  ZERO_CHECK_CUDA(cudaEventSynchronize(marks.back()));
  std::vector<float> times;
  for (int i = 0; i < iters; ++i) {
    float ms = 0;
    ZERO_CHECK_CUDA(cudaEventElapsedTime(&ms, marks[static_cast<std::size_t>(i)],
                                         marks[static_cast<std::size_t>(i) + 1]));
    times.push_back(ms);
  }
  for (auto& e : marks) ZERO_CHECK_CUDA(cudaEventDestroy(e));
  std::sort(times.begin(), times.end());
  const std::size_t mid = times.size() / 2;
  return times.size() % 2 ? times[mid] : 0.5 * (times[mid - 1] + times[mid]);
}

struct DeviceArray {
  void* data = nullptr;
  explicit DeviceArray(std::size_t bytes) { ZERO_CHECK_CUDA(cudaMalloc(&data, bytes)); }
  ~DeviceArray() { (void)cudaFree(data); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  float* f() const { return static_cast<float*>(data); }
};

nlohmann::json record(const std::string& name, double ms, double params, double bytes,
                      double copy_gbps) {
  const double gbps = bytes / (ms * 1e-3) / 1e9;
  nlohmann::json r = {{"name", name},
                      {"time_ms", ms},
                      {"params_per_s", params / (ms * 1e-3)},
                      {"bytes_per_param", bytes / params},
                      {"gb_per_s", gbps},
                      {"percent_of_copy", copy_gbps > 0 ? 100.0 * gbps / copy_gbps : 0.0}};
  std::printf("%-44s %9.3f ms %9.2f Gparam/s %8.1f GB/s %6.1f%% of copy\n", name.c_str(), ms,
              params / (ms * 1e-3) / 1e9, gbps, copy_gbps > 0 ? 100.0 * gbps / copy_gbps : 0.0);
  std::fflush(stdout);
  return r;
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return text;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  int device_count = 0;
  if (cudaGetDeviceCount(&device_count) != cudaSuccess || device_count == 0) {
    std::fprintf(stderr, "gpu_bench_optimizer: no CUDA device visible\n");
    return 2;
  }
  try {
    ZERO_CHECK_CUDA(cudaSetDevice(0));
    cudaDeviceProp prop{};
    ZERO_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
    int runtime = 0, driver = 0;
    cudaRuntimeGetVersion(&runtime);
    cudaDriverGetVersion(&driver);
    const std::size_t n = std::size_t{1} << o.log2_params;
    const double params = static_cast<double>(n);
    std::printf("device: %s, %d SMs, %.1f GiB; CUDA runtime %d, driver %d; %zu params per tensor\n",
                prop.name, prop.multiProcessorCount,
                static_cast<double>(prop.totalGlobalMem) / (1 << 30), runtime, driver, n);

    nlohmann::json out;
    out["date_utc"] = utc_now();
    out["device"] = {{"name", prop.name},
                     {"sms", prop.multiProcessorCount},
                     {"memory_bytes", prop.totalGlobalMem},
                     {"l2_bytes", prop.l2CacheSize},
                     {"cuda_runtime", runtime},
                     {"cuda_driver", driver}};
    out["params"] = n;
    out["iters"] = o.iters;
    out["warmup"] = o.warmup;
    out["statistic"] = "median";

    // fp32 master, m, v, grads; bf16 grads and copy for the mixed variant.
    DeviceArray p(n * 4), m(n * 4), v(n * 4), g(n * 4), g16(n * 2), copy16(n * 2);

    // ---- 1. copy bandwidth: 4 GiB read + 4 GiB written per copy.
    zero::gpu::fill_uniform(g.data, n, zero::DType::fp32, 1, -1.0f, 1.0f, nullptr);
    const double copy_ms = median_ms(
        [&] { ZERO_CHECK_CUDA(cudaMemcpyAsync(p.data, g.data, n * 4, cudaMemcpyDeviceToDevice, nullptr)); },
        o.warmup, o.iters);
    const double copy_gbps = 2.0 * n * 4 / (copy_ms * 1e-3) / 1e9;
    std::printf("%-44s %9.3f ms %30.1f GB/s (read + write)\n", "device-to-device copy", copy_ms,
                copy_gbps);
    out["copy"] = {{"time_ms", copy_ms}, {"bytes", 2.0 * n * 4}, {"gb_per_s", copy_gbps}};

    auto reset_state = [&] {
      zero::gpu::fill_uniform(p.data, n, zero::DType::fp32, 2, -1.0f, 1.0f, nullptr);
      zero::gpu::fill_uniform(m.data, n, zero::DType::fp32, 3, -0.1f, 0.1f, nullptr);
      zero::gpu::fill_uniform(v.data, n, zero::DType::fp32, 4, 0.0f, 0.01f, nullptr);
      zero::gpu::fill_uniform(g.data, n, zero::DType::fp32, 5, -1.0f, 1.0f, nullptr);
      zero::gpu::fill_uniform(g16.data, n, zero::DType::bf16, 6, -1.0f, 1.0f, nullptr);
      ZERO_CHECK_CUDA(cudaDeviceSynchronize());
    };
    reset_state();

    zero::OptimizerOptions adamw;
    adamw.kind = zero::OptimizerKind::adamw;
    adamw.lr = 1e-4;
    adamw.weight_decay = 0.01;
    const zero::StepScalars adamw_scalars = zero::make_step_scalars(adamw, 10, adamw.lr, 1.0);

    zero::ShardUpdate fp32_update{p.f(), g.data, zero::DType::fp32, m.f(), v.f(), nullptr,
                                  zero::DType::bf16, n};
    zero::ShardUpdate mixed_update{p.f(), g16.data, zero::DType::bf16, m.f(), v.f(), copy16.data,
                                   zero::DType::bf16, n};
    const double adamw_bytes = 28.0 * params;

    // ---- 2. zero AdamW, fp32 grads: default launch shape, then the sweep.
    const double zero_ms = median_ms(
        [&] { zero::gpu::optimizer_step(adamw, adamw_scalars, fp32_update, nullptr); }, o.warmup,
        o.iters);
    nlohmann::json zero_adamw = record("zero adamw fp32 (default launch)", zero_ms, params,
                                       adamw_bytes, copy_gbps);
    out["zero_adamw_fp32"] = zero_adamw;
    const zero::gpu::LaunchTuning defaults;
    out["zero_adamw_fp32"]["threads"] = defaults.threads;
    out["zero_adamw_fp32"]["max_blocks_per_sm"] = defaults.max_blocks_per_sm;

    // Launch shapes: threads per block x blocks per SM (0 = grid sized to the
    // data, -1 = one wave of resident blocks, n = grid-stride over n per SM).
    auto sweep_shapes = [&](const std::string& label, const zero::OptimizerOptions& options,
                            const zero::StepScalars& scalars, const zero::ShardUpdate& update,
                            double bytes, bool full) {
      nlohmann::json sweep = nlohmann::json::array();
      std::vector<zero::gpu::LaunchTuning> shapes;
      if (full) {
        for (int threads : {128, 256, 512, 1024})
          for (int blocks : {-1, 1, 2, 4, 8, 0})
            if (threads * blocks <= 2048) shapes.push_back({threads, blocks});
      } else {
        shapes = {{256, 0}, {512, 0}, {1024, 0}, {256, 2}, {512, 1}, {256, -1}};
      }
      for (const zero::gpu::LaunchTuning& tuning : shapes) {
        const double ms = median_ms(
            [&] { zero::gpu::optimizer_step(options, scalars, update, tuning, nullptr); }, 1, 10);
        const int blocks = tuning.max_blocks_per_sm;
        nlohmann::json r = record("  " + label + " threads " + std::to_string(tuning.threads) +
                                      " blocks/SM " +
                                      (blocks > 0 ? std::to_string(blocks)
                                                  : (blocks == 0 ? "no cap" : "resident")),
                                  ms, params, bytes, copy_gbps);
        r["threads"] = tuning.threads;
        r["max_blocks_per_sm"] = blocks;
        sweep.push_back(r);
      }
      return sweep;
    };
    if (o.sweep)
      out["zero_adamw_fp32_sweep"] =
          sweep_shapes("adamw fp32", adamw, adamw_scalars, fp32_update, adamw_bytes, true);

    // ---- 3. mixed precision and the other optimizers.
    const double mixed_ms = median_ms(
        [&] { zero::gpu::optimizer_step(adamw, adamw_scalars, mixed_update, nullptr); }, o.warmup,
        o.iters);
    out["zero_adamw_mixed_bf16"] =
        record("zero adamw bf16 grads + bf16 copy", mixed_ms, params, adamw_bytes, copy_gbps);
    // bf16 state (OptimizerOptions::state_dtype): m and v as bf16 in the
    // first halves of their buffers, rounded stochastically: 20 bytes a
    // parameter instead of 28, so ~0.71 of the time at the same bandwidth.
    zero::gpu::fill_uniform(m.data, n, zero::DType::bf16, 7, -0.1f, 0.1f, nullptr);
    zero::gpu::fill_uniform(v.data, n, zero::DType::bf16, 8, 0.0f, 0.01f, nullptr);
    zero::ShardUpdate bf16_state_update = mixed_update;
    bf16_state_update.state_dtype = zero::DType::bf16;
    zero::OptimizerOptions adamw_bf16_state = adamw;
    adamw_bf16_state.state_dtype = zero::DType::bf16;
    const double bf16_state_ms = median_ms(
        [&] { zero::gpu::optimizer_step(adamw_bf16_state, adamw_scalars, bf16_state_update, nullptr); }, o.warmup,
        o.iters);
    out["zero_adamw_mixed_bf16_state"] = record("zero adamw bf16 grads + copy + bf16 state", bf16_state_ms, params,
                                                20.0 * params, copy_gbps);
    out["zero_adamw_mixed_bf16_state"]["time_vs_fp32_state"] = bf16_state_ms / mixed_ms;
    reset_state();  // the fp32 runs below read m and v as fp32 again

    zero::OptimizerOptions sgd;
    sgd.kind = zero::OptimizerKind::sgd;
    sgd.lr = 1e-3;
    sgd.momentum = 0.9;
    const zero::StepScalars sgd_scalars = zero::make_step_scalars(sgd, 10, sgd.lr, 1.0);
    zero::ShardUpdate sgd_update = fp32_update;
    sgd_update.state1 = nullptr;
    const double sgd_ms = median_ms(
        [&] { zero::gpu::optimizer_step(sgd, sgd_scalars, sgd_update, nullptr); }, o.warmup, o.iters);
    out["zero_sgd_momentum_fp32"] =
        record("zero sgd momentum fp32", sgd_ms, params, 20.0 * params, copy_gbps);

    zero::OptimizerOptions lion;
    lion.kind = zero::OptimizerKind::lion;
    lion.lr = 1e-4;
    lion.beta2 = 0.99;
    const zero::StepScalars lion_scalars = zero::make_step_scalars(lion, 10, lion.lr, 1.0);
    const double lion_ms = median_ms(
        [&] { zero::gpu::optimizer_step(lion, lion_scalars, sgd_update, nullptr); }, o.warmup, o.iters);
    out["zero_lion_fp32"] = record("zero lion fp32", lion_ms, params, 20.0 * params, copy_gbps);
    if (o.sweep) {
      out["zero_adamw_mixed_bf16_sweep"] =
          sweep_shapes("adamw mixed", adamw, adamw_scalars, mixed_update, adamw_bytes, false);
      out["zero_sgd_momentum_fp32_sweep"] =
          sweep_shapes("sgd momentum", sgd, sgd_scalars, sgd_update, 20.0 * params, false);
      out["zero_lion_fp32_sweep"] =
          sweep_shapes("lion", lion, lion_scalars, sgd_update, 20.0 * params, false);
    }
    // The default once more, and the copy: how far apart two measurements of
    // the same thing are in this process (the noise floor for the ratios).
    const double zero_again_ms = median_ms(
        [&] { zero::gpu::optimizer_step(adamw, adamw_scalars, fp32_update, nullptr); }, o.warmup,
        o.iters);
    out["zero_adamw_fp32_repeat"] =
        record("zero adamw fp32 (default launch, again)", zero_again_ms, params, adamw_bytes, copy_gbps);
    const double copy_again_ms = median_ms(
        [&] { ZERO_CHECK_CUDA(cudaMemcpyAsync(p.data, g.data, n * 4, cudaMemcpyDeviceToDevice, nullptr)); },
        o.warmup, o.iters);
    out["copy_repeat"] = {{"time_ms", copy_again_ms}, {"gb_per_s", 2.0 * n * 4 / (copy_again_ms * 1e-3) / 1e9}};
    std::printf("%-44s %9.3f ms %30.1f GB/s (read + write)\n", "device-to-device copy (again)",
                copy_again_ms, 2.0 * n * 4 / (copy_again_ms * 1e-3) / 1e9);

    // ---- 4. LibTorch's fused AdamW on the same buffers.
#if defined(ZERO_BENCH_TORCH_FUSED_ADAMW)
    if (at::hasCUDA()) {
      reset_state();
      const auto options = at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, 0);
      const std::int64_t count = static_cast<std::int64_t>(n);
      std::vector<at::Tensor> tp = {at::from_blob(p.data, {count}, options)};
      std::vector<at::Tensor> tg = {at::from_blob(g.data, {count}, options)};
      std::vector<at::Tensor> tm = {at::from_blob(m.data, {count}, options)};
      std::vector<at::Tensor> tv = {at::from_blob(v.data, {count}, options)};
      // The step the kernel uses as is: PyTorch's optimizer increments
      // state_steps before it calls _fused_adamw_ (step 10, as zero's above).
      std::vector<at::Tensor> steps = {at::full({1}, 10.0, options)};
      const double torch_ms = median_ms(
          [&] {
            at::_fused_adamw_(tp, tg, tm, tv, at::TensorList(), steps, adamw.lr, adamw.beta1,
                              adamw.beta2, adamw.weight_decay, adamw.eps, /*amsgrad=*/false,
                              /*maximize=*/false);
          },
          o.warmup, o.iters);
      out["torch_fused_adamw_fp32"] =
          record("libtorch at::_fused_adamw_ fp32", torch_ms, params, adamw_bytes, copy_gbps);
      out["torch_version"] = TORCH_VERSION;
      out["zero_over_torch_speedup"] = torch_ms / zero_ms;
      std::printf("zero adamw / libtorch fused adamw: %.3fx faster\n", torch_ms / zero_ms);

      // Same math? One step of each from the same state on a 2^20 slice.
      const std::int64_t small = std::min<std::int64_t>(count, 1 << 20);
      reset_state();
      DeviceArray p2(small * 4), m2(small * 4), v2(small * 4);
      ZERO_CHECK_CUDA(cudaMemcpy(p2.data, p.data, small * 4, cudaMemcpyDeviceToDevice));
      ZERO_CHECK_CUDA(cudaMemcpy(m2.data, m.data, small * 4, cudaMemcpyDeviceToDevice));
      ZERO_CHECK_CUDA(cudaMemcpy(v2.data, v.data, small * 4, cudaMemcpyDeviceToDevice));
      zero::ShardUpdate slice{p.f(), g.data, zero::DType::fp32, m.f(), v.f(), nullptr,
                              zero::DType::bf16, static_cast<std::size_t>(small)};
      zero::gpu::optimizer_step(adamw, zero::make_step_scalars(adamw, 1, adamw.lr, 1.0), slice, nullptr);
      std::vector<at::Tensor> sp = {at::from_blob(p2.data, {small}, options)};
      std::vector<at::Tensor> sg = {at::from_blob(g.data, {small}, options)};
      std::vector<at::Tensor> sm = {at::from_blob(m2.data, {small}, options)};
      std::vector<at::Tensor> sv = {at::from_blob(v2.data, {small}, options)};
      std::vector<at::Tensor> s0 = {at::ones({1}, options)};  // step 1, already incremented
      at::_fused_adamw_(sp, sg, sm, sv, at::TensorList(), s0, adamw.lr, adamw.beta1, adamw.beta2,
                        adamw.weight_decay, adamw.eps, false, false);
      ZERO_CHECK_CUDA(cudaDeviceSynchronize());
      const at::Tensor zp = at::from_blob(p.data, {small}, options).to(at::kDouble);
      const at::Tensor tp2 = sp[0].to(at::kDouble);
      const double rel = ((zp - tp2).norm() / tp2.norm()).item<double>();
      const std::int64_t nan_zero = at::isnan(zp).sum().item<std::int64_t>();
      const std::int64_t nan_torch = at::isnan(tp2).sum().item<std::int64_t>();
      std::printf("zero vs libtorch after one AdamW step: relative difference %.3e (NaNs: zero %lld, "
                  "torch %lld)\n",
                  rel, static_cast<long long>(nan_zero), static_cast<long long>(nan_torch));
      out["zero_vs_torch_relative_difference"] = rel;
    } else {
      std::printf("libtorch: built without CUDA, fused AdamW comparison skipped\n");
      out["torch_fused_adamw_fp32"] = nullptr;
    }
#else
    std::printf("libtorch: not available in this build (or older than 2.0), comparison skipped\n");
    out["torch_fused_adamw_fp32"] = nullptr;
#endif

    if (!o.json_path.empty()) {
      std::ofstream file(o.json_path);
      file << out.dump(2) << "\n";
      std::printf("wrote %s\n", o.json_path.c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpu_bench_optimizer: %s\n", e.what());
    return 1;
  }
  return 0;
}
