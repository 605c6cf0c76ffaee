// The trainer's configuration: one table of options, read from a TOML file
// and overridable on the command line (`--key value`, the same dotted names),
// validated once with errors that name the key. `--help` prints every option
// with its default; the effective configuration is printed at start and
// saved with every checkpoint.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace zero {
struct EngineOptions;
}

namespace sdxl {

struct TrainConfig {
  // [model]
  std::string model_config = "tiny";   // "tiny", "sdxl-base", or a diffusers config.json / model folder
  std::string model_weights;           // safetensors / diffusers folder / single file; empty: random init
  /// [model] freeze = ["down_blocks.*", "conv_in.*"]: parameters (glob
  /// patterns on diffusers names) that keep their starting values; the
  /// engine holds only their model-dtype values (no gradient, master weights,
  /// optimizer state or EMA). `--freeze PATTERN` (repeatable) replaces the list.
  std::vector<std::string> freeze;
  // [lora]: adapters on the frozen UNet instead of training it (unet.hpp LoraOptions)
  std::int64_t lora_rank = 0;          // 0: no LoRA, the UNet itself is trained
  double lora_alpha = 0;               // scale = alpha / rank; 0: alpha = rank
  double lora_dropout = 0;
  /// Glob patterns over Linear module names; default: SDXL's attention
  /// projections and feed-forward layers (what diffusers' and kohya's SDXL
  /// LoRA scripts adapt).
  std::vector<std::string> lora_targets = {"*.to_q", "*.to_k", "*.to_v", "*.to_out.0", "*.ff.net.0.proj", "*.ff.net.2"};
  std::string lora_init_from;          // a LoRA file (PEFT/diffusers or kohya naming) to start from
  // [data]
  std::string dataset;                 // cached dataset folder (docs/dataset.md); empty with synthetic
  bool synthetic = false;
  std::int64_t synthetic_samples = 512;
  std::int64_t latent_size = 16;       // synthetic: latent height and width (image size / 8)
  std::int64_t text_length = 77;       // synthetic: tokens of the text embedding
  // Probability that a sample's text conditioning is replaced by the
  // dataset's empty-prompt one (prompt embeds and pooled; time ids kept).
  double caption_dropout = 0;
  // [train]: the run's length is steps or epochs, exactly one of them (the other 0)
  std::int64_t steps = 100;            // optimizer steps; 0 with epochs > 0 (set implicitly when only epochs is given)
  std::int64_t epochs = 0;             // passes of the sampler over the dataset (data/epoch_schedule.hpp); 0: steps
  std::int64_t batch_size = 1;         // per rank and micro-step
  std::int64_t accumulation = 1;
  std::string precision = "bf16";      // fp32, bf16, fp16 (with loss scaling)
  std::string prediction = "epsilon";  // epsilon, v_prediction
  double min_snr_gamma = 0;            // 0: off
  double noise_offset = 0;
  bool activation_checkpointing = false;
  /// With activation_checkpointing, the units recomputed: "all"; a count k
  /// ("58"; in TOML also the integer 58): the k that free the most
  /// activation memory per recompute FLOP; "fit": the fewest of those whose
  /// predicted peak fits the GPU (max_gpu_memory, else its memory), decided
  /// before the engine is built (checkpoint_unit_count()).
  std::string checkpoint_units = "all";
  std::int64_t seed = 1234;
  // [optimizer]
  std::string optimizer = "adamw";     // adamw, lion, sgd
  double lr = 1e-5;
  std::string lr_schedule = "constant";  // constant, linear, cosine
  std::int64_t warmup_steps = 0;
  bool scale_lr = false;               // lr x (world size x batch x accumulation)
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 1e-2, momentum = 0.9;
  std::string state_dtype = "fp32";    // the optimizer state's storage: fp32, or bf16 (stochastic rounding)
  double max_grad_norm = 1.0;          // 0: no clipping
  std::int64_t max_nonfinite_steps = 20;  // steps in a row with non-finite gradients before stopping (0: never)
  double ema_decay = 0;                // 0: no EMA
  std::int64_t ema_every = 1;          // update the EMA every k steps with the decay over k (EmaOptions::every)
  /// [optimizer] no_weight_decay = ["*.bias", "*norm*"]: parameters (glob
  /// patterns on diffusers names) trained without weight decay.
  std::vector<std::string> no_weight_decay;
  /// [[optimizer.groups]]: parameters (patterns) with their own learning-rate
  /// scale and weight decay; the rest form the default group.
  struct OptimizerGroup {
    std::string name;
    std::vector<std::string> params;
    double lr_scale = 1.0;
    std::optional<double> weight_decay;
  };
  std::vector<OptimizerGroup> optimizer_groups;
  // [zero]
  std::int64_t stage = 2;
  double bucket_mib = 32;
  std::int64_t reductions_in_flight = 2;  // reductions (and offload's gradient downloads) in flight
  std::int64_t prefetch_units = 1;        // stage 3: units gathered ahead of the one in use
  std::string accumulation_mode = "each";  // each (reduce every micro-step), boundary
  std::string units = "layers";  // the UNet's ZeRO units: layers (per ResNet block/transformer layer) or blocks
  bool offload_optimizer = false;      // master, optimizer state, EMA in pinned host memory (stages 1-3)
  std::int64_t shard_group_size = 0;   // hybrid sharding: ranks per shard group (0: all ranks)
  bool offload_params = false;         // stage 3 + offload_optimizer: parameter shards in pinned host memory
  bool offload_delayed_update = false; // offload: the CPU update overlaps the next step (parameters one step stale)
  std::int64_t delayed_update_warmup = 0;  // synchronous updates before the delay starts
  bool offload_accumulate_on_host = false;  // offload + accumulation: the CPU adds the micro-steps' gradients
  bool offload_ema_on_device = false;  // offload: the EMA stays on the GPU; the master goes up, the GPU rounds it
  bool offload_upload_during_backward = true;  // delayed update, stages 1-2: parameters go up during backward
  bool offload_gradient_stats_on_device = true;  // offload: gradient statistics summed on the GPU before the download
  std::int64_t offload_update_threads = 0;    // the CPU update's threads beside the GPU (0: cores - 1)
  std::int64_t offload_gradient_threads = 0;  // the host gradient worker's threads (0: as the update's)
  // [output]
  std::string output_dir = "runs/sdxl";
  std::int64_t log_every = 1;
  std::int64_t checkpoint_every = 0;   // 0: only at the end
  std::int64_t checkpoint_every_epochs = 0;  // checkpoint at the step that completes epoch K, 2K, ... (0: off)
  std::int64_t export_every_epochs = 0;      // export to output_dir/exports/epoch-N at those steps (0: off)
  std::int64_t keep_checkpoints = 2;
  std::string resume;                  // "", "latest", or a checkpoint folder
  /// Start afresh in an output_dir that holds another run (its checkpoints,
  /// metrics.jsonl, TensorBoard events are removed first); without it such a
  /// folder is refused unless resuming.
  bool overwrite = false;
  /// Resume from a checkpoint whose manifest lists no CRC32C (version 1),
  /// where a damaged shard would load unnoticed; refused without it.
  bool accept_unchecksummed_checkpoint = false;
  std::int64_t stop_after = 0;         // save a checkpoint and stop after this step (0: run to the end)
  bool export_single_file = false;     // also write the original single-file layout
  std::string export_dtype = "fp32";   // fp32, bf16, fp16: the dtype of every exported UNet tensor
  /// A base single file (original SDXL layout, e.g. sd_xl_base_1.0.safetensors):
  /// output_dir/full_checkpoint.safetensors is that file with its UNet replaced
  /// by the trained one. Checked before training. Empty: not written.
  std::string export_full_checkpoint;
  std::string export_full_checkpoint_unet = "auto";  // auto (EMA when ema_decay > 0), ema, trained
  bool save_final = true;              // checkpoint after the last step
  bool export_unet = true;             // export the UNet (and EMA UNet) after the last step
  bool merge_lora = false;             // with LoRA: also export the UNet with the adapters merged in
  // [validation]: sample images while training (train_validation.hpp)
  std::int64_t validation_every = 0;       // steps between validation images, also after the last step; 0: off
  /// The prompts (one image each, prompt i on rank i mod N); empty: the
  /// dataset's cached validation prompts (prepare --validation_prompts).
  /// `--validation_prompt TEXT` (repeatable) replaces the list.
  std::vector<std::string> validation_prompts;
  std::string validation_negative_prompt;  // empty: zeros (SDXL's force_zeros_for_empty_prompt)
  /// diffusers SDXL pipeline folder: its VAE decodes the images, its text
  /// encoders encode prompts the dataset has not cached, its scheduler config
  /// sets the noise schedule.
  std::string validation_pipeline;
  /// Instead of validation_pipeline: an original single-file checkpoint's
  /// VAE and text encoders (A1111/ComfyUI), with the architectures of
  /// validation_single_file_config (a pipeline folder; empty: SDXL 1.0's) and
  /// the tokenizer folders (needed to encode prompts the dataset has not
  /// cached; default: the config folder's).
  std::string validation_single_file, validation_single_file_config;
  std::string validation_tokenizer, validation_tokenizer_2;
  std::int64_t validation_steps = 30;
  double validation_guidance = 5.0;
  std::int64_t validation_seed = 0;        // image i's initial noise: seed + i (the same at every validation)
  std::string validation_sampler = "euler";  // euler, dpmpp_2m, dpmpp_2m_karras
  std::int64_t validation_height = 1024;
  std::int64_t validation_width = 1024;
  // [device]
  std::string device = "cpu";          // cpu, cuda
  bool cudnn_benchmark = true;         // let cuDNN time its convolution algorithms once per shape
  bool tf32 = false;                   // TF32 tensor cores for fp32 matmuls and convolutions (false: strict fp32)
  std::int64_t host_threads = 0;       // LibTorch's intra-op threads on each rank; 0: the host's cores / ranks on it
  std::string max_gpu_memory;          // e.g. "24GiB": behave like a card of this size; empty: no cap
  /// e.g. "12GiB" (--fit): before the engine is built, the memory planner
  /// chooses batch_size, accumulation (keeping the global batch), stage,
  /// offload_optimizer, offload_params, offload_delayed_update and
  /// activation_checkpointing for the most predicted images/s under this
  /// size, applies them, and (on CUDA) caps the run at it as max_gpu_memory
  /// does. Options given on the command line are kept (train_memory.hpp).
  std::string fit;
  std::string attention = "default";   // scaled-dot-product attention kernel: default, flash, efficient, cudnn, math
  bool channels_last = false;          // convolutional path in NHWC (fused NHWC GroupNorm+SiLU on CUDA)
  bool cuda_graph = false;             // capture the micro-step once, replay it every step (any stage)
  bool deterministic = false;          // deterministic kernels only: the same bits on every run, graph or eager
  std::int64_t profile_step = 0;       // write a Kineto trace of this step to output_dir (CUDA; 0: off)

