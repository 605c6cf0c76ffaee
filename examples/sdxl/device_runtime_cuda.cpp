// DeviceRuntime where zero has CUDA and LibTorch has CUDA: device = "cuda"
// runs on a GPU, device = "cpu" on the host as in the CPU-only build.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include <deque>

#include "device_runtime.hpp"
#include "deterministic.hpp"
#include "env_flag.hpp"
#include "tf32.hpp"
#include "zero/comm/nccl_communicator.hpp"
#include "zero/comm/staged_communicator.hpp"
#include "zero/cuda/check.hpp"
#include "zero/cuda/cuda_backend.hpp"

namespace sdxl {

// ------------------------------------------------------------------ the device

DeviceRuntime::DeviceRuntime(const TrainConfig& cfg, zero::MpiCommunicator& host) : host_(host) {
  use_deterministic_algorithms(cfg.deterministic, /*on_gpu=*/cfg.device == "cuda");
  if (cfg.device != "cuda") {
    backend_ = zero::make_host_backend();
    return;
  }
  const int gpus = static_cast<int>(torch::cuda::device_count());
  ZERO_CHECK(gpus > 0, "device = cuda but no GPU is visible");
  const int index = host.local_rank() % gpus;
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(index));
  device_ = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
  if (host.local_size() <= gpus)
    device_comm_ = std::make_unique<zero::NcclCommunicator>(host.mpi_comm(), zero::NcclOptions{.device = index});
  else
    device_comm_ = std::make_unique<zero::StagedCommunicator>(host);
  if (cfg.cuda_graph) {
    // A graph cannot be captured on the legacy default stream, and each
    // parameter's gradient accumulator runs on the stream the parameter
    // was first used on: the whole run goes on one pool stream.
    c10::cuda::setCurrentCUDAStream(c10::cuda::getStreamFromPool(false, static_cast<c10::DeviceIndex>(index)));
  }
  backend_ = zero::make_cuda_backend(index, at::cuda::getCurrentCUDAStream().stream());
  // Shapes are fixed per bucket: timing the algorithms once pays back.
  // (Deterministic runs: the autotuner's choice could differ from run to run.)
  at::globalContext().setBenchmarkCuDNN(cfg.cudnn_benchmark && !cfg.deterministic);
  allow_tf32(cfg.tf32);  // strict fp32 unless [device] tf32 (LibTorch lets cuDNN use TF32 by default)
}

DeviceRuntime::~DeviceRuntime() = default;

void DeviceRuntime::synchronize() {
  if (device_.is_cuda()) ZERO_CHECK_CUDA(cudaDeviceSynchronize());
}

DeviceMemory DeviceRuntime::settled_memory() {
  ZERO_CHECK_CUDA(cudaDeviceSynchronize());
  c10::cuda::CUDACachingAllocator::emptyCache();
  std::size_t free_bytes = 0, total_bytes = 0;
  ZERO_CHECK_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));
  return {.in_use = total_bytes - free_bytes, .total = total_bytes};
}

void DeviceRuntime::limit_torch_memory(double fraction) {
  c10::cuda::CUDACachingAllocator::setMemoryFraction(fraction, device_.index());
}

std::optional<std::size_t> DeviceRuntime::memory_in_use() const {
  if (!device_.is_cuda()) return std::nullopt;
  std::size_t free = 0, total = 0;
  cudaMemGetInfo(&free, &total);
  return total - free;
}

// ------------------------------------------------------------------ the inputs

struct InputUploads::Buffers {
  struct Slot {
    torch::Tensor pinned;
    at::cuda::CUDAEvent copied;  // the last copy out of `pinned`
  };
  std::deque<Slot> slots;  // a deque: the events cannot be copied
};

InputUploads::InputUploads(torch::Device device) : device_(device) {
  if (device.is_cuda() && !env_flag("SDXL_BLOCKING_INPUT_COPIES")) buffers_ = std::make_unique<Buffers>();
}

InputUploads::~InputUploads() = default;

