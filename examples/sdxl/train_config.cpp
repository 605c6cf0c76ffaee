#include "train_config.hpp"

#include "zero/engine/memory_model.hpp"

#define TOML_HEADER_ONLY 1
#define TOML_EXCEPTIONS 1
#include <toml++/toml.h>

#include <CLI/CLI.hpp>

#include <array>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>
#include <utility>
#include <variant>

#include "zero/core/error.hpp"

namespace sdxl {

namespace {

// ---------------------------------------------------------------- bounds before parsing

// toml++ builds a node of about 90 bytes per value: a small file of a long
// array would cost gigabytes before any key is checked. A configuration is a
// few KB; these bounds refuse other files before a node is built.
constexpr std::size_t kMaxConfigBytes = 1 << 20;
constexpr std::size_t kMaxConfigValues = 10'000;

// Bounds of options whose size is known before anything is allocated: a
// value past them cannot run on any machine this trainer targets, and would
// otherwise end in an allocation failure deep inside LibTorch or the sampler.
constexpr double kMaxBucketMiB = 1 << 20;                    // 1 TiB
constexpr std::int64_t kMaxSyntheticSamples = 10'000'000;    // the sampler keeps ~40 bytes per sample
constexpr std::int64_t kMaxLatentSize = 1024;                // 8192-pixel images; SDXL trains at 128
constexpr std::int64_t kMaxTextLength = 4096;                // tokens; SDXL's encoders give 77
constexpr std::int64_t kMaxBatchSize = 65536;                // per rank and micro-step

// The values of a TOML text, over-counted (each '=', ',' and '[' outside
// strings and comments is one): the bound needs no parse.
std::size_t count_toml_values(std::string_view text) {
  std::size_t values = 0;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '#') {
      while (i < text.size() && text[i] != '\n') ++i;
    } else if (c == '"' || c == '\'') {
      const bool multiline = text.substr(i, 3) == std::string(3, c);
      const std::string_view close = multiline ? text.substr(i, 3) : text.substr(i, 1);
      i += close.size();
      while (i < text.size() && text.substr(i, close.size()) != close) {
        if (c == '"' && text[i] == '\\') ++i;  // an escape: the next character is part of the string
        else if (!multiline && text[i] == '\n') break;
        ++i;
      }
      i += close.size() - 1;
    } else if (c == '=' || c == ',' || c == '[') {
      ++values;
    }
  }
  return values;
}

void check_config_bounds(std::string_view text, const std::string& origin) {
  ZERO_CHECK(text.size() <= kMaxConfigBytes, origin, ": ", text.size(), " bytes, over the limit of ", kMaxConfigBytes,
             " for a configuration (kMaxConfigBytes; a training configuration is a few KB): is it the right file?");
  const std::size_t values = count_toml_values(text);
  ZERO_CHECK(values <= kMaxConfigValues, origin, ": about ", values, " values (keys and list entries), over the limit "
             "of ", kMaxConfigValues, " for a configuration (kMaxConfigValues)");
}

// toml++ 3.3 (the Debian package) tests code points outside strings, and
// after a line-ending backslash in a multi-line string, with a whitespace
// table whose lookup is undefined behaviour (it reaches TOML_UNREACHABLE) for
// three ranges of code points (upstream marzer/tomlplusplus issues 190 and
// 295; found by tests/fuzz/fuzz_train_config). toml++ is therefore given a
// text in which those code points are moved into private-use ranges, which the
// table handles, and every string read from it is moved back. A configuration
// that holds the private-use code points themselves is refused.
struct ShieldedRange {
  char32_t first, last, moved_to;
};
constexpr ShieldedRange kShieldedRanges[] = {
    {0x00A1, 0x0499, 0xF0A1}, {0x2C5E, 0x3057, 0xE000}, {0xFB26, 0xFEFE, 0xE400}};

// The code point of a well-formed 2- or 3-byte UTF-8 sequence at text[i] (and its length), else 0.
std::pair<char32_t, std::size_t> decode_utf8(std::string_view text, std::size_t i) {
  auto cont = [&](std::size_t k) { return k < text.size() && (static_cast<unsigned char>(text[k]) & 0xC0) == 0x80; };
  const auto b0 = static_cast<unsigned char>(text[i]);
  if ((b0 & 0xE0) == 0xC0 && cont(i + 1))
    return {(char32_t(b0 & 0x1F) << 6) | (static_cast<unsigned char>(text[i + 1]) & 0x3F), 2};
  if ((b0 & 0xF0) == 0xE0 && cont(i + 1) && cont(i + 2))
    return {(char32_t(b0 & 0x0F) << 12) | (char32_t(static_cast<unsigned char>(text[i + 1]) & 0x3F) << 6) |
                (static_cast<unsigned char>(text[i + 2]) & 0x3F),
            3};
  return {0, 1};
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
  } else {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
  }
  out += static_cast<char>(0x80 | (cp & 0x3F));
}

