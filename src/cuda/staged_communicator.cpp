// StagedCommunicator: device buffers through a host Communicator, staged in
// pinned memory.

#include "zero/comm/staged_communicator.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>

#include "zero/cuda/check.hpp"

namespace zero {

struct StagedCommunicator::Staging {
  unsigned char* pinned = nullptr;
  std::size_t bytes = 0;
  std::size_t peak = 0;
  // Recorded after the last copy out of `pinned`; the next collective waits
  // for it before overwriting the buffer (the copy may be on another stream).
  cudaEvent_t copied_back = nullptr;
  bool recorded = false;

  ~Staging() {
    if (copied_back != nullptr) {
      (void)cudaEventSynchronize(copied_back);
      (void)cudaEventDestroy(copied_back);
    }
    if (pinned != nullptr) (void)cudaFreeHost(pinned);
  }
};

namespace {

class StagedWork final : public Work {
 public:
  explicit StagedWork(cudaEvent_t event) : event_(event) {}
  ~StagedWork() override {
    (void)cudaEventSynchronize(event_);  // the contract: an unwaited Work is waited for
    (void)cudaEventDestroy(event_);
  }
  void wait() override { ZERO_CHECK_CUDA(cudaEventSynchronize(event_)); }
  bool test() override {
    const cudaError_t status = cudaEventQuery(event_);
    if (status == cudaSuccess) return true;
    if (status != cudaErrorNotReady) ZERO_CHECK_CUDA(status);
    return false;
  }

