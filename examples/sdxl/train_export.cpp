#include "train_export.hpp"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <optional>

#include "full_checkpoint.hpp"
#include "metrics/jsonl_writer.hpp"
#include "metrics/loss_plot.hpp"
#include "unet_io.hpp"
#include "zero/io/crc32c.hpp"

namespace sdxl {

namespace fs = std::filesystem;

UNetInOrder unet_in_order(const UNetConfig& ucfg, const std::vector<std::string>& names, torch::TensorOptions options,
                          const LoraOptions* lora) {
  UNetInOrder out{UNet2DConditionModel(ucfg, UNetBuildOptions{.tensor_options = options, .initialize = false}), {}};
  // The adapters' starting draw is overwritten by the caller: a generator of
  // its own keeps LibTorch's default one untouched.
  if (lora != nullptr) out.unet->add_lora(*lora, at::detail::createCPUGenerator(0));
  std::map<std::string, torch::Tensor> by_name;
  for (auto& item : out.unet->named_parameters()) by_name[item.key()] = item.value();
  ZERO_CHECK(by_name.size() == names.size(), "the UNet has ", by_name.size(), " parameters, the weights ",
             names.size());
  for (const std::string& name : names) {
    const auto it = by_name.find(name);
    ZERO_CHECK(it != by_name.end(), "the UNet has no parameter '", name, "'");
    out.parameters.push_back(it->second);
  }
  return out;
}

UNet2DConditionModel unet_holding(const UNetConfig& ucfg, const std::vector<std::vector<float>>& weights,
                                  const std::vector<std::string>& names) {
  UNetInOrder model = unet_in_order(ucfg, names);
  torch::NoGradGuard no_grad;
  for (std::size_t i = 0; i < names.size(); ++i) {
    torch::Tensor& p = model.parameters[i];
    ZERO_CHECK(static_cast<std::int64_t>(weights[i].size()) == p.numel(), "'", names[i], "' has ", p.numel(),
               " elements, its weights ", weights[i].size());
    p.copy_(torch::from_blob(const_cast<float*>(weights[i].data()), p.sizes(), torch::kFloat32));
  }
  return model.unet;
}

UNet2DConditionModel starting_unet(const TrainConfig& c, const UNetConfig& ucfg) {
  // Strict loading overwrites every parameter: only a run without weights
  // needs the initialisation (SDXL's takes seconds).
  const bool load = !c.model_weights.empty();
  torch::manual_seed(static_cast<std::uint64_t>(c.seed));  // the same initial weights on every rank, and at export
  UNet2DConditionModel unet(
      ucfg, UNetBuildOptions{.initialize = !load, .units = unit_granularity_from(c.units, "[zero] units")});
  if (load) load_unet_weights(*unet, c.model_weights);
  return unet;
}

void use_exact_frozen_values(const TrainConfig& c, const UNetConfig& ucfg, const zero::Engine& engine,
                             const std::vector<std::vector<std::vector<float>>*>& exports) {
  const zero::DType dtype = engine.options().param_dtype;
  if (engine.frozen_count() == 0 || dtype == zero::DType::fp32) return;
  // Built again here rather than kept from the start: a copy of the frozen
  // fp32 values held through the run would cost 4 bytes of host memory per
  // frozen element on every rank (gigabytes for SDXL); this costs one more
  // model on rank 0 for the moment of the export.
  std::map<std::string, torch::Tensor> start;
  {
    UNet2DConditionModel unet = starting_unet(c, ucfg);
    for (auto& item : unet->named_parameters()) start[item.key()] = item.value().detach().contiguous();
  }
  const std::string source = c.model_weights.empty() ? "the initialisation from seed " + std::to_string(c.seed)
                                                      : "model_weights '" + c.model_weights + "'";
  const std::vector<zero::ParamSpec>& params = engine.params();
  for (std::size_t p = 0; p < params.size(); ++p) {
    if (!engine.frozen(p)) continue;
    const torch::Tensor& exact = start.at(params[p].name);
    ZERO_CHECK(static_cast<std::size_t>(exact.numel()) == params[p].numel, "export: frozen parameter '", params[p].name,
               "' has ", params[p].numel, " elements in the engine, ", exact.numel(), " in ", source);
    const float* values = exact.data_ptr<float>();
    for (std::vector<std::vector<float>>* out : exports) {
      if (out->empty()) continue;  // no EMA
      std::vector<float>& held = (*out)[p];
      for (std::size_t i = 0; i < held.size(); ++i) {
        const float rounded = zero::round_to(dtype, values[i]);
        if (std::memcmp(&rounded, &held[i], sizeof(float)) != 0)
          ZERO_THROW(zero::Error, "export: frozen parameter '", params[p].name, "' element ", i, " is ", held[i],
                     " in the engine but ", values[i], " (", rounded, " in ", zero::name_of(dtype), ") in ", source,
                     ": the weights the run started from changed (resume with the [model] model_weights and [train] "
                     "seed of the run that saved the checkpoint to export again)");
      }
      std::memcpy(held.data(), values, held.size() * sizeof(float));
    }
  }
}

void write_export_check(const TrainConfig& c, UNet2DConditionModel& model, const data::TextDims& text,
                        torch::Device device, torch::ScalarType compute_type, bool leader) {
  torch::NoGradGuard no_grad;
  torch::manual_seed(7);
  const std::int64_t h = c.latent_size;
  std::map<std::string, torch::Tensor> io = {
      {"sample", torch::randn({2, 4, h, h})},
      {"timestep", torch::tensor({999.0f, 250.0f})},
      {"encoder_hidden_states", torch::randn({2, c.text_length, text.width})},
      {"text_embeds", torch::randn({2, text.pooled_width})},
      {"time_ids", torch::tensor({8.0f * h, 8.0f * h, 0.0f, 0.0f, 8.0f * h, 8.0f * h}).repeat({2, 1})}};
  auto on = [&](const torch::Tensor& t) { return t.to(device, compute_type); };
  torch::Tensor out = model->forward(on(io["sample"]), io["timestep"].to(device), on(io["encoder_hidden_states"]),
                                     on(io["text_embeds"]), on(io["time_ids"]));
  io["expected"] = out.to(torch::kCPU, torch::kFloat32);
  if (leader) write_tensors(fs::path(c.output_dir) / "export_check.safetensors", io);
}

namespace {

torch::ScalarType export_scalar_type(const TrainConfig& c) {
  switch (zero::parse_dtype(c.export_dtype, "export_dtype")) {
    case zero::DType::fp32: return torch::kFloat32;
    case zero::DType::bf16: return torch::kBFloat16;
    case zero::DType::fp16: return torch::kFloat16;
  }
  return torch::kFloat32;
}

bool full_checkpoint_uses_ema(const TrainConfig& c) {
  return c.export_full_checkpoint_unet == "ema" || (c.export_full_checkpoint_unet == "auto" && c.ema_decay > 0);
}

fs::path full_checkpoint_path(const TrainConfig& c) { return fs::path(c.output_dir) / "full_checkpoint.safetensors"; }

/// The size and CRC32C of a file just written, read back from the disk: what
/// a copy of it can be checked against.
void report_file(const fs::path& path, const std::string& what) {
  std::printf("export: %s (%s): %llu bytes, CRC32C %08x\n", path.c_str(), what.c_str(),
              static_cast<unsigned long long>(fs::file_size(path)), zero::io::file_crc32c(path));
  std::fflush(stdout);
}


/// The folder `where` and, with export_single_file, `where`.safetensors.
void save_unet_files(const TrainConfig& c, const UNet2DConditionModelImpl& model, const fs::path& where,
                     const std::string& which) {
  const torch::ScalarType dtype = export_scalar_type(c);
  save_unet(model, where, dtype);
  report_file(where / "diffusion_pytorch_model.safetensors", which + ", diffusers layout, " + c.export_dtype);
  if (!c.export_single_file) return;
  const fs::path single(where.string() + ".safetensors");
  save_unet(model, single, dtype, CheckpointFormat::kOriginalSingleFile);
  report_file(single, which + ", original layout, " + c.export_dtype);
}

}  // namespace

void check_export_options(const TrainConfig& c, const UNet2DConditionModelImpl& model, bool leader) {
  if (!c.export_unet || c.export_full_checkpoint.empty()) return;
  // The exported UNet's names and shapes: those of the model without any LoRA adapters.
  const UNet2DConditionModel plain(
      model.config(), UNetBuildOptions{.tensor_options = torch::TensorOptions().dtype(torch::kFloat32).device(torch::kMeta),
                                       .initialize = false});
  const FullCheckpointBase base = check_full_checkpoint_base(c.export_full_checkpoint, *plain);
  if (leader)
    std::printf("export_full_checkpoint: base '%s' checked: %zu tensors, %llu bytes, its %zu UNet tensors match the "
                "trained UNet; %s will hold the %s UNet in %s and every other tensor of the base, byte for byte\n",
                c.export_full_checkpoint.c_str(), base.tensors, static_cast<unsigned long long>(base.file_size),
                base.unet_tensors, full_checkpoint_path(c).c_str(), full_checkpoint_uses_ema(c) ? "EMA" : "trained",
                c.export_dtype.c_str());
}

void check_export_range(const TrainConfig& c, const std::vector<std::vector<float>>& weights,
                        const std::vector<std::string>& names, const std::string& which) {
  const zero::DType dtype = zero::parse_dtype(c.export_dtype, "export_dtype");
  if (dtype == zero::DType::fp32) return;
  const float largest = dtype == zero::DType::fp16 ? 65504.0f : std::numeric_limits<float>::max();
  std::size_t beyond = 0;
  std::optional<std::size_t> first;
  float first_max = 0;
  for (std::size_t p = 0; p < weights.size(); ++p) {
    float max_abs = 0;
    bool overflows = false;
    for (float v : weights[p]) {
      if (!std::isfinite(v)) continue;
      max_abs = std::max(max_abs, std::fabs(v));
      overflows = overflows || !std::isfinite(zero::round_to(dtype, v));
    }
    if (!overflows) continue;
    ++beyond;
    if (!first) {
      first = p;
      first_max = max_abs;
    }
  }
  if (!first) return;
  const std::string others = beyond > 1 ? " (and " + std::to_string(beyond - 1) + " more tensors)" : "";
  ZERO_THROW(zero::Error, "[output] export_dtype = ", c.export_dtype, ": tensor '", names[*first], "' of the ", which,
             " has max |value| ", first_max, others, ", beyond ", c.export_dtype, "'s largest finite value ", largest,
             " (it would be written as inf); no UNet was exported. Export the run's final checkpoint again with "
             "--resume <checkpoint> --export_dtype bf16 (or fp32)");
}

void export_weights(const TrainConfig& c, const UNetConfig& ucfg, const std::vector<std::vector<float>>& weights,
                    const fs::path& where, const std::vector<std::string>& names) {
  UNet2DConditionModel model = unet_holding(ucfg, weights, names);
  save_unet_files(c, *model, where, where.filename().string());
}

void export_unets(const TrainConfig& c, const UNetConfig& ucfg, const std::vector<std::vector<float>>& weights,
                  const std::vector<std::vector<float>>& ema, const std::vector<std::string>& names) {
  check_export_range(c, weights, names, "trained UNet");
  if (!ema.empty()) check_export_range(c, ema, names, "EMA UNet");
  const bool full_from_ema = full_checkpoint_uses_ema(c) && !ema.empty();
  struct Export {
    const std::vector<std::vector<float>>& values;
    const char* folder;
    const char* which;
    bool full_checkpoint;
  };
  for (const Export& e : {Export{weights, "unet", "trained UNet", !full_from_ema},
                          Export{ema, "unet_ema", "EMA UNet", full_from_ema}}) {
    if (e.values.empty()) continue;  // no EMA
    // One model at a time: SDXL's is 10 GB in fp32.
    UNet2DConditionModel model = unet_holding(ucfg, e.values, names);
    save_unet_files(c, *model, fs::path(c.output_dir) / e.folder, e.which);
    if (!e.full_checkpoint || c.export_full_checkpoint.empty()) continue;
    const fs::path out = full_checkpoint_path(c);
    const FullCheckpointWritten written =
        write_full_checkpoint(c.export_full_checkpoint, *model, export_scalar_type(c), out);
    std::printf("export: %s (full checkpoint: the %s in %s and %zu tensors of '%s', %llu bytes, copied): %llu bytes, "
                "CRC32C %08x; read back: %zu tensors with the base's names, shapes and dtypes, the UNet's as written, "
                "the others byte-identical to the base\n",
                out.c_str(), e.which, c.export_dtype.c_str(), written.tensors - written.unet_tensors,
                c.export_full_checkpoint.c_str(), static_cast<unsigned long long>(written.copied_bytes),
                static_cast<unsigned long long>(written.file_size), written.crc32c, written.tensors);
    std::fflush(stdout);
  }
}

void write_loss_plot(const TrainConfig& c) {
  std::vector<std::int64_t> steps;
  std::vector<double> losses;
  for (const auto& row : metrics::JsonlWriter::read_all(fs::path(c.output_dir) / "metrics.jsonl")) {
    if (!row.contains("loss") || row["loss"].is_null()) continue;
    steps.push_back(row["step"].get<std::int64_t>());
    losses.push_back(row["loss"].get<double>());
  }
  metrics::write_loss_svg(fs::path(c.output_dir) / "loss.svg", steps, losses,
                          {.title = "SDXL UNet training loss", .x_label = "step", .y_label = "loss"});
}

}  // namespace sdxl
