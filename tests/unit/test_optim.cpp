// Optimizer kernels against a float64 definition; vectorized == reference bit
// for bit; gradient statistics; loss scaling.
#include <doctest/doctest.h>

#include <cmath>
#include <algorithm>
#include <cstring>
#include <limits>
#include <random>
#include <tuple>
#include <utility>
#include <vector>

#include "zero/optim/loss_scaler.hpp"
#include "zero/optim/optimizer.hpp"

using namespace zero;

namespace {

struct Arrays {
  std::vector<float> master, m, v;
  std::vector<std::uint16_t> grad16;
  std::vector<float> grad32;
  std::vector<std::uint16_t> copy16;
  std::vector<float> copy32;
};

Arrays random_arrays(std::size_t n, DType grad_dtype, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> positive(1e-6f, 1e-2f);
  Arrays a;
  a.master.resize(n);
  a.m.resize(n);
  a.v.resize(n);
  a.grad32.resize(n);
  a.grad16.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    a.master[i] = normal(rng);
    a.m[i] = 0.1f * normal(rng);
    a.v[i] = positive(rng);
    const float g = 0.5f * normal(rng);
    if (grad_dtype == DType::fp32) a.grad32[i] = g;
    else store_from_float(a.grad16.data(), i, grad_dtype, g);
  }
  a.copy16.assign(n, 0xffff);  // poison: NaN in both bf16 and fp16
  a.copy32.assign(n, std::nanf(""));
  return a;
}

ShardUpdate view(Arrays& a, DType grad_dtype, DType copy_dtype, bool with_copy, int slots) {
  ShardUpdate u;
  u.master = a.master.data();
  u.grad = grad_dtype == DType::fp32 ? static_cast<const void*>(a.grad32.data()) : a.grad16.data();
  u.grad_dtype = grad_dtype;
  u.state0 = slots >= 1 ? a.m.data() : nullptr;
  u.state1 = slots >= 2 ? a.v.data() : nullptr;
  if (with_copy) u.model_copy = copy_dtype == DType::fp32 ? static_cast<void*>(a.copy32.data()) : a.copy16.data();
  u.model_dtype = copy_dtype;
  u.count = a.master.size();
  return u;
}

// Float64 definitions, written independently of optimizer.hpp.
void reference_f64(const OptimizerOptions& o, std::int64_t step, double lr, double grad_scale, double& p,
                   double& m, double& v, double g) {
  g *= grad_scale;
  switch (o.kind) {
    case OptimizerKind::adamw: {
      p *= 1 - lr * o.weight_decay;
      m = o.beta1 * m + (1 - o.beta1) * g;
      v = o.beta2 * v + (1 - o.beta2) * g * g;
      const double mhat = m / (1 - std::pow(o.beta1, step));
      const double vhat = v / (1 - std::pow(o.beta2, step));
      p -= lr * mhat / (std::sqrt(vhat) + o.eps);
      break;
    }
    case OptimizerKind::lion: {
      const double c = o.beta1 * m + (1 - o.beta1) * g;
      p *= 1 - lr * o.weight_decay;
      p -= lr * ((c > 0) - (c < 0));
      m = o.beta2 * m + (1 - o.beta2) * g;
      break;
    }
    case OptimizerKind::sgd: {
      g += o.weight_decay * p;
      if (o.momentum > 0) {
        m = step == 1 ? g : o.momentum * m + (1 - o.dampening) * g;
        g = o.nesterov ? g + o.momentum * m : m;
      }
      p -= lr * g;
      break;
    }
  }
}