std::string shield_for_tomlpp(std::string_view text, const std::string& origin) {
  std::string out;
  out.reserve(text.size() + text.size() / 2);
  std::size_t line = 1;
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '\n') ++line;
    const auto [cp, length] = decode_utf8(text, i);
    bool moved = false;
    for (const ShieldedRange& r : kShieldedRanges) {
      ZERO_CHECK(length == 1 || cp < r.moved_to || cp > r.moved_to + (r.last - r.first), origin, ":", line,
                 ": private-use character (code point ", static_cast<std::uint32_t>(cp),
                 ") is not accepted in a configuration");
      if (length > 1 && cp >= r.first && cp <= r.last) {
        append_utf8(out, cp - r.first + r.moved_to);
        moved = true;
      }
    }
    if (moved) {
      i += length - 1;
      continue;
    }
    out += text[i];
  }
  return out;
}

// The inverse of shield_for_tomlpp, for strings read from the parsed table.
std::string unshield(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (std::size_t i = 0; i < text.size(); ++i) {
    const auto [cp, length] = decode_utf8(text, i);
    bool moved = false;
    for (const ShieldedRange& r : kShieldedRanges)
      if (length == 3 && cp >= r.moved_to && cp <= r.moved_to + (r.last - r.first)) {
        append_utf8(out, cp - r.moved_to + r.first);
        moved = true;
      }
    if (moved) {
      i += length - 1;
      continue;
    }
    out += text[i];
  }
  return out;
}

// toml::parse on the shielded text; a syntax error is an InvalidArgument naming origin:line:column.
toml::table parse_toml(std::string_view text, const std::string& origin) {
  const std::string shielded = shield_for_tomlpp(text, origin);
  try {
    return toml::parse(shielded, origin);
  } catch (const toml::parse_error& e) {
    ZERO_THROW(zero::InvalidArgument, origin, ":", e.source().begin.line, ":", e.source().begin.column, ": ",
               unshield(e.description()));
  }
}

// The text of a configuration file, its size checked before it is read.
std::string read_config_text(const std::string& path) {
  std::error_code error;
  const std::uintmax_t bytes = std::filesystem::file_size(path, error);
  ZERO_CHECK(!error, "--config ", path, ": cannot read: ", error.message());
  ZERO_CHECK(bytes <= kMaxConfigBytes, path, ": ", bytes, " bytes, over the limit of ", kMaxConfigBytes,
             " for a configuration (kMaxConfigBytes; a training configuration is a few KB): is it the right file?");
  std::ifstream in(path, std::ios::binary);
  ZERO_CHECK(in.good(), "--config ", path, ": cannot open");
  std::string text(static_cast<std::size_t>(bytes), '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  ZERO_CHECK(in.gcount() == static_cast<std::streamsize>(text.size()), "--config ", path, ": cannot read all of its ",
             bytes, " bytes");
  return text;
}

using Field = std::variant<std::string*, std::int64_t*, double*, bool*>;

struct Option {
  const char* table;
  const char* key;
  Field field;
  const char* help;
  const char* flag = nullptr;  // the command-line name when not the key ([lora] rank is --lora_rank)
  std::string command_line() const { return std::string("--") + (flag != nullptr ? flag : key); }
};

