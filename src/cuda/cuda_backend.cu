// CudaBackend: device memory, two streams, events, and the kernels of
// optimizer_kernels.cu behind the Backend interface.

#include <cuda_runtime.h>

#include <sstream>

#include "zero/cuda/check.hpp"
#include "zero/cuda/cuda_backend.hpp"
#include "zero/cuda/kernels.hpp"
#include "device_guard.hpp"

namespace zero {
namespace {

using detail::DeviceGuard;

std::string format_gib(std::size_t bytes) {
  std::ostringstream out;
  out.precision(3);
  out << std::fixed << static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0) << " GiB";
  return out.str();
}

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, Stream compute_stream)
      : device_(device), compute_(static_cast<cudaStream_t>(compute_stream)) {
    int count = 0;
    ZERO_CHECK_CUDA(cudaGetDeviceCount(&count));
    ZERO_CHECK(device >= 0 && device < count, "make_cuda_backend: device ", device,
               " does not exist (", count, " visible)");
    ZERO_CHECK_CUDA(cudaSetDevice(device));
    // Non-blocking: the comm stream must not serialize with the legacy default
    // stream, or collectives could never overlap compute issued there.
    ZERO_CHECK_CUDA(cudaStreamCreateWithFlags(&comm_, cudaStreamNonBlocking));
    ZERO_CHECK_CUDA(cudaStreamCreateWithFlags(&transfer_, cudaStreamNonBlocking));
  }

  ~CudaBackend() override {
    (void)cudaSetDevice(device_);
    for (cudaStream_t stream : {transfer_, comm_}) {
      if (stream == nullptr) continue;
      (void)cudaStreamSynchronize(stream);
      (void)cudaStreamDestroy(stream);
    }
  }

  MemoryKind memory_kind() const override { return MemoryKind::device; }
  std::string name() const override { return "cuda:" + std::to_string(device_); }
  int device_index() const override { return device_; }

  void* allocate(std::size_t bytes) override {
    if (bytes == 0) return nullptr;
    DeviceGuard guard(device_);
    void* pointer = nullptr;
    const cudaError_t status = cudaMalloc(&pointer, bytes);  // 256-byte aligned by contract
    if (status == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // clear the recorded error so the next check does not see it
      std::size_t free_bytes = 0, total_bytes = 0;
      (void)cudaMemGetInfo(&free_bytes, &total_bytes);
      ZERO_THROW(OutOfMemory, "cudaMalloc of ", bytes, " bytes (", format_gib(bytes),
                 ") failed on GPU ", device_, ": ", format_gib(free_bytes), " free of ",
                 format_gib(total_bytes));
    }
    ZERO_CHECK_CUDA(status);
    return pointer;
  }

  void deallocate(void* pointer, std::size_t) override {
    if (pointer == nullptr) return;
    DeviceGuard guard(device_);
    ZERO_CHECK_CUDA(cudaFree(pointer));
  }

  void* allocate_host(std::size_t bytes) override {
    if (bytes == 0) return nullptr;
    DeviceGuard guard(device_);
    void* pointer = nullptr;
    const cudaError_t status = cudaHostAlloc(&pointer, bytes, cudaHostAllocDefault);
    if (status == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      ZERO_THROW(OutOfMemory, "cudaHostAlloc of ", bytes, " bytes (", format_gib(bytes),
                 ") of pinned host memory failed (host RAM, or the locked-memory limit: ulimit -l)");
    }
    ZERO_CHECK_CUDA(status);
    return pointer;
  }

  void deallocate_host(void* pointer, std::size_t) override {
    if (pointer == nullptr) return;
    DeviceGuard guard(device_);
    ZERO_CHECK_CUDA(cudaFreeHost(pointer));
  }

  void wait_event(Event event) override {
    ZERO_CHECK(event != nullptr, "wait_event: null event");
    DeviceGuard guard(device_);
    ZERO_CHECK_CUDA(cudaEventSynchronize(static_cast<cudaEvent_t>(event)));
  }

  Stream compute_stream() const override { return compute_; }
  Stream comm_stream() const override { return comm_; }
  Stream transfer_stream() const override { return transfer_; }

  Event record_event(Stream stream) override {
    DeviceGuard guard(device_);
    cudaEvent_t event = nullptr;
    // Ordering only, so no timing: cheaper to record and to wait on.
    ZERO_CHECK_CUDA(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    const cudaError_t status = cudaEventRecord(event, static_cast<cudaStream_t>(stream));
    if (status != cudaSuccess) (void)cudaEventDestroy(event);
    ZERO_CHECK_CUDA(status);
    return event;
  }

  void stream_wait(Stream waiter, Event event) override {
    ZERO_CHECK(event != nullptr, "stream_wait: null event");
    DeviceGuard guard(device_);
    ZERO_CHECK_CUDA(
        cudaStreamWaitEvent(static_cast<cudaStream_t>(waiter), static_cast<cudaEvent_t>(event), 0));
  }

  void release_event(Event event) override {
    if (event == nullptr) return;
    // Destroying a recorded event that has not completed is allowed: its
    // resources are released once the device reaches it.
    ZERO_CHECK_CUDA(cudaEventDestroy(static_cast<cudaEvent_t>(event)));
  }

  void synchronize(Stream stream) override {
    DeviceGuard guard(device_);
    ZERO_CHECK_CUDA(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
  }

  void fill_zero(void* data, std::size_t bytes, Stream stream) override {
    if (bytes == 0) return;
    DeviceGuard guard(device_);
    ZERO_CHECK_CUDA(cudaMemsetAsync(data, 0, bytes, static_cast<cudaStream_t>(stream)));
  }

  void copy(void* dst, const void* src, std::size_t bytes, Stream stream) override {
    if (bytes == 0 || dst == src) return;
    DeviceGuard guard(device_);
    ZERO_CHECK_CUDA(
        cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream)));
  }

  // Synchronous by contract; cudaMemcpy on pageable memory is, and it only
  // orders against the legacy default stream, so wait for the backend's two
  // streams first to see their results.
  void copy_to_host(void* host_dst, const void* src, std::size_t bytes) override {
    if (bytes == 0) return;
    DeviceGuard guard(device_);
    settle_streams();
    ZERO_CHECK_CUDA(cudaMemcpy(host_dst, src, bytes, cudaMemcpyDeviceToHost));
  }

  void copy_from_host(void* dst, const void* host_src, std::size_t bytes) override {
    if (bytes == 0) return;
    DeviceGuard guard(device_);
    settle_streams();
    ZERO_CHECK_CUDA(cudaMemcpy(dst, host_src, bytes, cudaMemcpyHostToDevice));
    // cudaMemcpy from pageable memory may return before the device copy ends
    // (it returns once the source is staged); make the data visible to every stream.
    ZERO_CHECK_CUDA(cudaStreamSynchronize(nullptr));
  }

  void convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, std::size_t count,
               Stream stream) override {
    DeviceGuard guard(device_);
    gpu::convert(src, src_dtype, dst, dst_dtype, count, stream);
  }

  void accumulate(void* dst, const void* src, DType dtype, std::size_t count,
                  Stream stream) override {
    DeviceGuard guard(device_);
    gpu::accumulate(dst, src, dtype, count, stream);
  }

  void ema_update(float* ema, const float* weights, std::size_t count, double decay,
                  Stream stream) override {
    DeviceGuard guard(device_);
    gpu::ema_update(ema, weights, count, decay, stream);
  }

  void optimizer_step(const OptimizerOptions& options, const StepScalars& scalars,
                      const ShardUpdate& update, Stream stream) override {
    DeviceGuard guard(device_);
    gpu::optimizer_step(options, scalars, update, stream);
  }

  GradStats grad_stats(const Span* spans, std::size_t span_count, DType dtype,
                       Stream stream) override {
    DeviceGuard guard(device_);
    return stats_.run(spans, span_count, dtype, stream);
  }

  void queue_grad_stats(const Span& span, DType dtype, std::size_t slot, Stream stream) override {
    DeviceGuard guard(device_);
    stats_.queue(span, dtype, slot, stream);
  }

  void read_grad_stats(GradStats* out, std::size_t count, Stream stream) override {
    DeviceGuard guard(device_);
    stats_.read_slots(out, count, stream);
  }

 private:
  void settle_streams() {
    ZERO_CHECK_CUDA(cudaStreamSynchronize(compute_));
    ZERO_CHECK_CUDA(cudaStreamSynchronize(comm_));
    ZERO_CHECK_CUDA(cudaStreamSynchronize(transfer_));
  }

  int device_;
  cudaStream_t compute_;
  cudaStream_t comm_ = nullptr;
  cudaStream_t transfer_ = nullptr;  // host-device copies beside the collectives (Backend::transfer_stream)
  gpu::GradStatsReducer stats_;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(int device, Stream compute_stream) {
  return std::make_unique<CudaBackend>(device, compute_stream);
}

}  // namespace zero