std::vector<OptimizerOptions> all_optimizers() {
  OptimizerOptions adamw;
  adamw.lr = 1e-3;
  adamw.weight_decay = 0.1;
  OptimizerOptions lion;
  lion.kind = OptimizerKind::lion;
  lion.lr = 1e-4;
  lion.beta1 = 0.9;
  lion.beta2 = 0.99;
  lion.weight_decay = 0.5;
  OptimizerOptions sgd;
  sgd.kind = OptimizerKind::sgd;
  sgd.lr = 0.05;
  sgd.momentum = 0.9;
  sgd.nesterov = true;
  sgd.weight_decay = 1e-4;
  OptimizerOptions sgd_plain = sgd;
  sgd_plain.momentum = 0;
  sgd_plain.nesterov = false;
  OptimizerOptions sgd_damped = sgd;
  sgd_damped.nesterov = false;
  sgd_damped.dampening = 0.3;
  return {adamw, lion, sgd, sgd_plain, sgd_damped};
}

float ulp_of(DType dtype, float x) {
  const int mantissa = dtype == DType::bf16 ? 7 : 10;
  const int min_exponent = dtype == DType::bf16 ? -126 : -14;
  int e = x == 0 ? min_exponent : std::max(std::ilogb(x), min_exponent);
  return std::ldexp(1.0f, e - mantissa);
}

}  // namespace

TEST_CASE("CPU optimizer kernels match float64 and agree bit for bit") {
  std::mt19937 rng(2026);
  const std::size_t sizes[] = {0, 1, 7, 31, 97, 1021, 65536 + 13, 300007};
  for (const OptimizerOptions& o : all_optimizers()) {
    for (DType grad_dtype : kAllDTypes) {
      for (DType copy_dtype : kAllDTypes) {
        for (std::size_t n : sizes) {
          CAPTURE(name_of(o.kind));
          CAPTURE(o.momentum);
          CAPTURE(grad_dtype);
          CAPTURE(copy_dtype);
          CAPTURE(n);
          Arrays ref = random_arrays(n, grad_dtype, rng);
          Arrays vec = ref;
          const int slots = o.state_slots();
          const double grad_scale = 0.37;
          for (std::int64_t step = 1; step <= 3; ++step) {
            const Arrays before = ref;
            const StepScalars s = make_step_scalars(o, step, o.lr, grad_scale);
            cpu_optimizer_step(o, s, view(ref, grad_dtype, copy_dtype, true, slots), CpuKernel::reference);
            cpu_optimizer_step(o, s, view(vec, grad_dtype, copy_dtype, true, slots), CpuKernel::vectorized);
            // Vector equality compares bits for the 16-bit copies and values
            // for floats; NaN never occurs in these buffers.
            REQUIRE(ref.master == vec.master);
            REQUIRE(ref.m == vec.m);
            REQUIRE(ref.v == vec.v);
            if (copy_dtype == DType::fp32) REQUIRE(ref.copy32 == vec.copy32);
            else REQUIRE(ref.copy16 == vec.copy16);
            double worst = 0;
            for (std::size_t i = 0; i < n; ++i) {
              double p = before.master[i], m = before.m[i], v = before.v[i];
              const double g = load_as_float(grad_dtype == DType::fp32 ? static_cast<const void*>(before.grad32.data())
                                                                       : before.grad16.data(),
                                             i, grad_dtype);
              reference_f64(o, step, o.lr, grad_scale, p, m, v, g);
              // Relative to the larger of the old and new value (an update that
              // lands near zero cancels; its rounding is that of the inputs).
              worst = std::max(worst, std::fabs(ref.master[i] - p) /
                                          std::max({std::fabs(p), std::fabs(static_cast<double>(before.master[i])), o.lr}));
              // Moments are sums of two terms that may cancel: measure against
              // the size of the terms (the error of one rounding of each).
              const double terms = std::fabs(o.kind == OptimizerKind::sgd ? o.momentum : o.kind == OptimizerKind::adamw ? o.beta1 : o.beta2) * std::fabs(before.m[i]) +
                                   std::fabs(g * grad_scale) + std::fabs(o.weight_decay * before.master[i]);
              if (slots >= 1) worst = std::max(worst, std::fabs(ref.m[i] - m) / std::max(std::fabs(m), terms));
              if (slots >= 2) worst = std::max(worst, std::fabs(ref.v[i] - v) / std::max(std::fabs(v), 1e-6));
              const float copy = load_as_float(copy_dtype == DType::fp32 ? static_cast<const void*>(ref.copy32.data())
                                                                         : ref.copy16.data(),
                                               i, copy_dtype);
              REQUIRE(std::isfinite(copy));  // poison overwritten
              if (copy_dtype != DType::fp32)
                REQUIRE(std::fabs(copy - round_to(copy_dtype, static_cast<float>(p))) <= ulp_of(copy_dtype, static_cast<float>(p)));
            }
            CHECK(worst <= 1e-6);
          }
        }
      }
    }
  }
}

