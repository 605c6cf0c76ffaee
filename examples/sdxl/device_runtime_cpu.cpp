// DeviceRuntime for builds without CUDA (or with a CPU-only LibTorch):
// device = "cpu" only. The GPU-only calls cannot be reached, because the
// configuration allows max_gpu_memory, cuda_graph and profile_step with
// device = "cuda" alone, which the constructor refuses; they throw anyway.
#include "device_runtime.hpp"
#include "deterministic.hpp"

#include "zero/core/error.hpp"

namespace sdxl {

namespace {
[[noreturn]] void no_cuda(const char* what) {
  ZERO_THROW(zero::InvalidArgument, what, ": this build has no CUDA (configure with the cuda preset)");
}
}  // namespace

DeviceRuntime::DeviceRuntime(const TrainConfig& cfg, zero::MpiCommunicator& host) : host_(host) {
  if (cfg.device == "cuda") no_cuda("device = cuda");
  use_deterministic_algorithms(cfg.deterministic, /*on_gpu=*/false);
  backend_ = zero::make_host_backend();
}

DeviceRuntime::~DeviceRuntime() = default;

void DeviceRuntime::synchronize() {}

DeviceMemory DeviceRuntime::settled_memory() { no_cuda("max_gpu_memory"); }

void DeviceRuntime::limit_torch_memory(double) { no_cuda("max_gpu_memory"); }

std::optional<std::size_t> DeviceRuntime::memory_in_use() const { return std::nullopt; }

struct InputUploads::Buffers {};

InputUploads::InputUploads(torch::Device device) : device_(device) {}

InputUploads::~InputUploads() = default;

torch::Tensor InputUploads::up(std::size_t, const torch::Tensor& host, torch::ScalarType type) {
  return host.to(device_, type);
}

struct GraphedMicroStep::Captured {};

GraphedMicroStep::GraphedMicroStep(zero::adapter::ShardedModel& sharded) : sharded_(sharded) {}

GraphedMicroStep::~GraphedMicroStep() = default;

torch::Tensor GraphedMicroStep::run(const torch::autograd::variable_list&, const Body&) { no_cuda("cuda_graph"); }

}  // namespace sdxl