 private:
  cudaEvent_t event_;
};

cudaStream_t as_cuda(Stream stream) { return static_cast<cudaStream_t>(stream); }

}  // namespace

StagedCommunicator::StagedCommunicator(Communicator& host)
    : host_(&host), staging_(std::make_unique<Staging>()) {
  ZERO_CHECK(host.memory_kind() == MemoryKind::host, "StagedCommunicator needs a host-memory "
             "communicator, got '", host.backend_name(), "' on device memory");
  ZERO_CHECK_CUDA(cudaEventCreateWithFlags(&staging_->copied_back, cudaEventDisableTiming));
}

StagedCommunicator::StagedCommunicator(std::unique_ptr<Communicator> host)
    : StagedCommunicator(*host) {
  owned_ = std::move(host);
}

StagedCommunicator::~StagedCommunicator() = default;

std::unique_ptr<Communicator> StagedCommunicator::split(int color, int key) {
  return std::make_unique<StagedCommunicator>(host_->split(color, key));
}

std::size_t StagedCommunicator::workspace_bytes() const {
  return staging_->bytes + host_->workspace_bytes();
}
std::size_t StagedCommunicator::peak_workspace_bytes() const {
  return staging_->peak + host_->peak_workspace_bytes();
}

void StagedCommunicator::before_staging() {
  if (staging_->recorded) ZERO_CHECK_CUDA(cudaEventSynchronize(staging_->copied_back));
}

unsigned char* StagedCommunicator::stage(std::size_t bytes) {
  before_staging();
  if (bytes > staging_->bytes) {
    if (staging_->pinned != nullptr) ZERO_CHECK_CUDA(cudaFreeHost(staging_->pinned));
    staging_->pinned = nullptr;
    staging_->bytes = 0;
    // Grow geometrically so that a ramp of message sizes does not reallocate
    // (pinned allocations are slow: they map pages for the device).
    const std::size_t grown = std::max(bytes, staging_->peak + staging_->peak / 2);
    void* pointer = nullptr;
    ZERO_CHECK_CUDA(cudaHostAlloc(&pointer, grown, cudaHostAllocDefault));
    staging_->pinned = static_cast<unsigned char*>(pointer);
    staging_->bytes = grown;
    staging_->peak = std::max(staging_->peak, grown);
  }
  return staging_->pinned;
}

WorkPtr StagedCommunicator::after_copy_back(Stream stream) {
  ZERO_CHECK_CUDA(cudaEventRecord(staging_->copied_back, as_cuda(stream)));
  staging_->recorded = true;
  cudaEvent_t event = nullptr;
  ZERO_CHECK_CUDA(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  const cudaError_t status = cudaEventRecord(event, as_cuda(stream));
  if (status != cudaSuccess) (void)cudaEventDestroy(event);
  ZERO_CHECK_CUDA(status);
  return std::make_unique<StagedWork>(event);
}

// cudaMemcpyDefault: the runtime infers the direction from the pointers
// (unified addressing), so host buffers passed by mistake still work.

WorkPtr StagedCommunicator::reduce_scatter(const void* send, void* recv, std::size_t count,
                                           DType dtype, ReduceOp op, Stream stream) {
  check_dtype(dtype, "reduce_scatter");
  const std::size_t recv_bytes = count * size_of(dtype);
  const std::size_t send_bytes = recv_bytes * static_cast<std::size_t>(size());
  if (count == 0) return std::make_unique<CompletedWork>();
  unsigned char* host_send = stage(send_bytes + recv_bytes);
  unsigned char* host_recv = host_send + send_bytes;
  ZERO_CHECK_CUDA(cudaMemcpyAsync(host_send, send, send_bytes, cudaMemcpyDefault, as_cuda(stream)));
  ZERO_CHECK_CUDA(cudaStreamSynchronize(as_cuda(stream)));
  host_->reduce_scatter(host_send, host_recv, count, dtype, op)->wait();
  ZERO_CHECK_CUDA(cudaMemcpyAsync(recv, host_recv, recv_bytes, cudaMemcpyDefault, as_cuda(stream)));
  return after_copy_back(stream);
}

WorkPtr StagedCommunicator::all_gather(const void* send, void* recv, std::size_t count,
                                       DType dtype, Stream stream) {
  check_dtype(dtype, "all_gather");
  const std::size_t send_bytes = count * size_of(dtype);
  const std::size_t recv_bytes = send_bytes * static_cast<std::size_t>(size());
  if (count == 0) return std::make_unique<CompletedWork>();
  unsigned char* host_recv = stage(recv_bytes);
  // Stage the send part straight into this rank's slot: the host collective
  // then runs in place, which every backend supports by the interface's rule.
  unsigned char* host_send = host_recv + static_cast<std::size_t>(rank()) * send_bytes;
  ZERO_CHECK_CUDA(cudaMemcpyAsync(host_send, send, send_bytes, cudaMemcpyDefault, as_cuda(stream)));
  ZERO_CHECK_CUDA(cudaStreamSynchronize(as_cuda(stream)));
  host_->all_gather(host_send, host_recv, count, dtype)->wait();
  ZERO_CHECK_CUDA(cudaMemcpyAsync(recv, host_recv, recv_bytes, cudaMemcpyDefault, as_cuda(stream)));
  return after_copy_back(stream);
}

WorkPtr StagedCommunicator::all_reduce(void* buffer, std::size_t count, DType dtype, ReduceOp op,
                                       Stream stream) {
  check_dtype(dtype, "all_reduce");
  const std::size_t bytes = count * size_of(dtype);
  if (count == 0) return std::make_unique<CompletedWork>();
  unsigned char* host_buffer = stage(bytes);
  ZERO_CHECK_CUDA(cudaMemcpyAsync(host_buffer, buffer, bytes, cudaMemcpyDefault, as_cuda(stream)));
  ZERO_CHECK_CUDA(cudaStreamSynchronize(as_cuda(stream)));
  host_->all_reduce(host_buffer, count, dtype, op)->wait();
  ZERO_CHECK_CUDA(cudaMemcpyAsync(buffer, host_buffer, bytes, cudaMemcpyDefault, as_cuda(stream)));
  return after_copy_back(stream);
}

WorkPtr StagedCommunicator::broadcast(void* buffer, std::size_t count, DType dtype, int root,
                                      Stream stream) {
  check_dtype(dtype, "broadcast");
  ZERO_CHECK(root >= 0 && root < size(), "broadcast: root ", root, " outside [0, ", size(), ")");
  const std::size_t bytes = count * size_of(dtype);
  if (count == 0) return std::make_unique<CompletedWork>();
  unsigned char* host_buffer = stage(bytes);
  const bool is_root = rank() == root;
  if (is_root) {
    ZERO_CHECK_CUDA(cudaMemcpyAsync(host_buffer, buffer, bytes, cudaMemcpyDefault, as_cuda(stream)));
    ZERO_CHECK_CUDA(cudaStreamSynchronize(as_cuda(stream)));
  }
  host_->broadcast(host_buffer, count, dtype, root)->wait();
  // The root's buffer already holds the data; the others receive it.
  if (!is_root)
    ZERO_CHECK_CUDA(cudaMemcpyAsync(buffer, host_buffer, bytes, cudaMemcpyDefault, as_cuda(stream)));
  return after_copy_back(stream);
}

}  // namespace zero
