// Hybrid sharding (HSDP): N = R x S ranks, sharded over groups of S
// consecutive ranks and replicated across the R groups. It trains as flat
// sharding at the same N does (the average over N ranks is taken as an
// average over S, then over R: another summation order, within 1e-6 in
// fp32), its stages agree bit for bit, it holds the memory of a world of S,
// and its checkpoints resume flat and at another (R, S).
#include <doctest/doctest.h>

#include <unistd.h>

#include <filesystem>
#include <vector>

#include "zero/comm/mpi_communicator.hpp"
#include "engine_steps.hpp"
#include "mlp_training.hpp"

using namespace zero;
using namespace zero::testing;

namespace {
// The shard group sizes that split this world into replicas (S < N, S | N).
std::vector<int> hybrid_sizes(int world) {
  std::vector<int> out;
  for (int s = 1; s < world; ++s)
    if (world % s == 0) out.push_back(s);
  return out;
}
}  // namespace

TEST_CASE("hybrid sharding trains as flat sharding does; its stages agree bitwise; memory as a world of S") {
  MpiCommunicator comm;
  auto backend = make_host_backend();
  const int n = comm.size();
  Config c = configs().front();  // fp32 AdamW with weight decay
  c.accumulation = 2;
  c.max_grad_norm = 0.5;  // the clip decision sees the global norm
  std::vector<Trained> flat;
  for (int stage = 1; stage <= 3; ++stage) flat.push_back(train_sharded(c, stage, comm, *backend));
  for (int s : hybrid_sizes(n)) {
    CAPTURE(s);
    Config hybrid = c;
    hybrid.shard_group_size = s;
    std::vector<Trained> by_stage;
    for (int stage = 0; stage <= 3; ++stage) {
      CAPTURE(stage);
      by_stage.push_back(train_sharded(hybrid, stage, comm, *backend));  // checks memory == its prediction
      if (stage == 0) continue;
      const double error = max_relative_error(by_stage.back().master, flat[static_cast<std::size_t>(stage - 1)].master);
      if (comm.rank() == 0) MESSAGE("N = ", n, ", S = ", s, ", stage ", stage, ": max relative error vs flat ", error);
      CHECK(error <= 1e-6);
      CHECK(bitwise_equal(by_stage.back().master, by_stage.front().master));
      CHECK(bitwise_equal(by_stage.back().model, by_stage.front().model));
      CHECK(by_stage.back().norms == by_stage.front().norms);
    }
    // The memory of a world of S: the engine's layout, its shards and the
    // model-state formula with S in place of N.
    for (int stage = 1; stage <= 3; ++stage) {
      CAPTURE(stage);
      Engine engine(mlp_units_of(hybrid), engine_options(hybrid, stage), comm, *backend);
      CHECK(engine.world_size() == s);
      CHECK(engine.rank() == comm.rank() % s);
      CHECK(engine.replica() == comm.rank() / s);
      CHECK(engine.replica_count() == n / s);
      CHECK(engine.layout().world_size() == s);
      const MemoryByCategory want = model_state_bytes(engine_options(hybrid, stage), engine.layout().padded_numel(), s);
      const MemoryByCategory got = engine.memory();
      CHECK(got.params == want.params);
      CHECK(got.grads == want.grads);
      CHECK(got.master == want.master);
      CHECK(got.optimizer_state == want.optimizer_state);
    }
  }
  // A shard group size that does not divide the world is refused on every rank.
  if (n > 2) {
    Config bad = c;
    bad.shard_group_size = n - 1;
    CHECK_THROWS_WITH_AS(Engine(mlp_units_of(bad), engine_options(bad, 2), comm, *backend),
                         doctest::Contains("shard_group_size"), InvalidArgument);
  }
}