std::vector<Option> options_of(TrainConfig& c) {
  return {
      {"model", "model_config", &c.model_config, "\"tiny\", \"sdxl-base\", or a diffusers config.json / UNet folder"},
      {"model", "model_weights", &c.model_weights, "weights to start from (safetensors file, diffusers folder, single file); empty: random init"},
      {"lora", "rank", &c.lora_rank, "LoRA rank: train adapters on the frozen UNet (0: train the UNet itself)",
       "lora_rank"},
      {"lora", "alpha", &c.lora_alpha, "LoRA alpha: the adapters are scaled by alpha / rank (0: alpha = rank)",
       "lora_alpha"},
      {"lora", "dropout", &c.lora_dropout, "dropout on the adapters' input while training", "lora_dropout"},
      {"lora", "init_from", &c.lora_init_from,
       "start the adapters from this LoRA file (diffusers/PEFT or kohya naming; same rank and layers)",
       "lora_init_from"},
      {"data", "dataset", &c.dataset, "cached dataset folder (see docs/dataset.md)"},
      {"data", "synthetic", &c.synthetic, "train on generated samples with a learnable structure"},
      {"data", "synthetic_samples", &c.synthetic_samples, "number of synthetic samples"},
      {"data", "latent_size", &c.latent_size, "synthetic latent height and width (image size / 8)"},
      {"data", "text_length", &c.text_length, "synthetic text-embedding length in tokens"},
      {"data", "caption_dropout", &c.caption_dropout,
       "probability that a sample trains on the dataset's empty-prompt conditioning (0: off)"},
      {"train", "steps", &c.steps,
       "optimizer steps to train for; 0 with epochs (given epochs alone, steps is 0)"},
      {"train", "epochs", &c.epochs,
       "train for this many passes over the dataset instead of steps (one pass: the sampler's global batches of "
       "batch_size x ranks, leftovers of a bucket dropped; accumulation of them per step); 0: steps"},
      {"train", "batch_size", &c.batch_size, "samples per rank and micro-step"},
      {"train", "accumulation", &c.accumulation, "micro-steps per optimizer step"},
      {"train", "precision", &c.precision, "fp32, bf16, or fp16 (dynamic loss scaling)"},
      {"train", "prediction", &c.prediction, "epsilon or v_prediction"},
      {"train", "min_snr_gamma", &c.min_snr_gamma, "min-SNR loss weighting gamma (0: off)"},
      {"train", "noise_offset", &c.noise_offset, "noise offset (0: off)"},
      {"train", "activation_checkpointing", &c.activation_checkpointing, "recompute each UNet block in backward"},
      {"train", "seed", &c.seed, "seed of data order, noise and timesteps"},
      {"optimizer", "optimizer", &c.optimizer, "adamw, lion or sgd"},
      {"optimizer", "lr", &c.lr, "peak learning rate"},
      {"optimizer", "lr_schedule", &c.lr_schedule, "constant, linear or cosine (after warm-up)"},
      {"optimizer", "warmup_steps", &c.warmup_steps, "linear warm-up steps"},
      {"optimizer", "scale_lr", &c.scale_lr, "multiply lr by world size x batch size x accumulation"},
      {"optimizer", "beta1", &c.beta1, "AdamW/Lion beta1"},
      {"optimizer", "beta2", &c.beta2, "AdamW/Lion beta2"},
      {"optimizer", "eps", &c.eps, "AdamW epsilon"},
      {"optimizer", "weight_decay", &c.weight_decay, "weight decay"},
      {"optimizer", "momentum", &c.momentum, "SGD momentum"},
      {"optimizer", "max_grad_norm", &c.max_grad_norm, "global gradient-norm clipping (0: off)"},
      {"optimizer", "max_nonfinite_steps", &c.max_nonfinite_steps,
       "stop after this many steps in a row with non-finite gradients, each skipped (0: never stop)"},
      {"optimizer", "ema_decay", &c.ema_decay, "EMA of the weights, sharded like the optimizer (0: off)"},
      {"zero", "stage", &c.stage, "ZeRO stage 0, 1, 2 or 3"},
      {"zero", "bucket_mib", &c.bucket_mib, "reduce-scatter bucket size in MiB"},
      {"zero", "shard_group_size", &c.shard_group_size,
       "hybrid sharding (HSDP): shard over groups of this many consecutive ranks (one node), replicate across the "
       "groups; must divide the number of ranks (0: shard over all ranks)"},
      {"zero", "accumulation_mode", &c.accumulation_mode, "each (reduce every micro-step) or boundary"},
      {"zero", "units", &c.units,
       "the UNet's ZeRO units, also its buckets and what checkpointing recomputes at once: layers (one per ResNet "
       "block, transformer layer and resampler; 93 for SDXL, at most 49 M parameters) or blocks (one per down, mid "
       "and up block; 9, up to 1.2 B)"},
      {"zero", "offload_optimizer", &c.offload_optimizer,
       "keep master weights, optimizer state and EMA in pinned host memory, updated by the CPU (stages 1-3)"},
      {"zero", "offload_params", &c.offload_params,
       "stage 3 with offload_optimizer: keep the parameter shards in pinned host memory as well (only gathered units on the GPU)"},
      {"zero", "offload_delayed_update", &c.offload_delayed_update,
       "with offload_optimizer: run the CPU update while the next step computes (ZeRO-Offload's delayed parameter "
       "update: each forward sees the parameters one update old; any accumulation, with or without offload_params)"},
      {"zero", "offload_accumulate_on_host", &c.offload_accumulate_on_host,
       "with offload_optimizer and accumulation: every micro-step's gradients stream to host memory and the CPU "
       "adds them (the same bits), so no gradient shard stays on the GPU (its whole size on one GPU); costs a "
       "pinned gradient shard on the host and a CPU pass per micro-step"},
      {"zero", "delayed_update_warmup", &c.delayed_update_warmup,
       "with offload_delayed_update: this many first steps update synchronously"},
      {"output", "output_dir", &c.output_dir, "where metrics, checkpoints and exports go"},
      {"output", "log_every", &c.log_every, "steps between log lines"},
      {"output", "checkpoint_every", &c.checkpoint_every, "steps between checkpoints (0: at the end only)"},
      {"output", "checkpoint_every_epochs", &c.checkpoint_every_epochs,
       "checkpoint at the step that completes every this many epochs (0: off; with checkpoint_every, both)"},
      {"output", "export_every_epochs", &c.export_every_epochs,
       "export the UNet (as at the end) to output_dir/exports/epoch-NNNNNN at the step that completes every this many "
       "epochs (0: off)"},
      {"output", "keep_checkpoints", &c.keep_checkpoints, "checkpoints kept (older ones are deleted)"},
      {"output", "resume", &c.resume, "\"latest\" or a checkpoint folder to resume from"},
      {"output", "overwrite", &c.overwrite,
       "start afresh in an output_dir that holds another run: its checkpoints, metrics.jsonl and TensorBoard events "
       "are removed first (without it, such a folder is refused unless resuming); with --resume latest: start afresh "
       "when only incomplete checkpoints are there"},
      {"output", "accept_unchecksummed_checkpoint", &c.accept_unchecksummed_checkpoint,
       "resume from a checkpoint whose manifest lists no CRC32C (version 1), where a damaged shard would load "
       "unnoticed"},
      {"output", "stop_after", &c.stop_after, "save a checkpoint and stop after this step, to resume later (0: off)"},
      {"output", "export_single_file", &c.export_single_file, "also export the original single-file layout"},
      {"output", "export_dtype", &c.export_dtype,
       "fp32, bf16 or fp16: dtype of every exported UNet (folders, single files, full checkpoint); fp16 refuses "
       "values beyond its range"},
      {"output", "export_full_checkpoint", &c.export_full_checkpoint,
       "a base single-file SDXL checkpoint (original layout, e.g. sd_xl_base_1.0.safetensors): write "
       "output_dir/full_checkpoint.safetensors, the base with its UNet replaced by the trained one (checked before "
       "training); empty: off"},
      {"output", "export_full_checkpoint_unet", &c.export_full_checkpoint_unet,
       "the UNet the full checkpoint holds: auto (the EMA UNet when ema_decay > 0, else the trained one), ema or "
       "trained"},
      {"output", "save_final", &c.save_final, "save a checkpoint after the last step"},
      {"output", "export_unet", &c.export_unet, "export the UNet (and EMA UNet) in diffusers format at the end"},
      {"output", "merge_lora", &c.merge_lora,
       "with LoRA: also export the UNet with the adapters merged into its weights (output_dir/unet)"},
      {"validation", "every", &c.validation_every,
       "write validation images every this many steps and after the last one (output_dir/samples/step-N, "
       "TensorBoard), with the EMA weights when ema_decay > 0; 0: off", "validation_every"},
      {"validation", "negative_prompt", &c.validation_negative_prompt,
       "negative prompt of every validation image (empty: zeros, as SDXL does)", "validation_negative_prompt"},
      {"validation", "pipeline", &c.validation_pipeline,
       "diffusers SDXL pipeline folder: its VAE decodes the images, its text encoders encode prompts the dataset has "
       "not cached, its scheduler config gives the noise schedule", "validation_pipeline"},
      {"validation", "steps", &c.validation_steps, "denoising steps per validation image", "validation_steps"},
      {"validation", "guidance", &c.validation_guidance, "classifier-free guidance scale (> 1 enables it)",
       "validation_guidance"},
      {"validation", "seed", &c.validation_seed, "seed of image 0's initial noise (image i: seed + i; the same at "
       "every validation)", "validation_seed"},
      {"validation", "sampler", &c.validation_sampler, "euler, dpmpp_2m or dpmpp_2m_karras", "validation_sampler"},
      {"validation", "height", &c.validation_height, "validation image height, pixels (a multiple of 8)",
       "validation_height"},
      {"validation", "width", &c.validation_width, "validation image width, pixels (a multiple of 8)",
       "validation_width"},
      {"device", "device", &c.device, "cpu or cuda"},
      {"device", "cudnn_benchmark", &c.cudnn_benchmark,
       "time cuDNN's convolution algorithms on the first step of each shape and keep the fastest"},
      {"device", "tf32", &c.tf32,
       "let fp32 matmuls (cuBLAS) and convolutions (cuDNN) use TF32 tensor cores on CUDA (10-bit mantissa "
       "products); false: strict fp32. Only fp32 computation is affected"},
      {"device", "max_gpu_memory", &c.max_gpu_memory,
       "cap GPU memory per rank, e.g. 24GiB (allocator limit + the engine's accounting); empty: no cap"},
      {"device", "fit", &c.fit,
       "choose batch_size and accumulation (same global batch), stage, offload_optimizer, offload_params, "
       "offload_delayed_update and activation_checkpointing for the most predicted images/s within this GPU memory "
       "per rank, e.g. 12GiB (zero-plan --fit), then cap the run at it as max_gpu_memory; options given on the "
       "command line are kept; a resumed run keeps the checkpoint's; empty: off"},
      {"device", "attention", &c.attention,
       "attention kernel on the GPU: default (LibTorch's choice), flash, efficient, cudnn or math"},
      {"device", "channels_last", &c.channels_last,
       "run the UNet's convolutions, GroupNorms and SiLUs in channels-last (NHWC) memory order: no NCHW<->NHWC "
       "transposes in cuDNN, fused NHWC GroupNorm+SiLU on CUDA"},
      {"device", "cuda_graph", &c.cuda_graph,
       "capture the micro-step in a CUDA graph after the first step and replay it (no launch overhead): forward and "
       "backward at stages 0-1, the reductions and stage-3 gathers too at stages 2-3; needs accumulation 1, no "
       "offload, no activation checkpointing, bf16 or fp32"},
      {"device", "profile_step", &c.profile_step,
       "write a Kineto trace of this step (rank 0, CUDA) to output_dir/profile-step-N.json (0: off)"},
  };
}

