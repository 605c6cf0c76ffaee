// unet_bench: times forward (and backward) of the full SDXL UNet with random
// weights, to size batches and check activation checkpointing on a GPU.
//
//   unet_bench [--device cuda] [--dtype bf16] [--batch 1] [--latent 128] [--tokens 77]
//              [--steps 5] [--warmup 2] [--backward] [--checkpointing]
//              [--attention default|flash|efficient|cudnn|math] [--channels_last] [--cuda_graph]
//              [--profile trace.json] [--tf32] [--unfused_linear_backward]
//
// Prints the mean step time over --steps after --warmup untimed steps.
// --cuda_graph captures one step in a CUDA graph and times its replays (the
// launch overhead gone); --profile writes a Kineto trace (chrome://tracing
// format) of one more step, which bench/gpu/kernel_summary.py sums by kernel family.

#include <CLI/CLI.hpp>

#include <chrono>
#include <optional>
#include <fstream>
#include <iostream>

#include "attention_backend.hpp"
#include "fused_linear.hpp"
#include "profile_trace.hpp"
#include "tf32.hpp"
#include "unet.hpp"
#include "unet_param_count.hpp"
#include "zero/core/dtype.hpp"

#if defined(ZERO_WITH_CUDA) && __has_include(<c10/cuda/CUDACachingAllocator.h>)
#define UNET_BENCH_CUDA_STATS 1
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace {

struct BenchOptions {
  std::string device_name = "cuda", dtype_name = "bf16";
  std::int64_t batch = 1, latent = 128, tokens = 77, steps = 5, warmup = 2, checkpoint_units = 0;
  bool backward = false, checkpointing = false, cuda_graph = false, channels_last = false, tf32 = false,
       unfused_linear_backward = false;
  std::string json_path, attention = "default", profile_path;
};

void add_options(CLI::App& app, BenchOptions& o) {
  app.add_option("--device", o.device_name, "cpu or cuda[:N]")->capture_default_str();
  app.add_option("--dtype", o.dtype_name, "fp32, bf16 or fp16")->capture_default_str();
  app.add_option("--batch", o.batch, "images per step")->capture_default_str();
  app.add_option("--latent", o.latent, "latent height and width (128 = 1024x1024 pixels)")->capture_default_str();
  app.add_option("--tokens", o.tokens, "text tokens")->capture_default_str();
  app.add_option("--steps", o.steps, "timed steps")->capture_default_str();
  app.add_option("--warmup", o.warmup, "untimed steps first")->capture_default_str();
  app.add_flag("--backward", o.backward, "also run backward of a sum of the output");
  app.add_flag("--checkpointing", o.checkpointing, "recompute each block in backward");
  app.add_option("--checkpoint_units", o.checkpoint_units,
                 "with --checkpointing: recompute only this many units, those that free the most activation memory "
                 "per recompute FLOP (the trainer's checkpoint_units; 0: every unit)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--json", o.json_path, "append one JSON line with the result to this file");
  app.add_option("--attention", o.attention, "scaled-dot-product attention kernel: " + sdxl::attention_backend_choices())
      ->capture_default_str();
  app.add_flag("--channels_last", o.channels_last, "run the convolutional path in NHWC (UNet::set_channels_last)");
  app.add_flag("--tf32", o.tf32, "--dtype fp32 on CUDA: let matmuls and convolutions use TF32 (default: strict fp32)");
  app.add_flag("--cuda_graph", o.cuda_graph, "capture one step in a CUDA graph and time its replays (CUDA only)");
  app.add_flag("--unfused_linear_backward", o.unfused_linear_backward,
               "Linear's weight and bias gradients as LibTorch computes them (a GEMM and a sum), not in one GEMM");
  app.add_option("--profile", o.profile_path, "write a Kineto trace of one more step to this file (CUDA only)");
}

void synchronize(const torch::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index() < 0 ? -1 : device.index());
}

int device_index(const torch::Device& device) { return device.index() < 0 ? 0 : device.index(); }

/// Random inputs of one batch, the same every run (seed 0).
struct BenchInputs {
  torch::Tensor sample, timestep, context, text_embeds, time_ids;
};

