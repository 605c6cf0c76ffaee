// Driving an engine through steps without a model, for the tests and test
// programs that need weights, gradients and steps but no particular network:
// random initial weights, one step's gradients that differ by (step, rank),
// and bitwise comparison of gathered tensors. No doctest here: the
// checkpoint_writer program uses it too.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "zero/engine/engine.hpp"

namespace zero::testing {

/// Every parameter from N(0, 1), the same values on every rank.
inline void init_random_params(Engine& engine, std::uint32_t seed = 5) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  for (std::size_t p = 0; p < engine.param_count(); ++p) {
    std::vector<float> v(engine.params()[p].numel);
    for (float& x : v) x = normal(rng);
    engine.set_param(p, v.data());
  }
}

/// The model-dtype parameters as floats, gathering each unit (stage 3) around
/// the read. With a backend, read through it (device memory); without, the
/// parameters must be host memory.
inline std::vector<std::vector<float>> read_model_params(Engine& engine, Backend* backend = nullptr) {
  const DType dtype = engine.options().param_dtype;
  std::vector<std::vector<float>> w(engine.param_count());
  for (std::size_t u = 0; u < engine.unit_count(); ++u) engine.gather_unit(u);
  for (std::size_t p = 0; p < engine.param_count(); ++p) {
    const std::size_t n = engine.params()[p].numel;
    const void* values = engine.param_data(p);
    std::vector<std::byte> staged;
    if (backend) {
      staged.resize(n * size_of(dtype));
      backend->copy_to_host(staged.data(), values, staged.size());
      values = staged.data();
    }
    for (std::size_t k = 0; k < n; ++k) w[p].push_back(load_as_float(values, k, dtype));
  }
  for (std::size_t u = 0; u < engine.unit_count(); ++u) engine.release_unit(u);
  return w;
}

enum class StepGradient {
  pull_to_half,  // w - 0.5 + 0.1 * noise: depends on the weights, so a wrong update shows later
  noise,         // 0.1 * noise
};

/// The engine's micro-steps (accumulation_steps of them), whose gradients
/// depend on (step, micro-step, rank) and, for pull_to_half, on the weights
/// w, then step(). The first micro-step's are what they were before
/// accumulation was driven here.
/// poison_rank >= 0: that rank writes a NaN into element 0 of parameter 0 (first micro-step).
/// With a backend, the gradients are written through it (device memory).
/// backward_order: the parameters' gradients are handed over last to first,
/// as a model's backward does (the values are the same either way).
inline StepResult run_step_from(Engine& engine, const std::vector<std::vector<float>>& w, int step, int rank,
                                StepGradient kind, int poison_rank = -1, Backend* backend = nullptr,
                                bool backward_order = false) {
  const DType g = engine.options().effective_grad_dtype();
  // Backward adds into a full buffer that is reduced only at the boundary
  // (as autograd accumulates .grad); elsewhere each micro-step's buffer is fresh.
  const bool adds = engine.plan().full_grads && engine.plan().reduce_only_at_boundary;
  for (int micro = 0; micro < engine.options().accumulation_steps; ++micro) {
    std::mt19937 rng(static_cast<std::uint32_t>(step * 131 + rank + micro * 7919));
    std::normal_distribution<float> normal;
    // Drawn in parameter order whatever the hand-over order: the same values.
    std::vector<std::vector<float>> values(engine.param_count());
    for (std::size_t p = 0; p < engine.param_count(); ++p) {
      if (engine.frozen(p)) continue;
      for (std::size_t k = 0; k < w[p].size(); ++k) {
        const float noise = 0.1f * normal(rng);
        values[p].push_back(kind == StepGradient::pull_to_half ? w[p][k] - 0.5f + noise : noise);
      }
    }
    for (std::size_t i = 0; i < engine.param_count(); ++i) {
      const std::size_t p = backward_order ? engine.param_count() - 1 - i : i;
      if (engine.frozen(p)) continue;  // no gradient
      void* grad = engine.grad_data(p);
      std::vector<std::byte> staged(backend ? w[p].size() * size_of(g) : 0);
      void* out = backend ? staged.data() : grad;
      if (backend && adds) backend->copy_to_host(staged.data(), grad, staged.size());
      for (std::size_t k = 0; k < w[p].size(); ++k)
        store_from_float(out, k, g, adds && micro > 0 ? load_as_float(out, k, g) + values[p][k] : values[p][k]);
      if (p == 0 && micro == 0 && rank == poison_rank)
        store_from_float(out, 0, g, std::numeric_limits<float>::quiet_NaN());
      if (backend) backend->copy_from_host(grad, staged.data(), staged.size());
      engine.grad_ready(p);
    }
    engine.finish_micro_step();
  }
  return engine.step();
}

/// run_step_from on the engine's own current parameters.
inline StepResult run_step(Engine& engine, int step, int rank, StepGradient kind, int poison_rank = -1) {
  return run_step_from(engine, read_model_params(engine), step, rank, kind, poison_rank);
}

inline bool bitwise_equal(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].size() != b[i].size()) return false;
    if (!a[i].empty() && std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)) != 0) return false;
  }
  return true;
}

}  // namespace zero::testing