// The EMA in the update's pass (what the offloaded update runs) against the
// update followed by cpu_ema_update (the separate pass it replaces) and the
// reference loop with the EMA: the same bits for every optimizer, dtype and
// a size that leaves a partial chunk.
TEST_CASE("CPU optimizer with the EMA in the same pass: the same bits as the update then cpu_ema_update") {
  std::mt19937 rng(77);
  std::normal_distribution<float> normal;
  for (const OptimizerOptions& o : all_optimizers()) {
    for (DType grad_dtype : kAllDTypes) {
      for (DType copy_dtype : {DType::fp32, DType::bf16}) {
        for (std::size_t n : {std::size_t{1}, std::size_t{1021}, std::size_t{65536 + 13}}) {
          CAPTURE(name_of(o.kind));
          CAPTURE(grad_dtype);
          CAPTURE(copy_dtype);
          CAPTURE(n);
          Arrays fused = random_arrays(n, grad_dtype, rng);
          Arrays two_pass = fused, reference = fused;
          std::vector<float> ema_fused(n), ema_two_pass, ema_reference;
          for (float& e : ema_fused) e = normal(rng);
          ema_two_pass = ema_reference = ema_fused;
          const std::vector<float> ema_before = ema_fused;
          const int slots = o.state_slots();
          for (std::int64_t step = 1; step <= 3; ++step) {
            const double decay = step == 2 ? 0.999 : 0.75;  // 1 - decay rounds differently
            const StepScalars s = make_step_scalars(o, step, o.lr, 0.5);
            ShardUpdate u = view(fused, grad_dtype, copy_dtype, true, slots);
            u.ema = ema_fused.data();
            u.ema_decay = decay;
            cpu_optimizer_step(o, s, u, CpuKernel::vectorized);
            ShardUpdate r = view(reference, grad_dtype, copy_dtype, true, slots);
            r.ema = ema_reference.data();
            r.ema_decay = decay;
            cpu_optimizer_step(o, s, r, CpuKernel::reference);
            cpu_optimizer_step(o, s, view(two_pass, grad_dtype, copy_dtype, true, slots), CpuKernel::vectorized);
            cpu_ema_update(ema_two_pass.data(), two_pass.master.data(), n, decay);
            REQUIRE(fused.master == two_pass.master);
            REQUIRE(fused.master == reference.master);
            REQUIRE(fused.m == two_pass.m);
            REQUIRE(fused.v == two_pass.v);
            if (copy_dtype == DType::fp32) REQUIRE(fused.copy32 == two_pass.copy32);
            else REQUIRE(fused.copy16 == two_pass.copy16);
            REQUIRE(ema_fused == ema_two_pass);
            REQUIRE(ema_fused == ema_reference);
            // The EMA moved toward the weights: the test cannot pass with the EMA left out.
            REQUIRE(ema_fused != ema_before);
          }
          const ShardUpdate tail = view(fused, grad_dtype, copy_dtype, true, slots).slice(n - 1, 1);
          ShardUpdate with_ema = view(fused, grad_dtype, copy_dtype, true, slots);
          with_ema.ema = ema_fused.data();
          REQUIRE(with_ema.slice(n - 1, 1).ema == ema_fused.data() + (n - 1));
          REQUIRE(tail.ema == nullptr);
        }
      }
    }
  }
}

