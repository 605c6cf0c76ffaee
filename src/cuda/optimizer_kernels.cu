// Fused optimizer steps, dtype conversion, gradient accumulation, EMA and
// fills on the GPU. All of these are memory-bound streams over a shard, so
// they share one launch scheme (elementwise.cuh; grad_stats_kernels.cu uses
// it too):
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

#include "elementwise.cuh"

namespace zero::gpu {

using namespace detail;

namespace {

std::atomic<int> g_sm_counts[64];  // sm_count() per device, cached

struct NoCopy {};  // "no model copy" in the optimizer kernels' template

// ---------------------------------------------------------------- optimizers

// S: the state's storage, float or __nv_bfloat16 (widened on load, rounded
// stochastically on store with the bits of state_rounding_bits).
template <OptimizerKind Kind, typename G, typename M, typename S>
struct OptimizerOp {
  float* master;
  const G* grad;
  S* state0;
  S* state1;
  M* copy;
  StepScalars s;
  std::uint64_t first_index;
  static constexpr bool kBf16State = std::is_same_v<S, __nv_bfloat16>;

  __device__ __forceinline__ void update(float& p, float& m, float& v, float g) const {
    if constexpr (Kind == OptimizerKind::adamw) {
      adamw_element(p, m, v, g, s);
    } else if constexpr (Kind == OptimizerKind::lion) {
      lion_element(p, m, g, s);
    } else {
      sgd_element(p, state0 != nullptr ? &m : nullptr, g, s);
    }
  }

  // bf16 state: eight values rounded stochastically into one 16-byte word.
  __device__ __forceinline__ static void store8_rounded(S* target, const float (&in)[kChunk],
                                                        const std::uint32_t (&bits)[kChunk], int shift) {
    std::uint32_t words[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
      words[k] = static_cast<std::uint32_t>(bf16_round_stochastic(in[2 * k], bits[2 * k] >> shift)) |
                 (static_cast<std::uint32_t>(bf16_round_stochastic(in[2 * k + 1], bits[2 * k + 1] >> shift)) << 16);
    *reinterpret_cast<uint4*>(target) = make_uint4(words[0], words[1], words[2], words[3]);
  }
  __device__ __forceinline__ static S round_state(float value, std::uint32_t bits, int shift) {
    if constexpr (kBf16State) {
      const std::uint16_t raw = bf16_round_stochastic(value, bits >> shift);
      return *reinterpret_cast<const S*>(&raw);
    } else {
      return value;
    }
  }
  __device__ __forceinline__ static float state_value(const S& value) {
    if constexpr (kBf16State) return __bfloat162float(value);
    else return value;
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
    if constexpr (kBf16State) {
      std::uint32_t bits[kChunk];
#pragma unroll
      for (int j = 0; j < kChunk; ++j) bits[j] = state_rounding_bits(first_index + i + j, s.rounding_key);
      if (state0 != nullptr) store8_rounded(state0 + i, m, bits, 16);
      if constexpr (Kind == OptimizerKind::adamw) store8_rounded(state1 + i, v, bits, 0);
    } else {
      if constexpr (Kind == OptimizerKind::sgd) {
        if (state0 != nullptr) store8(state0 + i, m);
      } else {
        store8(state0 + i, m);
      }
      if constexpr (Kind == OptimizerKind::adamw) store8(state1 + i, v);
    }
    if constexpr (!std::is_same_v<M, NoCopy>) store8(copy + i, p);
  }

  __device__ __forceinline__ void element(std::size_t i) const {
    float p = master[i], g = to_float(grad[i]), m = 0.0f, v = 0.0f;
    if (state0 != nullptr) m = state_value(state0[i]);
    if constexpr (Kind == OptimizerKind::adamw) v = state_value(state1[i]);
    update(p, m, v, g);
    master[i] = p;
    const std::uint32_t bits = kBf16State ? state_rounding_bits(first_index + i, s.rounding_key) : 0u;
    if (state0 != nullptr) state0[i] = round_state(m, bits, 16);
    if constexpr (Kind == OptimizerKind::adamw) state1[i] = round_state(v, bits, 0);
    if constexpr (!std::is_same_v<M, NoCopy>) copy[i] = from_float<M>(p);
  }
};

template <OptimizerKind Kind, typename G, typename M, typename S>
void launch_optimizer(const StepScalars& scalars, const ShardUpdate& u, const LaunchTuning& tuning,
                      cudaStream_t stream) {
  OptimizerOp<Kind, G, M, S> op{u.master,
                                static_cast<const G*>(u.grad),
                                static_cast<S*>(u.state0),
                                static_cast<S*>(u.state1),
                                static_cast<M*>(u.model_copy),
                                scalars,
                                u.first_index};
  const std::size_t copy_size = std::is_same_v<M, NoCopy> ? 1 : sizeof(M);
  const std::size_t head =
      vector_head({{u.master, 4}, {u.grad, sizeof(G)}, {u.state0, sizeof(S)}, {u.state1, sizeof(S)},
                   {std::is_same_v<M, NoCopy> ? nullptr : u.model_copy, copy_size}},
                  u.count);
  launch(op, u.count, head, tuning, stream);
}

template <OptimizerKind Kind, typename S>
void dispatch_optimizer_state(const StepScalars& scalars, const ShardUpdate& u, const LaunchTuning& tuning,
                              cudaStream_t stream) {
  with_type(u.grad_dtype, [&](auto grad_tag) {
    using G = decltype(grad_tag);
    if (u.model_copy == nullptr) {
      launch_optimizer<Kind, G, NoCopy, S>(scalars, u, tuning, stream);
    } else {
      with_type(u.model_dtype, [&](auto model_tag) {
        launch_optimizer<Kind, G, decltype(model_tag), S>(scalars, u, tuning, stream);
      });
    }
  });
}

template <OptimizerKind Kind>
void dispatch_optimizer(const StepScalars& scalars, const ShardUpdate& u,
                        const LaunchTuning& tuning, cudaStream_t stream) {
  if (u.state_dtype == DType::bf16 && u.state0 != nullptr)
    dispatch_optimizer_state<Kind, __nv_bfloat16>(scalars, u, tuning, stream);
  else
    dispatch_optimizer_state<Kind, float>(scalars, u, tuning, stream);
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
  // The device keeps its EMA update a kernel of its own (ema_update): its
  // memory traffic is not what bounds a step there.
  ZERO_CHECK(u.ema == nullptr, "optimizer_step on the GPU: ShardUpdate.ema (the EMA in the update's pass) is a "
             "host kernel's; run ema_update after the step");
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
  ZERO_CHECK(u.state_dtype == DType::fp32 || u.state_dtype == DType::bf16,
             "optimizer_step: ShardUpdate.state_dtype must be fp32 or bf16, got ", name_of(u.state_dtype));
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

}  // namespace zero::gpu
