// CPU optimizer kernels. The reference is one plain loop over the per-element
// math of optimizer.hpp. The vectorized kernel runs the same math on fixed
// chunks spread over OpenMP threads; within a chunk the loop is written so
// that GCC vectorizes it (no aliasing, branch-free conversions), and it is
// compiled for AVX-512, AVX2 and baseline x86-64 with the best chosen at run
// time (function multi-versioning). This file is built with
// -ffp-contract=off: every operation is rounded as written, so both kernels
// agree bit for bit.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "zero/optim/optimizer.hpp"

namespace zero {

namespace {

constexpr std::size_t kChunk = std::size_t{1} << 16;  // elements per task; fixed => deterministic sums

#if defined(__x86_64__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__)
// flatten: every callee (the dtype dispatch, the element loops) is inlined
// into each clone, so each gets code for its own ISA. Without it the clones
// only call one shared baseline (SSE) copy of the loops.
#define ZERO_MULTIVERSION __attribute__((flatten, target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ZERO_MULTIVERSION
#endif

// Branch-free conversions (selects instead of branches) so loops vectorize;
// they round exactly like the scalar ones in dtype.hpp.
inline std::uint16_t store_bf16(float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, 4);
  const std::uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const std::uint32_t quiet_nan = (bits >> 16) | 0x40u;
  const bool is_nan = (bits & 0x7fffffffu) > 0x7f800000u;
  return static_cast<std::uint16_t>(is_nan ? quiet_nan : rounded);
}

// The element type a DType is stored as.
template <DType D>
using Storage = std::conditional_t<D == DType::fp32, float, std::uint16_t>;

template <DType D>
inline float load_value(const Storage<D>* data, std::size_t i) {
  if constexpr (D == DType::fp32) return data[i];
  if constexpr (D == DType::bf16) return bf16_state_to_float(data[i]);
  if constexpr (D == DType::fp16) return fp16_bits_to_float(data[i]);
}

template <DType D>
inline void store_value(Storage<D>* data, std::size_t i, float value) {
  if constexpr (D == DType::fp32) data[i] = value;
  if constexpr (D == DType::bf16) data[i] = store_bf16(value);
  if constexpr (D == DType::fp16) data[i] = float_to_fp16_bits(value);
}

template <DType D>
inline float load_grad(const void* data, std::size_t i) {
  return load_value<D>(static_cast<const Storage<D>*>(data), i);
}

// ModelDType: the copy to write, or fp32 meaning "no copy".
// Bf16State: state0/state1 hold bf16, widened on load and rounded
// stochastically on store (optimizer.hpp); the math in between is the same.
// high_hash: with bf16 state, state_rounding_high of the elements' indices,
// the same over [begin, end) (update_range cuts the range where the high half
// changes), so the loop hashes only the low half, in 32-bit lanes.
template <OptimizerKind Kind, DType GradDType, DType ModelDType, bool HasCopy, bool HasMomentum, bool HasEma,
          bool Bf16State>
inline void update_run(const StepScalars& scalars, const ShardUpdate& u, std::size_t begin, std::size_t end,
                       std::uint32_t high_hash) {
  // The scalars in a local copy: read through the reference, they could
  // alias the spans the loop writes (GCC would reload them per element).
  const StepScalars s = scalars;
  using State = std::conditional_t<Bf16State, std::uint16_t, float>;
  float* __restrict master = u.master;
  State* __restrict m = static_cast<State*>(u.state0);
  State* __restrict v = static_cast<State*>(u.state1);
  // The low half of index first_index + i is first_index's plus i's (mod 2^32).
  const std::uint32_t low_offset = static_cast<std::uint32_t>(u.first_index);
  float* __restrict ema = u.ema;
  const Storage<GradDType>* __restrict grad = static_cast<const Storage<GradDType>*>(u.grad);
  Storage<ModelDType>* __restrict copy = static_cast<Storage<ModelDType>*>(u.model_copy);
  const float decay = static_cast<float>(u.ema_decay), one_minus_decay = static_cast<float>(1.0 - u.ema_decay);
  // GCC keeps restrict on parameters, not reliably on locals: without ivdep
  // it versions the loop with run-time overlap checks between the spans, and
  // with six spans (the EMA's added) there were more checks than it allows,
  // so the loop ran scalar, 4x slower. The spans never overlap (ShardUpdate's
  // contract).
#pragma GCC ivdep
  for (std::size_t i = begin; i < end; ++i) {
    const float g = load_value<GradDType>(grad, i);
    float p = master[i];
    if constexpr (Bf16State) {
      static_assert(HasMomentum, "bf16 state needs a state tensor");
      float mi = bf16_state_to_float(m[i]), vi = 0.0f;
      if constexpr (Kind == OptimizerKind::adamw) {
        vi = bf16_state_to_float(v[i]);
        adamw_element(p, mi, vi, g, s);
      } else if constexpr (Kind == OptimizerKind::lion) {
        lion_element(p, mi, g, s);
      } else {
        sgd_element(p, &mi, g, s);
      }
      const std::uint32_t bits = state_rounding_low(static_cast<std::uint32_t>(i) + low_offset, high_hash);
      m[i] = bf16_round_stochastic(mi, bits >> 16);
      if constexpr (Kind == OptimizerKind::adamw) v[i] = bf16_round_stochastic(vi, bits);
    } else if constexpr (Kind == OptimizerKind::adamw) {
      adamw_element(p, m[i], v[i], g, s);
    } else if constexpr (Kind == OptimizerKind::lion) {
      lion_element(p, m[i], g, s);
    } else {
      sgd_element(p, HasMomentum ? &m[i] : nullptr, g, s);
    }
    master[i] = p;
    if constexpr (HasEma) ema_element(ema[i], p, decay, one_minus_decay);
    if constexpr (HasCopy) store_value<ModelDType>(copy, i, p);
  }
}

template <OptimizerKind Kind, DType GradDType, DType ModelDType, bool HasCopy, bool HasMomentum, bool HasEma,
          bool Bf16State = false>
inline void update_range(const StepScalars& s, const ShardUpdate& u, std::size_t begin, std::size_t end) {
  if constexpr (!Bf16State) {
    update_run<Kind, GradDType, ModelDType, HasCopy, HasMomentum, HasEma, false>(s, u, begin, end, 0);
  } else {
    // Runs over which the indices' high half stays (one run unless the range
    // crosses a multiple of 2^32).
    constexpr std::uint64_t kLowSpan = std::uint64_t{1} << 32;
    for (std::size_t lo = begin; lo < end;) {
      const std::uint64_t index = u.first_index + lo;
      const std::size_t run = static_cast<std::size_t>(
          std::min<std::uint64_t>(end - lo, kLowSpan - (index & (kLowSpan - 1))));
      const std::uint32_t high_hash = state_rounding_high(static_cast<std::uint32_t>(index >> 32), s.rounding_key);
      update_run<Kind, GradDType, ModelDType, HasCopy, HasMomentum, HasEma, true>(s, u, lo, lo + run, high_hash);
      lo += run;
    }
  }
}

using RangeFn = void (*)(const StepScalars&, const ShardUpdate&, std::size_t, std::size_t);

// One multi-versioned entry per optimizer; the dtype dispatch happens inside
// so that each clone gets its own vectorized copies of every instantiation.
template <OptimizerKind Kind>
void dispatch_range(const StepScalars& s, const ShardUpdate& u, std::size_t begin, std::size_t end) {
  const bool copy = u.model_copy != nullptr;
  const bool momentum = u.state0 != nullptr;
  // The EMA is the innermost choice: every variant exists with and without
  // it, with fp32 state and (where there is state) with bf16 state.
  const bool bf16_state = u.state_dtype == DType::bf16;
  auto run = [&]<DType G, DType M, bool Copy, bool Momentum>() {
    auto with_ema = [&]<bool Bf16State>() {
      if (u.ema) update_range<Kind, G, M, Copy, Momentum, true, Bf16State>(s, u, begin, end);
      else update_range<Kind, G, M, Copy, Momentum, false, Bf16State>(s, u, begin, end);
    };
    if constexpr (Momentum) {
      if (bf16_state) return with_ema.template operator()<true>();
    }
    with_ema.template operator()<false>();
  };
  auto with_grad = [&]<DType G>() {
    if (!copy) {
      if (momentum) run.template operator()<G, DType::fp32, false, true>();
      else run.template operator()<G, DType::fp32, false, false>();
      return;
    }
    switch (u.model_dtype) {
      case DType::fp32:
        if (momentum) run.template operator()<G, DType::fp32, true, true>();
        else run.template operator()<G, DType::fp32, true, false>();
        return;
      case DType::bf16:
        if (momentum) run.template operator()<G, DType::bf16, true, true>();
        else run.template operator()<G, DType::bf16, true, false>();
        return;
      case DType::fp16:
        if (momentum) run.template operator()<G, DType::fp16, true, true>();
        else run.template operator()<G, DType::fp16, true, false>();
        return;
    }
  };
  switch (u.grad_dtype) {
    case DType::fp32: with_grad.template operator()<DType::fp32>(); return;
    case DType::bf16: with_grad.template operator()<DType::bf16>(); return;
    case DType::fp16: with_grad.template operator()<DType::fp16>(); return;
  }
}

ZERO_MULTIVERSION void adamw_chunk(const StepScalars& s, const ShardUpdate& u, std::size_t b, std::size_t e) {
  dispatch_range<OptimizerKind::adamw>(s, u, b, e);
}
ZERO_MULTIVERSION void lion_chunk(const StepScalars& s, const ShardUpdate& u, std::size_t b, std::size_t e) {
  dispatch_range<OptimizerKind::lion>(s, u, b, e);
}
ZERO_MULTIVERSION void sgd_chunk(const StepScalars& s, const ShardUpdate& u, std::size_t b, std::size_t e) {
  dispatch_range<OptimizerKind::sgd>(s, u, b, e);
}

// The reference: the same per-element functions, scalar conversions from
// dtype.hpp, no templates, no threads.
void reference_step(const OptimizerOptions& o, const StepScalars& s, const ShardUpdate& u) {
  const float decay = static_cast<float>(u.ema_decay), one_minus_decay = static_cast<float>(1.0 - u.ema_decay);
  const bool bf16_state = u.state_dtype == DType::bf16;
  for (std::size_t i = 0; i < u.count; ++i) {
    const float g = load_as_float(u.grad, i, u.grad_dtype);
    float p = u.master[i];
    float m = u.state0 ? load_as_float(u.state0, i, u.state_dtype) : 0.0f;
    float v = u.state1 ? load_as_float(u.state1, i, u.state_dtype) : 0.0f;
    switch (o.kind) {
      case OptimizerKind::adamw: adamw_element(p, m, v, g, s); break;
      case OptimizerKind::lion: lion_element(p, m, g, s); break;
      case OptimizerKind::sgd: sgd_element(p, u.state0 ? &m : nullptr, g, s); break;
    }
    if (bf16_state) {
      const std::uint32_t bits = state_rounding_bits(u.first_index + i, s.rounding_key);
      if (u.state0) static_cast<std::uint16_t*>(u.state0)[i] = bf16_round_stochastic(m, bits >> 16);
      if (u.state1) static_cast<std::uint16_t*>(u.state1)[i] = bf16_round_stochastic(v, bits);
    } else {
      if (u.state0) static_cast<float*>(u.state0)[i] = m;
      if (u.state1) static_cast<float*>(u.state1)[i] = v;
    }
    u.master[i] = p;
    if (u.model_copy) store_from_float(u.model_copy, i, u.model_dtype, p);
    if (u.ema) ema_element(u.ema[i], p, decay, one_minus_decay);
  }
}

// dst += src over [begin, end), rounded to D (the device kernel's fp32 add
// and rounding), in the branch-free conversions so the loop vectorizes: the
// generic per-element dispatch ran at 1 G elements/s on two cores, slower
// than the AdamW + EMA update it was to feed.
template <DType D>
ZERO_MULTIVERSION void accumulate_chunk(void* dst_bytes, const void* src_bytes, std::size_t begin, std::size_t end) {
  Storage<D>* dst = static_cast<Storage<D>*>(dst_bytes);
  const Storage<D>* src = static_cast<const Storage<D>*>(src_bytes);
  for (std::size_t i = begin; i < end; ++i) store_value<D>(dst, i, load_value<D>(dst, i) + load_value<D>(src, i));
}

template <DType D>
ZERO_MULTIVERSION GradStats stats_chunk(const void* data, std::size_t begin, std::size_t end) {
  // Sixteen independent float partials per block of 256 (element i goes to
  // lane i mod 16), then added pairwise in double in a fixed order, and the
  // blocks in order: the result is independent of the ISA and the thread
  // count, and the lanes map onto vector registers. One running double sum
  // is a chain of dependent adds behind a conversion per element (measured
  // 0.25 s for SDXL's 2.57 G bf16 gradients on the H200 host's 16 cores).
  double sum = 0;
  bool nonfinite = false;
  constexpr std::size_t kBlock = 256, kLanes = 16;
  for (std::size_t b = begin; b < end; b += kBlock) {
    const std::size_t stop = std::min(end, b + kBlock);
    float lane[kLanes] = {};
    std::size_t i = b;
    for (; i + kLanes <= stop; i += kLanes)
      for (std::size_t j = 0; j < kLanes; ++j) {
        const float x = load_grad<D>(data, i + j);
        lane[j] += x * x;
      }
    for (std::size_t j = 0; i < stop; ++i, ++j) {
      const float x = load_grad<D>(data, i);
      lane[j] += x * x;
    }
    // Each lane summed at most 16 positive squares in fp32 (relative error
    // below 1e-6); from here on double, in a fixed order.
    double wide[kLanes];
    for (std::size_t j = 0; j < kLanes; ++j) wide[j] = lane[j];
    for (std::size_t width = kLanes / 2; width > 0; width /= 2)
      for (std::size_t j = 0; j < width; ++j) wide[j] += wide[j + width];
    if (std::isfinite(wide[0])) {
      sum += wide[0];
      continue;
    }
    // A non-finite element, or fp32 overflow of finite squares (|x| > ~1.8e19,
    // as the device kernel): the block again in double, elements checked.
    double exact = 0;
    for (std::size_t k = b; k < stop; ++k) {
      const double x = load_grad<D>(data, k);
      if (!std::isfinite(x)) nonfinite = true;
      else exact += x * x;
    }
    sum += exact;
  }
  return {sum, nonfinite};
}

GradStats stats_dispatch(const void* data, DType dtype, std::size_t begin, std::size_t end) {
  switch (dtype) {
    case DType::fp32: return stats_chunk<DType::fp32>(data, begin, end);
    case DType::bf16: return stats_chunk<DType::bf16>(data, begin, end);
    case DType::fp16: return stats_chunk<DType::fp16>(data, begin, end);
  }
  return {};
}

}  // namespace

