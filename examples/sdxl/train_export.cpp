#include "train_export.hpp"

#include <cstdint>
#include <map>
#include <optional>

#include "metrics/jsonl_writer.hpp"
#include "metrics/loss_plot.hpp"
#include "unet_io.hpp"

namespace sdxl {

namespace fs = std::filesystem;

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
