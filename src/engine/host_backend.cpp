// HostBackend: the engine on CPU memory, with the CPU kernels.
#include <cstdlib>
#include <cstring>

#include "zero/core/layout.hpp"
#include "zero/engine/backend.hpp"
#include "zero/engine/memory_model.hpp"

namespace zero {

namespace {

class HostBackend final : public Backend {
 public:
  explicit HostBackend(CpuKernel kernel) : kernel_(kernel) {}

  MemoryKind memory_kind() const override { return MemoryKind::host; }
  std::string name() const override {
    return kernel_ == CpuKernel::reference ? "host (reference kernels)" : "host";
  }

  void* allocate(std::size_t bytes) override {
    if (bytes == 0) return nullptr;
    void* pointer = std::aligned_alloc(kAlignment, round_up(bytes, kAlignment));
    if (!pointer) ZERO_THROW(OutOfMemory, "host allocation of ", format_bytes(bytes), " failed");
    return pointer;
  }
  void deallocate(void* pointer, std::size_t) override { std::free(pointer); }
  void* allocate_host(std::size_t bytes) override { return allocate(bytes); }
  void deallocate_host(void* pointer, std::size_t bytes) override { deallocate(pointer, bytes); }
  void wait_event(Event) override {}

  Stream compute_stream() const override { return nullptr; }
  Stream comm_stream() const override { return nullptr; }
  Event record_event(Stream) override { return nullptr; }
  void stream_wait(Stream, Event) override {}
  void release_event(Event) override {}
  void synchronize(Stream) override {}

  void fill_zero(void* data, std::size_t bytes, Stream) override {
    if (bytes) std::memset(data, 0, bytes);
  }
  void copy(void* dst, const void* src, std::size_t bytes, Stream) override {
    if (bytes && dst != src) std::memmove(dst, src, bytes);
  }
  void copy_to_host(void* host_dst, const void* src, std::size_t bytes) override {
    if (bytes) std::memcpy(host_dst, src, bytes);
  }
  void copy_from_host(void* dst, const void* host_src, std::size_t bytes) override {
    if (bytes) std::memcpy(dst, host_src, bytes);
  }
  void convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, std::size_t count,
               Stream) override {
    cpu_convert(src, src_dtype, dst, dst_dtype, count);
  }
  void accumulate(void* dst, const void* src, DType dtype, std::size_t count, Stream) override {
    cpu_accumulate(dst, src, dtype, count);
  }
  void ema_update(float* ema, const float* weights, std::size_t count, double decay, Stream) override {
    cpu_ema_update(ema, weights, count, decay);
  }
  void optimizer_step(const OptimizerOptions& options, const StepScalars& scalars,
                      const ShardUpdate& update, Stream) override {
    cpu_optimizer_step(options, scalars, update, kernel_);
  }
  GradStats grad_stats(const Span* spans, std::size_t span_count, DType dtype, Stream) override {
    GradStats total;
    for (std::size_t i = 0; i < span_count; ++i) {
      const GradStats part = cpu_grad_stats(spans[i].data, spans[i].count, dtype, kernel_);
      total.sum_squares += part.sum_squares;
      total.nonfinite = total.nonfinite || part.nonfinite;
    }
    return total;
  }

 private:
  static constexpr std::size_t kAlignment = 256;
  CpuKernel kernel_;
};

}  // namespace

std::unique_ptr<Backend> make_host_backend(CpuKernel kernel) {
  return std::make_unique<HostBackend>(kernel);
}

}  // namespace zero
