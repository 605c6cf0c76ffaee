// Where the SDXL tools get the models around the UNet: a diffusers pipeline
// folder (model_index.json, vae/, text_encoder/, text_encoder_2/,
// tokenizer/, tokenizer_2/, scheduler/) or an original single-file
// checkpoint (the VAE and both text encoders; the tokenizers then come from
// folders of their own). prepare, sample and the trainer's validation images
// read them through this one place, so options, defaults and errors agree.
#pragma once

#include <torch/torch.h>

#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "clip_text.hpp"
#include "clip_tokenizer.hpp"
#include "data/dataset.hpp"
#include "schedulers.hpp"
#include "unet.hpp"
#include "vae.hpp"

namespace sdxl {

struct PipelineSource {
  std::string pipeline;     // diffusers pipeline folder
  std::string single_file;  // original-layout single file (instead of pipeline)
  /// With single_file: a diffusers pipeline folder whose configs describe the
  /// file's models (vae/, text_encoder/, text_encoder_2/, unet/ config.json),
  /// as diffusers' from_single_file(config=...); its tokenizer/,
  /// tokenizer_2/, scheduler/ and model_index.json serve as defaults too.
  /// Empty: SDXL 1.0's architectures.
  std::string single_file_config;
  std::string tokenizer, tokenizer_2;  // default: PIPELINE/tokenizer, PIPELINE/tokenizer_2
  /// How errors name the options: "--" (the tools' flags) or "[validation] ".
  std::string option_prefix = "--";

  /// Checks that exactly one of pipeline / single_file is given and exists,
  /// and fills the tokenizer defaults; `needs_tokenizers`: a single file
  /// must come with both tokenizer folders (given, or in single_file_config).
  /// zero::InvalidArgument naming the option.
  void resolve(bool needs_tokenizers);

  /// The folder the configs, tokenizers and scheduler come from: the
  /// pipeline, or single_file_config (empty when neither).
  std::string config_root() const { return pipeline.empty() ? single_file_config : pipeline; }
  /// single_file_config's `component`/config.json text, or nullopt without
  /// single_file_config (the SDXL 1.0 default applies). IoError when the
  /// folder lacks it.
  std::optional<std::pair<std::string, std::string>> single_file_component_config(const char* component) const;

  std::string option(const char* key) const { return option_prefix + key; }
};

/// The VAE of `source`, in `options`' dtype and device, in eval mode.
AutoencoderKL load_source_vae(const PipelineSource& source, torch::TensorOptions options);

/// The UNet at `path` (a diffusers folder, a zero export or an original
/// single file), in `options`' dtype and device. When `path` is the source's
/// single file, single_file_config's unet/config.json gives its architecture
/// where present (a file's own "config" metadata, else SDXL 1.0's, otherwise).
UNet2DConditionModel load_source_unet(const PipelineSource& source, const std::string& path,
                                      torch::TensorOptions options);

/// model_index.json's force_zeros_for_empty_prompt (true when absent, as for
/// a single file: SDXL 1.0's pipeline says true): an empty negative prompt
/// is then zeros rather than the encoding of "".
bool force_zeros_for_empty_prompt(const PipelineSource& source);

/// The sampler's noise schedule: `explicit_file` when given (it must
/// exist), else the scheduler/scheduler_config.json of the pipeline (or of
/// single_file_config) when there,
/// else SDXL 1.0's (scaled-linear betas 0.00085..0.012, leading spacing,
/// steps_offset 1; Karras sigmas for dpmpp_2m_karras).
SchedulerConfig source_scheduler(const PipelineSource& source, const std::string& explicit_file, Sampler sampler,
                                 const std::string& explicit_option);

/// Both text encoders and both tokenizers of a source, checked to belong
/// together (vocabularies within the encoders', equal max lengths).
class PromptEncoder {
 public:
  PromptEncoder(const PipelineSource& source, torch::TensorOptions options);

  /// SDXL's conditioning of each prompt: prompt_embeds [B, T, W] and pooled
  /// [B, P], float32 on the CPU.
  std::pair<torch::Tensor, torch::Tensor> encode(const std::vector<std::string>& prompts);
  /// T, W and P of encode().
  data::TextDims text_dims() const;
  const ClipTokenizer& tokenizer() const { return *tokenizer_; }

 private:
  torch::Tensor token_ids(const ClipTokenizer& tokenizer, const std::vector<std::string>& prompts) const;

  torch::Device device_;
  SdxlTextEncoders text_;
  std::optional<ClipTokenizer> tokenizer_, tokenizer_2_;
};

}  // namespace sdxl
