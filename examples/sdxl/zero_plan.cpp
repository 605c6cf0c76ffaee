// zero-plan: predicts per-GPU and per-host memory of a zero training run by
// category, and with --fit proposes the fastest configuration that fits a
// GPU. The model, its calibration and its limits: docs/planner.md.
//
//   zero-plan --unet-config sdxl-base --stage 2 --ema --batch 8 --checkpointing
//   zero-plan --unet-config sdxl-base --ema --fit 24GiB
//   zero-plan --params 7e9 --world-size 8 --stage 3 --json
//
// Exit status: 0 (with --fit: a configuration fits), 3 nothing fits, 1 errors.

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "unet_config.hpp"
#include "sdxl_calibration.hpp"
#include "unet_param_count.hpp"
#include "zero/core/error.hpp"
#include "zero/engine/memory_model.hpp"
#include "zero/engine/planner.hpp"

namespace {

namespace fs = std::filesystem;

constexpr int kNothingFits = 3;

std::string read_text(const fs::path& path) {
  // Its size first: a mistaken path may name a huge file.
  std::error_code error;
  const std::uintmax_t bytes = fs::file_size(path, error);
  ZERO_CHECK(!error, "--unet-config: cannot read '", path.string(), "': ", error.message());
  ZERO_CHECK(bytes <= sdxl::UNetLimits::kMaxConfigBytes, "--unet-config: '", path.string(), "' is ", bytes,
             " bytes, over the limit of ", sdxl::UNetLimits::kMaxConfigBytes,
             " (a diffusers config.json is a few KB): is it the right file?");
  std::ifstream in(path);
  ZERO_CHECK(in.good(), "--unet-config: cannot read '", path.string(), "'");
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

/// "sdxl-base", a diffusers config.json, or a model folder with config.json
/// (or unet/config.json).
sdxl::UNetConfig unet_config_of(const std::string& name) {
  if (name == "sdxl-base") return sdxl::UNetConfig::sdxl_base();
  const fs::path path(name);
  ZERO_CHECK(fs::exists(path), "--unet-config: '", name, "' is neither sdxl-base nor an existing file or folder");
  if (fs::is_directory(path)) {
    for (const fs::path& candidate : {path / "config.json", path / "unet" / "config.json"})
      if (fs::is_regular_file(candidate)) return sdxl::UNetConfig::from_json(read_text(candidate), candidate.string());
    ZERO_THROW(zero::InvalidArgument, "--unet-config: folder '", name, "' has no config.json or unet/config.json");
  }
  return sdxl::UNetConfig::from_json(read_text(path), "--unet-config " + name);
}

/// A positive size: "24GiB", "12G", "500MiB" (binary units, as the trainer's max_gpu_memory).
std::size_t parse_size(const std::string& text, const std::string& option) {
  const std::size_t bytes = zero::parse_bytes(text, option);
  ZERO_CHECK(bytes > 0, option, ": must be more than 0 bytes, got \"", text, "\"");
  return bytes;
}

// Bounds on the inputs that scale the planner's work and memory: it runs the
// real engine on a counting backend, so a parameter count means buckets to
// walk, and the micro-steps walk them again. 1e13 parameters is 40 TB of fp32
// master weights, beyond any run this models; the other bounds are as far
// beyond practice and keep every product below in range.
constexpr double kMaxParams = 1e13;
constexpr int kMaxWorldSize = 1 << 20;  // as checkpoint manifests
constexpr int kMaxGpusPerHost = 1024;
constexpr int kMaxBatch = 1'000'000;
constexpr int kMaxAccumulation = 10'000;
constexpr std::int64_t kMaxLatentSize = 16384;  // 131072 pixels a side
constexpr int kMaxInFlight = 1024;
constexpr double kMaxBucketMiB = 1 << 20;  // 1 TiB
/// Buckets times micro-steps the planner walks (a --params model): 1e13
/// parameters in the default 32 MiB buckets are 6e5 buckets, 4 s and 0.2 GB;
/// the bound keeps any accepted input under about 7 s and 0.4 GB.
constexpr double kMaxBucketVisits = 1e6;

std::size_t parse_count(const std::string& text) {
  // 2567463684, 2.6e9: a positive number of parameters.
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  ZERO_CHECK(end != text.c_str() && *end == '\0' && std::isfinite(value) && value >= 1 && value <= kMaxParams,
             "--params: '", text, "' is not a parameter count in [1, 1e13] (e.g. 2567463684 or 2.6e9)");
  return static_cast<std::size_t>(std::llround(value));
}

// Every command-line setting, at its default.
struct Options {
  std::string params_text, unet_config, precision = "bf16", optimizer = "adamw", state_dtype = "fp32", fit_text,
      host_text;
  std::string accumulation_mode = "each", per_sample_text, fixed_text, overhead_text;
  std::string units = "layers";
  int shard_group_size = 0, global_batch = 0;
  std::size_t checkpoint_units = 0;
  int world_size = 1, gpus_per_host = 8, stage = 2, batch = 1, accumulation = 1, in_flight = 2, ema_every = 1, prefetch_units = 1;
  std::int64_t latent_size = 128;
  double bucket_mib = 32, margin = 0.05;
  bool ema = false, offload = false, offload_params = false, delayed_update = false, accumulate_on_host = false,
       ema_on_device = false,
       checkpointing = false, json_output = false, fp32_accumulate = false, lower_bound = false;
};

void define_options(CLI::App& app, Options& o) {
  auto* params_option = app.add_option("--params", o.params_text, "parameter count (e.g. 2.6e9), grouped into buckets");
  auto* unet_option = app.add_option("--unet-config", o.unet_config,
                                     "sdxl-base, a diffusers UNet config.json, or a model folder: one unit per block");
  params_option->excludes(unet_option);
  app.add_option("--world-size", o.world_size, "GPUs (ranks) N")
      ->capture_default_str()->check(CLI::Range(1, kMaxWorldSize));
  app.add_option("--gpus-per-host", o.gpus_per_host, "ranks sharing one host's memory")
      ->capture_default_str()->check(CLI::Range(1, kMaxGpusPerHost));
  app.add_option("--stage", o.stage, "ZeRO stage 0-3")->capture_default_str()->check(CLI::Range(0, 3));
  app.add_option("--shard-group-size", o.shard_group_size,
                 "hybrid sharding: shard over groups of this many consecutive ranks (a node), replicate across "
                 "them; must divide --world-size (0: all ranks)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--precision", o.precision, "bf16, fp16 or fp32 (parameters and gradients)")
      ->capture_default_str()->check(CLI::IsMember({"bf16", "fp16", "fp32"}));
  app.add_option("--optimizer", o.optimizer, "adamw, lion or sgd (with momentum)")
      ->capture_default_str()->check(CLI::IsMember({"adamw", "lion", "sgd"}));
  app.add_option("--state-dtype", o.state_dtype,
                 "the optimizer state's storage: fp32, or bf16 (the trainer's [optimizer] state_dtype; on the GPU or offloaded)")
      ->capture_default_str()->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_flag("--ema", o.ema, "an fp32 EMA of the weights");
  app.add_option("--ema-every", o.ema_every,
                 "with --ema: the EMA updated every k steps (the trainer's ema_every; the offloaded CPU update "
                 "moves fewer bytes)")
      ->capture_default_str()
      ->check(CLI::Range(1, 10000));
  app.add_flag("--offload-optimizer", o.offload, "master, optimizer state and EMA in pinned host memory (stages 1-3)");
  app.add_flag("--offload-params", o.offload_params,
               "stage 3 with --offload-optimizer: the parameter shard in pinned host memory too");
  app.add_flag("--delayed-update", o.delayed_update,
               "with --offload-optimizer: the CPU update overlaps the next step (parameters one update old; "
               "doubles the host staging)");
  app.add_flag("--accumulate-on-host", o.accumulate_on_host,
               "with --offload-optimizer and --accumulation: the CPU adds the micro-steps' gradients (no gradient "
               "shard on the GPU; one more on the host)");
  app.add_flag("--ema-on-device", o.ema_on_device,
               "with --offload-optimizer and --ema, without --offload-params: the EMA stays on the GPU; the fp32 "
               "master goes up and the GPU rounds it (the trainer's offload_ema_on_device)");
  app.add_option("--batch", o.batch, "samples per GPU and micro-step")
      ->capture_default_str()->check(CLI::Range(1, kMaxBatch));
  app.add_option("--accumulation", o.accumulation, "micro-steps per step")
      ->capture_default_str()->check(CLI::Range(1, kMaxAccumulation));
  app.add_option("--units", o.units,
                 "with --unet-config: the UNet's ZeRO units, layers (per ResNet block, transformer layer and "
                 "resampler) or blocks (per down, mid and up block), as the trainer's [zero] units")
      ->check(CLI::IsMember({"layers", "blocks"}))
      ->capture_default_str();
  app.add_option("--accumulation-mode", o.accumulation_mode, "each (reduce every micro-step) or boundary")
      ->capture_default_str()->check(CLI::IsMember({"each", "boundary"}));
  app.add_flag("--checkpointing", o.checkpointing, "activation checkpointing (recompute each block in backward)");
  app.add_option("--checkpoint-units,--checkpoint_units", o.checkpoint_units,
                 "with --checkpointing and --unet-config: recompute only this many units, those that free the most "
                 "activation memory per recompute FLOP (the trainer's checkpoint_units; 0: every unit)")
      ->capture_default_str();
  app.add_option("--latent-size", o.latent_size, "latent height = width (128 = 1024x1024 pixels)")
      ->capture_default_str()->check(CLI::Range(std::int64_t{1}, kMaxLatentSize));
  app.add_option("--bucket-mib", o.bucket_mib, "bucket size with --params")->capture_default_str();
  app.add_option("--max-reductions-in-flight", o.in_flight, "engine option")
      ->capture_default_str()->check(CLI::Range(1, kMaxInFlight));
  app.add_option("--prefetch-units", o.prefetch_units, "stage 3: units gathered ahead of the one in use")
      ->capture_default_str()->check(CLI::Range(0, 64));
  app.add_flag("--fp32-accumulate", o.fp32_accumulate, "NCCL half reductions through fp32 scratch");
  app.add_option("--activation-per-sample", o.per_sample_text, "override: activation bytes per sample (e.g. 2GiB)");
  app.add_option("--activation-fixed", o.fixed_text, "override: activation bytes independent of the batch");
  app.add_option("--runtime-overhead", o.overhead_text, "override: CUDA context + libraries + allocator slack per GPU");
  app.add_option("--fit", o.fit_text, "GPU memory (e.g. 24GiB, 80G): propose the fastest configuration that fits");
  app.add_option("--global-batch,--global_batch", o.global_batch,
                 "with --fit: samples per optimizer step over all GPUs; also search the micro-batch (--batch), "
                 "accumulation and the delayed update, maximising predicted images/s")
      ->check(CLI::Range(1, kMaxBatch));
  app.add_option("--host-memory", o.host_text, "with --fit: pinned host memory per host (e.g. 512GiB)");
  app.add_option("--margin", o.margin, "with --fit: safety margin (fraction of the GPU kept free)")->capture_default_str();
  app.add_flag("--lower-bound", o.lower_bound,
               "with --fit: compare the peak's lower bound (refuse only what cannot fit) instead of its upper bound");
  app.add_flag("--json", o.json_output, "JSON instead of the table");
}

// The model: its units (or a parameter count) and its activation memory.
void describe_model(const Options& o, zero::plan::PlanInput& in) {
  if (!o.unet_config.empty()) {
    const sdxl::UNetConfig config = unet_config_of(o.unet_config);
    in.units = sdxl::plan_units(config, sdxl::unit_granularity_from(o.units, "--units"), o.latent_size);
    in.model_name = o.unet_config;
    in.activations = sdxl::plan_activations(config, o.latent_size);
  } else {
    in.param_count = parse_count(o.params_text);
    in.model_name = o.params_text + " parameters";
    in.activations = sdxl::calibration::scaled_activation_model(in.param_count);
    in.activations.area_scale = static_cast<double>(o.latent_size * o.latent_size) / (128.0 * 128.0);
  }
  if (!o.per_sample_text.empty() || !o.fixed_text.empty()) {
    const double per_sample = o.per_sample_text.empty()
                                  ? 0.0
                                  : static_cast<double>(zero::parse_bytes(o.per_sample_text, "--activation-per-sample"));
    const double fixed =
        o.fixed_text.empty() ? 0.0 : static_cast<double>(zero::parse_bytes(o.fixed_text, "--activation-fixed"));
    in.activations.per_sample_bytes_checkpointed = in.activations.per_sample_bytes_full = per_sample;
    in.activations.fixed_bytes_checkpointed = in.activations.fixed_bytes_full = fixed;
    in.activations.source = "given";
  }
}

zero::plan::PlanInput plan_input_of(const Options& o) {
  ZERO_CHECK(!o.params_text.empty() || !o.unet_config.empty(), "give --params N or --unet-config NAME");
  zero::plan::PlanInput in;
  describe_model(o, in);
  in.runtime_overhead_bytes = sdxl::calibration::runtime_overhead_bytes();
  in.speed = sdxl::calibration::speed_model();
  if (!o.overhead_text.empty()) in.runtime_overhead_bytes = zero::parse_bytes(o.overhead_text, "--runtime-overhead");
  in.world_size = o.world_size;
  in.gpus_per_host = o.gpus_per_host;
  in.engine.stage = o.stage;
  in.engine.shard_group_size = o.shard_group_size;
  in.engine.param_dtype = zero::parse_dtype(o.precision, "--precision");
  in.engine.optimizer.kind = zero::parse_optimizer_kind(o.optimizer, "--optimizer");
  if (in.engine.optimizer.kind == zero::OptimizerKind::sgd) in.engine.optimizer.momentum = 0.9;  // the trainer's default
  in.engine.optimizer.state_dtype = zero::parse_dtype(o.state_dtype, "--state-dtype");
  in.engine.ema.decay = o.ema ? 0.9999 : 0.0;  // only on or off matters to memory
  in.engine.ema.every = o.ema_every;           // and to the offloaded update's time
  in.engine.offload.optimizer = o.offload;
  in.engine.offload.params = o.offload_params;
  in.engine.offload.delayed_update = o.delayed_update;
  in.engine.offload.accumulate_on_host = o.accumulate_on_host;
  in.engine.offload.ema_on_device = o.ema_on_device;
  in.engine.accumulation_steps = o.accumulation;
  in.engine.accumulation = o.accumulation_mode == "boundary" ? zero::GradAccumulation::reduce_at_boundary
                                                             : zero::GradAccumulation::reduce_each_micro_step;
  ZERO_CHECK(std::isfinite(o.bucket_mib) && o.bucket_mib > 0 && o.bucket_mib <= kMaxBucketMiB,
             "--bucket-mib: expected a size in MiB in (0, 1048576], got ", o.bucket_mib);
  in.engine.buckets.bytes = static_cast<std::size_t>(o.bucket_mib * (1 << 20));
  if (in.param_count > 0) {
    // The planner walks every bucket once per micro-step: bound that work.
    const double per_bucket = std::max(1.0, std::floor(static_cast<double>(in.engine.buckets.bytes) /
                                                       static_cast<double>(zero::size_of(in.engine.param_dtype))));
    const double buckets = std::ceil(static_cast<double>(in.param_count) / per_bucket);
    ZERO_CHECK(buckets * o.accumulation <= kMaxBucketVisits, "--params ", o.params_text, " in buckets of --bucket-mib ",
               o.bucket_mib, " is ", static_cast<long long>(buckets), " buckets, times --accumulation ",
               o.accumulation, " micro-steps: more than the 1000000 bucket visits zero-plan simulates; raise "
               "--bucket-mib or lower --accumulation");
  }
  in.engine.buckets.max_reductions_in_flight = o.in_flight;
  in.engine.buckets.prefetch_units = o.prefetch_units;
  in.fp32_accumulate_reductions = o.fp32_accumulate;
  in.batch = o.batch;
  in.activation_checkpointing = o.checkpointing;
  in.checkpoint_units = o.checkpoint_units;
  return in;
}

// Prints the plan, or with --fit the fastest configuration that fits; the exit status.
int plan_or_fit(const Options& o, const zero::plan::PlanInput& in) {
  ZERO_CHECK(o.global_batch == 0 || !o.fit_text.empty(), "--global-batch: needs --fit (it searches the micro-batch)");
  ZERO_CHECK(o.global_batch % o.world_size == 0, "--global-batch ", o.global_batch,
             " is not a multiple of --world-size ", o.world_size);
  if (o.fit_text.empty()) {
    const zero::plan::Plan plan = zero::plan::make_plan(in);
    std::fputs((o.json_output ? plan.to_json() + "\n" : plan.table()).c_str(), stdout);
    return 0;
  }
  zero::plan::FitOptions options;
  options.safety_margin = o.margin;
  if (o.lower_bound) options.estimate = zero::plan::PeakEstimate::lower;
  if (!o.host_text.empty()) options.host_bytes = parse_size(o.host_text, "--host-memory");
  options.global_batch = o.global_batch;
  const std::size_t gpu_bytes = parse_size(o.fit_text, "--fit");
  const zero::plan::FitResult result = zero::plan::fit(in, gpu_bytes, options);
  std::fputs((o.json_output ? result.to_json() + "\n" : result.table()).c_str(), stdout);
  return result.best ? 0 : kNothingFits;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"zero-plan: per-GPU and per-host memory of a zero training run, and the fastest configuration "
               "that fits (docs/planner.md)"};
  Options options;
  define_options(app, options);
  CLI11_PARSE(app, argc, argv);

  try {
    return plan_or_fit(options, plan_input_of(options));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zero-plan: error: %s\n", e.what());
    return 1;
  }
}
