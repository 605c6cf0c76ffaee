// Core: dtype conversions, shard math, layouts, launch discovery, memory model.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <map>
#include <random>

#include "zero/comm/launch_env.hpp"
#include "zero/core/dtype.hpp"
#include "zero/core/layout.hpp"
#include "zero/engine/engine.hpp"
#include "zero/engine/memory_model.hpp"

using namespace zero;

namespace {
// Round to nearest even through double arithmetic: an independent definition.
float round_via_double(double x, int mantissa_bits, int min_exponent, double max_finite) {
  if (std::isnan(x)) return std::numeric_limits<float>::quiet_NaN();
  if (std::isinf(x)) return static_cast<float>(x);
  if (x == 0) return static_cast<float>(x);
  int exponent = std::ilogb(x);
  exponent = std::max(exponent, min_exponent);
  const double quantum = std::ldexp(1.0, exponent - mantissa_bits);
  const double rounded = std::nearbyint(x / quantum) * quantum;
  if (std::fabs(rounded) > max_finite) return x > 0 ? INFINITY : -INFINITY;
  return static_cast<float>(rounded);
}
}  // namespace

TEST_CASE("bf16 and fp16 conversions round to nearest even, keep NaN and infinity") {
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::uint32_t> bits;
  for (int i = 0; i < 200000; ++i) {
    const float x = std::bit_cast<float>(bits(rng));
    const float bf = round_to(DType::bf16, x);
    const float hf = round_to(DType::fp16, x);
    if (std::isnan(x)) {
      CHECK(std::isnan(bf));
      CHECK(std::isnan(hf));
      continue;
    }
    // bf16: 8 significant bits (7 stored), fp32's exponent range.
    const float expected_bf = round_via_double(x, 7, -126, 3.3895313892515355e38);
    if (std::isfinite(expected_bf)) CHECK(bf == expected_bf);
    // fp16: 11 significant bits, min normal exponent -14, max 65504.
    const float expected_hf = round_via_double(x, 10, -14, 65504.0);
    CHECK_MESSAGE(hf == expected_hf, "x=", x, " got ", hf, " expected ", expected_hf);
  }
  CHECK(round_to(DType::fp16, 65519.0f) == 65504.0f);
  CHECK(std::isinf(round_to(DType::fp16, 65520.0f)));
  CHECK(round_to(DType::fp16, 5.96e-8f) == std::ldexp(1.0f, -24));
  CHECK(round_to(DType::bf16, 1.0f + std::ldexp(1.0f, -8)) == 1.0f);  // tie to even
  CHECK(parse_dtype("bfloat16") == DType::bf16);
  CHECK_THROWS_WITH_AS(parse_dtype("fp8", "--dtype"), doctest::Contains("--dtype: unknown dtype 'fp8'"),
                       InvalidArgument);
}

TEST_CASE("errors carry file:line, rank and the message; what() names the source only in debug mode") {
  try {
    ZERO_CHECK_EQ(3, 4, "sizes differ");
    FAIL("no throw");
  } catch (const InvalidArgument& e) {
    CHECK(e.file().find("test_core.cpp") != std::string::npos);
    CHECK(e.line() > 0);
    // ZERO_DEBUG=1 puts the internal source path into the message; users never need it.
    CHECK((std::string(e.what()).find("test_core.cpp:") != std::string::npos) == debug_mode());
    CHECK(std::string(e.what()).find("(3 vs 4)") != std::string::npos);
    CHECK(e.message().find("sizes differ") != std::string::npos);
  }
}

TEST_CASE("even shards cover every length exactly once at every world size") {
  for (int world = 1; world <= 9; ++world) {
    for (std::size_t length : {std::size_t{0}, std::size_t{1}, std::size_t{2}, std::size_t{7}, std::size_t{97},
                               std::size_t{1} << 20, (std::size_t{1} << 40) + 3}) {
      const std::size_t padded = round_up(length, static_cast<std::size_t>(world));
      CHECK(padded - length < static_cast<std::size_t>(world));
      std::size_t next = 0, valid = 0;
      for (int r = 0; r < world; ++r) {
        const ShardRange s = even_shard(padded, world, r);
        CHECK(s.offset == next);
        next = s.end();
        valid += clip_to(s, length).size;
      }
      CHECK(next == padded);
      CHECK(valid == length);
    }
  }
  CHECK_THROWS_AS(even_shard(10, 3, 0), InvalidArgument);
  CHECK_THROWS_AS(even_shard(9, 3, 3), InvalidArgument);
  CHECK_THROWS_AS(even_shard(9, 0, 0), InvalidArgument);
  CHECK_THROWS_AS(round_up(std::numeric_limits<std::size_t>::max(), 2), InvalidArgument);
}