std::string show(const Field& field) {
  return std::visit(
      [](auto* p) -> std::string {
        std::ostringstream out;
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, std::string>) out << '"' << *p << '"';
        else if constexpr (std::is_same_v<T, bool>) out << (*p ? "true" : "false");
        else out << *p;
        return out.str();
      },
      field);
}

void set_from_toml(const Option& o, const toml::node& node, const std::string& origin) {
  const std::string where = origin + ": [" + o.table + "] " + o.key;
  std::visit(
      [&](auto* p) {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, std::string>) {
          auto v = node.value<std::string>();
          ZERO_CHECK(node.is_string() && v, where, ": expected a string, got ", node.type());
          *p = unshield(*v);
        } else if constexpr (std::is_same_v<T, bool>) {
          ZERO_CHECK(node.is_boolean(), where, ": expected true or false, got ", node.type());
          *p = *node.value<bool>();
        } else if constexpr (std::is_same_v<T, std::int64_t>) {
          ZERO_CHECK(node.is_integer(), where, ": expected an integer, got ", node.type());
          *p = *node.value<std::int64_t>();
        } else {
          ZERO_CHECK(node.is_number(), where, ": expected a number, got ", node.type());
          *p = *node.value<double>();
        }
      },
      o.field);
}

void set_from_text(const Option& o, const std::string& text) {
  const std::string where = o.command_line();
  std::visit(
      [&](auto* p) {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, std::string>) {
          *p = text;
        } else if constexpr (std::is_same_v<T, bool>) {
          // A bare --overwrite (no value) means true.
          if (text.empty() || text == "true" || text == "1" || text == "on") *p = true;
          else if (text == "false" || text == "0" || text == "off") *p = false;
          else ZERO_THROW(zero::InvalidArgument, where, ": expected true or false, got '", text, "'");
        } else {
          std::size_t used = 0;
          T value{};
          try {
            if constexpr (std::is_same_v<T, std::int64_t>) value = std::stoll(text, &used);
            else value = std::stod(text, &used);
          } catch (const std::exception&) {
            used = 0;
          }
          ZERO_CHECK(used == text.size() && !text.empty(), where, ": expected ",
                     std::is_same_v<T, std::int64_t> ? "an integer" : "a number", ", got '", text, "'");
          *p = value;
        }
      },
      o.field);
}

