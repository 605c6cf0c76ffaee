// Fused optimizer steps, grad statistics, dtype conversion and gradient
// accumulation on the GPU. All of these are memory-bound streams over a shard,
// so they share one launch scheme (elementwise_kernel below):
//
// - each thread handles 8 consecutive elements per iteration, loaded and
//   stored with 16-byte accesses (two float4 for fp32, one uint4 for 16-bit),
//   every load of the chunk issued before the first use;
// - a grid sized to the data (one chunk per thread by default; LaunchTuning
//   can cap it at SM count * blocks per SM, and the threads then stride over
//   the remaining chunks);
// - the few elements before the first 16-byte boundary (the "head") and after
//   the last full chunk (the "tail") are done one at a time by the first
//   threads; when the buffers' relative alignment makes a common boundary
//   impossible the whole span runs one element at a time.
//
// The optimizer math is adamw_element / sgd_element / lion_element from
// optimizer.hpp, the same definition the CPU kernels evaluate.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <limits>
#include <type_traits>

#include "zero/cuda/check.hpp"
#include "zero/cuda/elements.cuh"
#include "zero/cuda/kernels.hpp"

namespace zero::gpu {
namespace {

constexpr int kChunk = 8;           // elements per thread per iteration
constexpr int kMaxThreads = 1024;
constexpr std::size_t kNoVector = std::numeric_limits<std::size_t>::max();

// ---------------------------------------------------------------- element access

struct NoCopy {};  // "no model copy" in the optimizer kernels' template

using zero::cuda::from_float;
using zero::cuda::to_float;

// 16-bit pairs packed in a 32-bit word, low element first (little endian).
template <typename T>
__device__ __forceinline__ float2 unpack2(std::uint32_t word) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    // bf16 -> fp32 is a shift: exact and cheaper than the intrinsic pair.
    return make_float2(__uint_as_float(word << 16), __uint_as_float(word & 0xffff0000u));
  } else {
    __half2 pair = *reinterpret_cast<__half2*>(&word);
    return __half22float2(pair);
  }
}

template <typename T>
__device__ __forceinline__ std::uint32_t pack2(float low, float high) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
    return *reinterpret_cast<std::uint32_t*>(&pair);
  } else {
    __half2 pair = __floats2half2_rn(low, high);
    return *reinterpret_cast<std::uint32_t*>(&pair);
  }
}

/// Loads 8 elements starting at a 16-byte-aligned address.
template <typename T>
__device__ __forceinline__ void load8(const T* source, float (&out)[kChunk]) {
  if constexpr (std::is_same_v<T, float>) {
    const float4 a = reinterpret_cast<const float4*>(source)[0];
    const float4 b = reinterpret_cast<const float4*>(source)[1];
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
    out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
  } else {
    const uint4 words = *reinterpret_cast<const uint4*>(source);
    const float2 p0 = unpack2<T>(words.x), p1 = unpack2<T>(words.y);
    const float2 p2 = unpack2<T>(words.z), p3 = unpack2<T>(words.w);
    out[0] = p0.x; out[1] = p0.y; out[2] = p1.x; out[3] = p1.y;
    out[4] = p2.x; out[5] = p2.y; out[6] = p3.x; out[7] = p3.y;
  }
}

/// Stores 8 elements (rounded to T) at a 16-byte-aligned address.
template <typename T>
__device__ __forceinline__ void store8(T* target, const float (&in)[kChunk]) {
  if constexpr (std::is_same_v<T, float>) {
    reinterpret_cast<float4*>(target)[0] = make_float4(in[0], in[1], in[2], in[3]);
    reinterpret_cast<float4*>(target)[1] = make_float4(in[4], in[5], in[6], in[7]);
  } else {
    uint4 words;
    words.x = pack2<T>(in[0], in[1]);
    words.y = pack2<T>(in[2], in[3]);
    words.z = pack2<T>(in[4], in[5]);
    words.w = pack2<T>(in[6], in[7]);
    *reinterpret_cast<uint4*>(target) = words;
  }
}

// ---------------------------------------------------------------- launch scheme

