#include "vae.hpp"

#include <nlohmann/json.hpp>
#include <cmath>
#include <cstring>
#include <map>
#include <set>

#include "zero/core/error.hpp"

namespace sdxl {

namespace fs = std::filesystem;
using nlohmann::json;
using torch::Tensor;

// ---------------------------------------------------------------- config

namespace {

constexpr double kVaeNormEps = 1e-6;  // diffusers' Encoder/Decoder: every GroupNorm
constexpr std::int64_t kMaxVaeChannels = 8192;
constexpr std::int64_t kMaxVaeLevels = 8;
constexpr std::int64_t kMaxVaeLayers = 32;

[[noreturn]] void config_error(const std::string& source, const std::string& key, const std::string& what) {
  ZERO_THROW(zero::IoError, "VAE config '", source, "': \"", key, "\" ", what);
}

std::int64_t positive_int(const json& v, const std::string& source, const std::string& key, std::int64_t max) {
  if (!v.is_number_integer() || v.get<std::int64_t>() < 1 || v.get<std::int64_t>() > max)
    config_error(source, key, "should be an integer in [1, " + std::to_string(max) + "], got " + v.dump());
  return v.get<std::int64_t>();
}

bool boolean(const json& v, const std::string& source, const std::string& key) {
  if (!v.is_boolean()) config_error(source, key, "should be true or false, got " + v.dump());
  return v.get<bool>();
}

}  // namespace

VaeConfig VaeConfig::from_json(const std::string& text, const std::string& source) {
  json doc;
  try {
    doc = json::parse(text);
  } catch (const json::exception& e) {
    ZERO_THROW(zero::IoError, "VAE config '", source, "' is not valid JSON: ", e.what());
  }
  if (!doc.is_object()) ZERO_THROW(zero::IoError, "VAE config '", source, "' is not a JSON object");
  for (const char* key : {"block_out_channels", "layers_per_block", "latent_channels", "norm_num_groups",
                          "down_block_types", "up_block_types"}) {
    if (!doc.contains(key)) config_error(source, key, "is missing (a diffusers AutoencoderKL config.json has it)");
  }
  if (doc.contains("_class_name") && doc["_class_name"] != "AutoencoderKL")
    config_error(source, "_class_name", "is " + doc["_class_name"].dump() + ", expected \"AutoencoderKL\"");
  VaeConfig c;
  for (const auto& [key, v] : doc.items()) {
    if (!key.empty() && key[0] == '_') continue;  // _class_name, _diffusers_version, _name_or_path
    if (key == "in_channels") c.in_channels = positive_int(v, source, key, kMaxVaeChannels);
    else if (key == "out_channels") c.out_channels = positive_int(v, source, key, kMaxVaeChannels);
    else if (key == "latent_channels") c.latent_channels = positive_int(v, source, key, kMaxVaeChannels);
    else if (key == "layers_per_block") c.layers_per_block = positive_int(v, source, key, kMaxVaeLayers);
    else if (key == "norm_num_groups") c.norm_num_groups = positive_int(v, source, key, kMaxVaeChannels);
    else if (key == "sample_size") c.sample_size = v.is_null() ? 0 : positive_int(v, source, key, 1 << 20);
    else if (key == "force_upcast") c.force_upcast = boolean(v, source, key);
    else if (key == "mid_block_add_attention") c.mid_block_add_attention = boolean(v, source, key);
    else if (key == "use_quant_conv") c.use_quant_conv = boolean(v, source, key);
    else if (key == "use_post_quant_conv") c.use_post_quant_conv = boolean(v, source, key);
    else if (key == "scaling_factor") {
      if (!v.is_number() || !(v.get<double>() > 0)) config_error(source, key, "should be a positive number, got " + v.dump());
      c.scaling_factor = v.get<double>();
    } else if (key == "block_out_channels") {
      if (!v.is_array() || v.empty() || v.size() > kMaxVaeLevels)
        config_error(source, key, "should be a list of 1 to " + std::to_string(kMaxVaeLevels) + " channel counts, got " + v.dump());
      for (const json& item : v) c.block_out_channels.push_back(positive_int(item, source, key, kMaxVaeChannels));
    } else if (key == "down_block_types" || key == "up_block_types") {
      const std::string expected = key == "down_block_types" ? "DownEncoderBlock2D" : "UpDecoderBlock2D";
      if (!v.is_array()) config_error(source, key, "should be a list, got " + v.dump());
      for (const json& item : v)
        if (item != expected) config_error(source, key, "has " + item.dump() + "; only \"" + expected + "\" is implemented");
    } else if (key == "act_fn") {
      if (v != "silu") config_error(source, key, "is " + v.dump() + "; only \"silu\" is implemented");
    } else if (key == "latents_mean" || key == "latents_std" || key == "shift_factor") {
      // SD3/Flux-style latent normalization: not part of SDXL's VAE.
      if (!v.is_null()) config_error(source, key, "is " + v.dump() + "; only null (SDXL) is implemented");
    } else {
      config_error(source, key, "is not an AutoencoderKL option this model implements (value " + v.dump() + ")");
    }
  }
  const auto levels = c.block_out_channels.size();
  if (doc["down_block_types"].size() != levels || doc["up_block_types"].size() != levels)
    config_error(source, "down_block_types", "and \"up_block_types\" should have one entry per block_out_channels entry (" +
                                                 std::to_string(levels) + ")");
  for (std::int64_t ch : c.block_out_channels)
    if (ch % c.norm_num_groups != 0)
      config_error(source, "norm_num_groups", "(" + std::to_string(c.norm_num_groups) + ") does not divide block_out_channels entry " +
                                                  std::to_string(ch));
  return c;
}

VaeConfig VaeConfig::sdxl() {
  VaeConfig c;
  c.block_out_channels = {128, 256, 512, 512};
  c.layers_per_block = 2;
  c.latent_channels = 4;
  c.norm_num_groups = 32;
  c.scaling_factor = 0.13025;
  c.force_upcast = true;
  c.sample_size = 1024;
  return c;
}

// ---------------------------------------------------------------- layers

namespace {

torch::nn::Conv2d conv(std::int64_t in, std::int64_t out, std::int64_t kernel, std::int64_t stride = 1,
                       std::int64_t padding = -1) {
  if (padding < 0) padding = kernel / 2;
  return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, kernel).stride(stride).padding(padding));
}

