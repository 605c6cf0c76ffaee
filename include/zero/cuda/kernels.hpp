// The CUDA kernels behind CudaBackend, callable on their own (benches, tests,
// users with their own buffers). Every function enqueues work on `stream`
// (a cudaStream_t; null = the legacy default stream), checks the launch, and
// returns without synchronizing. Pointers are device pointers on the current
// device, each aligned at least to its element size; 16-byte vector accesses
// are used wherever the buffers' relative alignment allows, scalar ones
// elsewhere, so any offset into a buffer works.
#pragma once

#include <cstddef>
#include <cstdint>

#include "zero/comm/communicator.hpp"
#include "zero/engine/backend.hpp"
#include "zero/optim/optimizer.hpp"

namespace zero::gpu {

/// Launch shape of the element-wise kernels: `threads` per block, and a grid of
/// min(blocks the data needs, SM count * blocks per SM) whose threads stride
/// over the rest. Blocks per SM: max_blocks_per_sm when > 0; 0 = no cap (one
/// 8-element chunk per thread, as many waves as that takes); -1 = as many as
/// are resident at once (the occupancy calculator's answer for the kernel).
///
/// The default is measured, not derived: on an H200 (2^30-parameter AdamW,
/// bench/results/gpu-kernels.md) a grid sized to the data ran at 95-96% of the
/// device-to-device copy bandwidth, while every grid-stride shape that kept
/// all resident threads looping (one full wave, or a few) stalled at ~81%;
/// grid-stride at half occupancy reached ~94%.
struct LaunchTuning {
  int threads = 512;
  int max_blocks_per_sm = 0;
  void validate() const;
};

/// One fused optimizer step over the span (AdamW, SGD or Lion per options.kind),
/// reading the gradient in its dtype and, when update.model_copy is set,
/// writing the updated parameters rounded to update.model_dtype in the same
/// pass. The math is adamw_element / sgd_element / lion_element.
void optimizer_step(const OptimizerOptions& options, const StepScalars& scalars,
                    const ShardUpdate& update, Stream stream);
void optimizer_step(const OptimizerOptions& options, const StepScalars& scalars,
                    const ShardUpdate& update, const LaunchTuning& tuning, Stream stream);

/// dst[i] = src[i] converted (round to nearest even); src and dst must not overlap
/// unless they are the same buffer with the same dtype.
void convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, std::size_t count,
             Stream stream);

/// dst[i] = round(dst[i] + src[i]), added in fp32.
void accumulate(void* dst, const void* src, DType dtype, std::size_t count, Stream stream);

/// ema = decay*ema + (1-decay)*weights (fp32), as ema_element().
void ema_update(float* ema, const float* weights, std::size_t count, double decay, Stream stream);

/// Fills with uniform values in [low, high) from a counter-based hash of
/// (seed, index): the same seed gives the same data on any launch shape.
void fill_uniform(void* data, std::size_t count, DType dtype, std::uint64_t seed, float low,
                  float high, Stream stream);
/// Fills with one value (NaN works: tests poison outputs with it).
void fill_value(void* data, std::size_t count, DType dtype, float value, Stream stream);

/// Sum of squares and non-finite flag of several spans in one kernel launch
/// (one per 65,535 spans). Each thread squares and adds 8 elements at a time in
/// fp32 and accumulates those partial sums in fp64; blocks reduce in fp64; the
/// last block to finish adds the block sums in a fixed order, so the result is
/// the same on every run. Chunks whose fp32 sum overflows while all their
/// elements are finite are redone in fp64, so a large finite gradient is never
/// reported as non-finite. Owns its device scratch and a pinned result slot;
/// one instance per device, not thread-safe.
class GradStatsReducer {
 public:
  GradStatsReducer();
  ~GradStatsReducer();
  GradStatsReducer(const GradStatsReducer&) = delete;
  GradStatsReducer& operator=(const GradStatsReducer&) = delete;

  /// Enqueues the reduction on stream and waits for that stream (only).
  GradStats run(const Backend::Span* spans, std::size_t span_count, DType dtype, Stream stream);

  /// Enqueues the statistics of one span (run()'s kernel on a grid of its
  /// own, so the last bits may differ from run()'s) into result slot `slot`
  /// on stream, without waiting: a caller queues each
  /// piece as it is ready and reads them all with read_slots(). Queue on
  /// one stream only (the slots share their block partials); slots grow as
  /// needed (growing waits for the device once).
  void queue(const Backend::Span& span, DType dtype, std::size_t slot, Stream stream);
  /// Waits for stream and writes slots [0, count) to out.
  void read_slots(GradStats* out, std::size_t count, Stream stream);

  std::size_t scratch_bytes() const { return scratch_bytes_; }

 private:
  void reserve(std::size_t partial_count, std::size_t span_count);
  void reserve_slots(std::size_t count);

  void* device_scratch_ = nullptr;  // result slot, then the span table, then block partials
  std::size_t scratch_bytes_ = 0;
  std::size_t partial_capacity_ = 0;
  std::size_t span_capacity_ = 0;
  void* host_pinned_ = nullptr;     // span table staging, then the result read back
  std::size_t host_pinned_bytes_ = 0;
  // queue()'s: its own block partials (apart from run()'s, which may run on
  // another stream meanwhile), then the result slots; their pinned copy.
  void* slot_scratch_ = nullptr;
  std::size_t slot_capacity_ = 0;
  void* slot_host_ = nullptr;
};

/// Multiprocessor count of the current device (cached per device).
int sm_count();

}  // namespace zero::gpu