/// Op provides chunk(i) for the 8 elements at i (16-byte aligned in every
/// buffer) and element(i) for one element.
template <typename Op>
__global__ void __launch_bounds__(kMaxThreads) elementwise_kernel(Op op, std::size_t count,
                                                                  std::size_t head) {
  const std::size_t thread = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  if (head == kNoVector) {
    for (std::size_t i = thread; i < count; i += stride) op.element(i);
    return;
  }
  const std::size_t chunks = (count - head) / kChunk;
  for (std::size_t c = thread; c < chunks; c += stride) op.chunk(head + c * kChunk);
  const std::size_t tail_start = head + chunks * kChunk;
  if (thread < head) op.element(thread);
  if (thread < count - tail_start) op.element(tail_start + thread);
}

/// A buffer taking part in a launch: its address and element size.
struct BufferRef {
  const void* pointer;
  std::size_t element_size;
};

/// The number of leading elements to do one at a time so that every buffer
/// reaches a 16-byte boundary at the same index, or kNoVector when their
/// relative alignment makes that impossible. A chunk of 8 elements is two
/// 16-byte words for fp32 and one for 16-bit types.
std::size_t vector_head(std::initializer_list<BufferRef> buffers, std::size_t count) {
  std::size_t head16 = kNoVector, head32 = kNoVector;
  for (const BufferRef& b : buffers) {
    if (b.pointer == nullptr) continue;
    const auto address = reinterpret_cast<std::uintptr_t>(b.pointer);
    ZERO_CHECK(address % b.element_size == 0, "device buffer ", b.pointer,
               " is not aligned to its element size ", b.element_size);
    const std::size_t lanes = 16 / b.element_size;  // elements per 16 bytes
    const std::size_t phase = (address % 16) / b.element_size;
    const std::size_t head = (lanes - phase) % lanes;
    std::size_t& slot = b.element_size == 4 ? head32 : head16;
    if (slot == kNoVector) slot = head;
    else if (slot != head) return kNoVector;
  }
  std::size_t head = 0;
  if (head16 != kNoVector) {
    if (head32 != kNoVector && head16 % 4 != head32) return kNoVector;
    head = head16;
  } else if (head32 != kNoVector) {
    head = head32;
  }
  return std::min(head, count);
}

std::atomic<int> g_sm_counts[64];

/// Blocks of `threads` threads of `kernel` resident on one SM at once (at
/// least 1), cached per kernel and block size: the occupancy query costs more
/// than a launch.
template <typename Kernel>
int resident_blocks_per_sm(Kernel* kernel, int threads) {
  struct Slot {
    std::atomic<int> threads{0};
    std::atomic<int> blocks{0};
  };
  static Slot cache;  // one per kernel instantiation: the usual block size hits
  if (cache.threads.load(std::memory_order_acquire) == threads) return cache.blocks.load();
  int blocks = 0;
  ZERO_CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, 0));
  blocks = std::max(blocks, 1);
  cache.blocks.store(blocks);
  cache.threads.store(threads, std::memory_order_release);
  return blocks;
}

template <typename Op>
void launch(const Op& op, std::size_t count, std::size_t head, const LaunchTuning& tuning,
            cudaStream_t stream) {
  if (count == 0) return;
  const std::size_t work = head == kNoVector ? count : (count - head) / kChunk;
  const std::size_t threads = static_cast<std::size_t>(tuning.threads);
  std::size_t blocks = std::max<std::size_t>(1, (work + threads - 1) / threads);
  int per_sm = tuning.max_blocks_per_sm;
  if (per_sm < 0) per_sm = resident_blocks_per_sm(elementwise_kernel<Op>, tuning.threads);
  if (per_sm > 0)
    blocks = std::min(blocks, static_cast<std::size_t>(sm_count()) * static_cast<std::size_t>(per_sm));
  blocks = std::min<std::size_t>(blocks, std::numeric_limits<int>::max());
  elementwise_kernel<Op><<<static_cast<unsigned>(blocks), static_cast<unsigned>(threads), 0,
                           stream>>>(op, count, head);
  ZERO_CHECK_LAUNCH();
}

/// Calls body(T{}) with T the C++ type of dtype.
template <typename Body>
void with_type(DType dtype, Body&& body) {
  switch (dtype) {
    case DType::fp32: body(float{}); return;
    case DType::bf16: body(__nv_bfloat16{}); return;
    case DType::fp16: body(__half{}); return;
  }
  ZERO_THROW(InvalidArgument, "unknown dtype value ", static_cast<int>(dtype));
}

// ---------------------------------------------------------------- optimizers

template <OptimizerKind Kind, typename G, typename M>
struct OptimizerOp {
  float* master;
  const G* grad;
  float* state0;
  float* state1;
  M* copy;
  StepScalars s;

