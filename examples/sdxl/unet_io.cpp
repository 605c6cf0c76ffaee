#include "unet_io.hpp"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "zero/core/error.hpp"
#include "zero/io/atomic_file.hpp"
#include "zero/io/safetensors.hpp"

namespace sdxl {

namespace fs = std::filesystem;
using torch::Tensor;
using zero::io::SafeTensorsFile;
using zero::io::TensorDType;
using zero::io::TensorInfo;

namespace {

constexpr const char* kOriginalPrefix = "model.diffusion_model.";
constexpr const char* kWeightsName = "diffusion_pytorch_model.safetensors";
constexpr const char* kIndexName = "diffusion_pytorch_model.safetensors.index.json";
constexpr const char* kFp16WeightsName = "diffusion_pytorch_model.fp16.safetensors";
constexpr const char* kFp16IndexName = "diffusion_pytorch_model.safetensors.index.fp16.json";

// ---------------------------------------------------------------- dtypes

torch::ScalarType to_scalar_type(TensorDType dtype) {
  switch (dtype) {
    case TensorDType::F64: return torch::kFloat64;
    case TensorDType::F32: return torch::kFloat32;
    case TensorDType::F16: return torch::kFloat16;
    case TensorDType::BF16: return torch::kBFloat16;
    case TensorDType::I64: return torch::kInt64;
    case TensorDType::I32: return torch::kInt32;
    case TensorDType::I16: return torch::kInt16;
    case TensorDType::I8: return torch::kInt8;
    case TensorDType::U8: return torch::kUInt8;
    case TensorDType::BOOL: return torch::kBool;
  }
  ZERO_THROW(zero::InternalError, "unhandled safetensors dtype ", static_cast<int>(dtype));
}

TensorDType to_tensor_dtype(torch::ScalarType type) {
  switch (type) {
    case torch::kFloat64: return TensorDType::F64;
    case torch::kFloat32: return TensorDType::F32;
    case torch::kFloat16: return TensorDType::F16;
    case torch::kBFloat16: return TensorDType::BF16;
    case torch::kInt64: return TensorDType::I64;
    case torch::kInt32: return TensorDType::I32;
    case torch::kInt16: return TensorDType::I16;
    case torch::kInt8: return TensorDType::I8;
    case torch::kUInt8: return TensorDType::U8;
    case torch::kBool: return TensorDType::BOOL;
    default: break;
  }
  ZERO_THROW(zero::InvalidArgument, "safetensors cannot store torch dtype ", c10::toString(type));
}

// ---------------------------------------------------------------- paths

std::string lower_extension(const fs::path& path) {
  std::string ext = path.extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return std::tolower(c); });
  return ext;
}

void refuse_pickle(const fs::path& path) {
  const std::string ext = lower_extension(path);
  if (ext == ".ckpt" || ext == ".bin" || ext == ".pt" || ext == ".pth" || ext == ".pkl" || ext == ".pickle") {
    ZERO_THROW(zero::IoError, "refusing to load '", path.string(), "': ", ext,
               " checkpoints are Python pickles, and unpickling can execute arbitrary code. "
               "Convert it to safetensors (e.g. with the safetensors or diffusers Python tools) and pass the "
               ".safetensors file or diffusers folder instead.");
  }
}

// A UNet config.json: its size is checked before it is read (a hostile or
// mistaken path may name a huge file).
std::string read_config_file(const fs::path& path) {
  std::error_code error;
  const std::uintmax_t bytes = fs::file_size(path, error);
  if (error) ZERO_THROW(zero::IoError, "cannot read UNet config '", path.string(), "': ", error.message());
  if (bytes > UNetLimits::kMaxConfigBytes)
    ZERO_THROW(zero::IoError, "UNet config '", path.string(), "' is ", bytes, " bytes, over the limit of ",
               UNetLimits::kMaxConfigBytes, " (kMaxConfigBytes; a diffusers config.json is a few KB): is it the "
               "right file?");
  return read_text_file(path);
}

// A diffusers pipeline root keeps the UNet in unet/.
fs::path unet_folder(const fs::path& dir) {
  if (!fs::exists(dir / "config.json") && fs::is_directory(dir / "unet")) return dir / "unet";
  return dir;
}