// The sum of squares: fp32 partials of at most 16 positive squares (relative
// error below 16 x 2^-24 < 1e-6 each), summed in double; so within 1e-6 of
// the float64 sum, and the same bits with any thread count.
TEST_CASE("gradient statistics: sum of squares within 1e-6 of float64, independent of threads, non-finite detected") {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  for (DType dtype : kAllDTypes) {
    for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{1000003}}) {
      std::vector<std::byte> data(n * size_of(dtype));
      double expected = 0;
      for (std::size_t i = 0; i < n; ++i) {
        store_from_float(data.data(), i, dtype, normal(rng));
        const double x = load_as_float(data.data(), i, dtype);
        expected += x * x;
      }
      const GradStats vec = cpu_grad_stats(data.data(), n, dtype, CpuKernel::vectorized);
      const GradStats ref = cpu_grad_stats(data.data(), n, dtype, CpuKernel::reference);
      CHECK(vec.sum_squares == ref.sum_squares);
      CHECK(vec.sum_squares == doctest::Approx(expected).epsilon(1e-6));
      CHECK_FALSE(vec.nonfinite);
      if (n > 0) {
        store_from_float(data.data(), n / 2, dtype, std::nanf(""));
        CHECK(cpu_grad_stats(data.data(), n, dtype).nonfinite);
        store_from_float(data.data(), n / 2, dtype, INFINITY);
        CHECK(cpu_grad_stats(data.data(), n, dtype).nonfinite);
        if (dtype != DType::fp16) {  // finite squares beyond fp32's range are not non-finite
          store_from_float(data.data(), n / 2, dtype, 1e20f);
          const GradStats big = cpu_grad_stats(data.data(), n, dtype);
          CHECK_FALSE(big.nonfinite);
          CHECK(big.sum_squares >= 0.9e40);  // bf16 rounds 1e20 to 9.97e19
        }
      }
    }
  }
}

TEST_CASE("conversion and accumulation helpers round once") {
  std::vector<float> src = {1.0f, 1.00390625f, -3.5f, 65504.0f, 1e-8f};
  std::vector<std::uint16_t> bf(src.size());
  cpu_convert(src.data(), DType::fp32, bf.data(), DType::bf16, src.size());
  for (std::size_t i = 0; i < src.size(); ++i) CHECK(bf16_bits_to_float(bf[i]) == round_to(DType::bf16, src[i]));
  std::vector<std::uint16_t> acc = bf;
  cpu_accumulate(acc.data(), bf.data(), DType::bf16, bf.size());
  for (std::size_t i = 0; i < src.size(); ++i)
    CHECK(bf16_bits_to_float(acc[i]) == round_to(DType::bf16, 2 * bf16_bits_to_float(bf[i])));
}

TEST_CASE("cpu_accumulate: bit for bit the scalar add and rounding, every dtype, across chunks and threads") {
  // More elements than one task's chunk, so the threaded, vectorized path
  // runs; values that round (ties included), overflow to inf, and NaNs.
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const std::size_t n = (std::size_t{1} << 17) + 77;
  for (DType dtype : {DType::fp32, DType::bf16, DType::fp16}) {
    CAPTURE(dtype);
    const std::size_t width = size_of(dtype);
    std::vector<std::byte> dst(n * width), src(n * width);
    for (std::size_t i = 0; i < n; ++i) {
      float a = normal(rng), b = normal(rng);
      if (i % 97 == 0) a = std::numeric_limits<float>::quiet_NaN();
      if (i % 101 == 0) b = 60000.0f;  // fp16: a + b overflows to inf
      if (i % 103 == 0) std::tie(a, b) = std::pair{1.0f, 0.00390625f};  // bf16: a tie
      store_from_float(dst.data(), i, dtype, a);
      store_from_float(src.data(), i, dtype, b);
    }
    std::vector<std::byte> expected = dst;
    for (std::size_t i = 0; i < n; ++i)
      store_from_float(expected.data(), i, dtype, load_as_float(expected.data(), i, dtype) + load_as_float(src.data(), i, dtype));
    cpu_accumulate(dst.data(), src.data(), dtype, n);
    CHECK(std::memcmp(dst.data(), expected.data(), dst.size()) == 0);
  }
}

