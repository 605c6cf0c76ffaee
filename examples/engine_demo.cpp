// engine_demo: the sharding engine on CPU ranks, no torch. Trains a synthetic
// model (a few large tensors pulled towards a hidden target by a quadratic
// loss, with a hand-written backward) at each ZeRO stage and prints, for every
// rank, the memory the engine holds by category next to the ZeRO formula.
//
//   mpirun -np 2 build/cpu/examples/engine_demo --params 50M --stages 0,1,2,3
#include <CLI/CLI.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "zero/comm/mpi_communicator.hpp"
#include "zero/engine/engine.hpp"

using namespace zero;

namespace {

std::size_t parse_count(const std::string& text) {
  std::size_t used = 0;
  const double value = std::stod(text, &used);
  double scale = 1;
  const std::string suffix = text.substr(used);
  if (suffix == "K" || suffix == "k") scale = 1e3;
  else if (suffix == "M" || suffix == "m") scale = 1e6;
  else if (suffix == "G" || suffix == "g" || suffix == "B") scale = 1e9;
  else ZERO_CHECK(suffix.empty(), "--params: unknown suffix '", suffix, "' (use K, M or G)");
  ZERO_CHECK(value > 0, "--params must be positive, got ", text);
  return static_cast<std::size_t>(value * scale);
}

// Tensors of a transformer-like block structure adding up to about `total`.
std::vector<std::vector<ParamSpec>> synthetic_units(std::size_t total) {
  const std::size_t per_unit = std::max<std::size_t>(total / 8, 16);
  std::vector<std::vector<ParamSpec>> units;
  for (int u = 0; u < 8; ++u) {
    const std::size_t weight = per_unit * 3 / 4 + static_cast<std::size_t>(u);  // uneven on purpose
    units.push_back({{"block" + std::to_string(u) + ".weight", weight, {}},
                     {"block" + std::to_string(u) + ".bias", per_unit - weight + 7, {}}});
  }
  return units;
}

float target_of(std::size_t param, std::size_t k) {
  return std::sin(0.001f * static_cast<float>(k) + static_cast<float>(param));
}

struct DemoOptions {
  std::string params_text = "20M";
  std::vector<int> stages = {0, 1, 2, 3};
  std::string dtype_text = "bf16";
  int steps = 5;
  int accumulation = 1;
};

void add_options(CLI::App& app, DemoOptions& o) {
  app.add_option("--params", o.params_text, "model size (K, M, G suffixes)")->capture_default_str();
  app.add_option("--stages", o.stages, "ZeRO stages to run")->delimiter(',')->capture_default_str()
      ->check(CLI::Range(0, 3));
  app.add_option("--dtype", o.dtype_text, "parameter dtype: fp32, bf16 or fp16")->capture_default_str();
  app.add_option("--steps", o.steps, "optimizer steps per stage")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--accumulation", o.accumulation, "micro-steps per step")->capture_default_str()
      ->check(CLI::PositiveNumber);
}

/// One micro-step: loss 0.5 * mean (w - target)^2 over every element, its
/// gradient written by hand, unit by unit in reverse. This rank's "data" is
/// the target with a rank-dependent offset that averages out. Returns the
/// loss averaged over ranks.
double micro_step(Engine& engine, Communicator& comm, DType dtype) {
  double local = 0;
  std::size_t count = 0;
  const float offset = 0.01f * static_cast<float>(comm.rank() - (comm.size() - 1) / 2.0f);
  for (std::size_t u = engine.unit_count(); u-- > 0;) {
    engine.gather_unit(u);
    const Bucket& bucket = engine.layout().buckets()[u];
    for (std::size_t p = bucket.first_param; p < bucket.first_param + bucket.param_count; ++p) {
      const std::size_t n = engine.params()[p].numel;
      const void* w = engine.param_data(p);
      void* g = engine.grad_data(p);
      for (std::size_t k = 0; k < n; ++k) {
        const float d = load_as_float(w, k, dtype) - (target_of(p, k) + offset);
        local += 0.5 * d * d;
        store_from_float(g, k, dtype, d);
      }
      count += n;
      engine.grad_ready(p);
    }
    engine.release_unit(u);
  }
  engine.finish_micro_step();
  double sums[2] = {local, static_cast<double>(count)};
  comm.all_reduce_host_f64(sums, 2, ReduceOp::sum);
  return sums[0] / sums[1];
}

/// Per-rank memory next to the ZeRO formula: every rank sends its numbers to rank 0.
void print_memory(const Engine& engine, MpiCommunicator& comm, int stage, double seconds, int steps) {
  const int world = comm.size();
  const MemoryByCategory live = engine.memory(), peak = engine.peak_memory(),
                         formula = engine.predicted_model_state();
  const double mine[] = {double(live.params), double(live.grads), double(live.master),
                         double(live.optimizer_state), double(peak.buffers), double(peak.params)};
  std::vector<double> all(6 * static_cast<std::size_t>(world));
  ZERO_CHECK_MPI(MPI_Gather(mine, 6, MPI_DOUBLE, all.data(), 6, MPI_DOUBLE, 0, comm.mpi_comm()));
  if (comm.rank() == 0) {
    std::printf("stage %d: %.2f s for %d steps; padded %zu of %zu parameters\n", stage, seconds, steps,
                engine.layout().padded_numel(), engine.layout().param_numel());
    std::printf("  %-6s %12s %12s %12s %12s %12s %12s %14s\n", "rank", "params", "grads", "master",
                "optimizer", "model-state", "peak-buffers", "peak-params");
    for (int r = 0; r < world; ++r) {
      const double* m = &all[static_cast<std::size_t>(r) * 6];
      const std::size_t state = std::size_t(m[0] + m[1] + m[2] + m[3]);
      std::printf("  %-6d %12s %12s %12s %12s %12s %12s %14s\n", r, format_bytes(std::size_t(m[0])).c_str(),
                  format_bytes(std::size_t(m[1])).c_str(), format_bytes(std::size_t(m[2])).c_str(),
                  format_bytes(std::size_t(m[3])).c_str(), format_bytes(state).c_str(),
                  format_bytes(std::size_t(m[4])).c_str(), format_bytes(std::size_t(m[5])).c_str());
    }
    std::printf("  %-6s %12s %12s %12s %12s %12s   (ZeRO formula for the padded size)\n", "model",
                format_bytes(formula.params).c_str(), format_bytes(formula.grads).c_str(),
                format_bytes(formula.master).c_str(), format_bytes(formula.optimizer_state).c_str(),
                format_bytes(formula.model_state()).c_str());
  }
  ZERO_CHECK(live.model_state() == formula.model_state(), "engine holds ", live.model_state(),
             " bytes of model state, the formula says ", formula.model_state());
}

/// Trains the synthetic model at one stage from zeros and prints its memory.
void run_stage(const DemoOptions& o, int stage, MpiCommunicator& comm, Backend& backend) {
  const DType dtype = parse_dtype(o.dtype_text, "--dtype");
  EngineOptions options;
  options.stage = stage;
  options.param_dtype = dtype;
  options.accumulation_steps = o.accumulation;
  options.optimizer.lr = 0.05;
  options.optimizer.weight_decay = 0;
  Engine engine(synthetic_units(parse_count(o.params_text)), options, comm, backend);
  std::vector<float> values;
  for (std::size_t p = 0; p < engine.param_count(); ++p) {
    values.assign(engine.params()[p].numel, 0.0f);
    engine.set_param(p, values.data());
  }
  const auto start = std::chrono::steady_clock::now();
  double loss = 0;
  for (int step = 0; step < o.steps; ++step) {
    for (int micro = 0; micro < o.accumulation; ++micro) loss = micro_step(engine, comm, dtype);
    const StepResult r = engine.step();
    if (comm.rank() == 0)
      std::printf("  stage %d step %d: loss %.6f grad-norm %.4f\n", stage, step + 1, loss, r.grad_norm);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  print_memory(engine, comm, stage, seconds, o.steps);
}

}  // namespace

int main(int argc, char** argv) {
  return run_or_abort([&] {
    MpiSession session(&argc, &argv);
    CLI::App app{"zero engine demo: sharded training on CPU ranks with per-rank memory by category"};
    DemoOptions o;
    add_options(app, o);
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      return app.exit(e);
    }
    MpiCommunicator comm;
    auto backend = make_host_backend();
    const DType dtype = parse_dtype(o.dtype_text, "--dtype");
    if (comm.rank() == 0)
      std::printf("zero engine demo: %d ranks, %s parameters, %s params + fp32 master, AdamW, %d steps\n",
                  comm.size(), o.params_text.c_str(), std::string(name_of(dtype)).c_str(), o.steps);
    for (int stage : o.stages) run_stage(o, stage, comm, *backend);
    return 0;
  });
}