  __device__ __forceinline__ void update(float& p, float& m, float& v, float g) const {
    if constexpr (Kind == OptimizerKind::adamw) {
      adamw_element(p, m, v, g, s);
    } else if constexpr (Kind == OptimizerKind::lion) {
      lion_element(p, m, g, s);
    } else {
      sgd_element(p, state0 != nullptr ? &m : nullptr, g, s);
    }
  }

  __device__ __forceinline__ void chunk(std::size_t i) const {
    float p[kChunk], g[kChunk], m[kChunk] = {}, v[kChunk] = {};
    load8(master + i, p);
    load8(grad + i, g);
    if constexpr (Kind == OptimizerKind::sgd) {
      if (state0 != nullptr) load8(state0 + i, m);
    } else {
      load8(state0 + i, m);
    }
    if constexpr (Kind == OptimizerKind::adamw) load8(state1 + i, v);
#pragma unroll
    for (int j = 0; j < kChunk; ++j) update(p[j], m[j], v[j], g[j]);
    store8(master + i, p);
    if constexpr (Kind == OptimizerKind::sgd) {
      if (state0 != nullptr) store8(state0 + i, m);
    } else {
      store8(state0 + i, m);
    }
    if constexpr (Kind == OptimizerKind::adamw) store8(state1 + i, v);
    if constexpr (!std::is_same_v<M, NoCopy>) store8(copy + i, p);
  }

  __device__ __forceinline__ void element(std::size_t i) const {
    float p = master[i], g = to_float(grad[i]), m = 0.0f, v = 0.0f;
    if (state0 != nullptr) m = state0[i];
    if constexpr (Kind == OptimizerKind::adamw) v = state1[i];
    update(p, m, v, g);
    master[i] = p;
    if (state0 != nullptr) state0[i] = m;
    if constexpr (Kind == OptimizerKind::adamw) state1[i] = v;
    if constexpr (!std::is_same_v<M, NoCopy>) copy[i] = from_float<M>(p);
  }
};

template <OptimizerKind Kind, typename G, typename M>
void launch_optimizer(const StepScalars& scalars, const ShardUpdate& u, const LaunchTuning& tuning,
                      cudaStream_t stream) {
  OptimizerOp<Kind, G, M> op{u.master,
                             static_cast<const G*>(u.grad),
                             u.state0,
                             u.state1,
                             static_cast<M*>(u.model_copy),
                             scalars};
  const std::size_t copy_size = std::is_same_v<M, NoCopy> ? 1 : sizeof(M);
  const std::size_t head =
      vector_head({{u.master, 4}, {u.grad, sizeof(G)}, {u.state0, 4}, {u.state1, 4},
                   {std::is_same_v<M, NoCopy> ? nullptr : u.model_copy, copy_size}},
                  u.count);
  launch(op, u.count, head, tuning, stream);
}

template <OptimizerKind Kind>
void dispatch_optimizer(const StepScalars& scalars, const ShardUpdate& u,
                        const LaunchTuning& tuning, cudaStream_t stream) {
  with_type(u.grad_dtype, [&](auto grad_tag) {
    using G = decltype(grad_tag);
    if (u.model_copy == nullptr) {
      launch_optimizer<Kind, G, NoCopy>(scalars, u, tuning, stream);
    } else {
      with_type(u.model_dtype, [&](auto model_tag) {
        launch_optimizer<Kind, G, decltype(model_tag)>(scalars, u, tuning, stream);
      });
    }
  });
}

// ---------------------------------------------------------------- convert, accumulate, fill

template <typename S, typename D>
struct ConvertOp {
  const S* src;
  D* dst;
  __device__ __forceinline__ void chunk(std::size_t i) const {
    float x[kChunk];
    load8(src + i, x);
    store8(dst + i, x);
  }
  __device__ __forceinline__ void element(std::size_t i) const {
    dst[i] = from_float<D>(to_float(src[i]));
  }
};

template <typename T>
struct AccumulateOp {
  T* dst;
  const T* src;
  __device__ __forceinline__ void chunk(std::size_t i) const {
    float a[kChunk], b[kChunk];
    load8(dst + i, a);
    load8(src + i, b);
#pragma unroll
    for (int j = 0; j < kChunk; ++j) a[j] = a[j] + b[j];
    store8(dst + i, a);
  }
  __device__ __forceinline__ void element(std::size_t i) const {
    dst[i] = from_float<T>(to_float(dst[i]) + to_float(src[i]));
  }
};