TEST_CASE("flat layout: aligned, padded, every parameter placed once, any size and world") {
  std::mt19937 rng(11);
  for (int world = 1; world <= 8; ++world) {
    for (std::size_t alignment : {1, 4, 64}) {
      for (std::size_t bucket_elements : {1, 100, 4096, 1 << 20}) {
        std::vector<ParamSpec> params;
        const std::size_t sizes[] = {0, 1, 2, 3, 13, 97, 1000, 4099};
        for (int i = 0; i < 20; ++i) params.push_back({"p" + std::to_string(i), sizes[rng() % 8], {}});
        const FlatLayout layout = FlatLayout::build(
            params, {.world_size = world, .alignment = alignment, .bucket_elements = bucket_elements});
        std::size_t numel = 0;
        for (auto& p : params) numel += p.numel;
        CHECK(layout.param_numel() == numel);
        CHECK(layout.padded_numel() % (static_cast<std::size_t>(world) * alignment) == 0);
        CHECK(layout.shard_numel() * static_cast<std::size_t>(world) == layout.padded_numel());
        std::size_t shard_offset = 0, offset = 0;
        for (std::size_t b = 0; b < layout.buckets().size(); ++b) {
          const Bucket& bucket = layout.buckets()[b];
          CHECK(bucket.offset == offset);
          CHECK(bucket.shard_offset == shard_offset);
          CHECK(bucket.padded >= bucket.used);
          CHECK(bucket.padded % (static_cast<std::size_t>(world) * alignment) == 0);
          CHECK(bucket.shard_size % alignment == 0);
          std::size_t valid = 0;
          for (int r = 0; r < world; ++r) valid += layout.valid_in_slice(b, r);
          CHECK(valid == bucket.used);
          offset += bucket.padded;
          shard_offset += bucket.shard_size;
          // Parameters of the bucket lie inside it, aligned, in order, without overlap.
          std::size_t cursor = bucket.offset;
          for (std::size_t i = bucket.first_param; i < bucket.first_param + bucket.param_count; ++i) {
            const ParamSlot& slot = layout.slots()[i];
            CHECK(slot.bucket == b);
            CHECK(slot.offset % alignment == 0);
            CHECK(slot.offset >= cursor);
            cursor = slot.offset + slot.numel;
          }
          CHECK(cursor <= bucket.offset + bucket.used);
        }
        CHECK(offset == layout.padded_numel());
      }
    }
  }
}

TEST_CASE("grouped layout keeps one bucket per group and rejects bad groups") {
  const FlatLayout layout = FlatLayout::build_grouped(
      {{{"a", 10, {2, 5}}, {"b", 3, {3}}}, {{"c", 1, {}}}}, {.world_size = 3, .alignment = 2});
  REQUIRE(layout.buckets().size() == 2);
  CHECK(layout.buckets()[0].param_count == 2);
  CHECK(layout.slots()[1].offset == 10);
  CHECK(layout.buckets()[1].padded == 6);
  CHECK_THROWS_WITH_AS(FlatLayout::build_grouped({{}}, {.world_size = 2}), doctest::Contains("group 0 is empty"),
                       InvalidArgument);
  CHECK_THROWS_WITH_AS(FlatLayout::build({{"w", 6, {2, 2}}}, {.world_size = 2}),
                       doctest::Contains("parameter 'w': shape has 4 elements but numel is 6"), InvalidArgument);
  CHECK_THROWS_WITH_AS(FlatLayout::build({{"w", 6, {}}}, {.world_size = 0}),
                       doctest::Contains("world_size must be >= 1"), InvalidArgument);
}

