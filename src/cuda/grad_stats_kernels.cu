// Gradient statistics on the GPU: the sum of squares (in double) and a
// non-finite flag of several spans in one launch, summed per block in a fixed
// order and then across blocks by the last block to finish (no atomics on the
// sums: the same bits at every launch), read back through pinned memory.
#include "elementwise.cuh"

namespace zero::gpu {
namespace {

using namespace detail;

// ---------------------------------------------------------------- grad stats

struct SpanEntry {
  const void* data;
  std::size_t count;
  std::size_t head;  // kNoVector: scalar only
};

struct StatsResult {
  double sum_squares;
  unsigned int nonfinite;
  unsigned int blocks_done;
};

constexpr int kStatsThreads = 256;

template <typename T>
__device__ __forceinline__ double chunk_squares(const float (&x)[kChunk], unsigned int& nonfinite) {
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < kChunk; ++j) sum += x[j] * x[j];
  if (isfinite(sum)) return static_cast<double>(sum);
  // Either a non-finite element or fp32 overflow of finite squares (|x| > ~1.8e19).
  double exact = 0.0;
#pragma unroll
  for (int j = 0; j < kChunk; ++j) {
    if (!isfinite(x[j])) nonfinite = 1u;
    exact += static_cast<double>(x[j]) * static_cast<double>(x[j]);
  }
  return exact;
}

// One block's share of span blockIdx.y (partials indexed by the whole grid),
// and the grid's total into *result by the last block to finish.
template <typename T>
__device__ __forceinline__ void stats_of_span(const SpanEntry span, double* partials, StatsResult* result) {
  const T* data = static_cast<const T*>(span.data);
  const std::size_t thread = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  double acc = 0.0;
  unsigned int nonfinite = 0u;
  auto one = [&](std::size_t i) {
    const float x = to_float(data[i]);
    if (!isfinite(x)) nonfinite = 1u;
    else acc += static_cast<double>(x) * static_cast<double>(x);
  };
  if (span.head == kNoVector) {
    for (std::size_t i = thread; i < span.count; i += stride) one(i);
  } else {
    const std::size_t chunks = (span.count - span.head) / kChunk;
    for (std::size_t c = thread; c < chunks; c += stride) {
      float x[kChunk];
      load8(data + span.head + c * kChunk, x);
      acc += chunk_squares<T>(x, nonfinite);
    }
    const std::size_t tail_start = span.head + chunks * kChunk;
    if (thread < span.head) one(thread);
    if (thread < span.count - tail_start) one(tail_start + thread);
  }

  // Block reduction in fp64: warp shuffles, then one value per warp.
  __shared__ double warp_sums[kStatsThreads / 32];
  __shared__ bool is_last;
  for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_down_sync(0xffffffffu, acc, offset);
  const bool any_nonfinite = __syncthreads_or(nonfinite != 0u);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = acc;
  __syncthreads();
  const unsigned int total_blocks = gridDim.x * gridDim.y;
  if (threadIdx.x == 0) {
    double block_sum = 0.0;
    for (int w = 0; w < kStatsThreads / 32; ++w) block_sum += warp_sums[w];
    partials[static_cast<std::size_t>(blockIdx.y) * gridDim.x + blockIdx.x] = block_sum;
    if (any_nonfinite) atomicOr(&result->nonfinite, 1u);
    // Publish the partial before counting this block as done, so that the
    // last block sees every partial.
    __threadfence();
    is_last = atomicAdd(&result->blocks_done, 1u) == total_blocks - 1;
  }
  __syncthreads();
  if (!is_last) return;

  // The last block adds the partials in a fixed order: each thread a strided
  // subset in index order, then a fixed tree. Same grid, same bits.
  __threadfence();
  const std::size_t partial_count = static_cast<std::size_t>(total_blocks);
  double sum = 0.0;
  for (std::size_t p = threadIdx.x; p < partial_count; p += blockDim.x)
    sum += static_cast<volatile double*>(partials)[p];
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_down_sync(0xffffffffu, sum, offset);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0.0;
    for (int w = 0; w < kStatsThreads / 32; ++w) total += warp_sums[w];
    result->sum_squares += total;  // += : launches for more than 65,535 spans add up
    result->blocks_done = 0u;      // ready for the next launch on this scratch
  }
}

template <typename T>
__global__ void __launch_bounds__(kStatsThreads) grad_stats_kernel(const SpanEntry* spans, double* partials,
                                                                  StatsResult* result) {
  stats_of_span<T>(spans[blockIdx.y], partials, result);
}

// One span, passed by value (no table to upload: queue() launches without a
// host wait).
template <typename T>
__global__ void __launch_bounds__(kStatsThreads) grad_stats_span_kernel(SpanEntry span, double* partials,
                                                                       StatsResult* result) {
  stats_of_span<T>(span, partials, result);
}
}  // namespace

// ---------------------------------------------------------------- GradStatsReducer

GradStatsReducer::GradStatsReducer() = default;

