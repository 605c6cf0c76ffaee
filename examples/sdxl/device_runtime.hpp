// DeviceRuntime and GraphedMicroStep: the trainer's one seam to the device.
//
// Everything the trainer does differently on a GPU lives behind this header:
// picking the GPU, the device communicator and the engine's backend, the
// stream a CUDA graph can be captured on, cuDNN's settings, memory queries,
// synchronisation, and the captured forward/backward. CMake builds one of
// two implementations: device_runtime_cuda.cpp where zero has CUDA and
// LibTorch has CUDA, device_runtime_cpu.cpp elsewhere (device = "cpu" only).
// The trainer itself holds no #if.
#pragma once

#include <torch/torch.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <optional>

#include "train_config.hpp"
#include "zero/comm/communicator.hpp"
#include "zero/comm/mpi_communicator.hpp"
#include "zero/engine/backend.hpp"
#include "zero/torch/sharded_model.hpp"

namespace sdxl {

/// Device memory as the driver reports it (cudaMemGetInfo).
struct DeviceMemory {
  std::size_t in_use = 0;
  std::size_t total = 0;
};

class DeviceRuntime {
 public:
  /// device = "cpu": LibTorch on the CPU, the host backend, collectives over
  /// `host`. device = "cuda": the GPU local_rank % GPUs, NCCL (MPI staged
  /// through the host when ranks outnumber GPUs), the CUDA backend on the
  /// current stream (a pool stream with cuda_graph), cuDNN benchmark mode as
  /// configured. A build without CUDA refuses device = "cuda".
  DeviceRuntime(const TrainConfig& cfg, zero::MpiCommunicator& host);
  ~DeviceRuntime();
  DeviceRuntime(const DeviceRuntime&) = delete;
  DeviceRuntime& operator=(const DeviceRuntime&) = delete;

  torch::Device device() const { return device_; }
  /// The device communicator, or the host one when the run is on the CPU.
  zero::Communicator& communicator() { return device_comm_ ? *device_comm_ : host_; }
  zero::Backend& backend() { return *backend_; }

  /// Waits for all work on the device (nothing on the CPU).
  void synchronize();
  /// After the device is idle and LibTorch's cached blocks are given back:
  /// what is in use (CUDA context, NCCL, the engine's own allocations).
  DeviceMemory settled_memory();
  /// Caps LibTorch's caching allocator at `fraction` of the device's memory.
  void limit_torch_memory(double fraction);
  /// Memory in use on the GPU now; none on the CPU.
  std::optional<std::size_t> memory_in_use() const;

 private:
  zero::MpiCommunicator& host_;
  torch::Device device_ = torch::kCPU;
  // Destroyed in reverse order: the backend first, then the communicator.
  std::unique_ptr<zero::Communicator> device_comm_;
  std::unique_ptr<zero::Backend> backend_;
};

/// The micro-step's inputs on their way to the device. On a GPU each input
/// has a pinned host buffer of its own, allocated at the first micro-step and
/// reused: the input is converted into it on the host and copied up without
/// a host wait, queued behind the last step's update. (A blocking copy from
/// pageable memory waits for that update first, and the GPU then idles while
/// the host makes and sends the rest; pinning a new block every step, as
/// session 32 tried, made LibTorch's host allocator stall.) Before a buffer is
/// written again its last copy is waited for (an event; in the trainer long
/// done, since each micro-step ends reading its loss). On the CPU, and with
/// SDXL_BLOCKING_INPUT_COPIES=1 (the blocking copies, to measure against): a
/// plain conversion and copy.
class InputUploads {
 public:
  explicit InputUploads(torch::Device device);
  ~InputUploads();
  InputUploads(const InputUploads&) = delete;
  InputUploads& operator=(const InputUploads&) = delete;
  /// `host` (a CPU tensor) as a `type` tensor on the device. `slot` names the
  /// input: each slot keeps one buffer, made again when the shape or type changes.
  torch::Tensor up(std::size_t slot, const torch::Tensor& host, torch::ScalarType type);

 private:
  struct Buffers;  // the pinned tensors and their copies' events (CUDA builds)
  torch::Device device_;
  std::unique_ptr<Buffers> buffers_;
};

/// One micro-step captured once in a CUDA graph and replayed: one launch
/// instead of thousands (batch 1 is bound by launch overhead). The inputs are
/// copied into tensors the graph reads. The whole micro-step is captured
/// (Engine::begin_graph_capture): forward, backward, the reductions on the
/// comm stream, the stage-3 gathers, and, where the engine has no full
/// gradient buffer to bind autograd's gradients to (several ranks at stages
/// 2-3), the hooks' writes into bucket buffers. The optimizer step stays outside.
class GraphedMicroStep {
 public:
  using Body = std::function<torch::Tensor(const torch::autograd::variable_list&)>;

  explicit GraphedMicroStep(zero::adapter::ShardedModel& sharded);
  ~GraphedMicroStep();
  GraphedMicroStep(const GraphedMicroStep&) = delete;
  GraphedMicroStep& operator=(const GraphedMicroStep&) = delete;

  /// Returns the loss (a tensor the graph writes). `body` (forward and
  /// backward) runs once, under capture; every later call replays it on the
  /// new inputs (same shapes). The micro-step is finished on return
  /// (ShardedModel::finish_micro_step or its replay).
  torch::Tensor run(const torch::autograd::variable_list& inputs, const Body& body);

 private:
  struct Captured;  // the graph and the tensors it reads and writes (CUDA builds)
  zero::adapter::ShardedModel& sharded_;
  std::unique_ptr<Captured> captured_;
};

}  // namespace sdxl