// The weight files of a diffusers folder, preferring full precision.
std::vector<fs::path> folder_weight_files(const fs::path& dir) {
  for (const char* single : {kWeightsName, kFp16WeightsName}) {
    if (fs::is_regular_file(dir / single)) return {dir / single};
    const char* index = std::string(single) == kWeightsName ? kIndexName : kFp16IndexName;
    if (fs::is_regular_file(dir / index)) {
      const fs::path index_path = dir / index;
      nlohmann::json doc;
      try {
        doc = nlohmann::json::parse(read_text_file(index_path));
      } catch (const nlohmann::json::exception& e) {
        ZERO_THROW(zero::IoError, "'", index_path.string(), "' is not valid JSON: ", e.what());
      }
      if (!doc.is_object() || !doc.contains("weight_map") || !doc["weight_map"].is_object()) {
        ZERO_THROW(zero::IoError, "'", index_path.string(), "' has no \"weight_map\" object");
      }
      std::set<std::string> shards;
      for (const auto& [name, file] : doc["weight_map"].items()) {
        if (!file.is_string()) ZERO_THROW(zero::IoError, "'", index_path.string(), "': shard of '", name,
                                          "' is not a string");
        const std::string shard = file.get<std::string>();
        // Shards must be plain file names next to the index: never follow a
        // path out of the model folder.
        if (shard.empty() || shard.find('/') != std::string::npos || shard.find('\\') != std::string::npos ||
            shard == "." || shard == "..") {
          ZERO_THROW(zero::IoError, "'", index_path.string(), "': shard name '", shard, "' is not a plain file name");
        }
        refuse_pickle(shard);
        shards.insert(shard);
      }
      std::vector<fs::path> files;
      for (const std::string& shard : shards) files.push_back(dir / shard);
      return files;
    }
  }
  for (const char* pickle : {"diffusion_pytorch_model.bin", "diffusion_pytorch_model.fp16.bin"}) {
    if (fs::exists(dir / pickle)) refuse_pickle(dir / pickle);
  }
  ZERO_THROW(zero::IoError, "'", dir.string(), "' has none of ", kWeightsName, ", ", kIndexName, ", ",
             kFp16WeightsName, ", ", kFp16IndexName);
}

// ---------------------------------------------------------------- weight sets

/// The tensors of one checkpoint, possibly spread over shards, by stored name.
struct WeightSet {
  std::string description;
  std::vector<std::unique_ptr<SafeTensorsFile>> files;
  std::map<std::string, std::pair<const SafeTensorsFile*, const TensorInfo*>> tensors;
};

WeightSet open_weights(const fs::path& path) {
  refuse_pickle(path);
  if (!fs::exists(path)) ZERO_THROW(zero::IoError, "model path '", path.string(), "' does not exist");
  std::vector<fs::path> files;
  if (fs::is_directory(path)) {
    files = folder_weight_files(unet_folder(path));
  } else {
    files = {path};
  }
  WeightSet set;
  set.description = path.string();
  for (const fs::path& file : files) {
    refuse_pickle(file);
    set.files.push_back(std::make_unique<SafeTensorsFile>(SafeTensorsFile::open(file)));
    const SafeTensorsFile* f = set.files.back().get();
    for (const TensorInfo& info : f->tensors()) {
      auto [it, inserted] = set.tensors.emplace(info.name, std::make_pair(f, &info));
      if (!inserted) {
        ZERO_THROW(zero::IoError, "tensor '", info.name, "' appears in both '", it->second.first->path().string(),
                   "' and '", f->path().string(), "'");
      }
    }
  }
  return set;
}

bool is_original_layout(const WeightSet& set) {
  return std::any_of(set.tensors.begin(), set.tensors.end(),
                     [](const auto& item) { return item.first.rfind(kOriginalPrefix, 0) == 0; });
}

// ---------------------------------------------------------------- original single-file names

const std::map<std::string, std::string>& resnet_renames() {
  static const std::map<std::string, std::string> renames = {
      {"norm1", "in_layers.0"},      {"conv1", "in_layers.2"}, {"time_emb_proj", "emb_layers.1"},
      {"norm2", "out_layers.0"},     {"conv2", "out_layers.3"}, {"conv_shortcut", "skip_connection"}};
  return renames;
}

std::vector<std::string> split(const std::string& name) {
  std::vector<std::string> parts;
  std::string part;
  std::istringstream in(name);
  while (std::getline(in, part, '.')) parts.push_back(part);
  return parts;
}