GradStatsReducer::~GradStatsReducer() {
  // Destructors must not throw; a failure here only leaks.
  if (device_scratch_ != nullptr) (void)cudaFree(device_scratch_);
  if (host_pinned_ != nullptr) (void)cudaFreeHost(host_pinned_);
  if (slot_scratch_ != nullptr) (void)cudaFree(slot_scratch_);
  if (slot_host_ != nullptr) (void)cudaFreeHost(slot_host_);
}

namespace {
constexpr std::size_t align_up(std::size_t value, std::size_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}
// Device scratch layout: [StatsResult][SpanEntry x spans][double x partials].
std::size_t table_offset() { return align_up(sizeof(StatsResult), 256); }
std::size_t partials_offset(std::size_t spans) {
  return align_up(table_offset() + spans * sizeof(SpanEntry), 256);
}
// Pinned host layout: [StatsResult][SpanEntry x spans], so that reading the
// result back never races with the upload of the table.
std::size_t host_table_offset() { return align_up(sizeof(StatsResult), 64); }
}  // namespace

void GradStatsReducer::reserve(std::size_t partial_count, std::size_t span_count) {
  if (partial_count <= partial_capacity_ && span_count <= span_capacity_) return;
  const std::size_t spans = std::max(span_count, span_capacity_);
  const std::size_t partials = std::max(partial_count, partial_capacity_);
  const std::size_t bytes = partials_offset(spans) + partials * sizeof(double);
  void* fresh = nullptr;
  ZERO_CHECK_CUDA(cudaMalloc(&fresh, bytes));
  // blocks_done must start at zero; the kernel resets it after each launch.
  ZERO_CHECK_CUDA(cudaMemset(fresh, 0, sizeof(StatsResult)));
  if (device_scratch_ != nullptr) ZERO_CHECK_CUDA(cudaFree(device_scratch_));
  device_scratch_ = fresh;
  scratch_bytes_ = bytes;
  span_capacity_ = spans;
  partial_capacity_ = partials;
  const std::size_t host_bytes = host_table_offset() + spans * sizeof(SpanEntry);
  if (host_bytes > host_pinned_bytes_) {
    if (host_pinned_ != nullptr) ZERO_CHECK_CUDA(cudaFreeHost(host_pinned_));
    host_pinned_ = nullptr;
    ZERO_CHECK_CUDA(cudaHostAlloc(&host_pinned_, host_bytes, cudaHostAllocDefault));
    host_pinned_bytes_ = host_bytes;
  }
}

namespace {
// Blocks of the grid: about 8 per SM in all.
std::size_t block_budget() { return static_cast<std::size_t>(sm_count()) * 8; }
// Blocks per span for `spans` spans of at most max_count elements: enough
// for the largest, within the budget shared by the spans.
std::size_t blocks_per_span(std::size_t max_count, std::size_t spans) {
  const std::size_t wanted = (max_count + kStatsThreads * kChunk - 1) / (kStatsThreads * kChunk);
  const std::size_t budget = std::max<std::size_t>(1, block_budget() / spans);
  return std::max<std::size_t>(1, std::min(wanted, budget));
}
// Slot scratch layout: [double x partials][StatsResult x slots]; one span a
// launch, so at most block_budget() partials.
std::size_t slot_partials() { return block_budget(); }
std::size_t slots_offset() { return align_up(slot_partials() * sizeof(double), 256); }
}  // namespace

void GradStatsReducer::reserve_slots(std::size_t count) {
  if (count <= slot_capacity_) return;
  const std::size_t capacity = std::max<std::size_t>({count, 2 * slot_capacity_, 64});
  void* fresh = nullptr;
  ZERO_CHECK_CUDA(cudaMalloc(&fresh, slots_offset() + capacity * sizeof(StatsResult)));
  auto* fresh_slots = reinterpret_cast<StatsResult*>(static_cast<unsigned char*>(fresh) + slots_offset());
  // blocks_done must start at zero; the kernel resets it after each launch.
  ZERO_CHECK_CUDA(cudaMemset(fresh_slots, 0, capacity * sizeof(StatsResult)));
  if (slot_scratch_ != nullptr) {
    // Queued launches may still write the old slots: keep what they wrote.
    ZERO_CHECK_CUDA(cudaDeviceSynchronize());
    ZERO_CHECK_CUDA(cudaMemcpy(fresh_slots, static_cast<unsigned char*>(slot_scratch_) + slots_offset(),
                               slot_capacity_ * sizeof(StatsResult), cudaMemcpyDeviceToDevice));
    ZERO_CHECK_CUDA(cudaFree(slot_scratch_));
  }
  slot_scratch_ = fresh;
  void* host = nullptr;
  ZERO_CHECK_CUDA(cudaHostAlloc(&host, capacity * sizeof(StatsResult), cudaHostAllocDefault));
  if (slot_host_ != nullptr) ZERO_CHECK_CUDA(cudaFreeHost(slot_host_));
  slot_host_ = host;
  slot_capacity_ = capacity;
}