TEST_CASE("a hybrid checkpoint resumes flat and at another (R, S)") {
  MpiCommunicator comm;
  auto backend = make_host_backend();
  const int n = comm.size();
  const std::vector<int> sizes = hybrid_sizes(n);
  if (sizes.empty()) return;  // N = 1: nothing to split
  double pid = ::getpid();
  comm.all_reduce_host_f64(&pid, 1, ReduceOp::max);
  const std::string tag = "hybrid" + std::to_string(static_cast<long>(pid));
  auto file = [&](int shard_rank) {
    return (std::filesystem::temp_directory_path() /
            ("zero-test-" + tag + "-rank" + std::to_string(shard_rank) + ".safetensors"))
        .string();
  };
  const std::vector<std::vector<ParamSpec>> units = {
      {{"a", 1000, {}}, {"b", 37, {}}}, {{"c", 4099, {}}}, {{"d", 3, {}}, {"e", 517, {}}}};
  // SGD with momentum: another shard group size sums the gradient average in
  // another order (1e-7 apart), and AdamW would blow that up wherever a
  // gradient crosses zero (it divides by sqrt(v)); SGD passes it on as is.
  // The same (R, S) resumes AdamW bit for bit below.
  auto options = [](int stage, int s) {
    EngineOptions o;
    o.stage = stage;
    o.param_dtype = DType::fp32;  // bf16 gradients round after each of the two averages
    o.buckets.alignment_elements = 8;
    o.optimizer.kind = OptimizerKind::sgd;
    o.optimizer.lr = 5e-2;
    o.optimizer.momentum = 0.9;
    o.ema.decay = 0.9;
    o.shard_group_size = s;
    return o;
  };
  const int s = sizes.back();  // the largest proper shard group
  Engine straight(units, options(2, s), comm, *backend);
  init_random_params(straight);
  for (int step = 0; step < 3; ++step) REQUIRE(run_step(straight, step, comm.rank(), StepGradient::pull_to_half).applied);
  // Replica 0's shard group writes the checkpoint: one file per shard rank.
  if (straight.replica() == 0) straight.save_state(file(straight.rank()));
  comm.barrier();
  for (int step = 3; step < 6; ++step) REQUIRE(run_step(straight, step, comm.rank(), StepGradient::pull_to_half).applied);
  const auto want = straight.gather_master_params();
  std::vector<std::string> files;
  for (int r = 0; r < s; ++r) files.push_back(file(r));
  // Resumed flat (S = N) and at the smallest shard group (another R, S).
  for (int resume_s : {n, sizes.front()}) {
    for (int stage : {1, 3}) {
      CAPTURE(resume_s);
      CAPTURE(stage);
      Engine resumed(units, options(stage, resume_s), comm, *backend);
      resumed.load_state_resharded(files);
      CHECK(resumed.steps_applied() == 3);
      for (int step = 3; step < 6; ++step)
        REQUIRE(run_step(resumed, step, comm.rank(), StepGradient::pull_to_half).applied);
      const double error = max_relative_error(resumed.gather_master_params(), want);
      if (comm.rank() == 0) MESSAGE("saved at S = ", s, ", resumed at S = ", resume_s, ", stage ", stage, ": ", error);
      CHECK(error <= 1e-6);
    }
  }
  comm.barrier();
  // The same (R, S), AdamW: bit for bit, each rank from its shard's file.
  EngineOptions adamw = options(3, s);
  adamw.optimizer = {};
  adamw.optimizer.lr = 1e-2;
  Engine again(units, adamw, comm, *backend);
  init_random_params(again);
  for (int step = 0; step < 3; ++step) REQUIRE(run_step(again, step, comm.rank(), StepGradient::pull_to_half).applied);
  if (again.replica() == 0) again.save_state(file(again.rank()));
  comm.barrier();
  for (int step = 3; step < 6; ++step) REQUIRE(run_step(again, step, comm.rank(), StepGradient::pull_to_half).applied);
  Engine same(units, adamw, comm, *backend);
  same.load_state(file(same.rank()));
  for (int step = 3; step < 6; ++step) REQUIRE(run_step(same, step, comm.rank(), StepGradient::pull_to_half).applied);
  CHECK(same.gather_master_params() == again.gather_master_params());
  CHECK(same.gather_ema_params() == again.gather_ema_params());
  comm.barrier();
  if (comm.rank() == 0)
    for (const auto& f : files) std::filesystem::remove(f);
}