// bf16 optimizer state (OptimizerOptions::state_dtype): the rounding, the
// kernels' agreement, and that the moments keep moving where round-to-nearest
// would freeze them.
TEST_CASE("bf16_round_stochastic: rounds up with the dropped fraction's probability, exactly; keeps specials") {
  // 1 + k/4 of a bf16 ulp (2^-7 at 1.0): over all 2^16 random values exactly
  // k/4 of them round up.
  for (int k = 0; k < 4; ++k) {
    const float x = 1.0f + static_cast<float>(k) * 0.25f * 0x1p-7f;
    int up = 0;
    for (std::uint32_t r = 0; r < 65536; ++r) {
      const std::uint16_t b = bf16_round_stochastic(x, r);
      REQUIRE((b == 0x3f80 || b == 0x3f81));
      up += b == 0x3f81;
    }
    CHECK(up == k * 16384);
  }
  // Negative values round away from zero with the same probability (the
  // magnitude's bits are what is rounded).
  CHECK(bf16_round_stochastic(-1.0f - 0x1p-8f, 0x8000) == 0xbf81);
  CHECK(bf16_round_stochastic(-1.0f - 0x1p-8f, 0x7fff) == 0xbf80);
  // Only the low 16 bits of the random word count.
  CHECK(bf16_round_stochastic(1.0f + 0x1p-8f, 0xffff0000u) == 0x3f80);
  CHECK(bf16_state_to_float(bf16_round_stochastic(3.5f, 0xffff)) == 3.5f);  // exact values stay
  CHECK(bf16_round_stochastic(std::numeric_limits<float>::infinity(), 0xffff) == 0x7f80);
  CHECK(bf16_round_stochastic(-std::numeric_limits<float>::infinity(), 0xffff) == 0xff80);
  CHECK(std::isnan(bf16_state_to_float(bf16_round_stochastic(std::nanf(""), 0xffff))));
  // The random bits differ by element and by step.
  CHECK(state_rounding_bits(0, 1) != state_rounding_bits(1, 1));
  CHECK(state_rounding_bits(5, rounding_key_of(1)) != state_rounding_bits(5, rounding_key_of(2)));
  CHECK(state_rounding_bits(5, 7) != state_rounding_bits(5 + (std::uint64_t{1} << 32), 7));
}

