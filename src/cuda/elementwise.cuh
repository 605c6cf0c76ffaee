// The launch scheme shared by the memory-bound kernels of src/cuda (the
// optimizer steps, conversions and accumulation in optimizer_kernels.cu, the
// gradient statistics in grad_stats_kernels.cu):
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
// Internal to src/cuda.
#pragma once

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

namespace zero::gpu::detail {

constexpr int kChunk = 8;           // elements per thread per iteration
constexpr int kMaxThreads = 1024;
constexpr std::size_t kNoVector = std::numeric_limits<std::size_t>::max();

// ---------------------------------------------------------------- element access

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
inline std::size_t vector_head(std::initializer_list<BufferRef> buffers, std::size_t count) {
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
}  // namespace zero::gpu::detail