torch::nn::GroupNorm group_norm(std::int64_t groups, std::int64_t channels) {
  return torch::nn::GroupNorm(torch::nn::GroupNormOptions(groups, channels).eps(kVaeNormEps));
}

// GroupNorm with its statistics in fp32 for reduced-precision activations
// (LibTorch's CPU kernels do not all take bf16; the result is rounded once).
Tensor apply_norm(const torch::nn::GroupNorm& norm, const Tensor& x) {
  const auto& o = norm->options;
  if (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kFloat64)
    return torch::group_norm(x, o.num_groups(), norm->weight, norm->bias, o.eps());
  return torch::group_norm(x.to(torch::kFloat32), o.num_groups(), norm->weight.to(torch::kFloat32),
                           norm->bias.to(torch::kFloat32), o.eps())
      .to(x.scalar_type());
}

}  // namespace

/// diffusers' ResnetBlock2D without a time embedding (temb_channels None).
class VaeResnetBlock : public torch::nn::Module {
 public:
  VaeResnetBlock(std::int64_t in, std::int64_t out, std::int64_t groups) {
    norm1_ = register_module("norm1", group_norm(groups, in));
    conv1_ = register_module("conv1", conv(in, out, 3));
    norm2_ = register_module("norm2", group_norm(groups, out));
    conv2_ = register_module("conv2", conv(out, out, 3));
    if (in != out) conv_shortcut_ = register_module("conv_shortcut", conv(in, out, 1));
  }
  Tensor forward(const Tensor& x) {
    Tensor h = conv1_->forward(torch::silu(apply_norm(norm1_, x)));
    h = conv2_->forward(torch::silu(apply_norm(norm2_, h)));
    return (conv_shortcut_ ? conv_shortcut_->forward(x) : x) + h;
  }

 private:
  torch::nn::GroupNorm norm1_{nullptr}, norm2_{nullptr};
  torch::nn::Conv2d conv1_{nullptr}, conv2_{nullptr}, conv_shortcut_{nullptr};
};