std::string join(const std::vector<std::string>& parts, std::size_t from) {
  std::string out;
  for (std::size_t i = from; i < parts.size(); ++i) out += (out.empty() ? "" : ".") + parts[i];
  return out;
}

std::string rename_resnet_tail(const std::vector<std::string>& parts, std::size_t from, const std::string& full) {
  auto it = resnet_renames().find(parts.at(from));
  ZERO_CHECK(it != resnet_renames().end(), "no original name for resnet parameter '", full, "'");
  return it->second + "." + join(parts, from + 1);
}

}  // namespace

std::string read_text_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) ZERO_THROW(zero::IoError, "cannot open '", path.string(), "'");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) ZERO_THROW(zero::IoError, "cannot read '", path.string(), "'");
  return text.str();
}

Tensor copy_out(const SafeTensorsFile& file, const TensorInfo& info) {
  Tensor t = torch::empty(info.shape, torch::TensorOptions().dtype(to_scalar_type(info.dtype)));
  auto bytes = file.data(info);
  if (!bytes.empty()) std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
}

std::string shape_text(torch::IntArrayRef shape) {
  std::ostringstream out;
  out << "[";
  for (std::size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << "]";
  return out.str();
}

void append_list(std::ostringstream& out, const char* what, const std::vector<std::string>& names) {
  if (names.empty()) return;
  constexpr std::size_t kShown = 20;
  out << "\n  " << names.size() << " " << what << ":";
  for (std::size_t i = 0; i < names.size() && i < kShown; ++i) out << "\n    " << names[i];
  if (names.size() > kShown) out << "\n    ... and " << names.size() - kShown << " more";
}

// ---------------------------------------------------------------- public API

std::vector<std::pair<std::string, std::string>> original_checkpoint_names(const UNet2DConditionModelImpl& model) {
  const UNetConfig& cfg = model.config();
  // The original layout numbers input/output blocks consecutively, which only
  // has one meaning when every level has the same number of resnets.
  const std::int64_t layers = cfg.layers_per_block.at(0);
  for (std::int64_t l : cfg.layers_per_block) {
    ZERO_CHECK(l == layers, "the original single-file layout needs the same layers_per_block at every level");
  }
  ZERO_CHECK(cfg.has_mid_block, "the original single-file layout needs a mid block");
  const std::int64_t stride = layers + 1;  // input/output blocks per level

  std::vector<std::pair<std::string, std::string>> names;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const std::string& name = item.key();
    const std::vector<std::string> p = split(name);
    std::string original;
    const std::string& top = p.at(0);
    if (top == "conv_in") {
      original = "input_blocks.0.0." + join(p, 1);
    } else if (top == "time_embedding" || top == "add_embedding") {
      const std::string base = top == "time_embedding" ? "time_embed." : "label_emb.0.";
      original = base + (p.at(1) == "linear_1" ? "0." : "2.") + join(p, 2);
    } else if (top == "conv_norm_out") {
      original = "out.0." + join(p, 1);
    } else if (top == "conv_out") {
      original = "out.2." + join(p, 1);
    } else if (top == "down_blocks" || top == "up_blocks") {
      const bool down = top == "down_blocks";
      const std::int64_t level = std::stoll(p.at(1));
      const std::string& kind = p.at(2);
      const std::int64_t j = std::stoll(p.at(3));
      const std::string blocks = down ? "input_blocks." : "output_blocks.";
      if (kind == "resnets") {
        const std::int64_t index = down ? 1 + level * stride + j : level * stride + j;
        original = blocks + std::to_string(index) + ".0." + rename_resnet_tail(p, 4, name);
      } else if (kind == "attentions") {
        const std::int64_t index = down ? 1 + level * stride + j : level * stride + j;
        original = blocks + std::to_string(index) + ".1." + join(p, 4);
      } else if (kind == "downsamplers") {
        original = blocks + std::to_string((level + 1) * stride) + ".0.op." + join(p, 5);
      } else if (kind == "upsamplers") {
        const bool with_attention = cfg.up_block_types.at(level) == UpBlockType::kCrossAttnUp;
        original = blocks + std::to_string(level * stride + layers) + (with_attention ? ".2." : ".1.") + join(p, 4);
      }
    } else if (top == "mid_block") {
      const std::int64_t k = std::stoll(p.at(2));
      if (p.at(1) == "resnets") {
        original = "middle_block." + std::to_string(2 * k) + "." + rename_resnet_tail(p, 3, name);
      } else {
        original = "middle_block." + std::to_string(2 * k + 1) + "." + join(p, 3);
      }
    }
    ZERO_CHECK(!original.empty(), "no original single-file name for parameter '", name, "'");
    names.emplace_back(name, kOriginalPrefix + original);
  }
  return names;
}