TEST_CASE("bf16 optimizer state: vectorized == reference bit for bit, at any cut; the index draws the bits") {
  std::mt19937 rng(4242);
  for (OptimizerOptions o : all_optimizers()) {
    const int slots = o.state_slots();
    if (slots == 0) continue;
    o.state_dtype = DType::bf16;
    // With the EMA in the update's pass too (the offloaded update's path).
    for (const auto& [grad_dtype, with_ema] : {std::pair{DType::fp32, false}, std::pair{DType::bf16, false},
                                               std::pair{DType::bf16, true}}) {
      const std::size_t n = 65536 + 13;  // several chunks, spread over the threads
      CAPTURE(name_of(o.kind));
      CAPTURE(grad_dtype);
      CAPTURE(with_ema);
      Arrays base = random_arrays(n, grad_dtype, rng);
      std::vector<std::uint16_t> m16(n), v16(n);
      for (std::size_t i = 0; i < n; ++i) {
        m16[i] = bf16_round_stochastic(base.m[i], 0x8000);
        v16[i] = bf16_round_stochastic(base.v[i], 0x8000);
      }
      std::vector<float> ema0(n);
      for (std::size_t i = 0; i < n; ++i) ema0[i] = base.master[i] * 0.75f;
      struct Run {
        Arrays a;
        std::vector<std::uint16_t> m, v;
        std::vector<float> ema;
      };
      Run whole{base, m16, v16, ema0}, reference = whole, cut = whole, shifted = whole;
      auto update_of = [&](Run& run, std::uint64_t first_index) {
        ShardUpdate u = view(run.a, grad_dtype, DType::bf16, true, slots);
        u.state0 = run.m.data();
        u.state1 = slots >= 2 ? run.v.data() : nullptr;
        u.state_dtype = DType::bf16;
        u.first_index = first_index;
        if (with_ema) {
          u.ema = run.ema.data();
          u.ema_decay = 0.9;
        }
        return u;
      };
      const std::uint64_t first = (std::uint64_t{1} << 32) - 1000;  // crosses 2^32 inside the span
      for (std::int64_t step = 1; step <= 3; ++step) {
        const StepScalars s = make_step_scalars(o, step, o.lr, 0.5);
        cpu_optimizer_step(o, s, update_of(whole, first), CpuKernel::vectorized);
        cpu_optimizer_step(o, s, update_of(reference, first), CpuKernel::reference);
        const ShardUpdate u = update_of(cut, first);
        const std::size_t at = 4096 + 7 * static_cast<std::size_t>(step);
        cpu_optimizer_step(o, s, u.slice(at, n - at), CpuKernel::vectorized);
        cpu_optimizer_step(o, s, u.slice(0, at), CpuKernel::vectorized);
        cpu_optimizer_step(o, s, update_of(shifted, first + 1), CpuKernel::vectorized);
      }
      REQUIRE(whole.a.master == reference.a.master);
      REQUIRE(whole.m == reference.m);
      REQUIRE(whole.v == reference.v);
      REQUIRE(whole.a.copy16 == reference.a.copy16);
      REQUIRE(cut.a.master == whole.a.master);
      REQUIRE(cut.m == whole.m);
      REQUIRE(cut.v == whole.v);
      REQUIRE(whole.ema == reference.ema);
      REQUIRE(cut.ema == whole.ema);
      CHECK((whole.ema != ema0) == with_ema);
      // Other indices, other rounding: some state bits differ.
      CHECK(shifted.m != whole.m);
      // The state moved (the update wrote it), and stayed near fp32 state's.
      CHECK(whole.m != m16);
      Arrays fp32 = base;
      for (std::size_t i = 0; i < n; ++i) {
        fp32.m[i] = bf16_state_to_float(m16[i]);
        fp32.v[i] = bf16_state_to_float(v16[i]);
      }
      OptimizerOptions o32 = o;
      o32.state_dtype = DType::fp32;
      for (std::int64_t step = 1; step <= 3; ++step)
        cpu_optimizer_step(o32, make_step_scalars(o32, step, o32.lr, 0.5),
                           view(fp32, grad_dtype, DType::bf16, true, slots));
      // In the max norm (a moment passing near zero carries the absolute
      // error of the larger terms it was made of): each of the three
      // roundings adds under one bf16 ulp, 2^-7 relative at most.
      double diff = 0, scale = 0;
      for (std::size_t i = 0; i < n; ++i) {
        diff = std::max(diff, std::fabs(static_cast<double>(bf16_state_to_float(whole.m[i])) - fp32.m[i]));
        scale = std::max(scale, std::fabs(static_cast<double>(fp32.m[i])));
      }
      MESSAGE(name_of(o.kind), ": bf16 state's m within ", diff / scale, " of fp32 state's (max norm)");
      CHECK(diff / scale < 3 * 0x1p-7);
    }
  }
}

