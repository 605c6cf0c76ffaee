#include "train_config.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <utility>

#include "zero/core/error.hpp"
#include "zero/engine/memory_model.hpp"
#include "zero/engine/options.hpp"
#include "zero/optim/optimizer.hpp"

namespace sdxl {

namespace {

// Bounds of options whose size is known before anything is allocated: a
// value past them cannot run on any machine this trainer targets, and would
// otherwise end in an allocation failure deep inside LibTorch or the sampler.
constexpr double kMaxBucketMiB = 1 << 20;                    // 1 TiB
constexpr std::int64_t kMaxSyntheticSamples = 10'000'000;    // the sampler keeps ~40 bytes per sample
constexpr std::int64_t kMaxLatentSize = 1024;                // 8192-pixel images; SDXL trains at 128
constexpr std::int64_t kMaxTextLength = 4096;                // tokens; SDXL's encoders give 77
constexpr std::int64_t kMaxBatchSize = 65536;                // per rank and micro-step

}  // namespace

std::int64_t TrainConfig::checkpoint_unit_count() const {
  if (checkpoint_units == "all" || checkpoint_units == "fit") return 0;
  std::int64_t count = 0;
  const bool digits = !checkpoint_units.empty() && checkpoint_units.size() <= 6 &&
                      std::all_of(checkpoint_units.begin(), checkpoint_units.end(),
                                  [](char ch) { return ch >= '0' && ch <= '9'; });
  if (digits) count = std::stoll(checkpoint_units);
  ZERO_CHECK(digits && count >= 1, "checkpoint_units ([train]) must be \"all\", \"fit\" or a number of units "
             ">= 1, got \"", checkpoint_units, "\"");
  return count;
}

void TrainConfig::validate() const {
  using zero::InvalidArgument;
  auto one_of = [](const std::string& value, std::initializer_list<const char*> allowed, const char* key) {
    for (const char* a : allowed)
      if (value == a) return;
    std::string list;
    for (const char* a : allowed) list += std::string(list.empty() ? "" : ", ") + a;
    ZERO_THROW(InvalidArgument, key, ": '", value, "' is not one of ", list);
  };
  ZERO_CHECK(lora_rank >= 0 && lora_rank <= 65536, "[lora] rank must be in [0, 65536] (0: no LoRA), got ", lora_rank);
  if (lora_rank > 0) {
    ZERO_CHECK(std::isfinite(lora_alpha) && lora_alpha >= 0, "[lora] alpha must be >= 0 (0: alpha = rank), got ",
               lora_alpha);
    ZERO_CHECK(lora_dropout >= 0 && lora_dropout < 1, "[lora] dropout must be in [0, 1), got ", lora_dropout);
    ZERO_CHECK(!lora_targets.empty(), "[lora] targets is empty: name the Linear layers to adapt (glob patterns)");
    ZERO_CHECK(freeze.empty(), "[model] freeze = ", pattern_list(freeze),
               " with [lora] rank = ", lora_rank, ": LoRA freezes the whole UNet and trains only the adapters; "
               "narrow [lora] targets instead");
    ZERO_CHECK(lora_dropout == 0 || !activation_checkpointing,
               "[lora] dropout = ", lora_dropout, " does not work with activation_checkpointing (the recomputed "
               "forward would draw another dropout mask); set one of them off");
    ZERO_CHECK(merge_lora || (export_full_checkpoint.empty() && !export_single_file),
               "[lora] rank = ", lora_rank, " exports the adapters only: export_full_checkpoint and export_single_file "
               "need merge_lora = true (the UNet with the adapters merged in)");
  } else {
    ZERO_CHECK(!merge_lora, "merge_lora needs [lora] rank > 0 (there are no adapters to merge)");
    ZERO_CHECK(lora_init_from.empty(), "[lora] init_from needs [lora] rank > 0");
  }
  ZERO_CHECK(synthetic || !dataset.empty(), "data: set dataset to a cached dataset folder, or synthetic = true");
  ZERO_CHECK(synthetic_samples >= 1 && synthetic_samples <= kMaxSyntheticSamples, "synthetic_samples ([data]) must be in "
             "[1, ", kMaxSyntheticSamples, "] (the sampler holds every sample's index), got ", synthetic_samples);
  ZERO_CHECK(latent_size >= 8 && latent_size % 8 == 0 && latent_size <= kMaxLatentSize,
             "latent_size ([data]) must be a multiple of 8 in [8, ", kMaxLatentSize, "] (latent pixels: image pixels / 8; "
             "SDXL trains at 128), got ", latent_size);
  ZERO_CHECK(text_length >= 1 && text_length <= kMaxTextLength, "text_length ([data]) must be in [1, ", kMaxTextLength,
             "] tokens, got ", text_length);
  ZERO_CHECK(steps >= 0 && epochs >= 0, "[train] steps and epochs must be >= 0, got steps = ", steps, ", epochs = ",
             epochs);
  ZERO_CHECK(steps == 0 || epochs == 0, "[train] steps = ", steps, " and [train] epochs = ", epochs,
             " are both set: the run's length is one or the other; set the unused one to 0 (e.g. --steps 0 --epochs ",
             epochs, ")");
  ZERO_CHECK(steps > 0 || epochs > 0, "[train] steps and [train] epochs are both 0: set one of them to the run's length");
  // An epoch holds at least one step, and a step is below 2^63: bounded before the dataset is opened.
  ZERO_CHECK(epochs <= (std::int64_t{1} << 40), "[train] epochs must be at most 2^40, got ", epochs);
  ZERO_CHECK(batch_size >= 1 && batch_size <= kMaxBatchSize, "batch_size ([train]) must be in [1, ", kMaxBatchSize,
             "] samples per rank and micro-step (accumulation multiplies it without the memory), got ", batch_size);
  ZERO_CHECK(accumulation >= 1, "accumulation must be >= 1, got ", accumulation);
  one_of(precision, {"fp32", "bf16", "fp16"}, "precision");
  one_of(prediction, {"epsilon", "v_prediction"}, "prediction");
  ZERO_CHECK(min_snr_gamma >= 0 && std::isfinite(min_snr_gamma), "min_snr_gamma must be >= 0, got ", min_snr_gamma);
  ZERO_CHECK(noise_offset >= 0 && noise_offset < 1, "noise_offset must be in [0, 1), got ", noise_offset);
  ZERO_CHECK(caption_dropout >= 0 && caption_dropout <= 1, "caption_dropout ([data]) must be in [0, 1], got ",
             caption_dropout);
  ZERO_CHECK(validation_every >= 0, "[validation] every must be >= 0 (0: off), got ", validation_every);
  if (validation_every > 0) {
    ZERO_CHECK(!validation_pipeline.empty() || !validation_single_file.empty(), "[validation] every = ",
               validation_every, " needs [validation] pipeline (--validation_pipeline): the diffusers SDXL pipeline "
               "folder whose VAE decodes the images, or [validation] single_file (--validation_single_file)");
    ZERO_CHECK(validation_pipeline.empty() || validation_single_file.empty(),
               "[validation] pipeline and single_file exclude each other");
    ZERO_CHECK(validation_single_file_config.empty() || !validation_single_file.empty(),
               "[validation] single_file_config goes with [validation] single_file");
    ZERO_CHECK(validation_steps >= 1 && validation_steps <= 1000, "[validation] steps must be in [1, 1000], got ",
               validation_steps);
    ZERO_CHECK(std::isfinite(validation_guidance) && validation_guidance >= 0,
               "[validation] guidance must be >= 0, got ", validation_guidance);
    ZERO_CHECK(validation_seed >= 0, "[validation] seed must be >= 0, got ", validation_seed);
    one_of(validation_sampler, {"euler", "dpmpp_2m", "dpmpp_2m_karras"}, "[validation] sampler");
    for (const auto& [side, value] : {std::pair{"height", validation_height}, std::pair{"width", validation_width}})
      ZERO_CHECK(value >= 8 && value <= 8192 && value % 8 == 0, "[validation] ", side,
                 " must be a multiple of 8 in [8, 8192] pixels, got ", value);
  }
  one_of(optimizer, {"adamw", "lion", "sgd"}, "optimizer");
  ZERO_CHECK(lr > 0 && std::isfinite(lr), "lr must be > 0, got ", lr);
  one_of(lr_schedule, {"constant", "linear", "cosine"}, "lr_schedule");
  ZERO_CHECK(beta1 >= 0 && beta1 < 1, "beta1 must be in [0, 1), got ", beta1);
  ZERO_CHECK(beta2 >= 0 && beta2 < 1, "beta2 must be in [0, 1), got ", beta2);
  ZERO_CHECK(eps > 0, "eps must be > 0, got ", eps);
  ZERO_CHECK(weight_decay >= 0, "weight_decay must be >= 0, got ", weight_decay);
  ZERO_CHECK(momentum >= 0 && momentum < 1, "momentum must be in [0, 1), got ", momentum);
  one_of(state_dtype, {"fp32", "bf16"}, "state_dtype");
  ZERO_CHECK(max_grad_norm >= 0, "max_grad_norm must be >= 0, got ", max_grad_norm);
  ZERO_CHECK(max_nonfinite_steps >= 0 && max_nonfinite_steps <= std::numeric_limits<int>::max(),
             "max_nonfinite_steps must be in [0, ", std::numeric_limits<int>::max(), "] (0: never stop), got ",
             max_nonfinite_steps);
  ZERO_CHECK(ema_decay >= 0 && ema_decay < 1, "ema_decay must be in [0, 1), got ", ema_decay);
  ZERO_CHECK(ema_every >= 1 && ema_every <= 1000000, "ema_every must be in [1, 1000000] (1: every step), got ",
             ema_every);
  ZERO_CHECK(ema_decay == 0 || static_cast<double>(ema_every) * (1 - ema_decay) <= 1, "ema_every = ", ema_every,
             " is longer than the EMA's horizon 1 / (1 - ema_decay) = ", 1 / (1 - ema_decay), " steps");
  ZERO_CHECK(stage >= 0 && stage <= 3, "stage must be 0, 1, 2 or 3, got ", stage);
  ZERO_CHECK(shard_group_size >= 0 && shard_group_size <= (1 << 20),
             "shard_group_size must be 0 (all ranks) or a number of ranks that divides the world size, got ",
             shard_group_size);
  (void)checkpoint_unit_count();  // "all", "fit" or a count, else refused naming the key
  // "fit" without checkpointing has nothing to choose (sdxl-1024.toml sets
  // it, and --activation_checkpointing false must still work); a count does.
  ZERO_CHECK(checkpoint_unit_count() == 0 || activation_checkpointing, "checkpoint_units = \"", checkpoint_units,
             "\" ([train]) chooses the units activation checkpointing recomputes: set activation_checkpointing = "
             "true, or checkpoint_units = \"all\"");
  // The engine's buckets are whole bytes: below one byte the engine would name its own option, not this one.
  ZERO_CHECK(prefetch_units >= 0 && prefetch_units <= 64,
             "prefetch_units ([zero]) must be in [0, 64] (0: gather each unit when entered), got ", prefetch_units);
  ZERO_CHECK(reductions_in_flight >= 1 && reductions_in_flight <= 1024,
             "reductions_in_flight ([zero]) must be in [1, 1024], got ", reductions_in_flight);
  ZERO_CHECK(std::isfinite(bucket_mib) && bucket_mib * (1 << 20) >= 1 && bucket_mib <= kMaxBucketMiB,
             "bucket_mib ([zero]) must be a size in MiB in [1/1048576 (one byte), ", static_cast<long long>(kMaxBucketMiB),
             "], got ",
             bucket_mib);
  one_of(accumulation_mode, {"each", "boundary"}, "accumulation_mode");
  one_of(units, {"layers", "blocks"}, "units");
  // How the offload options combine with the stage, the EMA and each other:
  // the engine's rules (engine_options(*this).validate() below).
  ZERO_CHECK(offload_update_threads >= 0 && offload_update_threads <= 4096,
             "offload_update_threads must be in [0, 4096] (0: the cores less one), got ", offload_update_threads);
  ZERO_CHECK(offload_gradient_threads >= 0 && offload_gradient_threads <= 4096,
             "offload_gradient_threads must be in [0, 4096] (0: as offload_update_threads), got ",
             offload_gradient_threads);
  ZERO_CHECK(delayed_update_warmup >= 0 && delayed_update_warmup <= std::numeric_limits<int>::max(),
             "delayed_update_warmup must be >= 0, got ", delayed_update_warmup);
  if (!max_gpu_memory.empty()) {
    ZERO_CHECK(device == "cuda", "max_gpu_memory applies to device = \"cuda\" only");
    ZERO_CHECK(zero::parse_bytes(max_gpu_memory, "max_gpu_memory") > 0, "max_gpu_memory must be > 0");
  }
  if (!fit.empty()) {
    ZERO_CHECK(zero::parse_bytes(fit, "fit ([device], --fit)") > 0, "fit ([device], --fit) must be > 0");
    ZERO_CHECK(max_gpu_memory.empty() ||
                   zero::parse_bytes(max_gpu_memory, "max_gpu_memory") == zero::parse_bytes(fit, "fit"),
               "fit = \"", fit, "\" and max_gpu_memory = \"", max_gpu_memory, "\" differ: fit caps the run at its own "
               "size; leave max_gpu_memory empty or set it to the same size");
  }
  one_of(attention, {"default", "flash", "efficient", "cudnn", "math"}, "attention");
  if (cuda_graph) {
    ZERO_CHECK(device == "cuda", "cuda_graph applies to device = \"cuda\" only");
    ZERO_CHECK(accumulation == 1, "cuda_graph needs accumulation = 1, got ", accumulation);
    ZERO_CHECK(!offload_optimizer, "cuda_graph does not work with offload_optimizer (gradients go to the host)");
    ZERO_CHECK(precision != "fp16", "cuda_graph needs precision bf16 or fp32 (fp16's loss scale changes between steps)");
  }
  ZERO_CHECK(!(deterministic && attention == "cudnn"),
             "deterministic = true and attention = \"cudnn\": cuDNN's attention has no deterministic backward; use "
             "attention = \"default\", \"flash\", \"efficient\" or \"math\"");
  ZERO_CHECK(profile_step == 0 || device == "cuda", "profile_step applies to device = \"cuda\" only");
  ZERO_CHECK(host_threads >= 0 && host_threads <= 4096,
             "host_threads ([device]) must be in [0, 4096] (0: the host's cores / ranks on it), got ", host_threads);
  ZERO_CHECK(!output_dir.empty(), "output_dir must not be empty");
  ZERO_CHECK(log_every >= 1, "log_every must be >= 1, got ", log_every);
  ZERO_CHECK(checkpoint_every >= 0, "checkpoint_every must be >= 0, got ", checkpoint_every);
  ZERO_CHECK(keep_checkpoints >= 1, "keep_checkpoints must be >= 1, got ", keep_checkpoints);
  ZERO_CHECK(checkpoint_every_epochs >= 0, "checkpoint_every_epochs ([output]) must be >= 0, got ",
             checkpoint_every_epochs);
  ZERO_CHECK(export_every_epochs >= 0, "export_every_epochs ([output]) must be >= 0, got ", export_every_epochs);
  one_of(device, {"cpu", "cuda"}, "device");
  one_of(export_dtype, {"fp32", "bf16", "fp16"}, "export_dtype");
  one_of(export_full_checkpoint_unet, {"auto", "ema", "trained"}, "export_full_checkpoint_unet");
  ZERO_CHECK(export_full_checkpoint_unet != "ema" || ema_decay > 0,
             "export_full_checkpoint_unet = \"ema\" needs an EMA ([optimizer] ema_decay > 0)");
  // With epochs the upper bounds wait for the dataset (validate_length again then).
  validate_length(epochs == 0 ? steps : std::numeric_limits<std::int64_t>::max());
  // Last: every key above is in range, so what the engine refuses is how the
  // options combine. The offload rules are the engine's, in the trainer's key
  // names (without the engine's "EngineOptions.offload: ", which a config's
  // reader does not know); then the engine's other rules.
  const zero::EngineOptions engine = engine_options(*this);
  const std::string offload_conflict = engine.offload_conflict();
  ZERO_CHECK(offload_conflict.empty(), offload_conflict);
  engine.validate();
}

zero::EngineOptions engine_options(const TrainConfig& cfg) {
  zero::EngineOptions options;
  options.stage = static_cast<int>(cfg.stage);
  options.param_dtype = zero::parse_dtype(cfg.precision, "precision");
  options.buckets.bytes = static_cast<std::size_t>(cfg.bucket_mib * (1 << 20));
  options.buckets.max_reductions_in_flight = static_cast<int>(cfg.reductions_in_flight);
  options.buckets.prefetch_units = static_cast<int>(cfg.prefetch_units);
  options.accumulation_steps = static_cast<int>(cfg.accumulation);
  options.accumulation = cfg.accumulation_mode == "boundary" ? zero::GradAccumulation::reduce_at_boundary
                                                             : zero::GradAccumulation::reduce_each_micro_step;
  options.max_grad_norm = cfg.max_grad_norm;
  options.optimizer = {.kind = zero::parse_optimizer_kind(cfg.optimizer, "optimizer"), .lr = cfg.lr,
                       .beta1 = cfg.beta1, .beta2 = cfg.beta2, .eps = cfg.eps, .weight_decay = cfg.weight_decay,
                       .momentum = cfg.optimizer == "sgd" ? cfg.momentum : 0.0,
                       .state_dtype = zero::parse_dtype(cfg.state_dtype, "[optimizer] state_dtype")};
  options.ema.decay = cfg.ema_decay;
  options.ema.every = static_cast<int>(cfg.ema_every);
  options.max_consecutive_nonfinite = static_cast<int>(cfg.max_nonfinite_steps);
  options.offload.optimizer = cfg.offload_optimizer;
  options.offload.params = cfg.offload_params;
  options.shard_group_size = static_cast<int>(cfg.shard_group_size);
  options.offload.delayed_update = cfg.offload_delayed_update;
  options.offload.accumulate_on_host = cfg.offload_accumulate_on_host;
  options.offload.ema_on_device = cfg.offload_ema_on_device;
  options.offload.upload_during_backward = cfg.offload_upload_during_backward;
  options.offload.gradient_stats_on_device = cfg.offload_gradient_stats_on_device;
  options.offload.delayed_update_warmup_steps = static_cast<int>(cfg.delayed_update_warmup);
  options.offload.update_threads = static_cast<int>(cfg.offload_update_threads);
  options.offload.gradient_worker_threads = static_cast<int>(cfg.offload_gradient_threads);
  return options;
}

void TrainConfig::validate_length(std::int64_t total_steps) const {
  // With epochs the bound is what they come to, said in the message.
  const std::string bound = epochs > 0 && total_steps < std::numeric_limits<std::int64_t>::max() ? "[0, " + std::to_string(total_steps) + "] (epochs = " + std::to_string(epochs) +
                                             " is " + std::to_string(total_steps) + " steps)"
                                       : std::string("[0, steps]");
  ZERO_CHECK(warmup_steps >= 0 && warmup_steps <= total_steps, "warmup_steps must be in ", bound, ", got ",
             warmup_steps);
  ZERO_CHECK(profile_step >= 0 && profile_step <= total_steps, "profile_step must be in ", bound, " (0: off), got ",
             profile_step);
  ZERO_CHECK(stop_after >= 0 && stop_after <= total_steps, "stop_after must be in ", bound, ", got ", stop_after);
}

}  // namespace sdxl