  /// Keys of the options given as --key on the command line (not saved):
  /// what [device] fit must not change.
  std::vector<std::string> command_line_keys;

  /// Throws zero::InvalidArgument naming the first key that is out of range.
  /// With epochs the options bounded by the run's length in steps are
  /// checked by validate_length() once that length is known.
  void validate() const;
  /// checkpoint_units as a count: 0 for "all" (and for "fit" before it is
  /// decided), else the number given.
  std::int64_t checkpoint_unit_count() const;
  /// The options bounded by the run's length (warmup_steps, stop_after,
  /// profile_step) against `total_steps`: steps, or what epochs come to.
  void validate_length(std::int64_t total_steps) const;
  /// Whether any option counts epochs (epochs, checkpoint_every_epochs, export_every_epochs).
  bool uses_epochs() const { return epochs > 0 || checkpoint_every_epochs > 0 || export_every_epochs > 0; }
  /// TOML text of every option (what was used), for logs and checkpoints.
  std::string to_toml() const;
};

/// The engine's options as this configuration sets them (stage, dtypes,
/// buckets, optimizer, EMA, offload). validate() checks them with the engine's
/// own rules, so the rules on how these options combine live in one place.
zero::EngineOptions engine_options(const TrainConfig& cfg);

/// Reads `--config file.toml` and `--key value` overrides from argv; returns
/// false when --help was printed (exit 0). Unknown keys in the file, wrong
/// types and bad values are zero::InvalidArgument naming the key and file.
bool parse_train_config(int argc, char** argv, TrainConfig& config);

/// Parses TOML text (for tests); `origin` names it in errors.
TrainConfig train_config_from_toml(const std::string& text, const std::string& origin);

/// [model] freeze of a configuration saved by to_toml() (a checkpoint's
/// manifest): empty when it has none, nullopt when the text does not parse
/// or the key is not a list of strings (only used to explain a refused resume).
std::optional<std::vector<std::string>> saved_freeze(const std::string& config_toml);

/// Patterns as a TOML array (toml++ writes [ 'a', 'b' ]), for messages and to_toml().
std::string pattern_list(const std::vector<std::string>& patterns);

}  // namespace sdxl
