// Backend: where the engine's buffers live and how its few kernels run. The
// engine's schedules are written once against this interface; HostBackend
// (CPU memory and kernels) and CudaBackend (device memory, streams, fused
// CUDA kernels) implement it. This is what keeps the sharding logic testable
// on a machine without a GPU.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "zero/comm/communicator.hpp"
#include "zero/optim/optimizer.hpp"

namespace zero {

/// Opaque event (cudaEvent_t in CUDA builds; unused by the host backend).
using Event = void*;

class Backend {
 public:
  virtual ~Backend() = default;
  virtual MemoryKind memory_kind() const = 0;
  virtual std::string name() const = 0;
  /// The GPU this backend allocates on; -1 for host memory.
  virtual int device_index() const { return -1; }

  /// Allocates bytes (aligned to at least 256); throws zero::OutOfMemory.
  virtual void* allocate(std::size_t bytes) = 0;
  virtual void deallocate(void* pointer, std::size_t bytes) = 0;

  /// Streams: compute is where the model's kernels run (the caller's current
  /// stream), comm where collectives run. Host: both null.
  virtual Stream compute_stream() const = 0;
  virtual Stream comm_stream() const = 0;
  /// A third stream for host-device copies that must not queue behind the
  /// collectives and gradient downloads of the comm stream (the delayed
  /// offloaded update's parameters, sent up during backward). Defaults to
  /// the comm stream; the CUDA backend has one of its own.
  virtual Stream transfer_stream() const { return comm_stream(); }
  /// Records an event on stream; make_wait makes `waiter` wait for it without
  /// blocking the host. Host: no-ops.
  virtual Event record_event(Stream stream) = 0;
  virtual void stream_wait(Stream waiter, Event event) = 0;
  virtual void release_event(Event event) = 0;
  /// Blocks the host until the stream's work is done.
  virtual void synchronize(Stream stream) = 0;

  /// Page-locked host memory (cudaHostAlloc on CUDA, plain aligned memory on
  /// the host backend) for offloaded optimizer state and staging: the device
  /// copies to and from it asynchronously. Throws zero::OutOfMemory.
  virtual void* allocate_host(std::size_t bytes) = 0;
  virtual void deallocate_host(void* pointer, std::size_t bytes) = 0;
  /// Blocks the host until `event` has completed (host backend: returns).
  virtual void wait_event(Event event) = 0;

  virtual void fill_zero(void* data, std::size_t bytes, Stream stream) = 0;
  /// Stream-ordered copy; either side may also be allocate_host() memory
  /// (device <-> pinned host, the direction inferred from the pointers).
  virtual void copy(void* dst, const void* src, std::size_t bytes, Stream stream) = 0;
  /// Host <-> backend memory (checkpoints, tests, user I/O); synchronous.
  virtual void copy_to_host(void* host_dst, const void* src, std::size_t bytes) = 0;
  virtual void copy_from_host(void* dst, const void* host_src, std::size_t bytes) = 0;

  virtual void convert(const void* src, DType src_dtype, void* dst, DType dst_dtype,
                       std::size_t count, Stream stream) = 0;
  virtual void accumulate(void* dst, const void* src, DType dtype, std::size_t count,
                          Stream stream) = 0;
  /// ema = decay*ema + (1-decay)*weights, fp32, count elements.
  virtual void ema_update(float* ema, const float* weights, std::size_t count, double decay, Stream stream) = 0;
  virtual void optimizer_step(const OptimizerOptions& options, const StepScalars& scalars,
                              const ShardUpdate& update, Stream stream) = 0;
  /// Sum of squares and a non-finite flag of several spans, read back to the
  /// host (synchronizes `stream`, not the device). Each span is summed the way
  /// cpu_grad_stats does, and spans are added in order.
  struct Span {
    const void* data;
    std::size_t count;
  };
  virtual GradStats grad_stats(const Span* spans, std::size_t span_count, DType dtype,
                               Stream stream) = 0;
  /// Statistics queued now and read later: queue_grad_stats sums one span
  /// (grad_stats' way, possibly in another grouping: the last bits may
  /// differ) into result slot `slot`, after the work
  /// queued on `stream`, without waiting for it; read_grad_stats waits for
  /// `stream` and returns slots [0, count). The engine queues each bucket's
  /// reduced gradient before it goes down to the host
  /// (offload.gradient_stats_on_device), on one stream. This implementation
  /// sums at once: for memory the calling thread reads.
  virtual void queue_grad_stats(const Span& span, DType dtype, std::size_t slot, Stream stream) {
    if (queued_stats_.size() <= slot) queued_stats_.resize(slot + 1);
    queued_stats_[slot] = grad_stats(&span, 1, dtype, stream);
  }
  virtual void read_grad_stats(GradStats* out, std::size_t count, Stream /*stream*/) {
    ZERO_CHECK(count <= queued_stats_.size(), "read_grad_stats: ", count, " slots read, ", queued_stats_.size(),
               " queued");
    std::copy_n(queued_stats_.begin(), count, out);
  }

  // Host kernels: work on allocate_host() memory (offloaded master, state,
  // EMA, staging), run by the calling CPU thread. Every backend computes
  // them with the CPU kernels; a backend that only counts bytes (the
  // planner's) makes them no-ops, since its host "memory" is not real.
  virtual void host_fill_zero(void* data, std::size_t bytes) { std::memset(data, 0, bytes); }
  virtual void host_copy(void* dst, const void* src, std::size_t bytes) { std::memcpy(dst, src, bytes); }
  virtual GradStats host_grad_stats(const void* data, std::size_t count, DType dtype) {
    return cpu_grad_stats(data, count, dtype);
  }
  virtual void host_optimizer_step(const OptimizerOptions& options, const StepScalars& scalars,
                                   const ShardUpdate& update) {
    cpu_optimizer_step(options, scalars, update, CpuKernel::vectorized);
  }
  /// dst += src (the device's accumulate, on host memory).
  virtual void host_accumulate(void* dst, const void* src, DType dtype, std::size_t count) {
    cpu_accumulate(dst, src, dtype, count);
  }
  virtual void host_ema_update(float* ema, const float* weights, std::size_t count, double decay) {
    cpu_ema_update(ema, weights, count, decay);
  }
  virtual void host_convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, std::size_t count) {
    cpu_convert(src, src_dtype, dst, dst_dtype, count);
  }

 private:
  std::vector<GradStats> queued_stats_;  // the default queue_grad_stats' slots
};

/// CPU memory, CPU kernels (vectorized and multi-threaded, or the plain
/// reference loop when `kernel` says so).
std::unique_ptr<Backend> make_host_backend(CpuKernel kernel = CpuKernel::vectorized);

}  // namespace zero