/// diffusers' Attention as the VAE's mid block builds it: one head over all
/// channels, q/k/v/out projections with bias, GroupNorm first, residual added.
class VaeAttention : public torch::nn::Module {
 public:
  VaeAttention(std::int64_t channels, std::int64_t groups) {
    group_norm_ = register_module("group_norm", group_norm(groups, channels));
    to_q_ = register_module("to_q", torch::nn::Linear(channels, channels));
    to_k_ = register_module("to_k", torch::nn::Linear(channels, channels));
    to_v_ = register_module("to_v", torch::nn::Linear(channels, channels));
    to_out_ = register_module("to_out", torch::nn::Sequential(torch::nn::Linear(channels, channels)));
  }
  Tensor forward(const Tensor& x) {
    const auto b = x.size(0), c = x.size(1), h = x.size(2), w = x.size(3);
    Tensor t = apply_norm(group_norm_, x).view({b, c, h * w}).transpose(1, 2);  // [B, HW, C]
    Tensor q = to_q_->forward(t), k = to_k_->forward(t), v = to_v_->forward(t);
    const double scale = 1.0 / std::sqrt(static_cast<double>(c));
    Tensor scores = torch::matmul(q, k.transpose(1, 2)) * scale;
    // Softmax in fp32 for reduced precision, as diffusers' upcast_softmax.
    Tensor probs = torch::softmax(scores, -1, torch::kFloat32).to(q.scalar_type());
    Tensor out = to_out_->forward(torch::matmul(probs, v));
    return out.transpose(1, 2).reshape({b, c, h, w}) + x;
  }

 private:
  torch::nn::GroupNorm group_norm_{nullptr};
  torch::nn::Linear to_q_{nullptr}, to_k_{nullptr}, to_v_{nullptr};
  torch::nn::Sequential to_out_{nullptr};
};

namespace {

// A ModuleList of resnets registered as "resnets", kept typed for forward().
std::vector<std::shared_ptr<VaeResnetBlock>> register_resnets(torch::nn::Module& parent, std::int64_t in,
                                                              std::int64_t out, std::int64_t count,
                                                              std::int64_t groups) {
  std::vector<std::shared_ptr<VaeResnetBlock>> blocks;
  auto list = torch::nn::ModuleList();
  for (std::int64_t i = 0; i < count; ++i) {
    blocks.push_back(std::make_shared<VaeResnetBlock>(i == 0 ? in : out, out, groups));
    list->push_back(blocks.back());
  }
  parent.register_module("resnets", list);
  return blocks;
}

// A one-element ModuleList named `name` holding `module` (diffusers'
// "downsamplers.0", "upsamplers.0", "attentions.0").
template <typename M>
void register_single(torch::nn::Module& parent, const std::string& name, std::shared_ptr<M> module) {
  auto list = torch::nn::ModuleList();
  list->push_back(module);
  parent.register_module(name, list);
}

/// Downsample2D / Upsample2D with use_conv: a module holding "conv".
class Resample : public torch::nn::Module {
 public:
  Resample(std::int64_t channels, bool down) : down_(down) {
    conv_ = register_module("conv", down ? conv(channels, channels, 3, 2, 0) : conv(channels, channels, 3));
  }
  Tensor forward(const Tensor& x) {
    if (down_) return conv_->forward(torch::constant_pad_nd(x, {0, 1, 0, 1}, 0));  // diffusers pads right/bottom
    namespace F = torch::nn::functional;
    return conv_->forward(F::interpolate(
        x, F::InterpolateFuncOptions().scale_factor(std::vector<double>{2.0, 2.0}).mode(torch::kNearest)));
  }

 private:
  bool down_;
  torch::nn::Conv2d conv_{nullptr};
};

}  // namespace

/// UNetMidBlock2D: resnet, (attention), resnet.
class VaeMidBlock : public torch::nn::Module {
 public:
  VaeMidBlock(std::int64_t channels, std::int64_t groups, bool attention) {
    resnets_ = register_resnets(*this, channels, channels, 2, groups);
    if (attention) {
      attention_ = std::make_shared<VaeAttention>(channels, groups);
      register_single(*this, "attentions", attention_);
    }
  }
  Tensor forward(const Tensor& x) {
    Tensor h = resnets_[0]->forward(x);
    if (attention_) h = attention_->forward(h);
    return resnets_[1]->forward(h);
  }

 private:
  std::vector<std::shared_ptr<VaeResnetBlock>> resnets_;
  std::shared_ptr<VaeAttention> attention_;
};

