#include "train_lora.hpp"

#include <cstdio>
#include <map>

#include "lora_io.hpp"
#include "train_export.hpp"
#include "zero/core/dtype.hpp"
#include "zero/core/error.hpp"

namespace sdxl {

namespace fs = std::filesystem;

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

/// A base model of the config, without storage: names and shapes only.
UNet2DConditionModel meta_unet(const UNetConfig& ucfg) {
  return UNet2DConditionModel(
      ucfg, UNetBuildOptions{.tensor_options = torch::TensorOptions().dtype(torch::kFloat32).device(torch::kMeta),
                             .initialize = false});
}

}  // namespace

LoraOptions lora_options(const TrainConfig& c) {
  return {.rank = c.lora_rank, .alpha = lora_alpha(c), .dropout = c.lora_dropout, .targets = c.lora_targets};
}

double lora_alpha(const TrainConfig& c) {
  return c.lora_alpha > 0 ? c.lora_alpha : static_cast<double>(c.lora_rank);
}

bool is_lora_parameter(const std::string& name) {
  return ends_with(name, ".lora_A.weight") || ends_with(name, ".lora_B.weight");
}

void add_lora_adapters(const TrainConfig& c, UNet2DConditionModelImpl& unet) {
  // Its own generator: the adapters' draw does not depend on how many
  // numbers the UNet's initialisation took from the default one.
  torch::Generator generator = at::detail::createCPUGenerator(static_cast<std::uint64_t>(c.seed) ^ 0x4c6f5241ULL);
  unet.add_lora(lora_options(c), generator);
  if (c.lora_init_from.empty()) return;
  const UNet2DConditionModel base = meta_unet(unet.config());
  const LoraWeights start = read_lora_file(c.lora_init_from, *base);
  ZERO_CHECK(start.rank == c.lora_rank, "[lora] init_from '", c.lora_init_from, "' has rank ", start.rank,
             ", [lora] rank is ", c.lora_rank);
  load_lora_into(unet, start, lora_alpha(c), "[lora] init_from '" + c.lora_init_from + "'");
}

std::string describe_lora(const TrainConfig& c, const UNet2DConditionModelImpl& unet,
                          const std::vector<std::string>& names, const std::vector<std::int64_t>& numels) {
  std::int64_t adapters = 0, base = 0;
  for (std::size_t i = 0; i < names.size(); ++i) (is_lora_parameter(names[i]) ? adapters : base) += numels[i];
  char line[512];
  std::snprintf(line, sizeof line,
                "LoRA: rank %lld, alpha %g (scale %g), dropout %g, on %zu Linear layers ([lora] targets = %s); "
                "trained: %lld adapter elements (%.3f%% of the UNet's %lld, which are frozen)%s\n",
                static_cast<long long>(c.lora_rank), lora_alpha(c), lora_alpha(c) / static_cast<double>(c.lora_rank),
                c.lora_dropout, unet.lora_modules().size(), pattern_list(c.lora_targets).c_str(),
                static_cast<long long>(adapters), 100.0 * static_cast<double>(adapters) / static_cast<double>(base),
                static_cast<long long>(base),
                c.lora_init_from.empty() ? "" : ("; started from " + c.lora_init_from).c_str());
  return line;
}

void seed_lora_dropout(const TrainConfig& c, std::int64_t step, std::int64_t micro, int rank) {
  if (!lora_enabled(c) || c.lora_dropout <= 0) return;
  torch::manual_seed(static_cast<std::uint64_t>(c.seed) * 6364136223846793005ULL +
                     static_cast<std::uint64_t>(step) * 1442695040888963407ULL +
                     static_cast<std::uint64_t>(micro) * 2654435761ULL + static_cast<std::uint64_t>(rank) * 40503ULL);
}

MergedUNet export_lora(const TrainConfig& c, const UNetConfig& ucfg, const std::vector<std::vector<float>>& weights,
                       const std::vector<std::string>& names, const fs::path& where) {
  const UNet2DConditionModel base = meta_unet(ucfg);
  std::map<std::string, torch::Tensor> shapes;
  for (const auto& item : base->named_parameters()) shapes[item.key()] = item.value();
  // The engine's values by name; adapters as [rank, in] / [out, rank].
  std::map<std::string, torch::Tensor> by_name;
  std::map<std::string, std::int64_t> in_features, out_features;
  for (const auto& [name, meta] : shapes)
    if (meta.dim() == 2 && ends_with(name, ".weight")) {
      const std::string module = name.substr(0, name.size() - 7);
      out_features[module] = meta.size(0);
      in_features[module] = meta.size(1);
    }
  LoraWeights lora{.rank = c.lora_rank, .alpha = lora_alpha(c)};
  std::map<std::string, std::pair<torch::Tensor, torch::Tensor>> halves;
  for (std::size_t i = 0; i < names.size(); ++i) {
    const torch::Tensor values =
        torch::from_blob(const_cast<float*>(weights[i].data()), {static_cast<std::int64_t>(weights[i].size())},
                         torch::kFloat32)
            .clone();
    if (!is_lora_parameter(names[i])) {
      by_name[names[i]] = values.view(shapes.at(names[i]).sizes());
      continue;
    }
    const bool down = ends_with(names[i], ".lora_A.weight");
    const std::string module = names[i].substr(0, names[i].size() - 14);
    if (down) halves[module].first = values.view({c.lora_rank, in_features.at(module)});
    else halves[module].second = values.view({out_features.at(module), c.lora_rank});
  }
  for (const auto& [module, ab] : halves) {
    lora.modules.push_back(module);
    lora.down.push_back(ab.first);
    lora.up.push_back(ab.second);
  }
  // The adapters in export_dtype; fp16 refuses values beyond its range as the UNet exports do.
  std::vector<std::vector<float>> adapter_values;
  std::vector<std::string> adapter_names;
  for (std::size_t i = 0; i < names.size(); ++i)
    if (is_lora_parameter(names[i])) {
      adapter_names.push_back(names[i]);
      adapter_values.push_back(weights[i]);
    }
  check_export_range(c, adapter_values, adapter_names, "LoRA adapters");
  torch::ScalarType dtype = torch::kFloat32;
  switch (zero::parse_dtype(c.export_dtype, "export_dtype")) {
    case zero::DType::fp32: dtype = torch::kFloat32; break;
    case zero::DType::bf16: dtype = torch::kBFloat16; break;
    case zero::DType::fp16: dtype = torch::kFloat16; break;
  }
  fs::create_directories(where);
  for (const auto& [file, naming] : {std::pair{"pytorch_lora_weights.safetensors", LoraNaming::kDiffusers},
                                     std::pair{"lora_kohya.safetensors", LoraNaming::kKohya}}) {
    write_lora_file(where / file, lora, naming, *base, dtype);
    std::printf("exported %s (%s naming, %s, %llu bytes)\n", (where / file).c_str(),
                naming == LoraNaming::kDiffusers ? "diffusers/PEFT" : "kohya", c.export_dtype.c_str(),
                static_cast<unsigned long long>(fs::file_size(where / file)));
  }
  MergedUNet merged;
  if (!c.merge_lora) return merged;
  merge_lora(lora, by_name);
  for (const auto& [name, tensor] : by_name) {
    merged.names.push_back(name);
    const torch::Tensor flat = tensor.contiguous().view({-1});
    merged.weights.emplace_back(flat.data_ptr<float>(), flat.data_ptr<float>() + flat.numel());
  }
  return merged;
}

}  // namespace sdxl
