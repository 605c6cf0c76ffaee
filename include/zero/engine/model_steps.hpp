// Drives an Engine as a model's training loop does, without a model:
// forward enters every unit (stage 3), backward enters them in reverse and
// hands in every trained parameter's gradient, the engine's unit schedule
// deciding the prefetches (a checkpointed unit's recompute is a backward
// entry: the same schedule). The memory planner replays a configuration with
// it on a CountingBackend; tests drive real backends with it.
#pragma once

#include <cstddef>
#include <functional>

#include "zero/engine/engine.hpp"

namespace zero {

/// Runs `steps` optimizer steps of engine.options().accumulation_steps
/// micro-steps each. `write` fills a parameter's gradient before it is
/// declared ready (none: left as the engine zeroed it). Returns the last
/// step's result.
inline StepResult run_model_steps(Engine& engine, int steps,
                                  const std::function<void(std::size_t param, void* grad)>& write = {}) {
  StepResult last;
  for (int s = 0; s < steps; ++s) {
    for (int micro = 0; micro < engine.options().accumulation_steps; ++micro) {
      if (engine.plan().gathers_units)
        for (std::size_t u = 0; u < engine.unit_count(); ++u) {
          engine.enter_unit(u, Pass::forward);
          engine.release_unit(u);
        }
      for (std::size_t u = engine.unit_count(); u-- > 0;) {
        engine.enter_unit(u, Pass::backward);
        for (std::size_t p : engine.unit_params(u)) {
          if (engine.frozen(p)) continue;
          void* grad = engine.grad_data(p);
          if (write) write(p, grad);
          engine.grad_ready(p);
        }
        engine.release_unit(u);
      }
      engine.finish_micro_step();
    }
    last = engine.step();
  }
  return last;
}

}  // namespace zero
