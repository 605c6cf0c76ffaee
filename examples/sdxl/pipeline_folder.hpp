// Finding a component's files in a diffusers pipeline folder (model_index.json
// plus one subfolder per component: vae/, text_encoder/, text_encoder_2/, ...)
// and loading safetensors weights into a LibTorch module strictly by name.
//
// A component folder holds config.json and its weights in one of these forms
// (`base` is "diffusion_pytorch_model" for diffusers models, "model" for
// transformers models):
//   base.safetensors                       one file
//   base.safetensors.index.json            shards listed in its "weight_map"
//   base.fp16.safetensors                  the fp16 variant, one file
//   base.safetensors.index.fp16.json       the fp16 variant, sharded
// (transformers also writes the fp16 index as base.fp16.safetensors.index.json;
// both spellings are accepted). Pickle files (.bin, .ckpt) are refused.
#pragma once

#include <torch/torch.h>

#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "zero/io/safetensors.hpp"

namespace sdxl {

/// Which weight files of a component folder to use.
enum class WeightVariant {
  kPreferFull,  // full precision when present, else the fp16 variant (diffusers' default)
  kFp16,        // only the ".fp16" files
};

/// A diffusers pipeline root: model_index.json names the components.
struct PipelineFolder {
  std::filesystem::path root;
  /// Component name -> [library, class name], e.g. "vae" -> {"diffusers", "AutoencoderKL"};
  /// an entry of [null, null] (a component left out) maps to two empty strings.
  std::map<std::string, std::pair<std::string, std::string>> components;

  /// Reads `root`/model_index.json. zero::IoError when it is missing or malformed.
  static PipelineFolder open(const std::filesystem::path& root);

  /// `root`/`name`, checked to be listed with class `expected_class` (when not
  /// empty) and to exist as a folder.
  std::filesystem::path component(const std::string& name, const std::string& expected_class = "") const;
};

/// The text of a config.json, refused by size (over 1 MiB; a config is a few
/// KB) and by JSON complexity before any parser builds a document from it.
std::string read_config_text(const std::filesystem::path& path);

/// The weight files of component folder `dir` for weights named `base`
/// (see the header comment). zero::IoError naming the folder and the names
/// looked for when none is there, or naming the index and shard when an
/// index lists a shard that is missing.
std::vector<std::filesystem::path> component_weight_files(const std::filesystem::path& dir, const std::string& base,
                                                          WeightVariant variant = WeightVariant::kPreferFull);

/// The tensors of one checkpoint, possibly spread over shards, by stored name.
struct WeightSet {
  std::string description;  // for messages: the folder or file
  std::vector<std::unique_ptr<zero::io::SafeTensorsFile>> files;
  std::map<std::string, std::pair<const zero::io::SafeTensorsFile*, const zero::io::TensorInfo*>> tensors;

  /// Opens every file (validating its header); a tensor stored twice is an error.
  static WeightSet open(const std::vector<std::filesystem::path>& files, std::string description);
  /// A CPU copy of the tensor stored as `name`, in its stored dtype.
  torch::Tensor read(const std::string& name) const;
};

/// One tensor a checkpoint provides for a module's parameter or buffer.
struct TensorSource {
  std::string module_name;  // "" when the module has no use for it (skipped)
  std::string stored_name;  // for messages; several sources may share one (a fused qkv)
  std::vector<std::int64_t> shape;  // of what read() returns
  zero::io::TensorDType dtype = zero::io::TensorDType::F32;
  std::function<torch::Tensor()> read;  // a CPU tensor, only called once all sources match
};

/// Copies the sources into `module`'s parameters and buffers by module name,
/// converting dtype. Strict, as load_named_tensors; `description` names the
/// checkpoint in messages.
void load_tensor_sources(torch::nn::Module& module, const std::vector<TensorSource>& sources,
                         const std::string& what, const std::string& description);

/// Copies `set`'s tensors into `module`'s parameters and buffers by name,
/// converting dtype. `stored_to_module` maps a stored name to the module's
/// name, or to "" to skip the tensor (e.g. buffers old checkpoints carry);
/// identity when empty. Strict: when names or shapes differ nothing is
/// copied, and zero::IoError lists the missing, unexpected and misshapen
/// tensors (with both shapes), naming `what` (e.g. "VAE") and the checkpoint.
void load_named_tensors(torch::nn::Module& module, const WeightSet& set, const std::string& what,
                        const std::function<std::string(const std::string&)>& stored_to_module = {});

}  // namespace sdxl
