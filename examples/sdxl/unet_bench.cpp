// unet_bench: times forward (and backward) of the full SDXL UNet with random
// weights, to size batches and check activation checkpointing on a GPU.
//
//   unet_bench [--device cuda] [--dtype bf16] [--batch 1] [--latent 128] [--tokens 77]
//              [--steps 5] [--warmup 2] [--backward] [--checkpointing]
//              [--attention default|flash|efficient|cudnn|math] [--channels_last] [--cuda_graph]
//              [--profile trace.json]
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
#include "profile_trace.hpp"
#include "unet.hpp"
#include "zero/core/dtype.hpp"

#if defined(ZERO_WITH_CUDA) && __has_include(<c10/cuda/CUDACachingAllocator.h>)
#define UNET_BENCH_CUDA_STATS 1
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace {

void synchronize(const torch::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index() < 0 ? -1 : device.index());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Forward/backward timing of the SDXL UNet with random weights"};
  std::string device_name = "cuda", dtype_name = "bf16";
  std::int64_t batch = 1, latent = 128, tokens = 77, steps = 5, warmup = 2;
  bool backward = false, checkpointing = false, cuda_graph = false, channels_last = false;
  std::string json_path, attention = "default", profile_path;
  app.add_option("--device", device_name, "cpu or cuda[:N]")->capture_default_str();
  app.add_option("--dtype", dtype_name, "fp32, bf16 or fp16")->capture_default_str();
  app.add_option("--batch", batch, "images per step")->capture_default_str();
  app.add_option("--latent", latent, "latent height and width (128 = 1024x1024 pixels)")->capture_default_str();
  app.add_option("--tokens", tokens, "text tokens")->capture_default_str();
  app.add_option("--steps", steps, "timed steps")->capture_default_str();
  app.add_option("--warmup", warmup, "untimed steps first")->capture_default_str();
  app.add_flag("--backward", backward, "also run backward of a sum of the output");
  app.add_flag("--checkpointing", checkpointing, "recompute each block in backward");
  app.add_option("--json", json_path, "append one JSON line with the result to this file");
  app.add_option("--attention", attention, "scaled-dot-product attention kernel: " + sdxl::attention_backend_choices())
      ->capture_default_str();
  app.add_flag("--channels_last", channels_last, "run the convolutional path in NHWC (UNet::set_channels_last)");
  app.add_flag("--cuda_graph", cuda_graph, "capture one step in a CUDA graph and time its replays (CUDA only)");
  app.add_option("--profile", profile_path, "write a Kineto trace of one more step to this file (CUDA only)");
  CLI11_PARSE(app, argc, argv);

  try {
    const torch::Device device(device_name);
    sdxl::select_attention_backend(attention, "--attention");
    if ((cuda_graph || !profile_path.empty()) && !device.is_cuda())
      throw std::invalid_argument("--cuda_graph and --profile need --device cuda");
#ifndef UNET_BENCH_CUDA_STATS
    if (cuda_graph || !profile_path.empty())
      throw std::invalid_argument("--cuda_graph and --profile need a CUDA build (configure with the cuda preset)");
#endif
    const zero::DType dt = zero::parse_dtype(dtype_name, "--dtype");
    const torch::ScalarType dtype = dt == zero::DType::fp32   ? torch::kFloat32
                                    : dt == zero::DType::bf16 ? torch::kBFloat16
                                                              : torch::kFloat16;
    const auto opts = torch::TensorOptions().dtype(dtype).device(device);
    sdxl::UNetBuildOptions build;
    build.tensor_options = opts;
    build.activation_checkpointing = checkpointing;
    const auto t0 = std::chrono::steady_clock::now();
    sdxl::UNet2DConditionModel model(sdxl::UNetConfig::sdxl_base(), build);
    model->set_channels_last(channels_last);
    synchronize(device);
    std::cout << "built SDXL UNet (" << model->parameters().size() << " tensors) in "
              << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() << " s\n";

    torch::manual_seed(0);
    const torch::Tensor sample = torch::randn({batch, 4, latent, latent}, opts);
    const torch::Tensor timestep = torch::full({batch}, 500.0, opts.dtype(torch::kFloat32));
    const torch::Tensor context = torch::randn({batch, tokens, 2048}, opts);
    const torch::Tensor text_embeds = torch::randn({batch, 1280}, opts);
    const torch::Tensor time_ids =
        torch::tensor({1024.0f, 1024.0f, 0.0f, 0.0f, 1024.0f, 1024.0f}, opts.dtype(torch::kFloat32))
            .repeat({batch, 1});

#ifdef UNET_BENCH_CUDA_STATS
    if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(device.index() < 0 ? 0 : device.index());
#endif
    auto run_step = [&] {
      if (backward) {
        model->zero_grad();
        model->forward(sample, timestep, context, text_embeds, time_ids).to(torch::kFloat32).sum().backward();
      } else {
        torch::NoGradGuard no_grad;
        model->forward(sample, timestep, context, text_embeds, time_ids);
      }
    };
    double total = 0;
#ifdef UNET_BENCH_CUDA_STATS
    std::optional<at::cuda::CUDAGraph> graph;
    std::optional<c10::cuda::CUDAStreamGuard> graph_stream;
    if (cuda_graph) {
      // Capture needs a side stream; the warm-up steps run there first so that
      // cuDNN/cuBLAS handles and workspaces exist before capture.
      graph_stream.emplace(c10::cuda::getStreamFromPool(false, device.index() < 0 ? 0 : device.index()));
      for (std::int64_t i = 0; i < std::max<std::int64_t>(warmup, 2); ++i) run_step();
      synchronize(device);
      graph.emplace();
      graph->capture_begin();
      run_step();
      graph->capture_end();
      synchronize(device);
      std::cout << "captured one " << (backward ? "forward+backward" : "forward") << " step in a CUDA graph\n";
    }
#endif
    for (std::int64_t step = 0; step < warmup + steps; ++step) {
      synchronize(device);
      const auto start = std::chrono::steady_clock::now();
#ifdef UNET_BENCH_CUDA_STATS
      if (graph) graph->replay();
      else run_step();
#else
      run_step();
#endif
      synchronize(device);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (step >= warmup) total += seconds;
    }
#ifdef UNET_BENCH_CUDA_STATS
    if (!profile_path.empty()) {
      sdxl::start_profile_trace();
      if (graph) graph->replay();
      else run_step();
      synchronize(device);
      sdxl::save_profile_trace(profile_path);
      std::cout << "profile of one step written to " << profile_path << "\n";
    }
#endif
    const double ms = 1e3 * total / static_cast<double>(steps);
    double peak_gib = 0;
#ifdef UNET_BENCH_CUDA_STATS
    if (device.is_cuda()) {
      const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index() < 0 ? 0 : device.index());
      peak_gib = static_cast<double>(stats.allocated_bytes[0].peak) / (1u << 30);
    }
#endif
    // 20.62 TFLOP per 1024x1024 image for forward+backward (DESIGN.md); the
    // count scales with the latent area; forward alone is a third of it.
    const double tflop = 20.62 * batch * (latent * latent) / (128.0 * 128.0) / (backward ? 1.0 : 3.0);
    const double tflops = tflop / (ms / 1e3);
    std::cout << (backward ? "forward+backward" : "forward") << (checkpointing ? " (checkpointing)" : "")
              << (cuda_graph ? " (CUDA graph)" : "") << (channels_last ? " (channels-last)" : "") << ", attention "
              << attention
              << ", batch " << batch << ", latent " << latent << "x" << latent << ", " << dtype_name << " on "
              << device << ": " << ms << " ms/step, " << 1e3 * batch / ms << " images/s, " << tflops
              << " TFLOP/s (MFU " << 100 * tflops / 989.0 << "% of 989), peak allocated " << peak_gib << " GiB\n";
    if (!json_path.empty()) {
      std::ofstream out(json_path, std::ios::app);
      out << "{\"pass\": \"" << (backward ? "forward+backward" : "forward") << "\", \"checkpointing\": "
          << (checkpointing ? "true" : "false") << ", \"cuda_graph\": " << (cuda_graph ? "true" : "false")
          << ", \"channels_last\": " << (channels_last ? "true" : "false") << ", \"attention\": \"" << attention << "\", \"batch\": " << batch << ", \"latent\": " << latent
          << ", \"dtype\": \"" << dtype_name << "\", \"ms_per_step\": " << ms << ", \"images_per_s\": "
          << 1e3 * batch / ms << ", \"tflops\": " << tflops << ", \"mfu_vs_989\": " << tflops / 989.0
          << ", \"peak_allocated_gib\": " << peak_gib << ", \"steps\": " << steps << "}\n";
    }
  } catch (const std::exception& e) {
    std::cerr << "unet_bench: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
