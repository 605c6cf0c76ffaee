// Engine state: save and resume at the same world size continue bit for bit,
// also at another stage; the EMA follows its definition; a shard of another
// rank, model or world size is refused with the file named; the same
// parameters in other units or another order are matched by name.
#include <doctest/doctest.h>

#include <cmath>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <string>
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

// Every rank's file of the checkpoint `tag`, written at `world` ranks.
std::vector<std::string> shard_paths(const std::string& tag, int world) {
  std::vector<std::string> files;
  for (int r = 0; r < world; ++r) files.push_back(shard_path(tag, r));
  return files;
}

// ---- the same parameters in other units or another order

// The parameters of units(with_frozen), regrouped: each unit split into
// single parameters, the first two units merged, units and parameters
// reversed, and everything shuffled into other units.
enum class Regrouping { split, merge, reverse, shuffle };
constexpr Regrouping kRegroupings[] = {Regrouping::split, Regrouping::merge, Regrouping::reverse, Regrouping::shuffle};

const char* name_of(Regrouping r) {
  switch (r) {
    case Regrouping::split: return "split";
    case Regrouping::merge: return "merge";
    case Regrouping::reverse: return "reverse";
    case Regrouping::shuffle: return "shuffle";
  }
  return "?";
}

std::vector<std::vector<ParamSpec>> regrouped_units(Regrouping how, bool with_frozen = false) {
  const std::vector<std::vector<ParamSpec>> u = units(with_frozen);
  std::map<std::string, ParamSpec> p;
  for (const auto& unit : u)
    for (const ParamSpec& s : unit) p[s.name] = s;
  switch (how) {
    case Regrouping::split: return {{p["a"]}, {p["b"]}, {p["c"]}, {p["d"]}, {p["e"]}};
    case Regrouping::merge: return {{p["a"], p["b"], p["c"]}, {p["d"], p["e"]}};
    case Regrouping::reverse: return {{p["e"], p["d"]}, {p["c"]}, {p["b"], p["a"]}};
    case Regrouping::shuffle: return {{p["c"], p["e"]}, {p["a"]}, {p["d"], p["b"]}};
  }
  return u;
}

// One step whose gradients depend on (step, rank, parameter name) and on the
// weights, not on where the parameter is: the same in any units and order.
void train_step_by_name(Engine& engine, int step, int rank) {
  const std::vector<std::vector<float>> w = testing::read_model_params(engine);
  const DType g = engine.options().effective_grad_dtype();
  for (std::size_t p = 0; p < engine.param_count(); ++p) {
    if (engine.frozen(p)) continue;
    std::uint32_t seed = 2166136261u;  // FNV-1a of the name
    for (const char ch : engine.params()[p].name) seed = (seed ^ static_cast<std::uint8_t>(ch)) * 16777619u;
    std::mt19937 rng(seed + static_cast<std::uint32_t>(step * 131 + rank));
    std::normal_distribution<float> normal;
    void* grad = engine.grad_data(p);
    for (std::size_t k = 0; k < w[p].size(); ++k) store_from_float(grad, k, g, w[p][k] - 0.5f + 0.1f * normal(rng));
    engine.grad_ready(p);
  }
  engine.finish_micro_step();
  REQUIRE(engine.step().applied);
}

using ByName = std::map<std::string, std::vector<float>>;

ByName by_name(const Engine& engine, std::vector<std::vector<float>> values) {
  ByName out;
  for (std::size_t p = 0; p < engine.param_count(); ++p) out[engine.params()[p].name] = std::move(values[p]);
  return out;
}

// Master weights (frozen values included), EMA, both moments and the model
// copy, per parameter name (collective).
struct NamedState {
  ByName master, ema, m, v, model;
};

NamedState named_state(Engine& engine) {
  return {by_name(engine, engine.gather_master_params()), by_name(engine, engine.gather_ema_params()),
          by_name(engine, engine.gather_optimizer_state(0)), by_name(engine, engine.gather_optimizer_state(1)),
          by_name(engine, engine.gather_model_params())};
}

