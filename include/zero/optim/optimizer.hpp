// Optimizers: one definition of the math, per element, shared by the CPU
// kernels (src/optim/) and the CUDA kernels (src/cuda/). Semantics follow
// PyTorch's AdamW (decoupled decay, bias correction), SGD (coupled decay,
// momentum with dampening, Nesterov) and Lion (Chen et al., 2023).
//
// The order of operations below is the contract: the plain and vectorized CPU
// kernels evaluate exactly these expressions (built with -ffp-contract=off),
// so they agree bit for bit.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "zero/core/dtype.hpp"
#include "zero/core/error.hpp"

#if defined(__CUDACC__)
#define ZERO_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define ZERO_HOST_DEVICE inline
#endif

namespace zero {

enum class OptimizerKind { adamw, sgd, lion };

constexpr std::string_view name_of(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::adamw: return "adamw";
    case OptimizerKind::sgd: return "sgd";
    case OptimizerKind::lion: return "lion";
  }
  return "unknown";
}

inline OptimizerKind parse_optimizer_kind(std::string_view text, std::string_view what = "optimizer") {
  if (text == "adamw") return OptimizerKind::adamw;
  if (text == "sgd") return OptimizerKind::sgd;
  if (text == "lion") return OptimizerKind::lion;
  ZERO_THROW(InvalidArgument, what, ": unknown optimizer '", text, "' (expected adamw, sgd or lion)");
}

struct OptimizerOptions {
  OptimizerKind kind = OptimizerKind::adamw;
  double lr = 1e-3;
  double beta1 = 0.9;          // AdamW, Lion (interpolation for the update)
  double beta2 = 0.999;        // AdamW, Lion (momentum decay; Lion's default is 0.99)
  double eps = 1e-8;           // AdamW
  double weight_decay = 0.01;  // decoupled for AdamW and Lion, coupled (L2) for SGD
  double momentum = 0.0;       // SGD
  double dampening = 0.0;      // SGD
  bool nesterov = false;       // SGD
  /// How the state tensors (m, v, momentum) are stored: fp32, or bf16 rounded
  /// stochastically after each update (bf16_round_stochastic below): 2 bytes
  /// a slot instead of 4, so AdamW's update moves 20 bytes a parameter
  /// instead of 28 with bf16 gradients and parameters. The math stays fp32.
  /// On the device and offloaded (the host kernel draws the same bits).
  DType state_dtype = DType::fp32;

  void validate() const {
    ZERO_CHECK(std::isfinite(lr) && lr >= 0, "optimizer.lr must be finite and >= 0, got ", lr);
    ZERO_CHECK(std::isfinite(weight_decay) && weight_decay >= 0,
               "optimizer.weight_decay must be finite and >= 0, got ", weight_decay);
    if (kind == OptimizerKind::adamw || kind == OptimizerKind::lion) {
      ZERO_CHECK(beta1 >= 0 && beta1 < 1, "optimizer.beta1 must be in [0, 1), got ", beta1);
      ZERO_CHECK(beta2 >= 0 && beta2 < 1, "optimizer.beta2 must be in [0, 1), got ", beta2);
    }
    if (kind == OptimizerKind::adamw)
      ZERO_CHECK(eps > 0 && std::isfinite(eps), "optimizer.eps must be > 0, got ", eps);
    ZERO_CHECK(state_dtype == DType::fp32 || state_dtype == DType::bf16,
               "optimizer.state_dtype must be fp32 or bf16, got ", name_of(state_dtype));
    if (kind == OptimizerKind::sgd) {
      ZERO_CHECK(momentum >= 0 && momentum < 1, "optimizer.momentum must be in [0, 1), got ", momentum);
      ZERO_CHECK(dampening >= 0 && dampening <= 1, "optimizer.dampening must be in [0, 1], got ",
                 dampening);
      ZERO_CHECK(!nesterov || (momentum > 0 && dampening == 0),
                 "optimizer.nesterov needs momentum > 0 and dampening == 0");
    }
  }