/// DownEncoderBlock2D (down = true) or UpDecoderBlock2D.
class VaeLevel : public torch::nn::Module {
 public:
  VaeLevel(std::int64_t in, std::int64_t out, std::int64_t layers, std::int64_t groups, bool down, bool resample) {
    resnets_ = register_resnets(*this, in, out, layers, groups);
    if (resample) {
      resample_ = std::make_shared<Resample>(out, down);
      register_single(*this, down ? "downsamplers" : "upsamplers", resample_);
    }
  }
  Tensor forward(Tensor x) {
    for (auto& r : resnets_) x = r->forward(x);
    return resample_ ? resample_->forward(x) : x;
  }

 private:
  std::vector<std::shared_ptr<VaeResnetBlock>> resnets_;
  std::shared_ptr<Resample> resample_;
};

/// diffusers' Encoder (double_z): images -> 2 * latent_channels moments.
class VaeEncoder : public torch::nn::Module {
 public:
  explicit VaeEncoder(const VaeConfig& c) {
    const auto& ch = c.block_out_channels;
    const std::int64_t groups = c.norm_num_groups;
    conv_in_ = register_module("conv_in", conv(c.in_channels, ch[0], 3));
    auto list = torch::nn::ModuleList();
    for (std::size_t i = 0; i < ch.size(); ++i) {
      levels_.push_back(std::make_shared<VaeLevel>(i == 0 ? ch[0] : ch[i - 1], ch[i], c.layers_per_block, groups,
                                                   /*down=*/true, /*resample=*/i + 1 < ch.size()));
      list->push_back(levels_.back());
    }
    register_module("down_blocks", list);
    mid_ = register_module("mid_block", std::make_shared<VaeMidBlock>(ch.back(), groups, c.mid_block_add_attention));
    norm_out_ = register_module("conv_norm_out", group_norm(groups, ch.back()));
    conv_out_ = register_module("conv_out", conv(ch.back(), 2 * c.latent_channels, 3));
  }
  Tensor forward(const Tensor& x) {
    Tensor h = conv_in_->forward(x);
    for (auto& level : levels_) h = level->forward(h);
    h = mid_->forward(h);
    return conv_out_->forward(torch::silu(apply_norm(norm_out_, h)));
  }

 private:
  torch::nn::Conv2d conv_in_{nullptr}, conv_out_{nullptr};
  std::vector<std::shared_ptr<VaeLevel>> levels_;
  std::shared_ptr<VaeMidBlock> mid_;
  torch::nn::GroupNorm norm_out_{nullptr};
};

/// diffusers' Decoder: latents -> images. Up levels run over the channels
/// reversed, each with layers_per_block + 1 resnets.
class VaeDecoder : public torch::nn::Module {
 public:
  explicit VaeDecoder(const VaeConfig& c) {
    std::vector<std::int64_t> ch(c.block_out_channels.rbegin(), c.block_out_channels.rend());
    const std::int64_t groups = c.norm_num_groups;
    conv_in_ = register_module("conv_in", conv(c.latent_channels, ch[0], 3));
    mid_ = register_module("mid_block", std::make_shared<VaeMidBlock>(ch[0], groups, c.mid_block_add_attention));
    auto list = torch::nn::ModuleList();
    for (std::size_t i = 0; i < ch.size(); ++i) {
      levels_.push_back(std::make_shared<VaeLevel>(i == 0 ? ch[0] : ch[i - 1], ch[i], c.layers_per_block + 1, groups,
                                                   /*down=*/false, /*resample=*/i + 1 < ch.size()));
      list->push_back(levels_.back());
    }
    register_module("up_blocks", list);
    norm_out_ = register_module("conv_norm_out", group_norm(groups, ch.back()));
    conv_out_ = register_module("conv_out", conv(ch.back(), c.out_channels, 3));
  }
  Tensor forward(const Tensor& z) {
    Tensor h = mid_->forward(conv_in_->forward(z));
    for (auto& level : levels_) h = level->forward(h);
    return conv_out_->forward(torch::silu(apply_norm(norm_out_, h)));
  }

 private:
  torch::nn::Conv2d conv_in_{nullptr}, conv_out_{nullptr};
  std::vector<std::shared_ptr<VaeLevel>> levels_;
  std::shared_ptr<VaeMidBlock> mid_;
  torch::nn::GroupNorm norm_out_{nullptr};
};

// ---------------------------------------------------------------- model

