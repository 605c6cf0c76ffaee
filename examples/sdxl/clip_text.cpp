#include "clip_text.hpp"

#include <cmath>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>

#include "zero/core/error.hpp"

namespace sdxl {

namespace fs = std::filesystem;
using nlohmann::json;
using torch::Tensor;

// ---------------------------------------------------------------- config

namespace {

constexpr std::int64_t kMaxClipWidth = 65536;
constexpr std::int64_t kMaxClipLayers = 256;
constexpr std::int64_t kMaxClipVocab = 10'000'000;

[[noreturn]] void config_error(const std::string& source, const std::string& key, const std::string& what) {
  ZERO_THROW(zero::IoError, "text encoder config '", source, "': \"", key, "\" ", what);
}

std::int64_t bounded_int(const json& doc, const std::string& source, const char* key, std::int64_t min,
                         std::int64_t max) {
  const json& v = doc[key];
  if (!v.is_number_integer() || v.get<std::int64_t>() < min || v.get<std::int64_t>() > max)
    config_error(source, key,
                 "should be an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "], got " + v.dump());
  return v.get<std::int64_t>();
}

}  // namespace

ClipTextConfig ClipTextConfig::from_json(const std::string& text, const std::string& source) {
  json doc;
  try {
    doc = json::parse(text);
  } catch (const json::exception& e) {
    ZERO_THROW(zero::IoError, "text encoder config '", source, "' is not valid JSON: ", e.what());
  }
  if (!doc.is_object()) ZERO_THROW(zero::IoError, "text encoder config '", source, "' is not a JSON object");
  if (doc.contains("model_type") && doc["model_type"] != "clip_text_model")
    config_error(source, "model_type", "is " + doc["model_type"].dump() + ", expected \"clip_text_model\"");
  for (const char* key : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                          "num_attention_heads", "max_position_embeddings"}) {
    if (!doc.contains(key)) config_error(source, key, "is missing (a transformers CLIPTextConfig has it)");
  }
  // Other keys (dropout rates, initializer ranges, torch_dtype and the generic
  // PretrainedConfig fields older transformers wrote out) do not change inference.
  ClipTextConfig c;
  c.vocab_size = bounded_int(doc, source, "vocab_size", 1, kMaxClipVocab);
  c.hidden_size = bounded_int(doc, source, "hidden_size", 1, kMaxClipWidth);
  c.intermediate_size = bounded_int(doc, source, "intermediate_size", 1, 4 * kMaxClipWidth);
  c.num_hidden_layers = bounded_int(doc, source, "num_hidden_layers", 2, kMaxClipLayers);
  c.num_attention_heads = bounded_int(doc, source, "num_attention_heads", 1, kMaxClipWidth);
  c.max_position_embeddings = bounded_int(doc, source, "max_position_embeddings", 1, 1 << 16);
  if (c.hidden_size % c.num_attention_heads != 0)
    config_error(source, "num_attention_heads", "(" + std::to_string(c.num_attention_heads) +
                                                    ") does not divide hidden_size (" + std::to_string(c.hidden_size) + ")");
  if (doc.contains("hidden_act")) {
    if (doc["hidden_act"] != "quick_gelu" && doc["hidden_act"] != "gelu")
      config_error(source, "hidden_act", "is " + doc["hidden_act"].dump() + "; \"quick_gelu\" and \"gelu\" are implemented");
    c.hidden_act = doc["hidden_act"].get<std::string>();
  }
  if (doc.contains("layer_norm_eps")) {
    if (!doc["layer_norm_eps"].is_number() || !(doc["layer_norm_eps"].get<double>() > 0))
      config_error(source, "layer_norm_eps", "should be a positive number, got " + doc["layer_norm_eps"].dump());
    c.layer_norm_eps = doc["layer_norm_eps"].get<double>();
  }
  if (doc.contains("projection_dim")) c.projection_dim = bounded_int(doc, source, "projection_dim", 1, kMaxClipWidth);
  if (doc.contains("eos_token_id")) c.eos_token_id = bounded_int(doc, source, "eos_token_id", 0, c.vocab_size - 1);
  if (doc.contains("pad_token_id") && !doc["pad_token_id"].is_null())
    c.pad_token_id = bounded_int(doc, source, "pad_token_id", 0, c.vocab_size - 1);
  if (doc.contains("bos_token_id") && !doc["bos_token_id"].is_null())
    c.bos_token_id = bounded_int(doc, source, "bos_token_id", 0, c.vocab_size - 1);
  return c;
}