  /// fp32 state tensors per parameter: AdamW 2 (m, v), Lion 1 (m), SGD 1 with
  /// momentum, else 0.
  int state_slots() const {
    switch (kind) {
      case OptimizerKind::adamw: return 2;
      case OptimizerKind::lion: return 1;
      case OptimizerKind::sgd: return momentum > 0 ? 1 : 0;
    }
    return 0;
  }
};

/// Per-step scalars, computed once on the host (float, as the kernels use them).
struct StepScalars {
  float lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  // 1 - beta computed in double and rounded once: 1.0f - 0.999f would carry
  // the rounding of beta2 (1.3e-5 relative) into every second moment.
  float one_minus_beta1 = 1, one_minus_beta2 = 1;
  float bias_correction1 = 1;       // 1 - beta1^t
  float bias_correction2_sqrt = 1;  // sqrt(1 - beta2^t)
  float momentum = 0, dampening = 0;
  int nesterov = 0;
  int first_step = 0;               // SGD: momentum buffer starts as the gradient
  /// Multiplies every gradient before use: 1 / (loss scale * accumulation
  /// steps) * clip coefficient. Folding it here saves a pass over the grads.
  float grad_scale = 1;
  /// bf16 state: this step's key for the stochastic rounding's random bits
  /// (state_rounding_bits), a hash of the step.
  std::uint32_t rounding_key = 0;
};

// ---------------------------------------------------------------------------
// bf16 optimizer state. Round-to-nearest would freeze AdamW's second moment:
// v <- 0.999 v + 0.001 g^2 changes v by ~0.1% a step, below half a bf16 ulp
// (0.2-0.4%), so v would stay where it is. Rounding up with probability equal
// to the dropped fraction keeps every update's expectation. The random bits
// are a hash of the element's index in the full flat buffer and the step, so
// the result does not depend on how the buffer is sharded or cut into
// launches (stages 0-3 give the same bits on the same world size) and every
// kernel (CPU reference, CPU vectorized, GPU) draws the same bits.

