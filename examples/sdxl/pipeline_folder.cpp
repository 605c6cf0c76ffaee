#include "pipeline_folder.hpp"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "unet_io.hpp"  // copy_out, read_text_file, shape_text, append_list
#include "zero/core/error.hpp"
#include "zero/io/json_limits.hpp"

namespace sdxl {

namespace fs = std::filesystem;
using nlohmann::json;
using torch::Tensor;
using zero::io::SafeTensorsFile;
using zero::io::TensorDType;
using zero::io::TensorInfo;

namespace {

constexpr std::size_t kMaxConfigBytes = 1 << 20;
constexpr zero::io::JsonLimits kConfigLimits{.max_bytes = kMaxConfigBytes, .max_values = 1'000'000,
                                             .max_depth = 16};

bool is_pickle_name(const fs::path& path) {
  std::string ext = path.extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return std::tolower(c); });
  return ext == ".ckpt" || ext == ".bin" || ext == ".pt" || ext == ".pth" || ext == ".pkl" || ext == ".pickle";
}

json parse_bounded(const fs::path& path, std::string_view what) {
  const std::string text = read_config_text(path);
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    ZERO_THROW(zero::IoError, what, " '", path.string(), "' is not valid JSON: ", e.what());
  }
}

// The shard files an index's "weight_map" names, each a plain file name next
// to the index (never a path out of the folder), each present.
std::vector<fs::path> index_shards(const fs::path& index_path) {
  const json doc = parse_bounded(index_path, "weight index");
  if (!doc.is_object() || !doc.contains("weight_map") || !doc["weight_map"].is_object())
    ZERO_THROW(zero::IoError, "weight index '", index_path.string(), "' has no \"weight_map\" object");
  std::set<std::string> shards;
  for (const auto& [name, file] : doc["weight_map"].items()) {
    if (!file.is_string())
      ZERO_THROW(zero::IoError, "weight index '", index_path.string(), "': the shard of '", name, "' is not a string");
    const std::string shard = file.get<std::string>();
    if (shard.empty() || shard.find('/') != std::string::npos || shard.find('\\') != std::string::npos ||
        shard == "." || shard == "..")
      ZERO_THROW(zero::IoError, "weight index '", index_path.string(), "': shard name '", shard,
                 "' (of '", name, "') is not a plain file name");
    if (is_pickle_name(shard))
      ZERO_THROW(zero::IoError, "weight index '", index_path.string(), "' names the pickle shard '", shard,
                 "': pickles can execute code when loaded; convert the model to safetensors");
    shards.insert(shard);
  }
  if (shards.empty()) ZERO_THROW(zero::IoError, "weight index '", index_path.string(), "' lists no shards");
  std::vector<fs::path> files;
  for (const std::string& shard : shards) {
    const fs::path path = index_path.parent_path() / shard;
    if (!fs::is_regular_file(path))
      ZERO_THROW(zero::IoError, "weight index '", index_path.string(), "' lists shard '", shard,
                 "', which is missing from '", index_path.parent_path().string(), "'");
    files.push_back(path);
  }
  return files;
}

}  // namespace

std::string read_config_text(const fs::path& path) {
  std::error_code error;
  if (!fs::is_regular_file(path, error)) ZERO_THROW(zero::IoError, "config '", path.string(), "' does not exist");
  const std::uintmax_t bytes = fs::file_size(path, error);
  if (error) ZERO_THROW(zero::IoError, "cannot read config '", path.string(), "': ", error.message());
  if (bytes > kMaxConfigBytes)
    ZERO_THROW(zero::IoError, "config '", path.string(), "' is ", bytes, " bytes, over the limit of ",
               kMaxConfigBytes, " (a config.json is a few KB): is it the right file?");
  std::string text = read_text_file(path);
  zero::io::check_json_limits(text, kConfigLimits, "config '" + path.string() + "'");
  return text;
}

PipelineFolder PipelineFolder::open(const fs::path& root) {
  const fs::path index = root / "model_index.json";
  if (!fs::is_regular_file(index))
    ZERO_THROW(zero::IoError, "'", root.string(), "' is not a diffusers pipeline folder: it has no model_index.json");
  const json doc = parse_bounded(index, "pipeline index");
  if (!doc.is_object()) ZERO_THROW(zero::IoError, "pipeline index '", index.string(), "' is not a JSON object");
  PipelineFolder folder;
  folder.root = root;
  for (const auto& [name, value] : doc.items()) {
    if (name.empty() || name[0] == '_' || !value.is_array()) continue;  // "_class_name", options like "force_zeros_for_empty_prompt"
    if (value.size() != 2)
      ZERO_THROW(zero::IoError, "pipeline index '", index.string(), "': component '", name,
                 "' should be [library, class], got ", value.dump());
    auto text = [](const json& v) { return v.is_string() ? v.get<std::string>() : std::string(); };
    folder.components[name] = {text(value[0]), text(value[1])};
  }
  return folder;
}

fs::path PipelineFolder::component(const std::string& name, const std::string& expected_class) const {
  const fs::path index = root / "model_index.json";
  auto it = components.find(name);
  if (it == components.end() || it->second.second.empty())
    ZERO_THROW(zero::IoError, "pipeline index '", index.string(), "' has no component '", name, "'");
  if (!expected_class.empty() && it->second.second != expected_class)
    ZERO_THROW(zero::IoError, "pipeline index '", index.string(), "': component '", name, "' is a ",
               it->second.second, ", expected ", expected_class);
  const fs::path dir = root / name;
  if (!fs::is_directory(dir))
    ZERO_THROW(zero::IoError, "pipeline folder '", root.string(), "' lists component '", name,
               "' but has no folder '", dir.string(), "'");
  return dir;
}