struct EmaOp {
  float* ema;
  const float* weights;
  float decay, one_minus_decay;
  __device__ __forceinline__ void chunk(std::size_t i) const {
    float e[kChunk], w[kChunk];
    load8(ema + i, e);
    load8(weights + i, w);
#pragma unroll
    for (int j = 0; j < kChunk; ++j) ema_element(e[j], w[j], decay, one_minus_decay);
    store8(ema + i, e);
  }
  __device__ __forceinline__ void element(std::size_t i) const {
    ema_element(ema[i], weights[i], decay, one_minus_decay);
  }
};

// SplitMix64's finalizer: a well-mixed 64-bit hash of the counter.
__device__ __forceinline__ std::uint64_t mix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

template <typename T>
struct FillOp {
  T* data;
  std::uint64_t seed;
  float low, scale;  // uniform: low + scale * u; constant: scale == 0
  __device__ __forceinline__ float value(std::size_t i) const {
    if (scale == 0.0f) return low;
    const std::uint64_t bits = mix64(seed ^ mix64(i));
    const float u = static_cast<float>(bits >> 40) * (1.0f / 16777216.0f);  // 24 bits in [0, 1)
    return low + scale * u;
  }
  __device__ __forceinline__ void chunk(std::size_t i) const {
    float x[kChunk];
#pragma unroll
    for (int j = 0; j < kChunk; ++j) x[j] = value(i + j);
    store8(data + i, x);
  }
  __device__ __forceinline__ void element(std::size_t i) const { data[i] = from_float<T>(value(i)); }
};

template <typename T>
void launch_fill(void* data, std::size_t count, std::uint64_t seed, float low, float scale,
                 cudaStream_t stream) {
  FillOp<T> op{static_cast<T*>(data), seed, low, scale};
  launch(op, count, vector_head({{data, sizeof(T)}}, count), LaunchTuning{}, stream);
}

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

template <typename T>
__global__ void __launch_bounds__(kStatsThreads) grad_stats_kernel(const SpanEntry* spans,
                                                                  std::size_t span_count,
                                                                  double* partials,
                                                                  StatsResult* result) {
  const SpanEntry span = spans[blockIdx.y];
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
  (void)span_count;
}

}  // namespace

// ---------------------------------------------------------------- public entry points

void LaunchTuning::validate() const {
  ZERO_CHECK(threads >= 32 && threads <= kMaxThreads && threads % 32 == 0,
             "LaunchTuning.threads must be a multiple of 32 in [32, ", kMaxThreads, "], got ",
             threads);
  ZERO_CHECK(max_blocks_per_sm >= -1,
             "LaunchTuning.max_blocks_per_sm must be -1 (resident), 0 (no cap) or positive, got ",
             max_blocks_per_sm);
}