torch::Tensor InputUploads::up(std::size_t slot, const torch::Tensor& host, torch::ScalarType type) {
  if (!buffers_) return host.to(device_, type);
  ZERO_CHECK(host.device().is_cpu(), "InputUploads::up: input ", slot, " is on ", host.device().str(),
             ", expected the CPU");
  while (buffers_->slots.size() <= slot) buffers_->slots.emplace_back();
  Buffers::Slot& s = buffers_->slots[slot];
  s.copied.synchronize();  // nothing to wait for before its first record
  if (!s.pinned.defined() || s.pinned.sizes() != host.sizes() || s.pinned.scalar_type() != type)
    s.pinned = torch::empty(host.sizes(), torch::TensorOptions().dtype(type).pinned_memory(true));
  s.pinned.copy_(host);  // converted here, on the host
  torch::Tensor on_device = s.pinned.to(device_, type, /*non_blocking=*/true);
  s.copied.record(at::cuda::getCurrentCUDAStream(device_.index()));
  return on_device;
}

// ------------------------------------------------------------------ the captured micro-step

struct GraphedMicroStep::Captured {
  at::cuda::CUDAGraph graph;
  torch::autograd::variable_list static_inputs;
  torch::Tensor loss;
};

GraphedMicroStep::GraphedMicroStep(zero::adapter::ShardedModel& sharded) : sharded_(sharded) {}

GraphedMicroStep::~GraphedMicroStep() = default;

torch::Tensor GraphedMicroStep::run(const torch::autograd::variable_list& inputs, const Body& body) {
  // The whole micro-step is captured: with gradients bound to the engine's
  // full buffer, forward, backward and the (in-place) reductions; otherwise
  // also the hooks' gradient writes into bucket buffers; at stage 3 the gathers.
  zero::Engine& engine = sharded_.engine();
  engine.prepare_graph_replay();  // stages 1-2: the gathers step() left in flight
  const bool capturing = !captured_;
  if (capturing) {
    const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream();
    ZERO_CHECK(stream != c10::cuda::getDefaultCUDAStream(stream.device_index()),
               "cuda_graph: the current stream is the default stream, which cannot be captured");
    torch::autograd::variable_list static_inputs;
    for (const torch::Tensor& t : inputs) static_inputs.push_back(t.defined() ? t.clone() : t);
    // The eager step's activations are cached, unused, in the allocator;
    // give them back so that the graph's own pool does not double them.
    c10::cuda::CUDACachingAllocator::emptyCache();
    captured_ = std::make_unique<Captured>();
    captured_->static_inputs = std::move(static_inputs);
    // Relaxed: the engine's pool may allocate a block the capture needs.
    captured_->graph.capture_begin({0, 0}, cudaStreamCaptureModeRelaxed);
    try {
      engine.begin_graph_capture();
      captured_->loss = body(captured_->static_inputs);
      sharded_.finish_micro_step();
      engine.end_graph_capture();
    } catch (const std::exception& e) {
      // End the broken capture so that this error is what surfaces, not
      // every later CUDA call failing.
      cudaGraph_t broken = nullptr;
      (void)cudaStreamEndCapture(stream.stream(), &broken);
      if (broken) (void)cudaGraphDestroy(broken);
      (void)cudaGetLastError();
      ZERO_THROW(zero::Error, "[device] cuda_graph: capturing the micro-step failed: ", e.what());
    }
    captured_->graph.capture_end();
  } else {
    torch::autograd::variable_list& static_inputs = captured_->static_inputs;
    ZERO_CHECK(inputs.size() == static_inputs.size(), "cuda_graph: ", inputs.size(), " inputs, captured with ",
               static_inputs.size());
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      if (!inputs[i].defined()) continue;
      ZERO_CHECK(inputs[i].sizes() == static_inputs[i].sizes(), "cuda_graph: input ", i, " has shape ",
                 inputs[i].sizes(), ", the captured step had ", static_inputs[i].sizes(),
                 " (every step must have the same shapes)");
      static_inputs[i].copy_(inputs[i]);
    }
  }
  captured_->graph.replay();
  if (!capturing) engine.graph_replayed();  // the capture's own bookkeeping ran in it
  return captured_->loss;
}

}  // namespace sdxl