BenchInputs make_inputs(const BenchOptions& o, const torch::TensorOptions& opts) {
  torch::manual_seed(0);
  BenchInputs in;
  in.sample = torch::randn({o.batch, 4, o.latent, o.latent}, opts);
  in.timestep = torch::full({o.batch}, 500.0, opts.dtype(torch::kFloat32));
  in.context = torch::randn({o.batch, o.tokens, 2048}, opts);
  in.text_embeds = torch::randn({o.batch, 1280}, opts);
  in.time_ids = torch::tensor({1024.0f, 1024.0f, 0.0f, 0.0f, 1024.0f, 1024.0f}, opts.dtype(torch::kFloat32))
                    .repeat({o.batch, 1});
  return in;
}

/// One step of the model, eager or (--cuda_graph) replayed from a captured graph.
class BenchStep {
 public:
  BenchStep(const BenchOptions& o, const torch::Device& device, sdxl::UNet2DConditionModel& model,
            const BenchInputs& in)
      : o_(o), device_(device), model_(model), in_(in) {
#ifdef UNET_BENCH_CUDA_STATS
    if (!o.cuda_graph) return;
    // Capture needs a side stream; the warm-up steps run there first so that
    // cuDNN/cuBLAS handles and workspaces exist before capture.
    graph_stream_.emplace(c10::cuda::getStreamFromPool(false, device_index(device)));
    for (std::int64_t i = 0; i < std::max<std::int64_t>(o.warmup, 2); ++i) eager();
    synchronize(device);
    graph_.emplace();
    graph_->capture_begin();
    eager();
    graph_->capture_end();
    synchronize(device);
    std::cout << "captured one " << (o.backward ? "forward+backward" : "forward") << " step in a CUDA graph\n";
#endif
  }
  void run() {
#ifdef UNET_BENCH_CUDA_STATS
    if (graph_) {
      graph_->replay();
      return;
    }
#endif
    eager();
  }

 private:
  void eager() {
    if (o_.backward) {
      model_->zero_grad();
      model_->forward(in_.sample, in_.timestep, in_.context, in_.text_embeds, in_.time_ids)
          .to(torch::kFloat32)
          .sum()
          .backward();
    } else {
      torch::NoGradGuard no_grad;
      model_->forward(in_.sample, in_.timestep, in_.context, in_.text_embeds, in_.time_ids);
    }
  }
  const BenchOptions& o_;
  const torch::Device& device_;
  sdxl::UNet2DConditionModel& model_;
  const BenchInputs& in_;
#ifdef UNET_BENCH_CUDA_STATS
  std::optional<at::cuda::CUDAGraph> graph_;
  std::optional<c10::cuda::CUDAStreamGuard> graph_stream_;
#endif
};

/// Seconds of the --steps timed steps after --warmup untimed ones.
double time_steps(const BenchOptions& o, const torch::Device& device, BenchStep& step) {
  double total = 0;
  for (std::int64_t i = 0; i < o.warmup + o.steps; ++i) {
    synchronize(device);
    const auto start = std::chrono::steady_clock::now();
    step.run();
    synchronize(device);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (i >= o.warmup) total += seconds;
  }
  return total;
}

double peak_allocated_gib(const torch::Device& device) {
#ifdef UNET_BENCH_CUDA_STATS
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device_index(device));
    return static_cast<double>(stats.allocated_bytes[0].peak) / (1u << 30);
  }
#endif
  (void)device;
  return 0;
}