std::vector<std::string> string_list(const toml::node& node, const std::string& where) {
  const toml::array* array = node.as_array();
  ZERO_CHECK(array != nullptr, where, ": expected an array of strings (glob patterns), got ", node.type());
  std::vector<std::string> out;
  for (const toml::node& item : *array) {
    auto text = item.value<std::string>();
    ZERO_CHECK(item.is_string() && text && !text->empty(), where, ": expected non-empty strings, got ", item.type());
    out.push_back(unshield(*text));
  }
  return out;
}

/// [[optimizer.groups]]: each a table of params (patterns), lr_scale and
/// weight_decay (optional), name (optional).
std::vector<TrainConfig::OptimizerGroup> optimizer_groups_of(const toml::node& node, const std::string& origin) {
  const toml::array* array = node.as_array();
  ZERO_CHECK(array != nullptr && array->is_array_of_tables(), origin,
             ": optimizer.groups must be an array of tables ([[optimizer.groups]]), got ", node.type());
  std::vector<TrainConfig::OptimizerGroup> out;
  for (std::size_t i = 0; i < array->size(); ++i) {
    const std::string where = origin + ": [[optimizer.groups]] #" + std::to_string(i + 1);
    TrainConfig::OptimizerGroup group;
    group.name = "group " + std::to_string(i + 1);
    for (const auto& [key_node, value] : *array->get(i)->as_table()) {
      const std::string key(key_node.str());
      if (key == "params") {
        group.params = string_list(value, where + " params");
      } else if (key == "name") {
        auto text = value.value<std::string>();
        ZERO_CHECK(value.is_string() && text && !text->empty(), where, " name: expected a non-empty string");
        group.name = unshield(*text);
      } else if (key == "lr_scale" || key == "weight_decay") {
        ZERO_CHECK(value.is_number(), where, " ", key, ": expected a number, got ", value.type());
        const double x = *value.value<double>();
        ZERO_CHECK(std::isfinite(x) && x >= 0, where, " ", key, ": must be finite and >= 0, got ", x);
        if (key == "lr_scale") group.lr_scale = x;
        else group.weight_decay = x;
      } else {
        ZERO_THROW(zero::InvalidArgument, where, ": unknown key '", key,
                   "' (expected params, lr_scale, weight_decay, name)");
      }
    }
    ZERO_CHECK(!group.params.empty(), where, ": params is missing or empty (glob patterns of parameter names)");
    out.push_back(std::move(group));
  }
  return out;
}