void GradStatsReducer::queue(const Backend::Span& span, DType dtype, std::size_t slot, Stream stream) {
  check_dtype(dtype, "grad_stats: dtype");
  ZERO_CHECK(span.count == 0 || span.data != nullptr, "grad_stats: a span of ", span.count,
             " elements has no data");
  reserve_slots(slot + 1);
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  auto* bytes = static_cast<unsigned char*>(slot_scratch_);
  auto* partials = reinterpret_cast<double*>(bytes);
  auto* result = reinterpret_cast<StatsResult*>(bytes + slots_offset()) + slot;
  ZERO_CHECK_CUDA(cudaMemsetAsync(result, 0, offsetof(StatsResult, blocks_done), cuda_stream));
  if (span.count == 0) return;
  with_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    const SpanEntry entry{span.data, span.count, vector_head({{span.data, sizeof(T)}}, span.count)};
    grad_stats_span_kernel<T><<<static_cast<unsigned>(blocks_per_span(span.count, 1)), kStatsThreads, 0, cuda_stream>>>(
        entry, partials, result);
    ZERO_CHECK_LAUNCH();
  });
}

void GradStatsReducer::read_slots(GradStats* out, std::size_t count, Stream stream) {
  if (count == 0) return;
  ZERO_CHECK(count <= slot_capacity_, "grad_stats: ", count, " slots read, ", slot_capacity_, " queued at most");
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  ZERO_CHECK_CUDA(cudaMemcpyAsync(slot_host_, static_cast<unsigned char*>(slot_scratch_) + slots_offset(),
                                  count * sizeof(StatsResult), cudaMemcpyDeviceToHost, cuda_stream));
  ZERO_CHECK_CUDA(cudaStreamSynchronize(cuda_stream));
  const auto* results = static_cast<const StatsResult*>(slot_host_);
  for (std::size_t i = 0; i < count; ++i) {
    out[i].sum_squares = results[i].sum_squares;
    out[i].nonfinite = results[i].nonfinite != 0u;
  }
}

GradStats GradStatsReducer::run(const Backend::Span* spans, std::size_t span_count, DType dtype,
                                Stream stream) {
  check_dtype(dtype, "grad_stats: dtype");
  GradStats stats;
  std::size_t max_count = 0;
  for (std::size_t s = 0; s < span_count; ++s) {
    ZERO_CHECK(spans[s].count == 0 || spans[s].data != nullptr, "grad_stats: span ", s,
               " has ", spans[s].count, " elements but no data");
    max_count = std::max(max_count, spans[s].count);
  }
  if (span_count == 0 || max_count == 0) return stats;
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  constexpr std::size_t kMaxSpansPerLaunch = 65535;  // gridDim.y limit
  const std::size_t batch = std::min(span_count, kMaxSpansPerLaunch);
  const std::size_t blocks_x = blocks_per_span(max_count, batch);
  reserve(blocks_x * batch, batch);

  auto* bytes = static_cast<unsigned char*>(device_scratch_);
  auto* result = reinterpret_cast<StatsResult*>(bytes);
  auto* table = reinterpret_cast<SpanEntry*>(bytes + table_offset());
  auto* partials = reinterpret_cast<double*>(bytes + partials_offset(span_capacity_));
  auto* host_result = static_cast<StatsResult*>(host_pinned_);
  auto* host_table =
      reinterpret_cast<SpanEntry*>(static_cast<unsigned char*>(host_pinned_) + host_table_offset());
  // Zero the sum and flag, not blocks_done (kept at zero by the kernel).
  ZERO_CHECK_CUDA(cudaMemsetAsync(result, 0, offsetof(StatsResult, blocks_done), cuda_stream));

  with_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    for (std::size_t first = 0; first < span_count; first += batch) {
      const std::size_t n = std::min(batch, span_count - first);
      if (first > 0) {
        // The pinned table is reused: the previous launch's upload must be done.
        ZERO_CHECK_CUDA(cudaStreamSynchronize(cuda_stream));
      }
      for (std::size_t s = 0; s < n; ++s) {
        const Backend::Span& span = spans[first + s];
        host_table[s] = {span.data, span.count,
                         vector_head({{span.data, sizeof(T)}}, span.count)};
      }
      ZERO_CHECK_CUDA(cudaMemcpyAsync(table, host_table, n * sizeof(SpanEntry),
                                      cudaMemcpyHostToDevice, cuda_stream));
      const dim3 grid(static_cast<unsigned>(blocks_x), static_cast<unsigned>(n));
      grad_stats_kernel<T><<<grid, kStatsThreads, 0, cuda_stream>>>(table, partials, result);
      ZERO_CHECK_LAUNCH();
    }
  });
  ZERO_CHECK_CUDA(cudaMemcpyAsync(host_result, result, sizeof(StatsResult), cudaMemcpyDeviceToHost,
                                  cuda_stream));
  ZERO_CHECK_CUDA(cudaStreamSynchronize(cuda_stream));
  stats.sum_squares = host_result->sum_squares;
  stats.nonfinite = host_result->nonfinite != 0u;
  return stats;
}

}  // namespace zero::gpu
