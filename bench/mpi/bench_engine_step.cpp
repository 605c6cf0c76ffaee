// bench_engine_step: one engine step (gradients written, bucketed
// reduce-scatter, optimizer on the shard, parameter all-gather) per ZeRO stage
// under mpirun, with per-rank memory by category. The model's forward and
// backward are not part of it: this times what zero adds to a step.
//
//   mpirun -np 4 build/cpu/bench/mpi/bench_engine_step --params 64M --json out.json
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <vector>

#include "zero/comm/mpi_communicator.hpp"
#include "zero/engine/engine.hpp"

using namespace zero;

int main(int argc, char** argv) {
  return run_or_abort([&] {
    MpiSession session(&argc, &argv);
    CLI::App app{"time one zero engine step per stage under mpirun"};
    double params_millions = 32;
    int iterations = 5;
    std::string dtype_text = "bf16", json_path;
    std::size_t bucket_mib = 32;
    app.add_option("--params", params_millions, "model size in millions of parameters")->capture_default_str();
    app.add_option("--iterations", iterations, "timed steps per stage (after one warm-up)")->capture_default_str();
    app.add_option("--dtype", dtype_text, "parameter dtype")->capture_default_str();
    app.add_option("--bucket-mib", bucket_mib, "bucket size in MiB")->capture_default_str();
    app.add_option("--json", json_path, "write results as JSON here (rank 0)");
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      return app.exit(e);
    }
    MpiCommunicator comm;
    auto backend = make_host_backend();
    const DType dtype = parse_dtype(dtype_text, "--dtype");
    const auto total = static_cast<std::size_t>(params_millions * 1e6);
    std::vector<ParamSpec> params;
    for (std::size_t done = 0, i = 0; done < total; ++i) {
      const std::size_t n = std::min<std::size_t>(total - done, 1'000'003 + 4099 * (i % 5));
      params.push_back({"p" + std::to_string(i), n, {}});
      done += n;
    }
    nlohmann::json results = nlohmann::json::array();
    if (comm.rank() == 0)
      std::printf("%5s %6s %12s %12s %12s %12s %12s %12s\n", "stage", "ranks", "step(ms)", "params", "grads",
                  "master", "optimizer", "peak-buffers");
    for (int stage = 0; stage <= 3; ++stage) {
      EngineOptions options;
      options.stage = stage;
      options.param_dtype = dtype;
      options.buckets.bytes = bucket_mib << 20;
      Engine engine(params, options, comm, *backend);
      std::vector<double> times;
      for (int it = 0; it <= iterations; ++it) {
        comm.barrier();
        const auto start = std::chrono::steady_clock::now();
        for (std::size_t u = engine.unit_count(); u-- > 0;) {
          engine.gather_unit(u);
          const Bucket& b = engine.layout().buckets()[u];
          for (std::size_t p = b.first_param; p < b.first_param + b.param_count; ++p) {
            void* g = engine.grad_data(p);
            store_from_float(g, 0, engine.options().effective_grad_dtype(), 1e-3f);
            engine.grad_ready(p);
          }
          engine.release_unit(u);
        }
        engine.finish_micro_step();
        engine.step();
        comm.barrier();
        const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
        if (it > 0) times.push_back(ms);
      }
      std::sort(times.begin(), times.end());
      const double median = times[times.size() / 2];
      const MemoryByCategory m = engine.memory(), peak = engine.peak_memory();
      if (comm.rank() == 0) {
        std::printf("%5d %6d %12.2f %12s %12s %12s %12s %12s\n", stage, comm.size(), median,
                    format_bytes(m.params).c_str(), format_bytes(m.grads).c_str(), format_bytes(m.master).c_str(),
                    format_bytes(m.optimizer_state).c_str(), format_bytes(peak.buffers).c_str());
        results.push_back({{"stage", stage},
                           {"ranks", comm.size()},
                           {"params", engine.layout().param_numel()},
                           {"dtype", std::string(name_of(dtype))},
                           {"step_ms_median", median},
                           {"memory_bytes_rank0",
                            {{"params", m.params},
                             {"grads", m.grads},
                             {"master", m.master},
                             {"optimizer_state", m.optimizer_state},
                             {"peak_buffers", peak.buffers}}}});
      }
    }
    if (comm.rank() == 0 && !json_path.empty()) {
      std::ofstream out(json_path);
      ZERO_CHECK(out.good(), "--json: cannot write '", json_path, "'");
      out << results.dump(2) << "\n";
    }
    return 0;
  });
}