void apply_toml(TrainConfig& config, const toml::table& root, const std::string& origin) {
  auto options = options_of(config);
  for (const auto& [table_key, table_node] : root) {
    const std::string table(table_key.str());
    const toml::table* entries = table_node.as_table();
    ZERO_CHECK(entries != nullptr, origin, ": top-level key '", table,
               "' must be a table ([model], [lora], [data], [train], [optimizer], [zero], [output], [validation], [device])");
    for (const auto& [key_node, value] : *entries) {
      const std::string key(key_node.str());
      if (table == "model" && key == "freeze") {
        config.freeze = string_list(value, origin + ": [model] freeze");
        continue;
      }
      if (table == "lora" && key == "targets") {
        config.lora_targets = string_list(value, origin + ": [lora] targets");
        continue;
      }
      if (table == "optimizer" && key == "no_weight_decay") {
        config.no_weight_decay = string_list(value, origin + ": [optimizer] no_weight_decay");
        continue;
      }
      if (table == "validation" && key == "prompts") {
        config.validation_prompts = string_list(value, origin + ": [validation] prompts");
        continue;
      }
      if (table == "optimizer" && key == "groups") {
        config.optimizer_groups = optimizer_groups_of(value, origin);
        continue;
      }
      const Option* match = nullptr;
      for (const Option& o : options)
        if (table == o.table && key == o.key) match = &o;
      if (!match) {
        std::string hint;
        for (const Option& o : options)
          if (key == o.key) hint = std::string(" (it belongs in [") + o.table + "])";
        if (key == "freeze") hint = " (it belongs in [model])";
        if (key == "targets") hint = " (it belongs in [lora])";
        if (key == "no_weight_decay" || key == "groups") hint = " (it belongs in [optimizer])";
        if (key == "prompts") hint = " (it belongs in [validation])";
        ZERO_THROW(zero::InvalidArgument, origin, ": unknown key '", table, ".", key, "'", hint);
      }
      set_from_toml(*match, value, origin);
    }
  }
}

// Given epochs alone (in the file or on the command line), the run is as
// long as they say: the default of steps does not apply. Both given is an
// error of validate(), naming both.
void length_from_epochs(TrainConfig& config, bool steps_given) {
  if (config.epochs > 0 && !steps_given) config.steps = 0;
}