Tensor LatentDistribution::sample(torch::Generator generator) const {
  // Drawn in fp32 whatever the model's dtype, so a seed gives the same noise
  // to an fp32 and a bf16 VAE; `generator` must live on mean's device.
  const Tensor noise = torch::randn(mean.sizes(), generator, mean.options().dtype(torch::kFloat32));
  return mean + std() * noise.to(mean.scalar_type());
}

namespace {

torch::ScalarType vae_compute_dtype(const VaeConfig& config, torch::ScalarType requested) {
  if (requested != torch::kFloat32 && requested != torch::kBFloat16 && requested != torch::kFloat16)
    ZERO_THROW(zero::InvalidArgument, "the VAE runs in float32, bfloat16 or float16 (with force_upcast false), not ",
               c10::toString(requested));
  // SDXL's VAE overflows fp16 in its decoder: diffusers then runs it in fp32.
  if (requested == torch::kFloat16 && config.force_upcast) return torch::kFloat32;
  return requested;
}

}  // namespace

AutoencoderKLImpl::AutoencoderKLImpl(VaeConfig config, torch::TensorOptions options)
    : config_(std::move(config)),
      compute_dtype_(vae_compute_dtype(config_, options.has_dtype() ? c10::typeMetaToScalarType(options.dtype())
                                                                    : torch::kFloat32)) {
  ZERO_CHECK(!config_.block_out_channels.empty(), "VAE config: block_out_channels is empty");
  encoder_ = register_module("encoder", std::make_shared<VaeEncoder>(config_));
  decoder_ = register_module("decoder", std::make_shared<VaeDecoder>(config_));
  const std::int64_t z = config_.latent_channels;
  if (config_.use_quant_conv) quant_conv_ = register_module("quant_conv", conv(2 * z, 2 * z, 1));
  if (config_.use_post_quant_conv) post_quant_conv_ = register_module("post_quant_conv", conv(z, z, 1));
  to(options.device(), compute_dtype_);
}

LatentDistribution AutoencoderKLImpl::encode(const Tensor& images) {
  ZERO_CHECK(images.dim() == 4 && images.size(1) == config_.in_channels, "VAE encode: images should be [B, ",
             config_.in_channels, ", H, W], got ", images.sizes());
  Tensor moments = encoder_->forward(images.to(compute_dtype_));
  if (quant_conv_) moments = quant_conv_->forward(moments);
  auto halves = moments.chunk(2, 1);
  return {halves[0], torch::clamp(halves[1], -30.0, 20.0)};
}

Tensor AutoencoderKLImpl::decode(const Tensor& latents) {
  ZERO_CHECK(latents.dim() == 4 && latents.size(1) == config_.latent_channels, "VAE decode: latents should be [B, ",
             config_.latent_channels, ", h, w], got ", latents.sizes());
  Tensor z = latents.to(compute_dtype_);
  if (post_quant_conv_) z = post_quant_conv_->forward(z);
  return decoder_->forward(z);
}

// ---------------------------------------------------------------- loading