void cpu_optimizer_step(const OptimizerOptions& options, const StepScalars& scalars,
                        const ShardUpdate& update, CpuKernel kernel) {
  check_dtype(update.grad_dtype, "ShardUpdate.grad_dtype");
  if (update.model_copy) check_dtype(update.model_dtype, "ShardUpdate.model_dtype");
  if (update.count == 0) return;
  ZERO_CHECK(update.master && update.grad, "ShardUpdate: master and grad are required");
  const int slots = options.state_slots();
  ZERO_CHECK(slots < 1 || update.state0, "ShardUpdate: ", name_of(options.kind), " needs state0");
  ZERO_CHECK(slots < 2 || update.state1, "ShardUpdate: ", name_of(options.kind), " needs state1");
  ZERO_CHECK(update.state_dtype == DType::fp32 || update.state_dtype == DType::bf16,
             "ShardUpdate.state_dtype must be fp32 or bf16, got ", name_of(update.state_dtype));
  // A state buffer the optimizer has no use for (SGD without momentum, Lion's
  // second) is never touched, even when given.
  ShardUpdate u = update;
  if (slots < 1) u.state0 = nullptr;
  if (slots < 2) u.state1 = nullptr;
  if (kernel == CpuKernel::reference) {
    reference_step(options, scalars, u);
    return;
  }
  RangeFn fn = options.kind == OptimizerKind::adamw ? adamw_chunk
               : options.kind == OptimizerKind::lion ? lion_chunk
                                                     : sgd_chunk;
  // The update is element-wise: any cut gives the same bits, so it is cut
  // finer than the sums' fixed chunks. A small run (a parameter group's
  // biases in a bucket) is then spread over the cores instead of running on
  // one. (Every region keeps the whole team: a team size that changes from
  // call to call made libgomp 8x slower on 16 cores.)
  //
  // Chunks are handed out as threads come free, 16 at a time (64 Ki
  // elements, ~1.7 MB of AdamW traffic): in an offloaded step the team
  // shares the cores with the thread driving the GPU and the CUDA
  // runtime's, and with a static split one descheduled thread held the
  // whole region back.
  constexpr std::size_t kStepChunk = std::size_t{1} << 12;
  const std::size_t chunks = (u.count + kStepChunk - 1) / kStepChunk;
  if (chunks == 1) {
    fn(scalars, u, 0, u.count);
    return;
  }
#pragma omp parallel for schedule(dynamic, 16)
  for (std::size_t c = 0; c < chunks; ++c)
    fn(scalars, u, c * kStepChunk, std::min(u.count, (c + 1) * kStepChunk));
}