/// A 32-bit integer hash (lowbias32: two multiplies, three xor-shifts).
ZERO_HOST_DEVICE std::uint32_t rounding_hash(std::uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

/// The step's key (StepScalars::rounding_key).
inline std::uint32_t rounding_key_of(std::int64_t step) {
  return rounding_hash(static_cast<std::uint32_t>(step) ^ 0x9e3779b9u) ^
         rounding_hash(static_cast<std::uint32_t>(static_cast<std::uint64_t>(step) >> 32) ^ 0x85ebca6bu);
}

/// The part of state_rounding_bits that depends on the index's high 32 bits
/// and the key only: the same for 2^32 elements in a row, so a loop over
/// them may compute it once (the CPU kernel does).
ZERO_HOST_DEVICE std::uint32_t state_rounding_high(std::uint32_t index_high, std::uint32_t key) {
  return rounding_hash(index_high ^ key);
}

/// state_rounding_bits from the index's low 32 bits and state_rounding_high.
ZERO_HOST_DEVICE std::uint32_t state_rounding_low(std::uint32_t index_low, std::uint32_t high) {
  return rounding_hash(index_low ^ high);
}

/// 32 random bits for the element at `index` of the full flat buffer: the
/// high half rounds state0, the low half state1.
ZERO_HOST_DEVICE std::uint32_t state_rounding_bits(std::uint64_t index, std::uint32_t key) {
  return state_rounding_low(static_cast<std::uint32_t>(index),
                            state_rounding_high(static_cast<std::uint32_t>(index >> 32), key));
}

/// float -> bf16, rounded up with probability (dropped bits) / 2^16: the 16
/// random bits are added below the kept ones and the sum truncated. NaN stays
/// a quiet NaN and infinity infinity; a finite value within an ulp of bf16's
/// largest may round to infinity (as for round-to-nearest near the top).
ZERO_HOST_DEVICE std::uint16_t bf16_round_stochastic(float value, std::uint32_t random16) {
  std::uint32_t bits;
#if defined(__CUDA_ARCH__)
  bits = __float_as_uint(value);
#else
  std::memcpy(&bits, &value, 4);
#endif
  const bool special = (bits & 0x7fffffffu) >= 0x7f800000u;  // inf or NaN
  const bool is_nan = (bits & 0x7fffffffu) > 0x7f800000u;
  const std::uint32_t rounded = special ? (bits >> 16) | (is_nan ? 0x40u : 0u) : (bits + (random16 & 0xffffu)) >> 16;
  return static_cast<std::uint16_t>(rounded);
}

/// bf16 bits -> float (exact).
ZERO_HOST_DEVICE float bf16_state_to_float(std::uint16_t bits) {
  const std::uint32_t wide = static_cast<std::uint32_t>(bits) << 16;
#if defined(__CUDA_ARCH__)
  return __uint_as_float(wide);
#else
  float value;
  std::memcpy(&value, &wide, 4);
  return value;
#endif
}

/// step is 1-based (the step being taken).
inline StepScalars make_step_scalars(const OptimizerOptions& o, std::int64_t step, double lr,
                                     double grad_scale) {
  ZERO_CHECK(step >= 1, "optimizer step must be >= 1, got ", step);
  StepScalars s;
  s.lr = static_cast<float>(lr);
  s.beta1 = static_cast<float>(o.beta1);
  s.beta2 = static_cast<float>(o.beta2);
  s.eps = static_cast<float>(o.eps);
  s.weight_decay = static_cast<float>(o.weight_decay);
  s.one_minus_beta1 = static_cast<float>(1.0 - o.beta1);
  s.one_minus_beta2 = static_cast<float>(1.0 - o.beta2);
  s.bias_correction1 = static_cast<float>(1.0 - std::pow(o.beta1, static_cast<double>(step)));
  s.bias_correction2_sqrt =
      static_cast<float>(std::sqrt(1.0 - std::pow(o.beta2, static_cast<double>(step))));
  s.momentum = static_cast<float>(o.momentum);
  s.dampening = static_cast<float>(o.dampening);
  s.nesterov = o.nesterov ? 1 : 0;
  s.first_step = step == 1 ? 1 : 0;
  s.grad_scale = static_cast<float>(grad_scale);
  s.rounding_key = rounding_key_of(step);
  return s;
}

// ---------------------------------------------------------------------------
// Per-element math. `param` is the fp32 master value; `g` the gradient as
// float before grad_scale is applied.

ZERO_HOST_DEVICE void adamw_element(float& param, float& m, float& v, float g, const StepScalars& s) {
  g = g * s.grad_scale;
  param = param * (1.0f - s.lr * s.weight_decay);
  m = s.beta1 * m + s.one_minus_beta1 * g;
  v = s.beta2 * v + s.one_minus_beta2 * (g * g);
  const float denom = sqrtf(v) / s.bias_correction2_sqrt + s.eps;
  param = param - (s.lr / s.bias_correction1) * (m / denom);
}

ZERO_HOST_DEVICE void lion_element(float& param, float& m, float g, const StepScalars& s) {
  g = g * s.grad_scale;
  const float c = s.beta1 * m + s.one_minus_beta1 * g;
  const float sign = static_cast<float>((c > 0.0f) - (c < 0.0f));
  param = param * (1.0f - s.lr * s.weight_decay);
  param = param - s.lr * sign;
  m = s.beta2 * m + s.one_minus_beta2 * g;
}

/// buf may be nullptr-equivalent when momentum == 0 (has_momentum false).
ZERO_HOST_DEVICE void sgd_element(float& param, float* buf, float g, const StepScalars& s) {
  g = g * s.grad_scale;
  g = g + s.weight_decay * param;
  if (buf != nullptr) {
    float b = s.first_step ? g : s.momentum * (*buf) + (1.0f - s.dampening) * g;
    *buf = b;
    g = s.nesterov ? g + s.momentum * b : b;
  }
  param = param - s.lr * g;
}

/// Exponential moving average of the weights: ema <- decay*ema + (1-decay)*w.
ZERO_HOST_DEVICE void ema_element(float& ema, float weight, float decay, float one_minus_decay) {
  ema = decay * ema + one_minus_decay * weight;
}

// ---------------------------------------------------------------------------
// Kernel interface. One span of a rank's shard; all pointers cover `count`
// elements. Padding elements (zero grad, zero param, zero state) stay zero.

struct ShardUpdate {
  float* master = nullptr;                // fp32 master weights, updated in place
  const void* grad = nullptr;             // gradients, grad_dtype
  DType grad_dtype = DType::fp32;
  void* state0 = nullptr;                 // AdamW m, Lion m, SGD momentum buffer; state_dtype
  void* state1 = nullptr;                 // AdamW v; state_dtype
  void* model_copy = nullptr;             // optional: updated params rounded to model_dtype
  DType model_dtype = DType::bf16;
  std::size_t count = 0;
  /// Optional: the fp32 exponential moving average of the weights, updated in
  /// the same pass from the new master value (ema_element with ema_decay and
  /// 1 - ema_decay rounded to float): the same bits as cpu_ema_update over
  /// the updated master, without reading the master a second time. The CPU
  /// kernels only (the GPU's optimizer_step refuses it).
  float* ema = nullptr;
  double ema_decay = 0;
  // (Last, so that aggregate initializations of the fields above still hold.)
  /// fp32, or bf16 rounded stochastically (OptimizerOptions::state_dtype).
  DType state_dtype = DType::fp32;
  /// The index of element 0 of this span in the full flat buffer (padding
  /// included): where bf16 state draws its rounding bits.
  std::uint64_t first_index = 0;

  /// Elements [begin, begin + n) of this span.
  ShardUpdate slice(std::size_t begin, std::size_t n) const {
    ShardUpdate part = *this;
    part.master = master + begin;
    part.grad = static_cast<const std::byte*>(grad) + begin * size_of(grad_dtype);
    const std::size_t state_size = size_of(state_dtype);
    part.state0 = state0 ? static_cast<std::byte*>(state0) + begin * state_size : nullptr;
    part.state1 = state1 ? static_cast<std::byte*>(state1) + begin * state_size : nullptr;
    part.first_index = first_index + begin;
    part.model_copy = model_copy ? static_cast<std::byte*>(model_copy) + begin * size_of(model_dtype) : nullptr;
    part.ema = ema ? ema + begin : nullptr;
    part.count = n;
    return part;
  }
};

/// Which CPU implementation to run.
enum class CpuKernel {
  reference,   // one thread, a plain loop: the definition
  vectorized,  // SIMD (AVX-512/AVX2 chosen at run time) and all cores
};

/// Applies one optimizer step to the span on the CPU.
void cpu_optimizer_step(const OptimizerOptions& options, const StepScalars& scalars,
                        const ShardUpdate& update, CpuKernel kernel = CpuKernel::vectorized);

/// Sum of squares (float64 accumulation, in fixed-size chunks summed in order,
/// so the result does not depend on the thread count) and whether any element
/// is NaN or infinite.
struct GradStats {
  double sum_squares = 0;
  bool nonfinite = false;
};
GradStats cpu_grad_stats(const void* data, std::size_t count, DType dtype,
                         CpuKernel kernel = CpuKernel::vectorized);

/// ema[i] = decay*ema[i] + (1-decay)*weights[i] on the CPU.
void cpu_ema_update(float* ema, const float* weights, std::size_t count, double decay);

/// Converts count elements between dtypes on the CPU (round to nearest even).
void cpu_convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, std::size_t count);
/// dst[i] = round(dst[i] + src[i]) with fp32 accumulation (gradient accumulation).
void cpu_accumulate(void* dst, const void* src, DType dtype, std::size_t count);

}  // namespace zero