bool bitwise_same(const ByName& a, const ByName& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [name, values] : a) {
    const auto it = b.find(name);
    if (it == b.end() || !testing::bitwise_equal({values}, {it->second})) return false;
  }
  return true;
}

void check_same_state(const NamedState& got, const NamedState& want) {
  CHECK(bitwise_same(got.master, want.master));
  CHECK(bitwise_same(got.ema, want.ema));
  CHECK(bitwise_same(got.m, want.m));
  CHECK(bitwise_same(got.v, want.v));
  CHECK(bitwise_same(got.model, want.model));
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

TEST_CASE("bf16 optimizer state: resumed bit for bit at another stage and offloaded; read by either state dtype") {
  MpiCommunicator comm;
  auto backend = make_host_backend();
  double pid = ::getpid();
  comm.all_reduce_host_f64(&pid, 1, ReduceOp::max);
  const std::string tag = "bf16state" + std::to_string(static_cast<long>(pid));
  auto bf16_options = [](int stage) {
    EngineOptions o = options(stage, DType::bf16);
    o.optimizer.state_dtype = DType::bf16;
    return o;
  };
  for (int save_stage : {0, 3}) {  // resumed at 1 and at 0
    CAPTURE(save_stage);
    Engine straight(units(false), bf16_options(save_stage), comm, *backend);
    init(straight);
    for (int s = 0; s < 3; ++s) train_step(straight, s, comm.rank());
    const std::string path = shard_path(tag, comm.rank());
    straight.save_state(path);
    const NamedState at_save = named_state(straight);
    for (int s = 3; s < 6; ++s) train_step(straight, s, comm.rank());
    const NamedState want = named_state(straight);
    // Every moment is a bf16 value (widened exactly).
    for (const ByName* moments : {&at_save.m, &at_save.v})
      for (const auto& [name, values] : *moments)
        for (float x : values) REQUIRE(bf16_state_to_float(bf16_round_stochastic(x, 0)) == x);
    // bf16 state again, at the next stage: the same bits onward.
    {
      Engine resumed(units(false), bf16_options((save_stage + 1) % 4), comm, *backend);
      testing::init_random_params(resumed, 99);
      resumed.load_state(path);
      check_same_state(named_state(resumed), at_save);
      for (int s = 3; s < 6; ++s) train_step(resumed, s, comm.rank());
      check_same_state(named_state(resumed), want);
    }
    // bf16 state offloaded to host memory (stage 2): the same bits onward.
    {
      EngineOptions o = bf16_options(2);
      o.offload.optimizer = true;
      Engine offloaded(units(false), o, comm, *backend);
      testing::init_random_params(offloaded, 99);
      offloaded.load_state(path);
      check_same_state(named_state(offloaded), at_save);
      for (int s = 3; s < 6; ++s) train_step(offloaded, s, comm.rank());
      check_same_state(named_state(offloaded), want);
    }
    // fp32 state from the same file: the moments as they were, then fp32 onward.
    {
      Engine widened(units(false), options(save_stage, DType::bf16), comm, *backend);
      testing::init_random_params(widened, 99);
      widened.load_state(path);
      check_same_state(named_state(widened), at_save);
    }
    std::filesystem::remove(path);
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
  comm.barrier();  // every rank's file of `path` is written
  // A renamed parameter is another model, whichever loader or query meets it.
  auto renamed_units = units();
  renamed_units[1][0].name = "c2";
  Engine renamed(renamed_units, options(2, DType::bf16), comm, *backend);
  const std::string first_path = shard_path(tag, 0);  // the file load_state_resharded checks
  const std::pair<std::function<void()>, const std::string*> attempts[] = {
      {[&] { renamed.load_state(path); }, &path},
      {[&] { renamed.load_state_resharded(shard_paths(tag, comm.size())); }, &first_path},
      {[&] { (void)renamed.saved_layout_matches(path); }, &path}};
  for (const auto& [attempt, named] : attempts) {
    CHECK_THROWS_WITH_AS(attempt(), doctest::Contains("belongs to another model: parameter 2 ('c2') is not in the "
                                                      "checkpoint; the checkpoint's 'c' is not here"),
                         IoError);
    CHECK_THROWS_WITH_AS(attempt(), doctest::Contains(named->c_str()), IoError);
  }
  // In other units, parameters are matched by name: another size is still
  // refused with the parameter named, and so is one frozen on one side only.
  auto resized = regrouped_units(Regrouping::reverse);
  resized[1][0].numel = 4098;  // "c"
  Engine other_resized(resized, options(2, DType::bf16), comm, *backend);
  CHECK_THROWS_WITH_AS(other_resized.load_state_resharded(shard_paths(tag, comm.size())),
                       doctest::Contains("belongs to another model: parameter 2 is {\"name\":\"c\",\"numel\":4099} in "
                                         "the checkpoint, {\"name\":\"c\",\"numel\":4098} here"),
                       IoError);
  auto half_frozen = regrouped_units(Regrouping::reverse, true);
  half_frozen[1][0].frozen = false;  // "c": frozen in the checkpoint, trained here
  Engine other_frozen(half_frozen, options(2, DType::bf16), comm, *backend);
  comm.barrier();  // every rank's frozen_path is written
  CHECK_THROWS_WITH_AS(other_frozen.load_state_resharded(shard_paths(tag + "frozen", comm.size())),
                       doctest::Contains("parameter 'c' is frozen in the checkpoint, trained here"), IoError);
  comm.barrier();
  std::filesystem::remove(path);
  std::filesystem::remove(frozen_path);
}

TEST_CASE("resume the same parameters in other units or another order: matched by name and bit for bit") {
  MpiCommunicator comm;
  const int n = comm.size();
  auto backend = make_host_backend();
  double pid = ::getpid();
  comm.all_reduce_host_f64(&pid, 1, ReduceOp::max);
  const std::string tag = "regroup" + std::to_string(static_cast<long>(pid));
  for (const auto& [dtype, frozen] : {std::pair{DType::fp32, false}, std::pair{DType::bf16, true}}) {
    for (int stage = 1; stage <= 3; ++stage) {
      CAPTURE(dtype);
      CAPTURE(frozen);
      CAPTURE(stage);
      Engine saved(units(frozen), options(stage, dtype), comm, *backend);
      init(saved);
      for (int s = 0; s < 3; ++s) train_step_by_name(saved, s, comm.rank());
      const std::string path = shard_path(tag, comm.rank());
      saved.save_state(path);
      comm.barrier();  // every rank's file is written
      CHECK(saved.saved_layout_matches(path));  // the fast path: load_state from its own file
      const NamedState want = named_state(saved);
      train_step_by_name(saved, 3, comm.rank());
      const NamedState want_next = named_state(saved);
      for (const Regrouping how : kRegroupings) {
        CAPTURE(name_of(how));
        Engine regrouped(regrouped_units(how, frozen), options(stage, dtype), comm, *backend);
        testing::init_random_params(regrouped, 99);  // other values, all overwritten by the load (frozen ones too)
        CHECK_FALSE(regrouped.saved_layout_matches(path));
        CHECK_THROWS_WITH_AS(regrouped.load_state(path), doctest::Contains("resume with load_state_resharded"),
                             IoError);
        regrouped.load_state_resharded(shard_paths(tag, n));
        CHECK(regrouped.steps_applied() == 3);
        check_same_state(named_state(regrouped), want);
        train_step_by_name(regrouped, 3, comm.rank());  // one more step from both: the same parameters
        check_same_state(named_state(regrouped), want_next);
      }
      // The same units at another alignment place the elements elsewhere too.
      EngineOptions realigned = options(stage, dtype);
      realigned.buckets.alignment_elements = 4;
      Engine moved(units(frozen), realigned, comm, *backend);
      testing::init_random_params(moved, 99);
      CHECK_FALSE(moved.saved_layout_matches(path));
      moved.load_state_resharded(shard_paths(tag, n));
      check_same_state(named_state(moved), want);
      comm.barrier();
      std::filesystem::remove(path);
    }
  }
}

// The first N - 1 ranks of this world as a communicator of their own (null
// on the last rank), and a file tag all ranks share (rank 0's pid), apart
// from concurrent runs: for the tests that resume at another world size.
struct SmallerWorld {
  std::string tag;
  bool in_small = false;
  MPI_Comm comm = MPI_COMM_NULL;
  SmallerWorld(MpiCommunicator& world, const std::string& prefix) {
    double pid = ::getpid();
    world.all_reduce_host_f64(&pid, 1, ReduceOp::max);
    tag = prefix + std::to_string(static_cast<long>(pid));
    in_small = world.rank() < world.size() - 1;
    ZERO_CHECK_MPI(MPI_Comm_split(world.mpi_comm(), in_small ? 0 : MPI_UNDEFINED, world.rank(), &comm));
  }
  SmallerWorld(const SmallerWorld&) = delete;
  SmallerWorld& operator=(const SmallerWorld&) = delete;
  ~SmallerWorld() {
    if (comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
  }
};

TEST_CASE("resume in other units at another world size (N -> N-1 and N-1 -> N)") {
  MpiCommunicator comm;
  const int n = comm.size();
  if (n < 2) return;  // needs two world sizes within this run
  auto backend = make_host_backend();
  const SmallerWorld smaller(comm, "regroup-world");
  const std::string& tag = smaller.tag;
  const int small = n - 1;
  const bool in_small = smaller.in_small;
  for (const auto& [dtype, frozen] : {std::pair{DType::fp32, false}, std::pair{DType::bf16, true}}) {
    for (int stage = 1; stage <= 3; ++stage) {
      for (const Regrouping how : kRegroupings) {
        CAPTURE(dtype);
        CAPTURE(frozen);
        CAPTURE(stage);
        CAPTURE(name_of(how));
        // N -> N-1 into other units, at another stage and alignment.
        EngineOptions small_options = options(stage % 3 + 1, dtype);
        small_options.buckets.alignment_elements = 4;
        Engine big(units(frozen), options(stage, dtype), comm, *backend);
        init(big);
        for (int s = 0; s < 3; ++s) train_step_by_name(big, s, comm.rank());
        big.save_state(shard_path(tag + "big", comm.rank()));
        const NamedState want = named_state(big);
        comm.barrier();
        std::optional<NamedState> small_next;
        if (in_small) {
          MpiCommunicator sub(smaller.comm);
          Engine resumed(regrouped_units(how, frozen), small_options, sub, *backend);
          testing::init_random_params(resumed, 99);
          resumed.load_state_resharded(shard_paths(tag + "big", n));
          CHECK(resumed.steps_applied() == 3);
          check_same_state(named_state(resumed), want);
          train_step_by_name(resumed, 3, sub.rank());  // and it trains on
          small_next = named_state(resumed);
          // N-1 -> N: saved in the other units for the next part.
          resumed.save_state(shard_path(tag + "small", sub.rank()));
        }
        comm.barrier();
        Engine grown(units(frozen), options(stage, dtype), comm, *backend);
        testing::init_random_params(grown, 99);
        grown.load_state_resharded(shard_paths(tag + "small", small));
        CHECK(grown.steps_applied() == 4);
        const NamedState got = named_state(grown);
        if (small_next) check_same_state(got, *small_next);
        comm.barrier();
        if (comm.rank() == 0) {
          for (const auto& f : shard_paths(tag + "big", n)) std::filesystem::remove(f);
          for (const auto& f : shard_paths(tag + "small", small)) std::filesystem::remove(f);
        }
        comm.barrier();
      }
    }
  }
}

TEST_CASE("resume at another world size from the sharded files (N -> N-1 and N-1 -> N)") {
  MpiCommunicator comm;
  const int n = comm.size();
  if (n < 2) return;  // needs two world sizes within this run
  auto backend = make_host_backend();
  const SmallerWorld smaller(comm, "reshard");
  const std::string& tag = smaller.tag;
  const int small = n - 1;
  const bool in_small = smaller.in_small;
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
        MpiCommunicator sub(smaller.comm);
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
        MpiCommunicator sub(smaller.comm);
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
  // Wrong file count or order is a clear error.
  Engine engine(units(), options(2, DType::bf16), comm, *backend);
  CHECK_THROWS_WITH_AS(engine.load_state_resharded({}), doctest::Contains("no checkpoint files"), InvalidArgument);
}