TEST_CASE("launch environment discovery: Open MPI, Slurm, torchrun, PMI; bad values are named") {
  auto from = [](std::map<std::string, std::string> vars) {
    return [vars](const std::string& name) -> std::optional<std::string> {
      auto it = vars.find(name);
      if (it == vars.end()) return std::nullopt;
      return it->second;
    };
  };
  LaunchEnv env = discover_launch_env(from({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "8"},
                                            {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                            {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}));
  CHECK(env.launcher == "openmpi");
  CHECK(env.rank == 3);
  CHECK(env.world_size == 8);
  CHECK(env.local_rank == 1);
  CHECK(env.local_size == 2);
  env = discover_launch_env(from({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "6"}, {"SLURM_LOCALID", "1"},
                                  {"SLURM_NTASKS_PER_NODE", "3(x2)"}}));
  CHECK(env.launcher == "slurm");
  CHECK(env.local_size == 6);
  env = discover_launch_env(from({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"}}));
  CHECK(env.launcher == "torchrun");
  env = discover_launch_env(from({{"PMI_RANK", "0"}, {"PMI_SIZE", "2"}}));
  CHECK(env.launcher == "pmi");
  env = discover_launch_env(from({}));
  CHECK(env.launcher == "none");
  CHECK(env.world_size == 1);
  CHECK_THROWS_WITH_AS(discover_launch_env(from({{"RANK", "4"}, {"WORLD_SIZE", "4"}})),
                       doctest::Contains("RANK=4 is outside [0, WORLD_SIZE=4)"), InvalidArgument);
  CHECK_THROWS_WITH_AS(discover_launch_env(from({{"RANK", "x1"}})),
                       doctest::Contains("RANK='x1' is not an integer"), InvalidArgument);
}

TEST_CASE("memory model is the ZeRO formula: (2+2+12)Psi/N at stage 3 with bf16 and AdamW") {
  const std::size_t psi = 2520 * 1024;
  for (int n = 1; n <= 8; ++n) {
    EngineOptions c;
    c.stage = 3;
    MemoryByCategory m = model_state_bytes(c, psi, n);
    CHECK(m.params == 2 * psi / n);
    CHECK(m.grads == 2 * psi / n);
    CHECK(m.master == 4 * psi / n);
    CHECK(m.optimizer_state == 8 * psi / n);
    CHECK(m.model_state() == 16 * psi / n);
    c.stage = 2;
    m = model_state_bytes(c, psi, n);
    CHECK(m.model_state() == 2 * psi + (2 + 12) * psi / n);
    c.stage = 1;
    m = model_state_bytes(c, psi, n);
    CHECK(m.model_state() == 4 * psi + 12 * psi / n);
    c.stage = 0;
    m = model_state_bytes(c, psi, n);
    CHECK(m.model_state() == 16 * psi);
  }
  // fp32 model: no separate master; SGD without momentum: no state.
  EngineOptions fp32{.stage = 3, .param_dtype = DType::fp32, .grad_dtype = DType::fp32};
  fp32.optimizer.kind = OptimizerKind::sgd;
  const MemoryByCategory m = model_state_bytes(fp32, 1024, 4);
  CHECK(m.master == 0);
  CHECK(m.optimizer_state == 0);
  CHECK(m.params == 1024);
  CHECK_THROWS_AS(model_state_bytes(EngineOptions{}, 10, 4), InvalidArgument);
  CHECK(format_bytes(3u << 30) == "3.00 GiB");
}

TEST_CASE("engine options are validated with the option's name") {
  EngineOptions o;
  o.stage = 4;
  CHECK_THROWS_WITH_AS(o.validate(), doctest::Contains("EngineOptions.stage must be 0, 1, 2 or 3, got 4"),
                       InvalidArgument);
  o = {};
  o.accumulation_steps = 0;
  CHECK_THROWS_WITH_AS(o.validate(), doctest::Contains("accumulation_steps"), InvalidArgument);
  o = {};
  o.param_dtype = static_cast<DType>(9);
  CHECK_THROWS_WITH_AS(o.validate(), doctest::Contains("unknown dtype value 9"), InvalidArgument);
  o = {};
  o.optimizer.beta2 = 1.0;
  CHECK_THROWS_WITH_AS(o.validate(), doctest::Contains("optimizer.beta2 must be in [0, 1)"), InvalidArgument);
  o = {};
  o.max_grad_norm = -1;
  CHECK_THROWS_WITH_AS(o.validate(), doctest::Contains("max_grad_norm"), InvalidArgument);
  o = {};
  o.optimizer.kind = OptimizerKind::sgd;
  o.optimizer.nesterov = true;
  CHECK_THROWS_WITH_AS(o.validate(), doctest::Contains("nesterov needs momentum > 0"), InvalidArgument);
  o = {};
  o.param_dtype = DType::fp16;
  o.loss_scaler.backoff_factor = 2;
  CHECK_THROWS_WITH_AS(o.validate(), doctest::Contains("backoff_factor"), InvalidArgument);
  CHECK_THROWS_WITH_AS(parse_optimizer_kind("adam", "optimizer.kind"),
                       doctest::Contains("unknown optimizer 'adam'"), InvalidArgument);
}

TEST_CASE("the offload rules: validate() names the struct, offload_conflict() only the switches") {
  EngineOptions o;
  o.stage = 2;
  o.offload.optimizer = true;
  CHECK(o.offload_conflict().empty());
  CHECK_NOTHROW(o.validate());
  o.offload.params = true;  // below stage 3
  const std::string conflict = o.offload_conflict();
  CHECK(conflict.starts_with("offload_params needs stage 3 with offload_optimizer, got stage 2"));
  const std::string message = "EngineOptions.offload: " + conflict;
  CHECK_THROWS_WITH_AS(o.validate(), doctest::Contains(message.c_str()), InvalidArgument);
  o.stage = 3;
  CHECK(o.offload_conflict().empty());
  o.offload.ema_on_device = true;  // beside offloaded parameters, and no EMA
  CHECK(o.offload_conflict().starts_with("offload_ema_on_device needs offload_optimizer and an EMA"));
  CHECK(o.offload_conflict().find("no EMA (ema_decay 0), offload_params, stage 3") != std::string::npos);
  o = {};
  o.offload.delayed_update = true;  // without offload_optimizer
  CHECK(o.offload_conflict().starts_with("offload_delayed_update needs offload_optimizer"));
  o = {};
  o.stage = 1;
  o.offload.optimizer = o.offload.accumulate_on_host = true;
  o.accumulation = GradAccumulation::reduce_at_boundary;
  CHECK(o.offload_conflict().find("use accumulation_mode each") != std::string::npos);
}

// offload.gradient_stats_on_device (on by default) applies where the step's
// gradient streams down whole; elsewhere it is no error, the statistics are
// summed where the gradient is.
TEST_CASE("the plan sums streamed gradients' statistics on the device where the step's gradient goes down whole") {
  EngineOptions o;
  CHECK(o.offload.gradient_stats_on_device);
  CHECK_FALSE(StagePlan::of(o, 2).grad_stats_on_device_before_download);  // nothing streams
  o.stage = 2;
  o.offload.optimizer = true;
  CHECK(StagePlan::of(o, 2).grad_stats_on_device_before_download);
  o.offload.gradient_stats_on_device = false;
  CHECK_FALSE(StagePlan::of(o, 2).grad_stats_on_device_before_download);
  o.offload.gradient_stats_on_device = true;
  o.accumulation_steps = 3;  // accumulated on the device, downloaded at the step: summed there before it
  CHECK_FALSE(StagePlan::of(o, 2).streams_grads_to_host);
  CHECK_FALSE(StagePlan::of(o, 2).grad_stats_on_device_before_download);
  o.offload.accumulate_on_host = true;  // the host adds the micro-steps: the worker sums their total
  CHECK(StagePlan::of(o, 2).accumulates_on_host);
  CHECK_FALSE(StagePlan::of(o, 2).grad_stats_on_device_before_download);
  CHECK(o.offload_conflict().empty());
  o.accumulation_steps = 1;  // streamed on the host, one micro-step: whole on the device
  CHECK(StagePlan::of(o, 2).grad_stats_on_device_before_download);
}