ClipTextConfig ClipTextConfig::sdxl_text_encoder() {
  ClipTextConfig c;
  c.vocab_size = 49408;
  c.hidden_size = 768;
  c.intermediate_size = 3072;
  c.num_hidden_layers = 12;
  c.num_attention_heads = 12;
  c.max_position_embeddings = 77;
  c.hidden_act = "quick_gelu";
  c.projection_dim = 768;
  return c;  // eos_token_id 2, pad 1, bos 0: the defaults, as SDXL's config.json
}

ClipTextConfig ClipTextConfig::sdxl_text_encoder_2() {
  ClipTextConfig c = sdxl_text_encoder();
  c.hidden_size = 1280;
  c.intermediate_size = 5120;
  c.num_hidden_layers = 32;
  c.num_attention_heads = 20;
  c.hidden_act = "gelu";
  c.projection_dim = 1280;
  return c;
}

// ---------------------------------------------------------------- layers

namespace {

torch::nn::LayerNorm layer_norm(std::int64_t width, double eps) {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({width}).eps(eps));
}

}  // namespace

/// CLIPEncoderLayer: pre-norm causal self-attention and MLP, both residual.
class ClipEncoderLayer : public torch::nn::Module {
 public:
  explicit ClipEncoderLayer(const ClipTextConfig& c)
      : heads_(c.num_attention_heads), quick_gelu_(c.hidden_act == "quick_gelu") {
    const std::int64_t d = c.hidden_size;
    auto attn = std::make_shared<torch::nn::Module>();
    q_proj_ = attn->register_module("q_proj", torch::nn::Linear(d, d));
    k_proj_ = attn->register_module("k_proj", torch::nn::Linear(d, d));
    v_proj_ = attn->register_module("v_proj", torch::nn::Linear(d, d));
    out_proj_ = attn->register_module("out_proj", torch::nn::Linear(d, d));
    register_module("self_attn", attn);
    layer_norm1_ = register_module("layer_norm1", layer_norm(d, c.layer_norm_eps));
    auto mlp = std::make_shared<torch::nn::Module>();
    fc1_ = mlp->register_module("fc1", torch::nn::Linear(d, c.intermediate_size));
    fc2_ = mlp->register_module("fc2", torch::nn::Linear(c.intermediate_size, d));
    register_module("mlp", mlp);
    layer_norm2_ = register_module("layer_norm2", layer_norm(d, c.layer_norm_eps));
  }

  Tensor forward(const Tensor& x, const Tensor& causal_mask) {
    const auto b = x.size(0), t = x.size(1), d = x.size(2), hd = d / heads_;
    Tensor h = layer_norm1_->forward(x);
    auto split = [&](const Tensor& y) { return y.view({b, t, heads_, hd}).transpose(1, 2); };  // [B, H, T, hd]
    Tensor q = split(q_proj_->forward(h)), k = split(k_proj_->forward(h)), v = split(v_proj_->forward(h));
    Tensor scores = torch::matmul(q, k.transpose(-1, -2)) * (1.0 / std::sqrt(static_cast<double>(hd)));
    // Softmax in fp32, as transformers' eager attention.
    Tensor probs = torch::softmax(scores.to(torch::kFloat32) + causal_mask, -1).to(q.scalar_type());
    Tensor attn = torch::matmul(probs, v).transpose(1, 2).reshape({b, t, d});
    Tensor y = x + out_proj_->forward(attn);
    Tensor m = fc1_->forward(layer_norm2_->forward(y));
    m = quick_gelu_ ? m * torch::sigmoid(1.702 * m) : torch::gelu(m);
    return y + fc2_->forward(m);
  }

 private:
  std::int64_t heads_;
  bool quick_gelu_;
  torch::nn::Linear q_proj_{nullptr}, k_proj_{nullptr}, v_proj_{nullptr}, out_proj_{nullptr};
  torch::nn::Linear fc1_{nullptr}, fc2_{nullptr};
  torch::nn::LayerNorm layer_norm1_{nullptr}, layer_norm2_{nullptr};
};

