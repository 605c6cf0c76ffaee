// checkpoint_writer: trains a small model for a few steps under mpirun and
// saves a checkpoint folder through zero/checkpoint/checkpoint.hpp, the way a trainer
// does (every rank its shard and CRC-32C, rank 0 the manifest), plus a
// reference file of what zero-ckpt must reconstruct: the engine's own
// gather_master_params(), gather_optimizer_state() and gather_ema_params(),
// fp32, as <name>, <name>.state0, <name>.state1, <name>.ema.
// check_zero_ckpt.py runs it and then the tool.
//
//   mpirun -np N checkpoint_writer ROOT STAGE OPTIMIZER REFERENCE
#include <mpi.h>

#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "engine_steps.hpp"
#include "zero/comm/mpi_communicator.hpp"
#include "zero/engine/engine.hpp"
#include "zero/checkpoint/checkpoint.hpp"
#include "zero/io/crc32c.hpp"
#include "zero/io/safetensors.hpp"

using namespace zero;
namespace fs = std::filesystem;

namespace {

constexpr std::int64_t kSteps = 3;

// Sizes that do not divide any world size, two units, shapes for all but one
// parameter (its consolidated shape must fall back to [numel]).
std::vector<std::vector<ParamSpec>> units() {
  return {{{"block.0.weight", 37 * 11, {37, 11}}, {"block.0.bias", 37, {37}}, {"scalar", 1, {}}},
          {{"block.1.weight", 5 * 3 * 3 * 7, {5, 3, 3, 7}}, {"no_shape", 513, {}}},
          {{"head.weight", 1000, {10, 100}}}};
}

void train_step(Engine& engine, int step, int rank) {
  if (!testing::run_step(engine, step, rank, testing::StepGradient::pull_to_half).applied)
    ZERO_THROW(InternalError, "step ", step, " was skipped");
}

}  // namespace

int main(int argc, char** argv) {
  return run_or_abort([&] {
    MpiSession session(&argc, &argv);
    if (argc != 5) {
      std::fprintf(stderr, "usage: checkpoint_writer ROOT STAGE OPTIMIZER REFERENCE\n");
      return 2;
    }
    const fs::path root = argv[1], reference = argv[4];
    MpiCommunicator comm;
    auto backend = make_host_backend();
    EngineOptions options;
    options.stage = std::stoi(argv[2]);
    options.param_dtype = DType::bf16;
    options.buckets.alignment_elements = 8;
    options.optimizer.kind = parse_optimizer_kind(argv[3]);
    options.optimizer.lr = 1e-2;
    options.optimizer.momentum = options.optimizer.kind == OptimizerKind::sgd ? 0.9 : 0.0;
    options.ema.decay = 0.9;
    Engine engine(units(), options, comm, *backend);
    std::mt19937 rng(5);
    std::normal_distribution<float> normal;
    for (std::size_t p = 0; p < engine.param_count(); ++p) {
      std::vector<float> v(engine.params()[p].numel);
      for (float& x : v) x = normal(rng);
      engine.set_param(p, v.data());
    }
    for (int s = 0; s < kSteps; ++s) train_step(engine, s, comm.rank());

    // The save, as a trainer does it.
    const fs::path dir = io::checkpoint_folder(root, kSteps);
    if (comm.rank() == 0) fs::create_directories(dir);
    comm.barrier();
    const std::string own = io::rank_file_name(comm.rank());
    engine.save_state((dir / own).string(), {{"sampler.epoch", "0"}});
    std::uint32_t crc = io::file_crc32c(dir / own);
    std::vector<std::uint32_t> crcs(static_cast<std::size_t>(comm.size()));
    ZERO_CHECK_MPI(MPI_Gather(&crc, 1, MPI_UINT32_T, crcs.data(), 1, MPI_UINT32_T, 0, comm.mpi_comm()));
    comm.barrier();
    if (comm.rank() == 0) {
      io::CheckpointManifest manifest;
      io::describe_engine(engine, manifest);
      manifest.step = kSteps;
      manifest.world_size = comm.size();
      manifest.data_position = {{"sampler.epoch", "0"}, {"sampler.batch_in_epoch", "3"}};
      manifest.seed = 1234;
      manifest.config = "[test]\nwriter = \"checkpoint_writer\"\n";
      for (int r = 0; r < comm.size(); ++r) {
        const std::string name = io::rank_file_name(r);
        manifest.files.push_back({name, fs::file_size(dir / name), crcs[static_cast<std::size_t>(r)]});
      }
      io::write_manifest(dir, manifest);
    }

    // The reference, from the engine's own gathers (collective).
    const auto master = engine.gather_master_params();
    const auto ema = engine.gather_ema_params();
    std::vector<std::vector<std::vector<float>>> states;
    for (int k = 0; k < options.optimizer.state_slots(); ++k) states.push_back(engine.gather_optimizer_state(k));
    if (comm.rank() == 0) {
      std::vector<io::TensorView> views;
      const auto& params = engine.params();
      auto add = [&](const std::string& suffix, const std::vector<std::vector<float>>& values) {
        for (std::size_t p = 0; p < params.size(); ++p)
          views.push_back({params[p].name + suffix, io::TensorDType::F32,
                           {static_cast<std::int64_t>(values[p].size())}, values[p].data()});
      };
      add("", master);
      add(".ema", ema);
      for (std::size_t k = 0; k < states.size(); ++k) add(".state" + std::to_string(k), states[k]);
      io::write_safetensors(reference, views);
    }
    comm.barrier();
    return 0;
  });
}