namespace {

// Checkpoints saved before diffusers 0.14 name the attention projections
// query/key/value/proj_attn; diffusers renames them on load, and so do we.
std::string vae_module_name(const std::string& stored) {
  static const std::pair<const char*, const char*> kRenames[] = {
      {".query.", ".to_q."}, {".key.", ".to_k."}, {".value.", ".to_v."}, {".proj_attn.", ".to_out.0."}};
  if (stored.find(".attentions.") == std::string::npos) return stored;
  for (const auto& [from, to] : kRenames) {
    const auto at = stored.find(from);
    if (at != std::string::npos) return stored.substr(0, at) + to + stored.substr(at + std::strlen(from));
  }
  return stored;
}

fs::path vae_folder(const fs::path& path) {
  if (fs::is_regular_file(path / "model_index.json")) return PipelineFolder::open(path).component("vae", "AutoencoderKL");
  return path;
}

// ldm name (after "first_stage_model.") -> diffusers name; "" when it has
// none, and the name itself when it is not recognised (reported as unexpected).
std::string original_vae_name(const std::string& name, std::size_t levels) {
  std::vector<std::string> p;
  for (std::size_t start = 0;;) {
    const auto dot = name.find('.', start);
    p.push_back(name.substr(start, dot - start));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  auto join_from = [&](std::size_t from) {
    std::string out;
    for (std::size_t i = from; i < p.size(); ++i) out += (out.empty() ? "" : ".") + p[i];
    return out;
  };
  auto resnet_tail = [&](std::size_t from) {
    std::string tail = join_from(from);
    if (tail.rfind("nin_shortcut.", 0) == 0) tail = "conv_shortcut." + tail.substr(13);
    return tail;
  };
  auto level_index = [&](const std::string& text, bool reversed) -> std::string {
    std::size_t i = 0;
    try {
      i = std::stoul(text);
    } catch (const std::exception&) {
      return "";
    }
    if (i >= levels) return "";
    return std::to_string(reversed ? levels - 1 - i : i);
  };
  if (p.size() < 3 || (p[0] != "encoder" && p[0] != "decoder")) return name;
  const std::string& part = p[0];
  if (p[1] == "norm_out") return part + ".conv_norm_out." + join_from(2);
  if (p[1] == "conv_in" || p[1] == "conv_out") return name;
  if (p[1] == "mid" && p.size() >= 4) {
    if (p[2] == "block_1") return part + ".mid_block.resnets.0." + resnet_tail(3);
    if (p[2] == "block_2") return part + ".mid_block.resnets.1." + resnet_tail(3);
    if (p[2] == "attn_1") {
      static const std::map<std::string, std::string> kAttn = {
          {"norm", "group_norm"}, {"q", "to_q"}, {"k", "to_k"}, {"v", "to_v"}, {"proj_out", "to_out.0"}};
      auto it = kAttn.find(p[3]);
      if (it != kAttn.end()) return part + ".mid_block.attentions.0." + it->second + "." + join_from(4);
    }
    return name;
  }
  const bool down = part == "encoder" && p[1] == "down", up = part == "decoder" && p[1] == "up";
  if ((down || up) && p.size() >= 5) {
    const std::string level = level_index(p[2], /*reversed=*/up);
    if (level.empty()) return name;
    const std::string block = part + (down ? ".down_blocks." : ".up_blocks.") + level;
    if (p[3] == "block") return block + ".resnets." + p[4] + "." + resnet_tail(5);
    if (p[3] == (down ? "downsample" : "upsample") && p[4] == "conv")
      return block + (down ? ".downsamplers.0.conv." : ".upsamplers.0.conv.") + join_from(5);
  }
  return name;
}

}  // namespace

AutoencoderKL load_vae_from_single_file(const fs::path& file, torch::TensorOptions options, const VaeConfig& config) {
  static const std::string kPrefix = "first_stage_model.";
  WeightSet weights = WeightSet::open({file}, file.string());
  std::vector<TensorSource> sources;
  for (const auto& [stored, location] : weights.tensors) {
    if (stored.rfind(kPrefix, 0) != 0) continue;  // the UNet and text encoders
    const zero::io::TensorInfo& info = *location.second;
    TensorSource source{original_vae_name(stored.substr(kPrefix.size()), config.block_out_channels.size()), stored,
                        info.shape, info.dtype, [&weights, stored = stored] { return weights.read(stored); }};
    // ldm's attention projections are 1x1 convolutions: [C, C, 1, 1] -> [C, C].
    if (source.module_name.find(".attentions.0.to_") != std::string::npos && info.shape.size() == 4 &&
        info.shape[2] == 1 && info.shape[3] == 1) {
      source.shape = {info.shape[0], info.shape[1]};
      source.read = [&weights, stored = stored] { return weights.read(stored).flatten(1); };
    }
    sources.push_back(std::move(source));
  }
  if (sources.empty())
    ZERO_THROW(zero::IoError, "'", file.string(), "' holds no VAE: no tensor starts with \"", kPrefix, "\"");
  AutoencoderKL model(config, options);
  load_tensor_sources(*model, sources, "VAE", file.string());
  model->eval();
  return model;
}

AutoencoderKL load_vae(const fs::path& path, torch::TensorOptions options, WeightVariant variant) {
  const fs::path dir = vae_folder(path);
  const fs::path config_path = dir / "config.json";
  VaeConfig config = VaeConfig::from_json(read_config_text(config_path), config_path.string());
  WeightSet weights = WeightSet::open(component_weight_files(dir, "diffusion_pytorch_model", variant), dir.string());
  AutoencoderKL model(config, options);
  load_named_tensors(*model, weights, "VAE", vae_module_name);
  model->eval();
  return model;
}

}  // namespace sdxl
