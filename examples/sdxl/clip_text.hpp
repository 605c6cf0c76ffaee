// transformers' CLIPTextModel and CLIPTextModelWithProjection in LibTorch,
// with transformers' parameter names ("text_model.encoder.layers.0.self_attn.
// q_proj.weight", "text_projection.weight"), and SDXL's use of the pair:
// the penultimate hidden states of both, concatenated on the channel axis,
// and the second encoder's pooled, projected output
// (diffusers' StableDiffusionXLPipeline.encode_prompt with clip_skip unset).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "pipeline_folder.hpp"

namespace sdxl {

/// The subset of transformers' CLIPTextConfig this model implements (keys of
/// the same names in config.json).
struct ClipTextConfig {
  std::int64_t vocab_size = 0;               // required
  std::int64_t hidden_size = 0;              // required
  std::int64_t intermediate_size = 0;        // required
  std::int64_t num_hidden_layers = 0;        // required
  std::int64_t num_attention_heads = 0;      // required
  std::int64_t max_position_embeddings = 0;  // required
  std::string hidden_act = "quick_gelu";     // "quick_gelu" (ViT-L/14) or "gelu" (OpenCLIP bigG)
  double layer_norm_eps = 1e-5;
  std::int64_t projection_dim = 0;  // width of text_projection (WithProjection only)
  std::int64_t eos_token_id = 2;
  std::int64_t pad_token_id = 1;
  std::int64_t bos_token_id = 0;

  /// Parses a transformers config.json's text (a CLIPTextConfig; the
  /// "text_config" of a full CLIPConfig is not accepted). zero::IoError
  /// naming `source` and the key for a missing or unsupported one.
  static ClipTextConfig from_json(const std::string& text, const std::string& source);
  /// SDXL 1.0's text_encoder (CLIP ViT-L/14) and text_encoder_2 (OpenCLIP
  /// bigG, with a 1280-wide projection), as their config.json files say.
  static ClipTextConfig sdxl_text_encoder();
  static ClipTextConfig sdxl_text_encoder_2();
};

/// What the encoder returns for token ids [B, T].
struct ClipTextOutput {
  torch::Tensor last_hidden_state;  // [B, T, hidden], after the final layer norm
  torch::Tensor pooled;             // [B, hidden]: last_hidden_state at each row's EOS position
  torch::Tensor text_embeds;        // [B, projection_dim]: text_projection(pooled); WithProjection only
  /// The embeddings, then each layer's output (num_hidden_layers + 1 entries,
  /// none normed): hidden_states[size - 2] is the "penultimate" SDXL uses.
  std::vector<torch::Tensor> hidden_states;
  const torch::Tensor& penultimate() const { return hidden_states.at(hidden_states.size() - 2); }
};

class ClipTextTransformer;

/// CLIPTextModel (with_projection false) or CLIPTextModelWithProjection.
class ClipTextModelImpl : public torch::nn::Module {
 public:
  ClipTextModelImpl(ClipTextConfig config, bool with_projection, torch::TensorOptions options = {});

  /// Token ids [B, T] (T <= max_position_embeddings), causal attention, no
  /// padding mask (as SDXL calls it). The pooled row is, as in transformers:
  /// argmax of the ids when eos_token_id == 2 (configs from before
  /// transformers 4.31 whose eos id was wrong), otherwise the first position
  /// holding eos_token_id.
  ClipTextOutput forward(const torch::Tensor& input_ids);

  const ClipTextConfig& config() const { return config_; }
  bool with_projection() const { return static_cast<bool>(text_projection_); }

 private:
  ClipTextConfig config_;
  std::shared_ptr<ClipTextTransformer> text_model_;
  torch::nn::Linear text_projection_{nullptr};
};
TORCH_MODULE(ClipTextModel);

/// Loads a text encoder from a component folder (config.json plus model
/// weights, see pipeline_folder.hpp). The class comes from the config's
/// "architectures" ("CLIPTextModelWithProjection" gets the projection); when
/// absent, from whether the weights hold text_projection.weight.
ClipTextModel load_clip_text_model(const std::filesystem::path& dir,
                                   torch::TensorOptions options = torch::TensorOptions().dtype(torch::kFloat32),
                                   WeightVariant variant = WeightVariant::kPreferFull);

/// SDXL's two text encoders from a pipeline root (text_encoder/, text_encoder_2/).
struct SdxlTextEncoders {
  ClipTextModel text_encoder{nullptr};    // CLIP ViT-L/14
  ClipTextModel text_encoder_2{nullptr};  // OpenCLIP bigG, with projection
};
SdxlTextEncoders load_sdxl_text_encoders(const std::filesystem::path& pipeline_root,
                                         torch::TensorOptions options = torch::TensorOptions().dtype(torch::kFloat32),
                                         WeightVariant variant = WeightVariant::kPreferFull);

/// Both text encoders from an original (Stability AI) single-file SDXL
/// checkpoint: "conditioner.embedders.0.transformer.text_model.*" (already in
/// transformers' naming) and "conditioner.embedders.1.model.*" in OpenCLIP's
/// naming (transformer.resblocks.I with a fused attn.in_proj_weight split
/// into q/k/v, ln_1/ln_2, mlp.c_fc/c_proj, positional_embedding, ln_final,
/// text_projection stored as [hidden, projection] and transposed). The file
/// holds no configs: the defaults are SDXL 1.0's.
SdxlTextEncoders load_sdxl_text_encoders_from_single_file(
    const std::filesystem::path& file, torch::TensorOptions options = torch::TensorOptions().dtype(torch::kFloat32),
    const ClipTextConfig& config = ClipTextConfig::sdxl_text_encoder(),
    const ClipTextConfig& config_2 = ClipTextConfig::sdxl_text_encoder_2());

/// The UNet's text conditioning.
struct SdxlTextConditioning {
  torch::Tensor prompt_embeds;         // [B, T, hidden_1 + hidden_2] (SDXL: 768 + 1280 = 2048)
  torch::Tensor pooled_prompt_embeds;  // [B, projection_dim_2] (SDXL: 1280)
};

/// encode_prompt's conditioning for ids from the two tokenizers (which differ
/// in padding): penultimate hidden states of both, concatenated, and the
/// second encoder's text_embeds. Classifier-free guidance's empty prompt is
/// the caller's business (SDXL's force_zeros_for_empty_prompt uses zeros).
SdxlTextConditioning sdxl_text_conditioning(ClipTextModelImpl& text_encoder, const torch::Tensor& input_ids,
                                            ClipTextModelImpl& text_encoder_2, const torch::Tensor& input_ids_2);

}  // namespace sdxl
