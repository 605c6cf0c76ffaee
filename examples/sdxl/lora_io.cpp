#include "lora_io.hpp"

#include <nlohmann/json.hpp>

#include <cmath>
#include <optional>
#include <set>
#include <utility>

#include "unet_io.hpp"
#include "zero/core/error.hpp"
#include "zero/io/safetensors.hpp"

namespace sdxl {

namespace fs = std::filesystem;

namespace {

constexpr const char* kDiffusersPrefix = "unet.";
constexpr const char* kKohyaPrefix = "lora_unet_";
constexpr const char* kMetadataKey = "lora_adapter_metadata";  // diffusers' LORA_ADAPTER_METADATA_KEY

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string underscored(std::string s) {
  for (char& c : s)
    if (c == '.') c = '_';
  return s;
}

/// kohya module name -> diffusers module name for every Linear-like weight
/// of the model: the original layout's names (what sd-scripts writes for
/// SDXL) and the diffusers names with underscores (what some converters
/// write), both without the ".weight".
std::map<std::string, std::string> kohya_to_module(const UNet2DConditionModelImpl& base) {
  static const std::string original_prefix = "model.diffusion_model.";
  std::map<std::string, std::string> out;
  for (const auto& [diffusers, original] : original_checkpoint_names(base)) {
    if (!ends_with(diffusers, ".weight")) continue;
    const std::string module = diffusers.substr(0, diffusers.size() - 7);
    std::string stored = original.substr(original_prefix.size());
    stored = stored.substr(0, stored.size() - 7);
    out[kKohyaPrefix + underscored(stored)] = module;
    out[kKohyaPrefix + underscored(module)] = module;
  }
  return out;
}

std::map<std::string, std::string> module_to_kohya(const UNet2DConditionModelImpl& base) {
  static const std::string original_prefix = "model.diffusion_model.";
  std::map<std::string, std::string> out;
  for (const auto& [diffusers, original] : original_checkpoint_names(base)) {
    if (!ends_with(diffusers, ".weight")) continue;
    std::string stored = original.substr(original_prefix.size());
    out[diffusers.substr(0, diffusers.size() - 7)] = kKohyaPrefix + underscored(stored.substr(0, stored.size() - 7));
  }
  return out;
}

}  // namespace

void write_lora_file(const fs::path& path, const LoraWeights& lora, LoraNaming naming,
                     const UNet2DConditionModelImpl& base, torch::ScalarType dtype) {
  ZERO_CHECK(lora.rank >= 1 && !lora.modules.empty() && lora.down.size() == lora.modules.size() &&
                 lora.up.size() == lora.modules.size(),
             "write_lora_file: no adapters to write to ", path.string());
  std::map<std::string, torch::Tensor> tensors;
  std::map<std::string, std::string> metadata{{"format", "pt"}};
  const double scale = lora.alpha / static_cast<double>(lora.rank);
  if (naming == LoraNaming::kDiffusers) {
    nlohmann::json targets = nlohmann::json::array();
    for (std::size_t i = 0; i < lora.modules.size(); ++i) {
      const std::string key = kDiffusersPrefix + lora.modules[i];
      tensors[key + ".lora_A.weight"] = lora.down[i].to(dtype);
      // alpha / rank multiplied in (fp32), so that alpha = rank is right for every loader.
      tensors[key + ".lora_B.weight"] = (lora.up[i].to(torch::kFloat32) * scale).to(dtype);
      targets.push_back(lora.modules[i]);
    }
    const nlohmann::json config = {{"unet.r", lora.rank},
                                   {"unet.lora_alpha", lora.rank},
                                   {"unet.target_modules", targets},
                                   {"unet.lora_dropout", 0.0},
                                   {"unet.init_lora_weights", true}};
    metadata[kMetadataKey] = config.dump(2);
  } else {
    const std::map<std::string, std::string> names = module_to_kohya(base);
    for (std::size_t i = 0; i < lora.modules.size(); ++i) {
      auto it = names.find(lora.modules[i]);
      ZERO_CHECK(it != names.end(), "write_lora_file: module '", lora.modules[i],
                 "' has no name in the original SDXL layout");
      tensors[it->second + ".lora_down.weight"] = lora.down[i].to(dtype);
      tensors[it->second + ".lora_up.weight"] = lora.up[i].to(dtype);
      tensors[it->second + ".alpha"] = torch::tensor(static_cast<float>(lora.alpha)).to(dtype);
    }
    metadata["ss_network_module"] = "networks.lora";
    metadata["ss_network_dim"] = std::to_string(lora.rank);
    metadata["ss_network_alpha"] = std::to_string(lora.alpha);
    metadata["ss_base_model_version"] = "sdxl_base_v1-0";
  }
  write_tensors(path, tensors, metadata);
}

LoraWeights read_lora_file(const fs::path& path, const UNet2DConditionModelImpl& base) {
  const std::map<std::string, torch::Tensor> tensors = read_tensors(path);
  ZERO_CHECK(!tensors.empty(), path.string(), ": holds no tensors (expected a LoRA file)");
  const bool kohya = tensors.begin()->first.rfind(kKohyaPrefix, 0) == 0;
  // Per module: A, B, and alpha (kohya) in file order of modules.
  struct Parts {
    torch::Tensor down, up;
    std::optional<double> alpha;
  };
  std::map<std::string, Parts> parts;
  std::vector<std::string> order;
  std::map<std::string, std::string> from_kohya;
  if (kohya) from_kohya = kohya_to_module(base);
  std::set<std::string> linear_modules;
  for (const auto& item : base.named_parameters(/*recurse=*/true))
    if (ends_with(item.key(), ".weight") && item.value().dim() == 2)
      linear_modules.insert(item.key().substr(0, item.key().size() - 7));
  auto part_of = [&](const std::string& module) -> Parts& {
    if (!parts.count(module)) order.push_back(module);
    return parts[module];
  };
  for (const auto& [key, tensor] : tensors) {
    if (kohya) {
      ZERO_CHECK(key.rfind(kKohyaPrefix, 0) == 0, path.string(), ": key '", key,
                 "' is not a UNet adapter in kohya naming (lora_unet_…); text-encoder LoRA is not supported");
      std::string stem, what;
      for (const char* suffix : {".lora_down.weight", ".lora_up.weight", ".alpha"})
        if (ends_with(key, suffix)) {
          stem = key.substr(0, key.size() - std::string(suffix).size());
          what = suffix;
        }
      ZERO_CHECK(!stem.empty(), path.string(), ": key '", key, "' is not .lora_down.weight, .lora_up.weight or .alpha");
      auto it = from_kohya.find(stem);
      ZERO_CHECK(it != from_kohya.end(), path.string(), ": '", stem, "' names no layer of this UNet");
      Parts& p = part_of(it->second);
      if (what == ".alpha") p.alpha = tensor.to(torch::kFloat64).item<double>();
      else (what == ".lora_down.weight" ? p.down : p.up) = tensor.to(torch::kFloat32);
    } else {
      ZERO_CHECK(key.rfind(kDiffusersPrefix, 0) == 0 &&
                     (ends_with(key, ".lora_A.weight") || ends_with(key, ".lora_B.weight")),
                 path.string(), ": key '", key, "' is neither diffusers/PEFT naming (unet.<module>.lora_A.weight, "
                 ".lora_B.weight) nor kohya naming (lora_unet_…)");
      const std::string module = key.substr(5, key.size() - 5 - 14);
      Parts& p = part_of(module);
      (ends_with(key, ".lora_A.weight") ? p.down : p.up) = tensor.to(torch::kFloat32);
    }
  }
  LoraWeights out;
  // diffusers naming: alpha from PEFT's config in the header when present, else alpha = rank.
  std::optional<double> file_alpha;
  if (!kohya) {
    const auto& metadata = zero::io::SafeTensorsFile::open(path).metadata();
    auto it = metadata.find(kMetadataKey);
    if (it != metadata.end()) {
      const nlohmann::json config = nlohmann::json::parse(it->second, nullptr, /*allow_exceptions=*/false);
      ZERO_CHECK(config.is_object(), path.string(), ": header entry ", kMetadataKey, " is not a JSON object");
      if (config.contains("unet.lora_alpha") && config["unet.lora_alpha"].is_number())
        file_alpha = config["unet.lora_alpha"].get<double>();
      ZERO_CHECK(!config.contains("unet.rank_pattern") || config["unet.rank_pattern"].empty(), path.string(),
                 ": per-layer ranks (rank_pattern) are not supported");
      ZERO_CHECK(!config.contains("unet.alpha_pattern") || config["unet.alpha_pattern"].empty(), path.string(),
                 ": per-layer alphas (alpha_pattern) are not supported");
    }
  }
  for (const std::string& module : order) {
    const Parts& p = parts.at(module);
    ZERO_CHECK(linear_modules.count(module), path.string(), ": '", module, "' is not a Linear layer of this UNet");
    ZERO_CHECK(p.down.defined() && p.up.defined(), path.string(), ": '", module, "' has only one of its two halves");
    ZERO_CHECK(p.down.dim() == 2 && p.up.dim() == 2 && p.up.size(1) == p.down.size(0), path.string(), ": '", module,
               "' has halves of shapes ", p.down.sizes(), " and ", p.up.sizes(), " (expected [rank, in], [out, rank])");
    const std::int64_t rank = p.down.size(0);
    if (out.rank == 0) out.rank = rank;
    ZERO_CHECK(rank == out.rank, path.string(), ": '", module, "' has rank ", rank, ", other layers ", out.rank,
               " (one rank for all layers is supported)");
    const double alpha = kohya ? p.alpha.value_or(static_cast<double>(rank)) : file_alpha.value_or(static_cast<double>(rank));
    if (out.modules.empty()) out.alpha = alpha;
    ZERO_CHECK(alpha == out.alpha, path.string(), ": '", module, "' has alpha ", alpha, ", other layers ", out.alpha,
               " (one alpha for all layers is supported)");
    out.modules.push_back(module);
    out.down.push_back(p.down);
    out.up.push_back(p.up);
  }
  return out;
}

void merge_lora(const LoraWeights& lora, std::map<std::string, torch::Tensor>& weights) {
  torch::NoGradGuard no_grad;
  const double scale = lora.alpha / static_cast<double>(lora.rank);
  for (std::size_t i = 0; i < lora.modules.size(); ++i) {
    auto it = weights.find(lora.modules[i] + ".weight");
    ZERO_CHECK(it != weights.end(), "merge_lora: no weight for the adapted layer '", lora.modules[i], "'");
    torch::Tensor w = it->second.to(torch::kFloat32);
    it->second = w + torch::matmul(lora.up[i].to(torch::kFloat32), lora.down[i].to(torch::kFloat32)) * scale;
  }
}

void load_lora_into(UNet2DConditionModelImpl& model, const LoraWeights& lora, double model_alpha,
                    const std::string& origin) {
  const std::vector<std::string>& ours = model.lora_modules();
  std::set<std::string> theirs(lora.modules.begin(), lora.modules.end());
  for (const std::string& m : ours)
    ZERO_CHECK(theirs.count(m), origin, ": has no adapter for '", m, "', which [lora] targets adapt (", ours.size(),
               " layers here, ", lora.modules.size(), " in the file)");
  ZERO_CHECK(lora.modules.size() == ours.size(), origin, ": adapts ", lora.modules.size(), " layers, [lora] targets ",
             ours.size(), " (the first extra one: '",
             [&] {
               std::set<std::string> mine(ours.begin(), ours.end());
               for (const std::string& m : lora.modules)
                 if (!mine.count(m)) return m;
               return std::string();
             }(),
             "')");
  std::map<std::string, torch::Tensor> params;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) params[item.key()] = item.value();
  const double rescale = (lora.alpha / static_cast<double>(lora.rank)) /
                         (model_alpha / static_cast<double>(lora.rank));
  torch::NoGradGuard no_grad;
  for (std::size_t i = 0; i < lora.modules.size(); ++i) {
    torch::Tensor a = params.at(lora.modules[i] + ".lora_A.weight");
    torch::Tensor b = params.at(lora.modules[i] + ".lora_B.weight");
    ZERO_CHECK(a.sizes() == lora.down[i].sizes() && b.sizes() == lora.up[i].sizes(), origin, ": '", lora.modules[i],
               "' has halves of shapes ", lora.down[i].sizes(), " and ", lora.up[i].sizes(), ", the model ", a.sizes(),
               " and ", b.sizes(), " ([lora] rank = ", a.size(0), ")");
    a.copy_(lora.down[i]);
    b.copy_(rescale == 1.0 ? lora.up[i] : lora.up[i] * rescale);
  }
}

}  // namespace sdxl