/// CLIPTextTransformer: "text_model" (embeddings, encoder.layers, final_layer_norm).
class ClipTextTransformer : public torch::nn::Module {
 public:
  explicit ClipTextTransformer(const ClipTextConfig& c) : config_(c) {
    auto embeddings = std::make_shared<torch::nn::Module>();
    token_embedding_ = embeddings->register_module("token_embedding", torch::nn::Embedding(c.vocab_size, c.hidden_size));
    position_embedding_ =
        embeddings->register_module("position_embedding", torch::nn::Embedding(c.max_position_embeddings, c.hidden_size));
    register_module("embeddings", embeddings);
    auto encoder = std::make_shared<torch::nn::Module>();
    auto layers = torch::nn::ModuleList();
    for (std::int64_t i = 0; i < c.num_hidden_layers; ++i) {
      layers_.push_back(std::make_shared<ClipEncoderLayer>(c));
      layers->push_back(layers_.back());
    }
    encoder->register_module("layers", layers);
    register_module("encoder", encoder);
    final_layer_norm_ = register_module("final_layer_norm", layer_norm(c.hidden_size, c.layer_norm_eps));
  }

  ClipTextOutput forward(const Tensor& ids) {
    ZERO_CHECK(ids.dim() == 2 && ids.size(1) >= 1 && ids.size(1) <= config_.max_position_embeddings,
               "text encoder: input ids should be [B, T] with 1 <= T <= ", config_.max_position_embeddings, ", got ",
               ids.sizes());
    const Tensor max_id = ids.max();
    const Tensor min_id = ids.min();
    ZERO_CHECK(min_id.item<std::int64_t>() >= 0 && max_id.item<std::int64_t>() < config_.vocab_size,
               "text encoder: token ids should lie in [0, ", config_.vocab_size, "), got [", min_id.item<std::int64_t>(),
               ", ", max_id.item<std::int64_t>(), "]");
    const auto t = ids.size(1);
    Tensor ids_dev = ids.to(token_embedding_->weight.device(), torch::kLong);
    Tensor positions = torch::arange(t, ids_dev.options());
    ClipTextOutput out;
    Tensor h = token_embedding_->forward(ids_dev) + position_embedding_->forward(positions).unsqueeze(0);
    out.hidden_states.push_back(h);
    Tensor causal = torch::full({t, t}, -std::numeric_limits<float>::infinity(),
                                torch::TensorOptions().dtype(torch::kFloat32).device(h.device()))
                        .triu(1);
    for (auto& layer : layers_) {
      h = layer->forward(h, causal);
      out.hidden_states.push_back(h);
    }
    out.last_hidden_state = final_layer_norm_->forward(h);
    // transformers' pooled row: configs with the legacy eos_token_id 2 take
    // the largest id (the real EOS has the largest id in CLIP's vocabulary);
    // others the first position of eos_token_id.
    Tensor eos_position = config_.eos_token_id == 2 ? ids_dev.argmax(-1)
                                                    : ids_dev.eq(config_.eos_token_id).to(torch::kInt).argmax(-1);
    out.pooled = out.last_hidden_state.index({torch::arange(ids.size(0), ids_dev.options()), eos_position});
    return out;
  }

 private:
  ClipTextConfig config_;
  torch::nn::Embedding token_embedding_{nullptr}, position_embedding_{nullptr};
  std::vector<std::shared_ptr<ClipEncoderLayer>> layers_;
  torch::nn::LayerNorm final_layer_norm_{nullptr};
};

// ---------------------------------------------------------------- model

ClipTextModelImpl::ClipTextModelImpl(ClipTextConfig config, bool with_projection, torch::TensorOptions options)
    : config_(std::move(config)) {
  text_model_ = register_module("text_model", std::make_shared<ClipTextTransformer>(config_));
  if (with_projection) {
    ZERO_CHECK(config_.projection_dim > 0, "CLIPTextModelWithProjection needs projection_dim in its config");
    text_projection_ = register_module(
        "text_projection", torch::nn::Linear(torch::nn::LinearOptions(config_.hidden_size, config_.projection_dim).bias(false)));
  }
  const auto dtype = options.has_dtype() ? c10::typeMetaToScalarType(options.dtype()) : torch::kFloat32;
  to(options.device(), dtype);
}

