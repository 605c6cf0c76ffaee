// A Backend that only counts: allocations get distinct fake addresses that
// are never dereferenced, kernels and copies do nothing, and the bytes held
// (device and host) are tracked with their peaks. The planner runs the real
// engine on it (with a SimulatedCommunicator), so what it predicts is what
// the engine allocates, by construction.
#pragma once

#include <cstdint>
#include <memory>

#include "zero/engine/backend.hpp"

namespace zero {

class CountingBackend final : public Backend {
 public:
  MemoryKind memory_kind() const override { return MemoryKind::device; }
  std::string name() const override { return "counting"; }
  int device_index() const override { return 0; }

  void* allocate(std::size_t bytes) override;
  void deallocate(void* pointer, std::size_t bytes) override;
  void* allocate_host(std::size_t bytes) override;
  void deallocate_host(void* pointer, std::size_t bytes) override;

  Stream compute_stream() const override { return nullptr; }
  Stream comm_stream() const override { return nullptr; }
  Event record_event(Stream) override { return nullptr; }
  void stream_wait(Stream, Event) override {}
  void release_event(Event) override {}
  void synchronize(Stream) override { ++synchronizations_; }
  void wait_event(Event) override {}

  void fill_zero(void*, std::size_t, Stream) override {}
  void copy(void*, const void*, std::size_t, Stream) override {}
  void copy_to_host(void*, const void*, std::size_t) override;
  void copy_from_host(void*, const void*, std::size_t) override {}
  void convert(const void*, DType, void*, DType, std::size_t, Stream) override {}
  void accumulate(void*, const void*, DType, std::size_t, Stream) override {}
  void ema_update(float*, const float*, std::size_t, double, Stream) override {}
  void optimizer_step(const OptimizerOptions&, const StepScalars&, const ShardUpdate&, Stream) override {}
  /// Finite zeros: every step applies.
  GradStats grad_stats(const Span*, std::size_t, DType, Stream) override { return {}; }

  void host_fill_zero(void*, std::size_t) override {}
  void host_copy(void*, const void*, std::size_t) override {}
  GradStats host_grad_stats(const void*, std::size_t, DType) override { return {}; }
  void host_optimizer_step(const OptimizerOptions&, const StepScalars&, const ShardUpdate&) override {}
  void host_accumulate(void*, const void*, DType, std::size_t) override {}
  void host_ema_update(float*, const float*, std::size_t, double) override {}
  void host_convert(const void*, DType, void*, DType, std::size_t) override {}

  std::size_t device_bytes() const { return device_; }
  std::size_t device_peak() const { return device_peak_; }
  std::size_t host_bytes() const { return host_; }
  /// Calls so far: device allocations and frees (each a cudaMalloc or a
  /// cudaFree, which waits for the device), and host waits for a stream.
  std::size_t allocations() const { return allocations_; }
  std::size_t deallocations() const { return deallocations_; }
  std::size_t synchronizations() const { return synchronizations_; }

 private:
  void* next_address(std::size_t bytes);
  std::uintptr_t next_ = std::uintptr_t{1} << 44;  // far from any real mapping
  std::size_t device_ = 0, device_peak_ = 0, host_ = 0;
  std::size_t allocations_ = 0, deallocations_ = 0, synchronizations_ = 0;
};

}  // namespace zero