bool file_sets(const toml::table& root, const char* path) { return root.at_path(path).node() != nullptr; }

}  // namespace

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
    ZERO_CHECK(!validation_pipeline.empty(), "[validation] every = ", validation_every,
               " needs [validation] pipeline (--validation_pipeline): the diffusers SDXL pipeline folder whose VAE "
               "decodes the images");
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
  ZERO_CHECK(max_grad_norm >= 0, "max_grad_norm must be >= 0, got ", max_grad_norm);
  ZERO_CHECK(max_nonfinite_steps >= 0 && max_nonfinite_steps <= std::numeric_limits<int>::max(),
             "max_nonfinite_steps must be in [0, ", std::numeric_limits<int>::max(), "] (0: never stop), got ",
             max_nonfinite_steps);
  ZERO_CHECK(ema_decay >= 0 && ema_decay < 1, "ema_decay must be in [0, 1), got ", ema_decay);
  ZERO_CHECK(stage >= 0 && stage <= 3, "stage must be 0, 1, 2 or 3, got ", stage);
  ZERO_CHECK(shard_group_size >= 0 && shard_group_size <= (1 << 20),
             "shard_group_size must be 0 (all ranks) or a number of ranks that divides the world size, got ",
             shard_group_size);
  // The engine's buckets are whole bytes: below one byte the engine would name its own option, not this one.
  ZERO_CHECK(std::isfinite(bucket_mib) && bucket_mib * (1 << 20) >= 1 && bucket_mib <= kMaxBucketMiB,
             "bucket_mib ([zero]) must be a size in MiB in [1/1048576 (one byte), ", static_cast<long long>(kMaxBucketMiB),
             "], got ",
             bucket_mib);
  one_of(accumulation_mode, {"each", "boundary"}, "accumulation_mode");
  one_of(units, {"layers", "blocks"}, "units");
  ZERO_CHECK(!offload_optimizer || stage >= 1, "offload_optimizer needs stage 1, 2 or 3, got stage ", stage);
  ZERO_CHECK(!offload_params || (stage == 3 && offload_optimizer),
             "offload_params needs stage = 3 and offload_optimizer = true, got stage ", stage,
             offload_optimizer ? "" : " without offload_optimizer");
  // Any accumulation and offload_params are fine (the engine double-buffers
  // what the background update writes).
  ZERO_CHECK(!offload_delayed_update || offload_optimizer,
             "offload_delayed_update needs offload_optimizer = true (the delayed update is the CPU optimizer's), got "
             "offload_optimizer = false");
  ZERO_CHECK(!offload_accumulate_on_host || offload_optimizer,
             "offload_accumulate_on_host needs offload_optimizer = true (the host holds the optimizer's gradient "
             "shard), got offload_optimizer = false");
  ZERO_CHECK(!offload_accumulate_on_host || accumulation_mode == "each",
             "offload_accumulate_on_host needs accumulation_mode = \"each\" (with \"boundary\" the micro-steps "
             "accumulate on the GPU before the one reduction), got \"", accumulation_mode, "\"");
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
    ZERO_CHECK(!activation_checkpointing, "cuda_graph does not work with activation_checkpointing yet");
    ZERO_CHECK(precision != "fp16", "cuda_graph needs precision bf16 or fp32 (fp16's loss scale changes between steps)");
  }
  ZERO_CHECK(profile_step == 0 || device == "cuda", "profile_step applies to device = \"cuda\" only");
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

std::string TrainConfig::to_toml() const {
  TrainConfig copy = *this;
  std::ostringstream out;
  std::string table;
  // The pattern lists are not in the option table (they are not scalars):
  // each goes at the end of its table.
  auto close_table = [&] {
    if (table == "model" && !freeze.empty()) out << "freeze = " << pattern_list(freeze) << "\n";
    if (table == "lora") out << "targets = " << pattern_list(lora_targets) << "\n";
    if (table == "optimizer" && !no_weight_decay.empty())
      out << "no_weight_decay = " << pattern_list(no_weight_decay) << "\n";
    if (table == "validation" && !validation_prompts.empty())
      out << "prompts = " << pattern_list(validation_prompts) << "\n";
  };
  for (const Option& o : options_of(copy)) {
    if (table != o.table) {
      close_table();
      table = o.table;
      out << (out.tellp() > 0 ? "\n" : "") << "[" << table << "]\n";
    }
    out << o.key << " = " << show(o.field) << "\n";
  }
  close_table();
  for (const OptimizerGroup& g : optimizer_groups) {
    out << "\n[[optimizer.groups]]\nname = " << toml::value<std::string>(g.name) << "\nparams = " << pattern_list(g.params)
        << "\nlr_scale = " << g.lr_scale << "\n";
    if (g.weight_decay) out << "weight_decay = " << *g.weight_decay << "\n";
  }
  return out.str();
}

std::string pattern_list(const std::vector<std::string>& patterns) {
  toml::array array;
  for (const std::string& p : patterns) array.push_back(p);
  std::ostringstream text;
  text << array;
  return text.str();
}