ClipTextOutput ClipTextModelImpl::forward(const Tensor& input_ids) {
  ClipTextOutput out = text_model_->forward(input_ids);
  if (text_projection_) out.text_embeds = text_projection_->forward(out.pooled);
  return out;
}

// ---------------------------------------------------------------- loading

namespace {

// transformers 4 stores CLIPTextModel's weights under "text_model."; 5 saves
// CLIPTextModel without that prefix (CLIPTextModelWithProjection keeps it).
// Checkpoints from before transformers 4.31 also carry the position_ids buffer.
std::string clip_module_name(const std::string& stored) {
  if (stored == "text_model.embeddings.position_ids" || stored == "embeddings.position_ids") return "";
  if (stored == "text_projection.weight" || stored.rfind("text_model.", 0) == 0) return stored;
  return "text_model." + stored;
}

}  // namespace

ClipTextModel load_clip_text_model(const fs::path& dir, torch::TensorOptions options, WeightVariant variant) {
  const fs::path config_path = dir / "config.json";
  const std::string text = read_config_text(config_path);
  ClipTextConfig config = ClipTextConfig::from_json(text, config_path.string());
  WeightSet weights = WeightSet::open(component_weight_files(dir, "model", variant), dir.string());
  bool with_projection = weights.tensors.count("text_projection.weight") > 0;
  const json doc = json::parse(text);
  if (doc.contains("architectures") && doc["architectures"].is_array() && !doc["architectures"].empty()) {
    const json& arch = doc["architectures"][0];
    if (arch == "CLIPTextModelWithProjection") with_projection = true;
    else if (arch == "CLIPTextModel") with_projection = false;
    else config_error(config_path.string(), "architectures",
                      "is " + doc["architectures"].dump() + "; CLIPTextModel and CLIPTextModelWithProjection are implemented");
  }
  ClipTextModel model(config, with_projection, options);
  load_named_tensors(*model, weights, with_projection ? "CLIPTextModelWithProjection" : "CLIPTextModel",
                     clip_module_name);
  model->eval();
  return model;
}

SdxlTextEncoders load_sdxl_text_encoders(const fs::path& pipeline_root, torch::TensorOptions options,
                                         WeightVariant variant) {
  const PipelineFolder folder = PipelineFolder::open(pipeline_root);
  SdxlTextEncoders encoders;
  encoders.text_encoder = load_clip_text_model(folder.component("text_encoder", "CLIPTextModel"), options, variant);
  encoders.text_encoder_2 =
      load_clip_text_model(folder.component("text_encoder_2", "CLIPTextModelWithProjection"), options, variant);
  return encoders;
}

namespace {

// OpenCLIP name (after "conditioner.embedders.1.model.") -> transformers name;
// "" for tensors without one; the name itself when unrecognised. The fused
// in_proj tensors are handled by the caller.
std::string openclip_name(const std::string& name) {
  static const std::map<std::string, std::string> kTop = {
      {"token_embedding.weight", "text_model.embeddings.token_embedding.weight"},
      {"positional_embedding", "text_model.embeddings.position_embedding.weight"},
      {"ln_final.weight", "text_model.final_layer_norm.weight"},
      {"ln_final.bias", "text_model.final_layer_norm.bias"},
      {"text_projection", "text_projection.weight"},
      {"logit_scale", ""},
      {"attn_mask", ""}};
  if (auto it = kTop.find(name); it != kTop.end()) return it->second;
  static const std::string kBlocks = "transformer.resblocks.";
  if (name.rfind(kBlocks, 0) != 0) return name;
  const auto dot = name.find('.', kBlocks.size());
  if (dot == std::string::npos) return name;
  const std::string layer = name.substr(kBlocks.size(), dot - kBlocks.size());
  const std::string tail = name.substr(dot + 1);
  static const std::pair<const char*, const char*> kParts[] = {{"ln_1.", "layer_norm1."},
                                                               {"ln_2.", "layer_norm2."},
                                                               {"attn.out_proj.", "self_attn.out_proj."},
                                                               {"mlp.c_fc.", "mlp.fc1."},
                                                               {"mlp.c_proj.", "mlp.fc2."}};
  for (const auto& [from, to] : kParts) {
    const std::string prefix = from;
    if (tail.rfind(prefix, 0) == 0)
      return "text_model.encoder.layers." + layer + "." + to + tail.substr(prefix.size());
  }
  return name;
}

}  // namespace