UNetConfig read_unet_config(const fs::path& path) {
  refuse_pickle(path);
  if (!fs::exists(path)) ZERO_THROW(zero::IoError, "model path '", path.string(), "' does not exist");
  if (fs::is_directory(path)) {
    const fs::path config = unet_folder(path) / "config.json";
    if (!fs::is_regular_file(config)) ZERO_THROW(zero::IoError, "'", path.string(), "' has no config.json");
    return UNetConfig::from_json(read_config_file(config), config.string());
  }
  // A diffusers config.json itself (its name may be anything ending in .json).
  if (lower_extension(path) == ".json") return UNetConfig::from_json(read_config_file(path), path.string());
  const SafeTensorsFile file = SafeTensorsFile::open(path);
  if (auto it = file.metadata().find("config"); it != file.metadata().end())
    return UNetConfig::from_json(it->second, path.string() + " metadata 'config'");
  // A weights file inside a diffusers folder: its config sits next to it.
  if (fs::is_regular_file(path.parent_path() / "config.json")) {
    return UNetConfig::from_json(read_config_file(path.parent_path() / "config.json"),
                                 (path.parent_path() / "config.json").string());
  }
  for (const TensorInfo& info : file.tensors()) {
    if (info.name.rfind(kOriginalPrefix, 0) == 0) return UNetConfig::sdxl_base();
  }
  ZERO_THROW(zero::IoError, "'", path.string(), "' has no \"config\" metadata entry and no config.json beside it; "
             "pass a diffusers folder or a file saved by save_unet()");
}

void load_unet_weights(UNet2DConditionModelImpl& model, const fs::path& path) {
  WeightSet set = open_weights(path);

  // Stored name -> the model's (diffusers) name, and back for messages.
  std::map<std::string, std::string> stored_to_model, model_to_stored;
  const bool original = is_original_layout(set);
  if (original) {
    for (const auto& [diffusers, stored] : original_checkpoint_names(model)) {
      stored_to_model[stored] = diffusers;
      model_to_stored[diffusers] = stored;
    }
  }

  const auto params = model.named_parameters(/*recurse=*/true);
  std::map<std::string, Tensor> expected;
  for (const auto& item : params) expected.emplace(item.key(), item.value());

  std::vector<std::string> unexpected, misshapen, bad_dtype;
  std::set<std::string> present;  // model names the checkpoint has, usable or not
  std::map<std::string, std::pair<const SafeTensorsFile*, const TensorInfo*>> found;  // by model name
  for (const auto& [stored, location] : set.tensors) {
    std::string name = stored;
    if (original) {
      // A single-file checkpoint also holds the VAE and text encoders: only
      // the UNet's prefix concerns us.
      if (stored.rfind(kOriginalPrefix, 0) != 0) continue;
      auto it = stored_to_model.find(stored);
      if (it == stored_to_model.end()) {
        unexpected.push_back(stored);
        continue;
      }
      name = it->second;
    }
    auto it = expected.find(name);
    if (it == expected.end()) {
      unexpected.push_back(stored);
      continue;
    }
    present.insert(name);
    const TensorInfo& info = *location.second;
    if (!torch::IntArrayRef(info.shape).equals(it->second.sizes())) {
      misshapen.push_back(stored + ": checkpoint " + shape_text(info.shape) + ", model " +
                          shape_text(it->second.sizes()));
      continue;
    }
    if (info.dtype != TensorDType::F32 && info.dtype != TensorDType::F16 && info.dtype != TensorDType::BF16 &&
        info.dtype != TensorDType::F64) {
      bad_dtype.push_back(stored + ": " + std::string(zero::io::name_of(info.dtype)));
      continue;
    }
    found.emplace(name, location);
  }
  std::vector<std::string> missing;  // by the name the checkpoint should have used
  for (const auto& item : params) {
    if (present.count(item.key()) == 0) missing.push_back(original ? model_to_stored.at(item.key()) : item.key());
  }
  if (!missing.empty() || !unexpected.empty() || !misshapen.empty() || !bad_dtype.empty()) {
    std::ostringstream out;
    out << "checkpoint '" << set.description << "' does not match the UNet (nothing was loaded):";
    append_list(out, "missing tensors", missing);
    append_list(out, "unexpected tensors", unexpected);
    append_list(out, "tensors with the wrong shape", misshapen);
    append_list(out, "tensors with a non-float dtype", bad_dtype);
    ZERO_THROW(zero::IoError, out.str());
  }

  torch::NoGradGuard no_grad;
  for (const auto& item : params) {
    const auto& [file, info] = found.at(item.key());
    Tensor param = item.value();
    param.copy_(copy_out(*file, *info));
  }
}