std::optional<std::vector<std::string>> saved_freeze(const std::string& config_toml) {
  toml::table root;
  try {
    check_config_bounds(config_toml, "saved configuration");
    root = parse_toml(config_toml, "saved configuration");
  } catch (const toml::parse_error&) {
    return std::nullopt;
  } catch (const zero::InvalidArgument&) {
    return std::nullopt;
  }
  const toml::node* node = root.at_path("model.freeze").node();
  if (node == nullptr) return std::vector<std::string>{};
  try {
    return string_list(*node, "saved [model] freeze");
  } catch (const zero::InvalidArgument&) {
    return std::nullopt;
  }
}

TrainConfig train_config_from_toml(const std::string& text, const std::string& origin) {
  TrainConfig config;
  toml::table root;
  check_config_bounds(text, origin);
  root = parse_toml(text, origin);
  apply_toml(config, root, origin);
  length_from_epochs(config, file_sets(root, "train.steps"));
  config.validate();
  return config;
}

bool parse_train_config(int argc, char** argv, TrainConfig& config) {
  CLI::App app{"Full fine-tuning of the SDXL UNet on zero.\n  mpirun -np N train --config file.toml [--key value ...]"};
  std::string config_path;
  app.add_option("--config", config_path, "TOML configuration file; --key value options override it");
  TrainConfig defaults;
  auto default_options = options_of(defaults);
  std::vector<std::string> overrides(default_options.size());
  std::vector<CLI::Option*> handles;
  for (std::size_t i = 0; i < default_options.size(); ++i) {
    const Option& o = default_options[i];
    const bool is_bool = std::holds_alternative<bool*>(o.field);
    handles.push_back(app.add_option(o.command_line(), overrides[i],
                                     std::string(o.help) + " [" + o.table + "] (default: " + show(o.field) + ")")
                          ->type_name(std::holds_alternative<std::string*>(o.field) ? "TEXT"
                                      : is_bool                                      ? "[BOOL]"
                                      : std::holds_alternative<double*>(o.field)     ? "NUMBER"
                                                                                      : "INT"));
    if (is_bool) handles.back()->expected(0, 1);  // --flag alone is --flag true
  }
  // The lists on the command line: one value per flag, the flag repeated
  // for several; the values given replace the file's list, and --flag ""
  // alone empties it (--freeze "" freezes nothing).
  struct ListFlag {
    const char* flag;
    const char* type_name;
    std::string help;
    std::vector<std::string> TrainConfig::*list;
    std::vector<std::string> values;
    CLI::Option* option = nullptr;
  };
  std::array<ListFlag, 3> list_flags{{
      {"--freeze", "PATTERN",
       "glob pattern of parameters to freeze (diffusers names; repeat for several); replaces [model] freeze; --freeze "
       "\"\" freezes none [model] (default: [])",
       &TrainConfig::freeze},
      {"--lora_target", "PATTERN",
       "glob pattern of Linear layers to adapt (repeat for several); replaces [lora] targets [lora] (default: " +
           pattern_list(defaults.lora_targets) + ")",
       &TrainConfig::lora_targets},
      {"--validation_prompt", "TEXT",
       "a validation prompt (repeat for several); replaces [validation] prompts [validation] (default: []: the "
       "dataset's cached validation prompts)",
       &TrainConfig::validation_prompts},
  }};
  for (ListFlag& f : list_flags) f.option = app.add_option(f.flag, f.values, f.help)->type_name(f.type_name);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::printf("%s", app.help().c_str());
    return false;
  } catch (const CLI::ParseError& e) {
    ZERO_THROW(zero::InvalidArgument, "command line: ", e.what(), " (see --help)");
  }
  config = TrainConfig{};
  bool steps_given = false;
  if (!config_path.empty()) {
    const std::string text = read_config_text(config_path);
    check_config_bounds(text, config_path);
    toml::table root;
    root = parse_toml(text, config_path);
    apply_toml(config, root, config_path);
    steps_given = file_sets(root, "train.steps");
  }
  auto options = options_of(config);
  for (std::size_t i = 0; i < options.size(); ++i)
    if (handles[i]->count() > 0) {
      set_from_text(options[i], overrides[i]);
      config.command_line_keys.push_back(options[i].key);
      if (std::string(options[i].table) == "train" && std::string(options[i].key) == "steps") steps_given = true;
    }
  length_from_epochs(config, steps_given);
  for (const ListFlag& f : list_flags) {
    if (f.option->count() == 0) continue;
    std::vector<std::string>& list = config.*f.list;
    list.clear();
    for (const std::string& value : f.values)
      if (!value.empty()) list.push_back(value);
  }
  config.validate();
  return true;
}

}  // namespace sdxl