SdxlTextEncoders load_sdxl_text_encoders_from_single_file(const fs::path& file, torch::TensorOptions options,
                                                          const ClipTextConfig& config,
                                                          const ClipTextConfig& config_2) {
  static const std::string kPrefix1 = "conditioner.embedders.0.transformer.";
  static const std::string kPrefix2 = "conditioner.embedders.1.model.";
  WeightSet weights = WeightSet::open({file}, file.string());
  std::vector<TensorSource> one, two;
  for (const auto& [stored, location] : weights.tensors) {
    const zero::io::TensorInfo& info = *location.second;
    auto reader = [&weights, stored = stored] { return weights.read(stored); };
    if (stored.rfind(kPrefix1, 0) == 0) {
      const std::string name = stored.substr(kPrefix1.size());
      one.push_back({clip_module_name(name), stored, info.shape, info.dtype, reader});
    } else if (stored.rfind(kPrefix2, 0) == 0) {
      const std::string name = stored.substr(kPrefix2.size());
      const auto in_proj = name.find(".attn.in_proj_");
      if (in_proj != std::string::npos && info.shape.size() >= 1 && info.shape[0] % 3 == 0) {
        // [3D, D] (weight) or [3D] (bias): rows q, k, v.
        const std::string layer_prefix =
            "text_model.encoder.layers." + name.substr(std::string("transformer.resblocks.").size(),
                                                       in_proj - std::string("transformer.resblocks.").size());
        const std::string kind = name.substr(in_proj + std::string(".attn.in_proj_").size());  // weight / bias
        std::vector<std::int64_t> shape = info.shape;
        shape[0] /= 3;
        const char* parts[] = {"q_proj", "k_proj", "v_proj"};
        for (std::int64_t k = 0; k < 3; ++k) {
          two.push_back({layer_prefix + ".self_attn." + parts[k] + "." + kind, stored, shape, info.dtype,
                         [&weights, stored = stored, k, rows = shape[0]] {
                           return weights.read(stored).narrow(0, k * rows, rows).contiguous();
                         }});
        }
      } else if (name == "text_projection" && info.shape.size() == 2) {
        two.push_back({"text_projection.weight", stored, {info.shape[1], info.shape[0]}, info.dtype,
                       [&weights, stored = stored] { return weights.read(stored).t().contiguous(); }});
      } else {
        two.push_back({openclip_name(name), stored, info.shape, info.dtype, reader});
      }
    }
  }
  if (one.empty() || two.empty())
    ZERO_THROW(zero::IoError, "'", file.string(), "' holds no SDXL text encoder", one.empty() ? "" : " 2",
               ": no tensor starts with \"", one.empty() ? kPrefix1 : kPrefix2, "\"");
  SdxlTextEncoders encoders;
  encoders.text_encoder = ClipTextModel(config, /*with_projection=*/false, options);
  load_tensor_sources(*encoders.text_encoder, one, "CLIPTextModel", file.string());
  encoders.text_encoder->eval();
  encoders.text_encoder_2 = ClipTextModel(config_2, /*with_projection=*/true, options);
  load_tensor_sources(*encoders.text_encoder_2, two, "CLIPTextModelWithProjection", file.string());
  encoders.text_encoder_2->eval();
  return encoders;
}

SdxlTextConditioning sdxl_text_conditioning(ClipTextModelImpl& text_encoder, const Tensor& input_ids,
                                            ClipTextModelImpl& text_encoder_2, const Tensor& input_ids_2) {
  ZERO_CHECK(text_encoder_2.with_projection(), "SDXL's second text encoder must be a CLIPTextModelWithProjection");
  ZERO_CHECK(input_ids.sizes() == input_ids_2.sizes(), "SDXL conditioning: the two tokenizers' ids differ in shape (",
             input_ids.sizes(), " vs ", input_ids_2.sizes(), ")");
  torch::NoGradGuard no_grad;
  ClipTextOutput one = text_encoder.forward(input_ids);
  ClipTextOutput two = text_encoder_2.forward(input_ids_2);
  Tensor second = two.penultimate().to(one.penultimate().device());
  return {torch::cat({one.penultimate(), second}, -1), two.text_embeds};
}

}  // namespace sdxl