GradStats cpu_grad_stats(const void* data, std::size_t count, DType dtype, CpuKernel kernel) {
  check_dtype(dtype, "grad_stats");
  const std::size_t chunks = (count + kChunk - 1) / kChunk;
  std::vector<GradStats> partial(chunks);
  if (kernel == CpuKernel::reference || chunks <= 1) {
    for (std::size_t c = 0; c < chunks; ++c)
      partial[c] = stats_dispatch(data, dtype, c * kChunk, std::min(count, (c + 1) * kChunk));
  } else {
#pragma omp parallel for schedule(static)
    for (std::size_t c = 0; c < chunks; ++c)
      partial[c] = stats_dispatch(data, dtype, c * kChunk, std::min(count, (c + 1) * kChunk));
  }
  GradStats total;
  for (const GradStats& p : partial) {
    total.sum_squares += p.sum_squares;
    total.nonfinite = total.nonfinite || p.nonfinite;
  }
  return total;
}

void cpu_convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, std::size_t count) {
  check_dtype(src_dtype, "convert source");
  check_dtype(dst_dtype, "convert destination");
  if (src_dtype == dst_dtype) {
    if (src != dst && count > 0) std::memmove(dst, src, count * size_of(src_dtype));
    return;
  }
#pragma omp parallel for schedule(static) if (count > kChunk)
  for (std::size_t i = 0; i < count; ++i) store_from_float(dst, i, dst_dtype, load_as_float(src, i, src_dtype));
}