UNet2DConditionModel load_unet(const fs::path& path, torch::TensorOptions options) {
  return load_unet(path, options, read_unet_config(path));
}

UNet2DConditionModel load_unet(const fs::path& path, torch::TensorOptions options, const UNetConfig& config) {
  UNetBuildOptions build;
  build.tensor_options = options;
  build.initialize = false;  // every parameter is overwritten by the load
  UNet2DConditionModel model(config, build);
  load_unet_weights(*model, path);
  return model;
}

void save_unet(const UNet2DConditionModelImpl& model, const fs::path& path, std::optional<torch::ScalarType> dtype,
               CheckpointFormat format) {
  const bool single_file = lower_extension(path) == ".safetensors";
  ZERO_CHECK(single_file || format == CheckpointFormat::kDiffusers,
             "save_unet: the original single-file layout needs a path ending in .safetensors, got '", path.string(),
             "'");
  std::map<std::string, std::string> rename;
  if (format == CheckpointFormat::kOriginalSingleFile) {
    for (const auto& [diffusers, original] : original_checkpoint_names(model)) rename[diffusers] = original;
  }

  // CPU, contiguous copies (no copy when already so) that outlive the views.
  std::vector<Tensor> keep;
  std::vector<zero::io::TensorView> views;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    Tensor t = item.value().detach();
    ZERO_CHECK(t.device().type() != torch::kMeta, "save_unet: parameter '", item.key(),
               "' is on the meta device and has no data");
    t = t.to(torch::kCPU, dtype.value_or(t.scalar_type())).contiguous();
    keep.push_back(t);
    const std::string name = rename.empty() ? item.key() : rename.at(item.key());
    views.push_back(zero::io::TensorView{name, to_tensor_dtype(t.scalar_type()),
                                         std::vector<std::int64_t>(t.sizes().begin(), t.sizes().end()),
                                         t.data_ptr()});
  }
  if (single_file) {
    zero::io::write_safetensors(path, views, {{"config", model.config().to_json()}, {"format", "pt"}});
    return;
  }
  std::error_code ec;
  fs::create_directories(path, ec);
  if (ec) ZERO_THROW(zero::IoError, "cannot create folder '", path.string(), "': ", ec.message());
  zero::io::write_safetensors(path / kWeightsName, views, {{"format", "pt"}});
  const std::string config = model.config().to_json() + "\n";
  zero::io::AtomicFileWriter writer(path / "config.json");
  writer.write(config.data(), config.size());
  writer.commit();
}

TensorDType safetensors_dtype_of(torch::ScalarType type) { return to_tensor_dtype(type); }

std::map<std::string, Tensor> read_tensors(const fs::path& path) {
  refuse_pickle(path);
  const SafeTensorsFile file = SafeTensorsFile::open(path);
  std::map<std::string, Tensor> out;
  for (const TensorInfo& info : file.tensors()) out.emplace(info.name, copy_out(file, info));
  return out;
}

void write_tensors(const fs::path& path, const std::map<std::string, Tensor>& tensors,
                   const std::map<std::string, std::string>& metadata) {
  std::vector<Tensor> keep;
  std::vector<zero::io::TensorView> views;
  for (const auto& [name, tensor] : tensors) {
    Tensor t = tensor.detach().to(torch::kCPU).contiguous();
    keep.push_back(t);
    views.push_back(zero::io::TensorView{name, to_tensor_dtype(t.scalar_type()),
                                         std::vector<std::int64_t>(t.sizes().begin(), t.sizes().end()),
                                         t.data_ptr()});
  }
  zero::io::write_safetensors(path, views, metadata);
}

}  // namespace sdxl