int sm_count() {
  int device = 0;
  ZERO_CHECK_CUDA(cudaGetDevice(&device));
  if (device >= 0 && device < static_cast<int>(std::size(g_sm_counts))) {
    if (int cached = g_sm_counts[device].load(std::memory_order_relaxed); cached > 0) return cached;
  }
  int count = 0;
  ZERO_CHECK_CUDA(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  if (device >= 0 && device < static_cast<int>(std::size(g_sm_counts)))
    g_sm_counts[device].store(count, std::memory_order_relaxed);
  return count;
}

void optimizer_step(const OptimizerOptions& options, const StepScalars& scalars,
                    const ShardUpdate& update, Stream stream) {
  optimizer_step(options, scalars, update, LaunchTuning{}, stream);
}

void optimizer_step(const OptimizerOptions& options, const StepScalars& scalars,
                    const ShardUpdate& u, const LaunchTuning& tuning, Stream stream) {
  tuning.validate();
  check_dtype(u.grad_dtype, "ShardUpdate.grad_dtype");
  if (u.model_copy != nullptr) check_dtype(u.model_dtype, "ShardUpdate.model_dtype");
  if (u.count == 0) return;
  ZERO_CHECK(u.master != nullptr && u.grad != nullptr,
             "optimizer_step: master and grad must be set for ", u.count, " elements");
  const int slots = options.state_slots();
  ZERO_CHECK(slots < 1 || u.state0 != nullptr, "optimizer_step: ", name_of(options.kind),
             " needs state0");
  ZERO_CHECK(slots < 2 || u.state1 != nullptr, "optimizer_step: ", name_of(options.kind),
             " needs state1");
  ShardUpdate update = u;
  // SGD without momentum must not touch a state buffer it was given anyway.
  if (slots < 1) update.state0 = nullptr;
  if (slots < 2) update.state1 = nullptr;
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  switch (options.kind) {
    case OptimizerKind::adamw:
      dispatch_optimizer<OptimizerKind::adamw>(scalars, update, tuning, cuda_stream);
      return;
    case OptimizerKind::sgd:
      dispatch_optimizer<OptimizerKind::sgd>(scalars, update, tuning, cuda_stream);
      return;
    case OptimizerKind::lion:
      dispatch_optimizer<OptimizerKind::lion>(scalars, update, tuning, cuda_stream);
      return;
  }
  ZERO_THROW(InvalidArgument, "unknown optimizer kind ", static_cast<int>(options.kind));
}

void convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, std::size_t count,
             Stream stream) {
  check_dtype(src_dtype, "convert: source dtype");
  check_dtype(dst_dtype, "convert: destination dtype");
  if (count == 0) return;
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  if (src_dtype == dst_dtype) {
    if (src != dst)
      ZERO_CHECK_CUDA(cudaMemcpyAsync(dst, src, count * size_of(src_dtype),
                                      cudaMemcpyDeviceToDevice, cuda_stream));
    return;
  }
  with_type(src_dtype, [&](auto src_tag) {
    using S = decltype(src_tag);
    with_type(dst_dtype, [&](auto dst_tag) {
      using D = decltype(dst_tag);
      if constexpr (!std::is_same_v<S, D>) {
        ConvertOp<S, D> op{static_cast<const S*>(src), static_cast<D*>(dst)};
        launch(op, count, vector_head({{src, sizeof(S)}, {dst, sizeof(D)}}, count), LaunchTuning{},
               cuda_stream);
      }
    });
  });
}

void accumulate(void* dst, const void* src, DType dtype, std::size_t count, Stream stream) {
  check_dtype(dtype, "accumulate: dtype");
  if (count == 0) return;
  with_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    AccumulateOp<T> op{static_cast<T*>(dst), static_cast<const T*>(src)};
    launch(op, count, vector_head({{dst, sizeof(T)}, {src, sizeof(T)}}, count), LaunchTuning{},
           static_cast<cudaStream_t>(stream));
  });
}

void ema_update(float* ema, const float* weights, std::size_t count, double decay, Stream stream) {
  if (count == 0) return;
  EmaOp op{ema, weights, static_cast<float>(decay), static_cast<float>(1.0 - decay)};
  launch(op, count, vector_head({{ema, 4}, {weights, 4}}, count), LaunchTuning{},
         static_cast<cudaStream_t>(stream));
}

void fill_uniform(void* data, std::size_t count, DType dtype, std::uint64_t seed, float low,
                  float high, Stream stream) {
  check_dtype(dtype, "fill_uniform: dtype");
  ZERO_CHECK(low < high, "fill_uniform: low ", low, " must be below high ", high);
  with_type(dtype, [&](auto tag) {
    launch_fill<decltype(tag)>(data, count, seed, low, high - low,
                               static_cast<cudaStream_t>(stream));
  });
}

void fill_value(void* data, std::size_t count, DType dtype, float value, Stream stream) {
  check_dtype(dtype, "fill_value: dtype");
  with_type(dtype, [&](auto tag) {
    launch_fill<decltype(tag)>(data, count, 0, value, 0.0f, static_cast<cudaStream_t>(stream));
  });
}

// ---------------------------------------------------------------- GradStatsReducer

GradStatsReducer::GradStatsReducer() = default;

GradStatsReducer::~GradStatsReducer() {
  // Destructors must not throw; a failure here only leaks.
  if (device_scratch_ != nullptr) (void)cudaFree(device_scratch_);
  if (host_pinned_ != nullptr) (void)cudaFreeHost(host_pinned_);
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
  // Blocks per span: enough for the largest span, but about 8 blocks per SM in all.
  const std::size_t wanted = (max_count + kStatsThreads * kChunk - 1) / (kStatsThreads * kChunk);
  const std::size_t budget =
      std::max<std::size_t>(1, static_cast<std::size_t>(sm_count()) * 8 / batch);
  const std::size_t blocks_x = std::max<std::size_t>(1, std::min(wanted, budget));
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
      grad_stats_kernel<T><<<grid, kStatsThreads, 0, cuda_stream>>>(table, n, partials, result);
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