void cpu_ema_update(float* ema, const float* weights, std::size_t count, double decay) {
  const float d = static_cast<float>(decay), one_minus = static_cast<float>(1.0 - decay);
#pragma omp parallel for schedule(static) if (count > kChunk)
  for (std::size_t i = 0; i < count; ++i) ema_element(ema[i], weights[i], d, one_minus);
}

void cpu_accumulate(void* dst, const void* src, DType dtype, std::size_t count) {
  check_dtype(dtype, "accumulate");
  auto chunk = [&](std::size_t begin, std::size_t end) {
    switch (dtype) {
      case DType::fp32: accumulate_chunk<DType::fp32>(dst, src, begin, end); return;
      case DType::bf16: accumulate_chunk<DType::bf16>(dst, src, begin, end); return;
      case DType::fp16: accumulate_chunk<DType::fp16>(dst, src, begin, end); return;
    }
  };
  // Element-wise: any cut gives the same bits.
  const std::size_t chunks = (count + kChunk - 1) / kChunk;
  if (chunks <= 1) {
    chunk(0, count);
    return;
  }
#pragma omp parallel for schedule(static)
  for (std::size_t c = 0; c < chunks; ++c) chunk(c * kChunk, std::min(count, (c + 1) * kChunk));
}

}  // namespace zero