std::vector<fs::path> component_weight_files(const fs::path& dir, const std::string& base, WeightVariant variant) {
  struct Form {
    std::string single;
    std::vector<std::string> indexes;
  };
  const Form full{base + ".safetensors", {base + ".safetensors.index.json"}};
  const Form fp16{base + ".fp16.safetensors",
                  {base + ".safetensors.index.fp16.json", base + ".fp16.safetensors.index.json"}};
  std::vector<const Form*> forms;
  if (variant == WeightVariant::kPreferFull) forms.push_back(&full);
  forms.push_back(&fp16);
  std::vector<std::string> looked_for;
  for (const Form* form : forms) {
    if (fs::is_regular_file(dir / form->single)) return {dir / form->single};
    looked_for.push_back(form->single);
    for (const std::string& index : form->indexes) {
      if (fs::is_regular_file(dir / index)) return index_shards(dir / index);
      looked_for.push_back(index);
    }
  }
  for (const std::string& pickle : {base + ".bin", base + ".fp16.bin"}) {
    if (fs::exists(dir / pickle))
      ZERO_THROW(zero::IoError, "'", (dir / pickle).string(), "' is a Python pickle, and unpickling can execute "
                 "code: convert the model to safetensors (the diffusers/transformers save_pretrained default)");
  }
  std::ostringstream names;
  for (std::size_t i = 0; i < looked_for.size(); ++i) names << (i ? ", " : "") << looked_for[i];
  ZERO_THROW(zero::IoError, "'", dir.string(), "' has no weights: looked for ", names.str());
}

WeightSet WeightSet::open(const std::vector<fs::path>& files, std::string description) {
  WeightSet set;
  set.description = std::move(description);
  for (const fs::path& file : files) {
    if (is_pickle_name(file))
      ZERO_THROW(zero::IoError, "refusing to load the pickle '", file.string(), "': convert it to safetensors");
    set.files.push_back(std::make_unique<SafeTensorsFile>(SafeTensorsFile::open(file)));
    const SafeTensorsFile* f = set.files.back().get();
    for (const TensorInfo& info : f->tensors()) {
      auto [it, inserted] = set.tensors.emplace(info.name, std::make_pair(f, &info));
      if (!inserted)
        ZERO_THROW(zero::IoError, "tensor '", info.name, "' appears in both '", it->second.first->path().string(),
                   "' and '", f->path().string(), "'");
    }
  }
  return set;
}

Tensor WeightSet::read(const std::string& name) const {
  auto it = tensors.find(name);
  if (it == tensors.end()) ZERO_THROW(zero::IoError, "checkpoint '", description, "' has no tensor '", name, "'");
  const auto& [file, info] = it->second;
  return copy_out(*file, *info);
}

void load_tensor_sources(torch::nn::Module& module, const std::vector<TensorSource>& sources,
                         const std::string& what, const std::string& description) {
  std::map<std::string, Tensor> expected;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) expected.emplace(item.key(), item.value());
  for (const auto& item : module.named_buffers(/*recurse=*/true)) expected.emplace(item.key(), item.value());

  std::vector<std::string> unexpected, misshapen, bad_dtype;
  std::map<std::string, const TensorSource*> found;  // by module name; null when present but unusable
  for (const TensorSource& source : sources) {
    if (source.module_name.empty()) continue;
    auto it = expected.find(source.module_name);
    if (it == expected.end()) {
      unexpected.push_back(source.stored_name);
      continue;
    }
    if (!torch::IntArrayRef(source.shape).equals(it->second.sizes())) {
      misshapen.push_back(source.stored_name + ": checkpoint " + shape_text(source.shape) + ", expected " +
                          shape_text(it->second.sizes()) + (source.stored_name == source.module_name
                                                                  ? std::string()
                                                                  : " (for " + source.module_name + ")"));
      found.emplace(source.module_name, nullptr);
      continue;
    }
    if (source.dtype != TensorDType::F32 && source.dtype != TensorDType::F16 && source.dtype != TensorDType::BF16 &&
        source.dtype != TensorDType::F64) {
      bad_dtype.push_back(source.stored_name + ": " + std::string(zero::io::name_of(source.dtype)));
      found.emplace(source.module_name, nullptr);
      continue;
    }
    if (!found.emplace(source.module_name, &source).second)
      unexpected.push_back(source.stored_name + " (a second tensor for " + source.module_name + ")");
  }
  std::vector<std::string> missing;
  for (const auto& [name, tensor] : expected)
    if (found.count(name) == 0) missing.push_back(name + " " + shape_text(tensor.sizes()));
  if (!missing.empty() || !unexpected.empty() || !misshapen.empty() || !bad_dtype.empty()) {
    std::ostringstream out;
    out << "checkpoint '" << description << "' does not match the " << what << " (nothing was loaded):";
    append_list(out, "missing tensors", missing);
    append_list(out, "unexpected tensors", unexpected);
    append_list(out, "tensors with the wrong shape", misshapen);
    append_list(out, "tensors with a non-float dtype", bad_dtype);
    ZERO_THROW(zero::IoError, out.str());
  }
  torch::NoGradGuard no_grad;
  for (auto& [name, tensor] : expected) tensor.copy_(found.at(name)->read());
}

void load_named_tensors(torch::nn::Module& module, const WeightSet& set, const std::string& what,
                        const std::function<std::string(const std::string&)>& stored_to_module) {
  std::vector<TensorSource> sources;
  for (const auto& [stored, location] : set.tensors) {
    const TensorInfo& info = *location.second;
    sources.push_back({stored_to_module ? stored_to_module(stored) : stored, stored, info.shape, info.dtype,
                       [&set, name = stored] { return set.read(name); }});
  }
  load_tensor_sources(module, sources, what, set.description);
}

}  // namespace sdxl
