// The CUDA kernels against references on the host: the optimizer steps
// against a float64 evaluation of the same formulas (and, bit for bit, against
// the float evaluation of optimizer.hpp's element functions), conversions and
// accumulation against the host rounding functions. Fresh random data on every
// run (the seed is printed on failure); outputs poisoned before each launch;
// guard bytes around every buffer checked after it.

#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "gpu_test_util.hpp"
#include "zero/cuda/kernels.hpp"

namespace zero::test {
namespace {

const std::size_t kSizes[] = {0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 257, 4099, 65537, 1000003};

/// ZERO_GPU_TEST_QUICK=1 drops the million-element cases (for runs under
/// compute-sanitizer, which slows every access down).
bool quick() { return std::getenv("ZERO_GPU_TEST_QUICK") != nullptr; }
std::size_t large_size() { return quick() ? 100003 : 1000003; }

/// Element offsets of (master, grad, state0, state1, copy) from a 256-byte
/// boundary: all aligned, all equally misaligned (vector body after a scalar
/// head), and mutually misaligned (scalar path).
struct Placement {
  const char* name;
  std::size_t master, grad, state0, state1, copy;
};
const Placement kPlacements[] = {
    {"aligned", 0, 0, 0, 0, 0},
    {"shifted-3", 3, 3, 3, 3, 3},
    {"mixed", 1, 2, 0, 3, 5},
};

struct OptimizerCase {
  const char* name;
  OptimizerOptions options;
  std::int64_t step;
};

std::vector<OptimizerCase> optimizer_cases() {
  std::vector<OptimizerCase> cases;
  OptimizerOptions adamw;
  adamw.kind = OptimizerKind::adamw;
  adamw.lr = 1e-3;
  adamw.weight_decay = 0.01;
  cases.push_back({"adamw", adamw, 5});
  OptimizerOptions nesterov;
  nesterov.kind = OptimizerKind::sgd;
  nesterov.lr = 0.05;
  nesterov.momentum = 0.9;
  nesterov.nesterov = true;
  nesterov.weight_decay = 1e-4;
  cases.push_back({"sgd-nesterov", nesterov, 3});
  OptimizerOptions damped = nesterov;
  damped.nesterov = false;
  damped.dampening = 0.1;
  cases.push_back({"sgd-dampened-first-step", damped, 1});
  OptimizerOptions plain;
  plain.kind = OptimizerKind::sgd;
  plain.lr = 0.1;
  plain.weight_decay = 0.0;
  cases.push_back({"sgd-no-momentum", plain, 2});
  OptimizerOptions lion;
  lion.kind = OptimizerKind::lion;
  lion.lr = 1e-4;
  lion.beta1 = 0.9;
  lion.beta2 = 0.99;
  lion.weight_decay = 0.1;
  cases.push_back({"lion", lion, 4});
  return cases;
}

/// The optimizer math in float64, from the same float scalars the kernels use.
void reference_step(OptimizerKind kind, const StepScalars& s, double& p, double& m, double& v,
                    double g, bool has_state) {
  g = g * s.grad_scale;
  switch (kind) {
    case OptimizerKind::adamw: {
      p = p * (1.0 - double(s.lr) * s.weight_decay);
      m = double(s.beta1) * m + double(s.one_minus_beta1) * g;
      v = double(s.beta2) * v + double(s.one_minus_beta2) * (g * g);
      const double denom = std::sqrt(v) / s.bias_correction2_sqrt + s.eps;
      p = p - (double(s.lr) / s.bias_correction1) * (m / denom);
      return;
    }
    case OptimizerKind::lion: {
      const double c = double(s.beta1) * m + double(s.one_minus_beta1) * g;
      const double sign = double((c > 0) - (c < 0));
      p = p * (1.0 - double(s.lr) * s.weight_decay);
      p = p - double(s.lr) * sign;
      m = double(s.beta2) * m + double(s.one_minus_beta2) * g;
      return;
    }
    case OptimizerKind::sgd: {
      g = g + double(s.weight_decay) * p;
      if (has_state) {
        const double b = s.first_step ? g : double(s.momentum) * m + (1.0 - double(s.dampening)) * g;
        m = b;
        g = s.nesterov ? g + double(s.momentum) * b : b;
      }
      p = p - double(s.lr) * g;
      return;
    }
  }
}

/// optimizer.hpp's element functions evaluated in float on the host.
void float_step(OptimizerKind kind, const StepScalars& s, float& p, float& m, float& v, float g,
                bool has_state) {
  switch (kind) {
    case OptimizerKind::adamw: adamw_element(p, m, v, g, s); return;
    case OptimizerKind::lion: lion_element(p, m, g, s); return;
    case OptimizerKind::sgd: sgd_element(p, has_state ? &m : nullptr, g, s); return;
  }
}

struct RunConfig {
  const OptimizerCase* optimizer;
  DType grad_dtype;
  bool with_copy;
  DType copy_dtype;
  std::size_t count;
  const Placement* placement;
  gpu::LaunchTuning tuning;
};

void check_optimizer_run(const RunConfig& c, std::uint64_t seed) {
  const OptimizerOptions& options = c.optimizer->options;
  const StepScalars s = make_step_scalars(options, c.optimizer->step, options.lr, 0.5);
  const bool has_state0 = options.state_slots() >= 1;
  const bool has_state1 = options.state_slots() >= 2;
  std::mt19937_64 rng(seed);
  const std::size_t n = c.count;
  HostArray master = random_array(rng, DType::fp32, n, -1.0f, 1.0f);
  HostArray grad = random_array(rng, c.grad_dtype, n, -1.0f, 1.0f);
  HostArray state0 = random_array(rng, DType::fp32, n, -0.1f, 0.1f);
  HostArray state1 = random_array(rng, DType::fp32, n, 0.0f, 0.01f);
  HostArray copy(c.copy_dtype, n);
  for (std::size_t i = 0; i < n; ++i) copy.set(i, std::numeric_limits<float>::quiet_NaN());

  const Placement& at = *c.placement;
  DeviceBuffer d_master(n * 4 + 64), d_grad(n * size_of(c.grad_dtype) + 64), d_state0(n * 4 + 64),
      d_state1(n * 4 + 64), d_copy(n * size_of(c.copy_dtype) + 64);
  const std::size_t o_master = at.master * 4, o_grad = at.grad * size_of(c.grad_dtype),
                    o_state0 = at.state0 * 4, o_state1 = at.state1 * 4,
                    o_copy = at.copy * size_of(c.copy_dtype);
  d_master.upload(master.data(), n * 4, o_master);
  d_grad.upload(grad.data(), grad.bytes.size(), o_grad);
  if (has_state0) d_state0.upload(state0.data(), n * 4, o_state0);
  if (has_state1) d_state1.upload(state1.data(), n * 4, o_state1);
  if (c.with_copy) d_copy.upload(copy.data(), copy.bytes.size(), o_copy);

  auto at_offset = [](DeviceBuffer& b, std::size_t offset) {
    return static_cast<void*>(static_cast<unsigned char*>(b.data()) + offset);
  };
  ShardUpdate u;
  u.master = static_cast<float*>(at_offset(d_master, o_master));
  u.grad = at_offset(d_grad, o_grad);
  u.grad_dtype = c.grad_dtype;
  u.state0 = has_state0 ? static_cast<float*>(at_offset(d_state0, o_state0)) : nullptr;
  u.state1 = has_state1 ? static_cast<float*>(at_offset(d_state1, o_state1)) : nullptr;
  u.model_copy = c.with_copy ? at_offset(d_copy, o_copy) : nullptr;
  u.model_dtype = c.copy_dtype;
  u.count = n;
  gpu::optimizer_step(options, s, u, c.tuning, nullptr);
  ZERO_CHECK_CUDA(cudaDeviceSynchronize());

  HostArray out_master(DType::fp32, n), out_state0(DType::fp32, n), out_state1(DType::fp32, n),
      out_copy(c.copy_dtype, n);
  d_master.download(out_master.data(), n * 4, o_master);
  if (has_state0) d_state0.download(out_state0.data(), n * 4, o_state0);
  if (has_state1) d_state1.download(out_state1.data(), n * 4, o_state1);
  if (c.with_copy) d_copy.download(out_copy.data(), out_copy.bytes.size(), o_copy);

  std::vector<double> got_p(n), ref_p(n), got_m(n), ref_m(n), got_v(n), ref_v(n), in_p(n), in_m(n),
      in_v(n);
  std::size_t bit_mismatches = 0, copy_mismatches = 0, copy_far = 0, nonfinite_copies = 0;
  for (std::size_t i = 0; i < n; ++i) {
    double p = master.get(i), m = state0.get(i), v = state1.get(i);
    in_p[i] = p;
    in_m[i] = m;
    in_v[i] = v;
    reference_step(options.kind, s, p, m, v, grad.get(i), has_state0);
    ref_p[i] = p;
    ref_m[i] = m;
    ref_v[i] = v;
    float fp = master.get(i), fm = state0.get(i), fv = state1.get(i);
    float_step(options.kind, s, fp, fm, fv, grad.get(i), has_state0);
    got_p[i] = out_master.get(i);
    got_m[i] = has_state0 ? out_state0.get(i) : m;
    got_v[i] = has_state1 ? out_state1.get(i) : v;
    if (out_master.get(i) != fp || (has_state0 && out_state0.get(i) != fm) ||
        (has_state1 && out_state1.get(i) != fv))
      ++bit_mismatches;
    if (c.with_copy) {
      const float copied = out_copy.get(i);
      if (!std::isfinite(copied)) ++nonfinite_copies;
      if (copied != round_to(c.copy_dtype, out_master.get(i))) ++copy_mismatches;
      // "Within one rounding step of the rounded fp64 result" holds where the
      // fp32 master is closer to fp64 than a quarter step; where terms cancel
      // the fp32 error itself (checked above) is the larger one. An fp32
      // copy is the master bit for bit (checked above).
      const double master_error = std::abs(static_cast<double>(out_master.get(i)) - p);
      if (c.copy_dtype != DType::fp32 && master_error < 0.25 * step16(c.copy_dtype, p) &&
          !within_one_step(c.copy_dtype, copied, p))
        ++copy_far;
    }
  }
  INFO("optimizer ", std::string(c.optimizer->name), ", grad ",
       std::string(name_of(c.grad_dtype)), ", copy ",
       std::string(c.with_copy ? name_of(c.copy_dtype) : "none"), ", count ", n, ", placement ",
       std::string(c.placement->name), ", threads ", c.tuning.threads, "x",
       c.tuning.max_blocks_per_sm, ", seed ", seed);
  CHECK(relative_error(got_p, ref_p, in_p) <= 1e-6);
  if (has_state0) CHECK(relative_error(got_m, ref_m, in_m) <= 1e-6);
  if (has_state1) CHECK(relative_error(got_v, ref_v, in_v) <= 1e-6);
  // No contraction on either side and IEEE sqrt/div: the same bits as the host.
  CHECK(bit_mismatches == 0);
  CHECK(nonfinite_copies == 0);
  CHECK(copy_mismatches == 0);
  CHECK(copy_far == 0);
  CHECK(d_master.guards_intact(o_master, n * 4));
  CHECK(d_grad.guards_intact(o_grad, grad.bytes.size()));
  if (has_state0) CHECK(d_state0.guards_intact(o_state0, n * 4));
  if (has_state1) CHECK(d_state1.guards_intact(o_state1, n * 4));
  if (c.with_copy) CHECK(d_copy.guards_intact(o_copy, out_copy.bytes.size()));
  // Buffers an optimizer does not use are never touched.
  if (!has_state0) CHECK(d_state0.guards_intact(0, 0));
  if (!has_state1) CHECK(d_state1.guards_intact(0, 0));
}

}  // namespace

TEST_CASE("kernels: optimizer steps match float64 and the host element functions") {
  const std::uint64_t seed = fresh_seed();
  const auto cases = optimizer_cases();
  std::uint64_t run = 0;
  for (const OptimizerCase& opt : cases) {
    for (DType grad_dtype : kAllDTypes) {
      for (int copy_kind = 0; copy_kind < 4; ++copy_kind) {
        const bool with_copy = copy_kind > 0;
        const DType copy_dtype = with_copy ? kAllDTypes[copy_kind - 1] : DType::bf16;
        for (std::size_t count : kSizes) {
          for (const Placement& placement : kPlacements) {
            // The largest size once per optimizer/grad/copy only: it is the
            // slow one on the host side and adds nothing per placement.
            if (count > 100000 && (quick() || &placement != &kPlacements[1])) continue;
            RunConfig config{&opt, grad_dtype, with_copy, copy_dtype, count, &placement, {}};
            check_optimizer_run(config, seed + run++);
          }
        }
      }
    }
  }
}

TEST_CASE("kernels: optimizer grid-stride loop with small grids") {
  // A capped grid makes every thread loop over many chunks; 64 threads x 1
  // block per SM on a 1M-element span.
  const std::uint64_t seed = fresh_seed();
  const auto cases = optimizer_cases();
  const gpu::LaunchTuning tunings[] = {{64, 1}, {128, 2}, {256, -1}, {1024, 4}};
  std::uint64_t run = 0;
  for (const gpu::LaunchTuning& tuning : tunings) {
    for (const OptimizerCase& opt : cases) {
      for (const Placement& placement : kPlacements) {
        RunConfig config{&opt, DType::bf16, true, DType::bf16, large_size(), &placement, tuning};
        check_optimizer_run(config, seed + run++);
      }
    }
  }
}

TEST_CASE("kernels: bf16 optimizer state, the same bits as the host kernel, at any offset and cut") {
  // The stochastic rounding's bits come from each element's index in the
  // full buffer (first_index): the device draws what the host draws, in
  // chunks of 8 and in the one-at-a-time head and tail alike.
  std::mt19937 rng(static_cast<std::uint32_t>(fresh_seed()));
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> positive(1e-6f, 1e-2f);
  const std::size_t n = quick() ? 4099 : (std::size_t{1} << 20) + 13;
  for (const OptimizerCase& opt : optimizer_cases()) {
    OptimizerOptions o = opt.options;
    const int slots = o.state_slots();
    if (slots == 0) continue;
    o.state_dtype = DType::bf16;
    for (std::size_t shift : {std::size_t{0}, std::size_t{3}}) {  // 3: a head done one element at a time
      CAPTURE(std::string(opt.name));
      CAPTURE(shift);
      std::vector<float> master(n);
      std::vector<std::uint16_t> grad(n), m(n), v(n), copy(n, 0xffff);
      for (std::size_t i = 0; i < n; ++i) {
        master[i] = normal(rng);
        store_from_float(grad.data(), i, DType::bf16, 0.5f * normal(rng));
        m[i] = bf16_round_stochastic(0.1f * normal(rng), 0x8000);
        v[i] = bf16_round_stochastic(positive(rng), 0x8000);
      }
      DeviceBuffer d_master((n + shift) * 4), d_grad((n + shift) * 2), d_m((n + shift) * 2), d_v((n + shift) * 2),
          d_copy((n + shift) * 2);
      d_master.upload(master.data(), n * 4, shift * 4);
      d_grad.upload(grad.data(), n * 2, shift * 2);
      d_m.upload(m.data(), n * 2, shift * 2);
      d_v.upload(v.data(), n * 2, shift * 2);
      auto at = [&](DeviceBuffer& b, std::size_t size) { return static_cast<unsigned char*>(b.data()) + shift * size; };
      ShardUpdate device;
      device.master = reinterpret_cast<float*>(at(d_master, 4));
      device.grad = at(d_grad, 2);
      device.grad_dtype = DType::bf16;
      device.state0 = at(d_m, 2);
      device.state1 = slots >= 2 ? at(d_v, 2) : nullptr;
      device.state_dtype = DType::bf16;
      device.model_copy = at(d_copy, 2);
      device.model_dtype = DType::bf16;
      device.count = n;
      device.first_index = (std::uint64_t{1} << 32) - 517;  // crosses 2^32
      ShardUpdate host = device;
      host.master = master.data();
      host.grad = grad.data();
      host.state0 = m.data();
      host.state1 = slots >= 2 ? v.data() : nullptr;
      host.model_copy = copy.data();
      for (std::int64_t step = 1; step <= 2; ++step) {
        const StepScalars s = make_step_scalars(o, step, o.lr, 0.5);
        const std::size_t cut = 1001;  // two launches on the device, one pass on the host
        gpu::optimizer_step(o, s, device.slice(0, cut), nullptr);
        gpu::optimizer_step(o, s, device.slice(cut, n - cut), nullptr);
        cpu_optimizer_step(o, s, host, CpuKernel::reference);
      }
      ZERO_CHECK_CUDA(cudaDeviceSynchronize());
      std::vector<float> got_master(n);
      std::vector<std::uint16_t> got_m(n), got_v(n), got_copy(n);
      d_master.download(got_master.data(), n * 4, shift * 4);
      d_m.download(got_m.data(), n * 2, shift * 2);
      d_v.download(got_v.data(), n * 2, shift * 2);
      d_copy.download(got_copy.data(), n * 2, shift * 2);
      CHECK(got_master == master);
      CHECK(got_m == m);
      if (slots >= 2) CHECK(got_v == v);
      CHECK(got_copy == copy);
      CHECK(d_m.guards_intact(shift * 2, n * 2));
      if (slots >= 2) CHECK(d_v.guards_intact(shift * 2, n * 2));
    }
  }
}

TEST_CASE("kernels: optimizer_step validates its input") {
  OptimizerOptions adamw;
  const StepScalars s = make_step_scalars(adamw, 1, adamw.lr, 1.0);
  DeviceBuffer buffer(1024);
  ShardUpdate u;
  u.master = static_cast<float*>(buffer.data());
  u.grad = buffer.data();
  u.count = 16;
  CHECK_THROWS_AS(gpu::optimizer_step(adamw, s, u, nullptr), InvalidArgument);  // no state
  u.state0 = u.master;
  u.state1 = u.master;
  u.grad_dtype = static_cast<DType>(9);
  CHECK_THROWS_AS(gpu::optimizer_step(adamw, s, u, nullptr), InvalidArgument);
  u.grad_dtype = DType::fp32;
  u.grad = static_cast<unsigned char*>(buffer.data()) + 1;  // not float-aligned
  CHECK_THROWS_AS(gpu::optimizer_step(adamw, s, u, nullptr), InvalidArgument);
  CHECK_THROWS_AS(gpu::optimizer_step(adamw, s, u, gpu::LaunchTuning{33, 1}, nullptr),
                  InvalidArgument);
  u.count = 0;  // nothing to do: no launch, no error
  gpu::optimizer_step(adamw, s, u, nullptr);
  ZERO_CHECK_CUDA(cudaDeviceSynchronize());
}

TEST_CASE("kernels: convert between every dtype pair, exactly as the host rounds") {
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  for (DType from : kAllDTypes) {
    for (DType to : kAllDTypes) {
      for (std::size_t count : kSizes) {
        for (std::size_t shift : {std::size_t{0}, std::size_t{1}, std::size_t{5}}) {
          if (count > 100000 && (quick() || shift != 1)) continue;
          // Wide range: exercises fp16 overflow to inf and subnormals.
          HostArray src = random_array(rng, from, count, -70000.0f, 70000.0f);
          for (std::size_t i = 0; i < count; i += 7) src.set(i, src.get(i) * 1e-7f);
          const std::size_t src_off = shift * size_of(from), dst_off = (shift * 3 % 8) * size_of(to);
          DeviceBuffer d_src(src.bytes.size() + 64), d_dst(count * size_of(to) + 64);
          d_src.upload(src.data(), src.bytes.size(), src_off);
          HostArray poison(to, count);
          for (std::size_t i = 0; i < count; ++i) poison.set(i, std::numeric_limits<float>::quiet_NaN());
          d_dst.upload(poison.data(), poison.bytes.size(), dst_off);
          gpu::convert(static_cast<unsigned char*>(d_src.data()) + src_off, from,
                       static_cast<unsigned char*>(d_dst.data()) + dst_off, to, count, nullptr);
          ZERO_CHECK_CUDA(cudaDeviceSynchronize());
          HostArray out(to, count);
          d_dst.download(out.data(), out.bytes.size(), dst_off);
          std::size_t wrong = 0;
          for (std::size_t i = 0; i < count; ++i) {
            HostArray expect(to, 1);
            expect.set(0, src.get(i));
            if (std::memcmp(expect.bytes.data(), out.bytes.data() + i * size_of(to), size_of(to)) != 0)
              ++wrong;
          }
          INFO("convert ", std::string(name_of(from)), " -> ", std::string(name_of(to)), ", count ", count, ", shift ",
               shift, ", seed ", seed);
          CHECK(wrong == 0);
          CHECK(d_dst.guards_intact(dst_off, out.bytes.size()));
          CHECK(d_src.guards_intact(src_off, src.bytes.size()));
        }
      }
    }
  }
}

TEST_CASE("kernels: accumulate adds in fp32 and rounds once") {
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  for (DType dtype : kAllDTypes) {
    for (std::size_t count : kSizes) {
      for (std::size_t shift : {std::size_t{0}, std::size_t{2}}) {
        HostArray dst = random_array(rng, dtype, count, -4.0f, 4.0f);
        HostArray src = random_array(rng, dtype, count, -4.0f, 4.0f);
        const std::size_t dst_off = shift * size_of(dtype), src_off = (shift ? 1 : 0) * size_of(dtype);
        DeviceBuffer d_dst(dst.bytes.size() + 64), d_src(src.bytes.size() + 64);
        d_dst.upload(dst.data(), dst.bytes.size(), dst_off);
        d_src.upload(src.data(), src.bytes.size(), src_off);
        gpu::accumulate(static_cast<unsigned char*>(d_dst.data()) + dst_off,
                        static_cast<unsigned char*>(d_src.data()) + src_off, dtype, count, nullptr);
        ZERO_CHECK_CUDA(cudaDeviceSynchronize());
        HostArray out(dtype, count);
        d_dst.download(out.data(), out.bytes.size(), dst_off);
        std::size_t wrong = 0;
        for (std::size_t i = 0; i < count; ++i) {
          HostArray expect(dtype, 1);
          expect.set(0, dst.get(i) + src.get(i));
          if (std::memcmp(expect.bytes.data(), out.bytes.data() + i * size_of(dtype),
                          size_of(dtype)) != 0)
            ++wrong;
        }
        INFO("accumulate ", std::string(name_of(dtype)), ", count ", count, ", shift ", shift, ", seed ", seed);
        CHECK(wrong == 0);
        CHECK(d_dst.guards_intact(dst_off, out.bytes.size()));
      }
    }
  }
}

TEST_CASE("kernels: fill_uniform is in range and the same for the same seed") {
  for (DType dtype : kAllDTypes) {
    const std::size_t count = 100003;
    DeviceBuffer a(count * size_of(dtype) + 64), b(count * size_of(dtype) + 64);
    gpu::fill_uniform(a.data(), count, dtype, 42, -2.0f, 3.0f, nullptr);
    gpu::fill_uniform(static_cast<unsigned char*>(b.data()) + size_of(dtype), count, dtype, 42,
                      -2.0f, 3.0f, nullptr);
    ZERO_CHECK_CUDA(cudaDeviceSynchronize());
    HostArray x(dtype, count), y(dtype, count);
    a.download(x.data(), x.bytes.size());
    b.download(y.data(), y.bytes.size(), size_of(dtype));
    double sum = 0;
    bool in_range = true;
    for (std::size_t i = 0; i < count; ++i) {
      in_range = in_range && x.get(i) >= -2.0f && x.get(i) <= 3.0f;
      sum += x.get(i);
    }
    CHECK(in_range);
    CHECK(std::abs(sum / count - 0.5) < 0.05);
    CHECK(x.bytes == y.bytes);  // launch shape and alignment do not change the values
    gpu::fill_value(a.data(), count, dtype, std::numeric_limits<float>::quiet_NaN(), nullptr);
    ZERO_CHECK_CUDA(cudaDeviceSynchronize());
    a.download(x.data(), x.bytes.size());
    bool all_nan = true;
    for (std::size_t i = 0; i < count; ++i) all_nan = all_nan && std::isnan(x.get(i));
    CHECK(all_nan);
    CHECK(a.guards_intact(0, x.bytes.size()));
  }
}

}  // namespace zero::test
