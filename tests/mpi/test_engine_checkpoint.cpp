// Engine state: save and resume at the same world size continue bit for bit,
// also at another stage; the EMA follows its definition; a shard of another
// rank, model or world size is refused with the file named.
#include <doctest/doctest.h>

#include <cmath>
#include <unistd.h>

#include <filesystem>
#include <optional>
#include <random>
#include <vector>

#include "zero/comm/mpi_communicator.hpp"
#include "engine_steps.hpp"
#include "zero/engine/engine.hpp"

using namespace zero;

namespace {

// with_frozen: "b" (beside a trainable parameter) and "c" (a unit of its own) frozen.
std::vector<std::vector<ParamSpec>> units(bool with_frozen = false) {
  std::vector<std::vector<ParamSpec>> u = {
      {{"a", 1000, {}}, {"b", 37, {}}}, {{"c", 4099, {}}}, {{"d", 3, {}}, {"e", 517, {}}}};
  u[0][1].frozen = u[1][0].frozen = with_frozen;
  return u;
}

EngineOptions options(int stage, DType dtype, bool offload = false) {
  EngineOptions o;
  o.offload.optimizer = offload;
  o.stage = stage;
  o.param_dtype = dtype;
  o.buckets.alignment_elements = 8;
  o.optimizer.lr = 1e-2;
  o.ema.decay = 0.9;
  return o;
}

void init(Engine& engine) { testing::init_random_params(engine); }

// One step with gradients that depend on (step, rank) and on the weights.
void train_step(Engine& engine, int step, int rank) {
  REQUIRE(testing::run_step(engine, step, rank, testing::StepGradient::pull_to_half).applied);
}

std::string shard_path(const std::string& tag, int rank) {
  return (std::filesystem::temp_directory_path() / ("zero-test-" + tag + "-rank" + std::to_string(rank) + ".safetensors"))
      .string();
}

}  // namespace

TEST_CASE("resume from a saved state continues bit for bit, at any stage") {
  MpiCommunicator comm;
  auto backend = make_host_backend();
  // The pid differs per rank; agree on rank 0's so every rank names the same files.
  double pid = ::getpid();
  comm.all_reduce_host_f64(&pid, 1, ReduceOp::max);
  const std::string tag = "resume" + std::to_string(static_cast<long>(pid));
  for (const auto& [dtype, frozen] : {std::pair{DType::fp32, false}, std::pair{DType::bf16, false}, std::pair{DType::bf16, true}}) {
    for (int save_stage = 0; save_stage <= 3; ++save_stage) {
      CAPTURE(dtype);
      CAPTURE(frozen);
      CAPTURE(save_stage);
      Engine straight(units(frozen), options(save_stage, dtype), comm, *backend);
      init(straight);
      for (int s = 0; s < 3; ++s) train_step(straight, s, comm.rank());
      const std::string path = shard_path(tag, comm.rank());
      straight.save_state(path, {{"note", "test"}});
      for (int s = 3; s < 6; ++s) train_step(straight, s, comm.rank());
      const auto want_master = straight.gather_master_params();
      const auto want_ema = straight.gather_ema_params();
      const auto want_model = straight.gather_model_params();
      // The same stage, the next one, and the optimizer offloaded to host memory.
      const std::pair<int, bool> resumes[] = {{save_stage, false}, {(save_stage + 1) % 4, false},
                                              {std::max(1, save_stage), true}};
      for (const auto& [resume_stage, offload] : resumes) {
        CAPTURE(resume_stage);
        CAPTURE(offload);
        Engine resumed(units(frozen), options(resume_stage, dtype, offload), comm, *backend);
        testing::init_random_params(resumed, 99);  // other values, all overwritten by the load (frozen ones too)
        resumed.load_state(path);
        CHECK(resumed.steps_applied() == 3);
        for (int s = 3; s < 6; ++s) train_step(resumed, s, comm.rank());
        CHECK(resumed.gather_master_params() == want_master);
        CHECK(resumed.gather_ema_params() == want_ema);
        CHECK(resumed.gather_model_params() == want_model);
      }
      std::filesystem::remove(path);
    }
  }
}

TEST_CASE("the EMA follows its definition with warm-up") {
  MpiCommunicator comm;
  auto backend = make_host_backend();
  for (int stage = 0; stage <= 3; ++stage) {
    CAPTURE(stage);
    Engine engine(units(), options(stage, DType::fp32), comm, *backend);
    init(engine);
    auto ema = engine.gather_master_params();
    for (int s = 0; s < 4; ++s) {
      train_step(engine, s, comm.rank());
      const auto w = engine.gather_master_params();
      const double t = s + 1;
      const double decay = std::min(0.9, (1 + t) / (10 + t));
      const float d = static_cast<float>(decay), one_minus = static_cast<float>(1.0 - decay);
      for (std::size_t p = 0; p < w.size(); ++p)
        for (std::size_t k = 0; k < w[p].size(); ++k) ema[p][k] = d * ema[p][k] + one_minus * w[p][k];
      CHECK(engine.gather_ema_params() == ema);
    }
  }
}