TEST_CASE("bf16 AdamW state keeps decaying where round-to-nearest would freeze it") {
  // v <- 0.999 v with zero gradients: 0.1% a step, under half a bf16 ulp, so
  // round-to-nearest leaves v where it is; stochastic rounding follows
  // 0.999^t on average.
  OptimizerOptions o;
  o.lr = 1e-3;
  o.weight_decay = 0;
  o.state_dtype = DType::bf16;
  const std::size_t n = 8192;
  std::vector<float> master(n, 1.0f), grad(n, 0.0f);
  std::vector<std::uint16_t> m(n, 0), v(n, bf16_round_stochastic(1e-2f, 0x8000));
  const double v0 = bf16_state_to_float(v[0]);
  ShardUpdate u;
  u.master = master.data();
  u.grad = grad.data();
  u.state0 = m.data();
  u.state1 = v.data();
  u.state_dtype = DType::bf16;
  u.count = n;
  const int steps = 300;
  for (int step = 1; step <= steps; ++step) cpu_optimizer_step(o, make_step_scalars(o, step, o.lr, 1.0), u);
  double mean = 0;
  for (std::uint16_t b : v) mean += bf16_state_to_float(b);
  mean /= static_cast<double>(n);
  const double expected = v0 * std::pow(0.999, steps);  // 0.741 v0
  MESSAGE("v after ", steps, " zero-gradient steps: ", mean / v0, " of v0 (fp32 state: ", expected / v0, ")");
  CHECK(std::fabs(mean - expected) < 0.01 * expected);
  // And the fp16 dtype is refused for the state.
  OptimizerOptions bad = o;
  bad.state_dtype = DType::fp16;
  CHECK_THROWS_WITH_AS(bad.validate(), doctest::Contains("state_dtype must be fp32 or bf16"), InvalidArgument);
  u.state_dtype = DType::fp16;
  CHECK_THROWS_WITH_AS(cpu_optimizer_step(o, make_step_scalars(o, 1, o.lr, 1.0), u),
                       doctest::Contains("state_dtype must be fp32 or bf16"), InvalidArgument);
}

TEST_CASE("kernels reject missing state with a clear message") {
  OptimizerOptions o;
  std::vector<float> p(4, 1.0f), g(4, 1.0f);
  ShardUpdate u;
  u.master = p.data();
  u.grad = g.data();
  u.count = 4;
  CHECK_THROWS_WITH_AS(cpu_optimizer_step(o, make_step_scalars(o, 1, 1e-3, 1), u),
                       doctest::Contains("adamw needs state0"), InvalidArgument);
  CHECK_THROWS_WITH_AS(make_step_scalars(o, 0, 1e-3, 1), doctest::Contains("step must be >= 1"), InvalidArgument);
}

TEST_CASE("dynamic loss scaler: backoff after hysteresis, growth after the interval, bounds") {
  DynamicLossScaler scaler({.initial_scale = 1024, .growth_interval = 3, .hysteresis = 2});
  CHECK(scaler.update(false));
  CHECK(scaler.update(false));
  CHECK(scaler.update(false));
  CHECK(scaler.scale() == 2048);
  CHECK_FALSE(scaler.update(true));  // first overflow: skipped, hysteresis absorbs it
  CHECK(scaler.scale() == 2048);
  CHECK_FALSE(scaler.update(true));  // second: back off
  CHECK(scaler.scale() == 1024);
  CHECK(scaler.skipped_steps() == 2);
  DynamicLossScaler floor({.initial_scale = 2, .hysteresis = 1, .min_scale = 1});
  floor.update(true);
  floor.update(true);
  CHECK(floor.scale() == 1);
  DynamicLossScaler fixed({.dynamic = false, .initial_scale = 128});
  CHECK_FALSE(fixed.update(true));
  CHECK(fixed.scale() == 128);
  CHECK_THROWS_AS(DynamicLossScaler({.initial_scale = -1}), InvalidArgument);
}
