#include "train_export.hpp"

#include <cstdint>
#include <cstring>
#include <map>
#include <optional>

#include "metrics/jsonl_writer.hpp"
#include "metrics/loss_plot.hpp"
#include "unet_io.hpp"

namespace sdxl {

namespace fs = std::filesystem;

UNet2DConditionModel starting_unet(const TrainConfig& c, const UNetConfig& ucfg) {
  // Strict loading overwrites every parameter: only a run without weights
  // needs the initialisation (SDXL's takes seconds).
  const bool load = !c.model_weights.empty();
  torch::manual_seed(static_cast<std::uint64_t>(c.seed));  // the same initial weights on every rank, and at export
  UNet2DConditionModel unet(ucfg, UNetBuildOptions{.initialize = !load});
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

void export_weights(const TrainConfig& c, const UNetConfig& ucfg, const std::vector<std::vector<float>>& weights,
                    const fs::path& where, const std::vector<std::string>& names) {
  UNet2DConditionModel model(ucfg, UNetBuildOptions{.initialize = false});
  std::map<std::string, torch::Tensor> by_name;
  for (auto& item : model->named_parameters()) by_name[item.key()] = item.value();
  torch::NoGradGuard no_grad;
  for (std::size_t i = 0; i < names.size(); ++i) {
    torch::Tensor p = by_name.at(names[i]);
    p.copy_(torch::from_blob(const_cast<float*>(weights[i].data()), p.sizes(), torch::kFloat32));
  }
  save_unet(*model, where);
  if (c.export_single_file) save_unet(*model, fs::path(where.string() + ".safetensors"), std::nullopt,
                                      CheckpointFormat::kOriginalSingleFile);
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