TEST_CASE("a shard of another model, rank or world size is refused, naming the file") {
  MpiCommunicator comm;
  auto backend = make_host_backend();
  double pid = ::getpid();
  comm.all_reduce_host_f64(&pid, 1, ReduceOp::max);
  const std::string tag = "bad" + std::to_string(static_cast<long>(pid));
  Engine engine(units(), options(2, DType::bf16), comm, *backend);
  init(engine);
  const std::string path = shard_path(tag, comm.rank());
  engine.save_state(path);
  auto other_units = units();
  other_units[1][0].numel = 4098;
  Engine other(other_units, options(2, DType::bf16), comm, *backend);
  CHECK_THROWS_WITH_AS(other.load_state(path), doctest::Contains("belongs to another model: parameter 2"), IoError);
  CHECK_THROWS_WITH_AS(other.load_state(path), doctest::Contains(path.c_str()), IoError);
  if (comm.size() > 1) {
    const std::string neighbour = shard_path(tag, (comm.rank() + 1) % comm.size());
    comm.barrier();
    CHECK_THROWS_WITH_AS(engine.load_state(neighbour), doctest::Contains("rank is"), IoError);
  }
  EngineOptions sgd = options(2, DType::bf16);
  sgd.optimizer.kind = OptimizerKind::sgd;
  Engine with_sgd(units(), sgd, comm, *backend);
  CHECK_THROWS_WITH_AS(with_sgd.load_state(path), doctest::Contains("optimizer is \"adamw\""), IoError);
  // Another set of frozen parameters is another model, both ways round.
  Engine with_frozen(units(true), options(2, DType::bf16), comm, *backend);
  CHECK_THROWS_WITH_AS(with_frozen.load_state(path), doctest::Contains("this run has frozen parameters"), IoError);
  const std::string frozen_path = shard_path(tag + "frozen", comm.rank());
  with_frozen.save_state(frozen_path);
  CHECK_THROWS_WITH_AS(engine.load_state(frozen_path), doctest::Contains("the checkpoint has frozen parameters"),
                       IoError);
  comm.barrier();
  std::filesystem::remove(path);
  std::filesystem::remove(frozen_path);
}

TEST_CASE("resume at another world size from the sharded files (N -> N-1 and N-1 -> N)") {
  MpiCommunicator comm;
  const int n = comm.size();
  if (n < 2) return;  // needs two world sizes within this run
  auto backend = make_host_backend();
  double pid = ::getpid();
  comm.all_reduce_host_f64(&pid, 1, ReduceOp::max);
  const std::string tag = "reshard" + std::to_string(static_cast<long>(pid));
  const int small = n - 1;
  const bool in_small = comm.rank() < small;
  MPI_Comm sub_comm = MPI_COMM_NULL;
  ZERO_CHECK_MPI(MPI_Comm_split(comm.mpi_comm(), in_small ? 0 : MPI_UNDEFINED, comm.rank(), &sub_comm));
  auto files_of = [&](const std::string& which, int world) {
    std::vector<std::string> files;
    for (int r = 0; r < world; ++r) files.push_back(shard_path(tag + which, r));
    return files;
  };
  struct Snapshot {
    std::vector<std::vector<float>> master, ema, m, v;
  };
  auto snapshot = [](Engine& e) {
    return Snapshot{e.gather_master_params(), e.gather_ema_params(), e.gather_optimizer_state(0),
                    e.gather_optimizer_state(1)};
  };
  for (const auto& [dtype, frozen] : {std::pair{DType::fp32, false}, std::pair{DType::bf16, false}, std::pair{DType::bf16, true}}) {
    for (int stage : {1, 3}) {
      CAPTURE(dtype);
      CAPTURE(frozen);
      CAPTURE(stage);
      // N -> N-1, saved at one stage and alignment, resumed at another.
      EngineOptions big_options = options(stage, dtype);
      EngineOptions small_options = options(3 - stage + 1, dtype);  // 1 <-> 3
      small_options.buckets.alignment_elements = 4;
      Engine big(units(frozen), big_options, comm, *backend);
      init(big);
      for (int s = 0; s < 3; ++s) train_step(big, s, comm.rank());
      big.save_state(shard_path(tag + "big", comm.rank()));
      const Snapshot want = snapshot(big);
      comm.barrier();
      if (in_small) {
        MpiCommunicator sub(sub_comm);
        Engine resumed(units(frozen), small_options, sub, *backend);
        resumed.load_state_resharded(files_of("big", n));
        CHECK(resumed.steps_applied() == 3);
        const Snapshot got = snapshot(resumed);
        CHECK(got.master == want.master);
        CHECK(got.ema == want.ema);
        CHECK(got.m == want.m);
        CHECK(got.v == want.v);
        train_step(resumed, 3, sub.rank());  // and it trains on
        // N-1 -> N: save from the small world for the next part.
        resumed.save_state(shard_path(tag + "small", sub.rank()));
      }
      comm.barrier();
      std::optional<Snapshot> saved_small;
      if (in_small) {
        MpiCommunicator sub(sub_comm);
        Engine again(units(frozen), small_options, sub, *backend);
        again.load_state(shard_path(tag + "small", sub.rank()));
        saved_small = snapshot(again);
      }
      Engine grown(units(frozen), big_options, comm, *backend);
      grown.load_state_resharded(files_of("small", small));
      CHECK(grown.steps_applied() == 4);
      const Snapshot got = snapshot(grown);
      if (saved_small) {
        CHECK(got.master == saved_small->master);
        CHECK(got.ema == saved_small->ema);
        CHECK(got.m == saved_small->m);
        CHECK(got.v == saved_small->v);
      }
      comm.barrier();
      if (comm.rank() == 0) {
        for (const auto& f : files_of("big", n)) std::filesystem::remove(f);
        for (const auto& f : files_of("small", small)) std::filesystem::remove(f);
      }
      comm.barrier();
    }
  }
  if (sub_comm != MPI_COMM_NULL) MPI_Comm_free(&sub_comm);
  // Wrong file count or order is a clear error.
  Engine engine(units(), options(2, DType::bf16), comm, *backend);
  CHECK_THROWS_WITH_AS(engine.load_state_resharded({}), doctest::Contains("no checkpoint files"), InvalidArgument);
}