void report(const BenchOptions& o, const torch::Device& device, double ms, double peak_gib) {
  // 20.62 TFLOP per 1024x1024 image for forward+backward (DESIGN.md); the
  // count scales with the latent area; forward alone is a third of it.
  const double tflop = 20.62 * o.batch * (o.latent * o.latent) / (128.0 * 128.0) / (o.backward ? 1.0 : 3.0);
  const double tflops = tflop / (ms / 1e3);
  const std::string recomputed =
      o.checkpoint_units > 0 ? " (checkpointing " + std::to_string(o.checkpoint_units) + " units)" : " (checkpointing)";
  std::cout << (o.backward ? "forward+backward" : "forward") << (o.checkpointing ? recomputed : "")
            << (o.cuda_graph ? " (CUDA graph)" : "") << (o.channels_last ? " (channels-last)" : "")
            << (o.backward && !o.unfused_linear_backward && sdxl::linear_has_fused_backward()
                    ? " (bias gradients in the GEMM)"
                    : "")
            << (o.dtype_name == "fp32" ? (o.tf32 ? " (TF32)" : " (strict fp32)") : "") << ", attention "
            << o.attention << ", batch " << o.batch << ", latent " << o.latent << "x" << o.latent << ", "
            << o.dtype_name << " on " << device << ": " << ms << " ms/step, " << 1e3 * o.batch / ms << " images/s, "
            << tflops << " TFLOP/s (MFU " << 100 * tflops / 989.0 << "% of 989), peak allocated " << peak_gib
            << " GiB\n";
  if (o.json_path.empty()) return;
  std::ofstream out(o.json_path, std::ios::app);
  out << "{\"pass\": \"" << (o.backward ? "forward+backward" : "forward") << "\", \"checkpointing\": "
      << (o.checkpointing ? "true" : "false") << ", \"checkpoint_units\": " << o.checkpoint_units
      << ", \"cuda_graph\": " << (o.cuda_graph ? "true" : "false")
      << ", \"channels_last\": " << (o.channels_last ? "true" : "false")
      << ", \"fused_linear_backward\": " << (!o.unfused_linear_backward && sdxl::linear_has_fused_backward() ? "true" : "false")
      << ", \"attention\": \"" << o.attention
      << "\", \"tf32\": " << (o.tf32 ? "true" : "false") << ", \"batch\": " << o.batch << ", \"latent\": " << o.latent << ", \"dtype\": \"" << o.dtype_name
      << "\", \"ms_per_step\": " << ms << ", \"images_per_s\": " << 1e3 * o.batch / ms << ", \"tflops\": " << tflops
      << ", \"mfu_vs_989\": " << tflops / 989.0 << ", \"peak_allocated_gib\": " << peak_gib
      << ", \"steps\": " << o.steps << "}\n";
}

void run_bench(const BenchOptions& o) {
  const torch::Device device(o.device_name);
  sdxl::select_attention_backend(o.attention, "--attention");
  sdxl::allow_tf32(o.tf32);
  sdxl::set_linear_backward_fused(!o.unfused_linear_backward);
  if ((o.cuda_graph || !o.profile_path.empty()) && !device.is_cuda())
    throw std::invalid_argument("--cuda_graph and --profile need --device cuda");
#ifndef UNET_BENCH_CUDA_STATS
  if (o.cuda_graph || !o.profile_path.empty())
    throw std::invalid_argument("--cuda_graph and --profile need a CUDA build (configure with the cuda preset)");
#endif
  if (o.checkpoint_units > 0 && !o.checkpointing)
    throw std::invalid_argument("--checkpoint_units chooses what --checkpointing recomputes: add --checkpointing");
  const zero::DType dt = zero::parse_dtype(o.dtype_name, "--dtype");
  const torch::ScalarType dtype = dt == zero::DType::fp32   ? torch::kFloat32
                                  : dt == zero::DType::bf16 ? torch::kBFloat16
                                                            : torch::kFloat16;
  const auto opts = torch::TensorOptions().dtype(dtype).device(device);
  sdxl::UNetBuildOptions build;
  build.tensor_options = opts;
  build.activation_checkpointing = o.checkpointing;
  const auto t0 = std::chrono::steady_clock::now();
  sdxl::UNet2DConditionModel model(sdxl::UNetConfig::sdxl_base(), build);
  model->set_channels_last(o.channels_last);
  if (o.checkpointing)
    model->set_recomputed_units(sdxl::recomputed_unit_mask(model->config(), model->unit_granularity(), o.latent,
                                                           o.checkpoint_units));
  synchronize(device);
  std::cout << "built SDXL UNet (" << model->parameters().size() << " tensors) in "
            << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() << " s\n";

  const BenchInputs inputs = make_inputs(o, opts);
#ifdef UNET_BENCH_CUDA_STATS
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(device_index(device));
#endif
  BenchStep step(o, device, model, inputs);
  const double total = time_steps(o, device, step);
  if (!o.profile_path.empty()) {
    sdxl::start_profile_trace();
    step.run();
    synchronize(device);
    sdxl::save_profile_trace(o.profile_path);
    std::cout << "profile of one step written to " << o.profile_path << "\n";
  }
  report(o, device, 1e3 * total / static_cast<double>(o.steps), peak_allocated_gib(device));
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Forward/backward timing of the SDXL UNet with random weights"};
  BenchOptions options;
  add_options(app, options);
  CLI11_PARSE(app, argc, argv);
  try {
    run_bench(options);
  } catch (const std::exception& e) {
    std::cerr << "unet_bench: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
