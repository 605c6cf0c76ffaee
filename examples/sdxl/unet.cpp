// The SDXL UNet's building blocks and their composition.
//
// Layout mirrors diffusers so that named_parameters() yields diffusers'
// state-dict names in diffusers' order: each module registers its parameters
// and children in the order diffusers' __init__ assigns them (e.g. a
// CrossAttnDownBlock2D registers "attentions" before "resnets").
//
// The leaf layers are in unet_layers.hpp, the attention side (Attention up to
// Transformer2DModel) in unet_transformer.hpp, activation checkpointing in
// activation_checkpoint.cpp.

#include "unet.hpp"

#include <algorithm>
#include <cmath>

#include "activation_checkpoint.hpp"
#include "unet_layers.hpp"
#include "unet_transformer.hpp"
#include "zero/core/error.hpp"
#include "zero/core/name_patterns.hpp"

namespace sdxl {

using torch::Tensor;
using torch::autograd::variable_list;

// ---------------------------------------------------------------- embeddings

Tensor timestep_features(const Tensor& timesteps, std::int64_t dim, bool flip_sin_to_cos,
                         double downscale_freq_shift) {
  ZERO_CHECK(timesteps.dim() == 1, "timestep_features: expected a 1-d tensor of timesteps, got ",
             timesteps.dim(), " dimensions");
  const std::int64_t half = dim / 2;
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(timesteps.device());
  // Same operation order as diffusers (exponent scaled, then exp) so that the
  // float32 rounding matches its reference output.
  Tensor exponent = torch::arange(0, half, f32) * (-std::log(10000.0));
  exponent = exponent / (static_cast<double>(half) - downscale_freq_shift);
  Tensor args = timesteps.to(torch::kFloat32).unsqueeze(1) * torch::exp(exponent).unsqueeze(0);
  Tensor emb = flip_sin_to_cos ? torch::cat({torch::cos(args), torch::sin(args)}, -1)
                               : torch::cat({torch::sin(args), torch::cos(args)}, -1);
  if (dim % 2 == 1) emb = torch::constant_pad_nd(emb, {0, 1, 0, 0});
  return emb;
}

/// diffusers' TimestepEmbedding: linear_1 -> SiLU -> linear_2.
class TimestepEmbedding : public torch::nn::Module {
 public:
  TimestepEmbedding(std::int64_t in, std::int64_t dim, const ParamFactory& f) {
    linear_1_ = register_module("linear_1", std::make_shared<Linear>(in, dim, true, f));
    linear_2_ = register_module("linear_2", std::make_shared<Linear>(dim, dim, true, f));
  }
  Tensor forward(const Tensor& x) const { return linear_2_->forward(torch::silu(linear_1_->forward(x))); }

 private:
  std::shared_ptr<Linear> linear_1_, linear_2_;
};

// ---------------------------------------------------------------- resnet

/// diffusers' ResnetBlock2D with time_embedding_norm "default": the projected
/// time embedding is added between conv1 and norm2; a 1x1 conv_shortcut
/// appears only when the channel count changes.
class ResnetBlock2D : public torch::nn::Module {
 public:
  ResnetBlock2D(std::int64_t in, std::int64_t out, std::int64_t temb_channels, std::int64_t groups, double eps,
                double output_scale_factor, const ParamFactory& f)
      : output_scale_factor_(output_scale_factor) {
    norm1_ = register_module("norm1", std::make_shared<GroupNorm>(groups, in, eps, f));
    conv1_ = register_module("conv1", std::make_shared<Conv2d>(in, out, 3, 1, 1, f));
    time_emb_proj_ = register_module("time_emb_proj", std::make_shared<Linear>(temb_channels, out, true, f));
    norm2_ = register_module("norm2", std::make_shared<GroupNorm>(groups, out, eps, f));
    conv2_ = register_module("conv2", std::make_shared<Conv2d>(out, out, 3, 1, 1, f));
    if (in != out) conv_shortcut_ = register_module("conv_shortcut", std::make_shared<Conv2d>(in, out, 1, 1, 0, f));
  }

  Tensor forward(const Tensor& x, const Tensor& temb) const {
    Tensor h = conv1_->forward(norm1_->forward_silu(x));
    h = h + time_emb_proj_->forward(torch::silu(temb)).unsqueeze(-1).unsqueeze(-1);
    h = conv2_->forward(norm2_->forward_silu(h));
    Tensor shortcut = conv_shortcut_ ? conv_shortcut_->forward(x) : x;
    Tensor out = shortcut + h;
    // Division by 1.0 is exact; skip it to save a pass over the activations.
    return output_scale_factor_ == 1.0 ? out : out / output_scale_factor_;
  }

 private:
  double output_scale_factor_;
  std::shared_ptr<GroupNorm> norm1_, norm2_;
  std::shared_ptr<Conv2d> conv1_, conv2_, conv_shortcut_;
  std::shared_ptr<Linear> time_emb_proj_;
};

// ---------------------------------------------------------------- down / mid / up blocks

namespace {

struct BlockCommon {
  std::int64_t temb_channels;
  std::int64_t groups;
  double eps;
  bool linear_projection;
  bool upcast;
};

}  // namespace

namespace {

// The layer units of a down or up block: resnet i, then attention i's
// transformer layers, for each i; then the resampler's convolution
// ("<prefix>.<samplers>.0"), if any.
void add_level_units(const std::string& prefix, const std::vector<std::shared_ptr<ResnetBlock2D>>& resnets,
                     const std::vector<std::shared_ptr<Transformer2DModel>>& attentions, const char* samplers,
                     const std::shared_ptr<Conv2d>& sampler, std::vector<ParameterUnit>& units) {
  for (std::size_t i = 0; i < resnets.size(); ++i) {
    const std::string resnet = prefix + ".resnets." + std::to_string(i);
    add_unit(units, resnet, {{resnet, resnets[i]}});
    if (!attentions.empty()) attentions[i]->add_units(prefix + ".attentions." + std::to_string(i), units);
  }
  if (sampler) {
    const std::string name = prefix + "." + samplers + ".0";
    add_unit(units, name, {{name + ".conv", sampler}});
  }
}

}  // namespace

/// DownBlock2D and CrossAttnDownBlock2D: resnets (each followed by a
/// Transformer2DModel when with_attention) and an optional stride-2 conv.
class DownBlock : public torch::nn::Module {
 public:
  DownBlock(std::int64_t in, const LevelSpec& spec, bool with_attention, bool add_downsample, const BlockCommon& c,
            const ParamFactory& f) {
    // Attributes are registered in diffusers' order: attentions, resnets, downsamplers.
    std::shared_ptr<torch::nn::Module> attentions = with_attention ? register_module("attentions", make_container())
                                                                  : nullptr;
    auto resnets = register_module("resnets", make_container());
    for (std::int64_t i = 0; i < spec.num_layers; ++i) {
      const std::string idx = std::to_string(i);
      resnets_.push_back(resnets->register_module(
          idx, std::make_shared<ResnetBlock2D>(i == 0 ? in : spec.channels, spec.channels, c.temb_channels,
                                               c.groups, c.eps, 1.0, f)));
      if (with_attention) {
        attentions_.push_back(attentions->register_module(
            idx, std::make_shared<Transformer2DModel>(spec.channels, spec.num_heads, spec.transformer_layers,
                                                      spec.cross_attention_dim, c.groups, c.linear_projection,
                                                      c.upcast, f)));
      }
    }
    if (add_downsample) {
      auto downsamplers = register_module("downsamplers", make_container());
      auto op = downsamplers->register_module("0", make_container());  // diffusers' Downsample2D
      downsample_ = op->register_module("conv", std::make_shared<Conv2d>(spec.channels, spec.channels, 3, 2, 1, f));
    }
  }

  /// Returns the skip connections for the up path; the last one is the
  /// block's output. run: each layer as its own unit (layer granularity).
  variable_list forward(Tensor x, const Tensor& temb, const Tensor& context, const LayerRunner* run = nullptr) const {
    variable_list outputs;
    for (std::size_t i = 0; i < resnets_.size(); ++i) {
      x = run_layer(run, {x, temb}, [r = resnets_[i].get()](const variable_list& in) {
        return variable_list{r->forward(in[0], in[1])};
      });
      if (!attentions_.empty()) x = attentions_[i]->forward(x, context, run);
      outputs.push_back(x);
    }
    if (downsample_) {
      x = run_layer(run, {x}, [conv = downsample_.get()](const variable_list& in) {
        return variable_list{conv->forward(in[0])};
      });
      outputs.push_back(x);
    }
    return outputs;
  }

  /// The units forward(..., run) runs, in that order.
  void add_units(const std::string& prefix, std::vector<ParameterUnit>& units) const {
    add_level_units(prefix, resnets_, attentions_, "downsamplers", downsample_, units);
  }

 private:
  std::vector<std::shared_ptr<ResnetBlock2D>> resnets_;
  std::vector<std::shared_ptr<Transformer2DModel>> attentions_;
  std::shared_ptr<Conv2d> downsample_;
};

/// UNetMidBlock2DCrossAttn: resnet, then (attention, resnet) per layer.
class MidBlock : public torch::nn::Module {
 public:
  MidBlock(const LevelSpec& spec, double output_scale_factor, const BlockCommon& c, const ParamFactory& f) {
    auto attentions = register_module("attentions", make_container());
    auto resnets = register_module("resnets", make_container());
    auto resnet = [&] {
      return std::make_shared<ResnetBlock2D>(spec.channels, spec.channels, c.temb_channels, c.groups, c.eps,
                                             output_scale_factor, f);
    };
    resnets_.push_back(resnets->register_module("0", resnet()));
    for (std::int64_t i = 0; i < spec.num_layers; ++i) {
      attentions_.push_back(attentions->register_module(
          std::to_string(i), std::make_shared<Transformer2DModel>(spec.channels, spec.num_heads,
                                                                  spec.transformer_layers, spec.cross_attention_dim,
                                                                  c.groups, c.linear_projection, c.upcast, f)));
      resnets_.push_back(resnets->register_module(std::to_string(i + 1), resnet()));
    }
  }

  Tensor forward(Tensor x, const Tensor& temb, const Tensor& context, const LayerRunner* run = nullptr) const {
    auto resnet = [&](std::size_t i, const Tensor& in) {
      return run_layer(run, {in, temb}, [r = resnets_[i].get()](const variable_list& a) {
        return variable_list{r->forward(a[0], a[1])};
      });
    };
    x = resnet(0, x);
    for (std::size_t i = 0; i < attentions_.size(); ++i) {
      x = attentions_[i]->forward(x, context, run);
      x = resnet(i + 1, x);
    }
    return x;
  }

  void add_units(const std::string& prefix, std::vector<ParameterUnit>& units) const {
    add_unit(units, prefix + ".resnets.0", {{prefix + ".resnets.0", resnets_[0]}});
    for (std::size_t i = 0; i < attentions_.size(); ++i) {
      attentions_[i]->add_units(prefix + ".attentions." + std::to_string(i), units);
      const std::string r = prefix + ".resnets." + std::to_string(i + 1);
      add_unit(units, r, {{r, resnets_[i + 1]}});
    }
  }

 private:
  std::vector<std::shared_ptr<ResnetBlock2D>> resnets_;
  std::vector<std::shared_ptr<Transformer2DModel>> attentions_;
};

/// UpBlock2D and CrossAttnUpBlock2D: each resnet takes the running features
/// concatenated with one skip connection (consumed last-first), then optional
/// attention; finally nearest x2 upsampling and a conv.
class UpBlock : public torch::nn::Module {
 public:
  /// skip_channels[i]: channels of the skip connection resnet i consumes.
  UpBlock(std::int64_t prev_channels, const std::vector<std::int64_t>& skip_channels, const LevelSpec& spec,
          bool with_attention, bool add_upsample, const BlockCommon& c, const ParamFactory& f) {
    std::shared_ptr<torch::nn::Module> attentions = with_attention ? register_module("attentions", make_container())
                                                                  : nullptr;
    auto resnets = register_module("resnets", make_container());
    for (std::int64_t i = 0; i < spec.num_layers; ++i) {
      const std::string idx = std::to_string(i);
      const std::int64_t in = (i == 0 ? prev_channels : spec.channels) + skip_channels[i];
      resnets_.push_back(resnets->register_module(
          idx, std::make_shared<ResnetBlock2D>(in, spec.channels, c.temb_channels, c.groups, c.eps, 1.0, f)));
      if (with_attention) {
        attentions_.push_back(attentions->register_module(
            idx, std::make_shared<Transformer2DModel>(spec.channels, spec.num_heads, spec.transformer_layers,
                                                      spec.cross_attention_dim, c.groups, c.linear_projection,
                                                      c.upcast, f)));
      }
    }
    if (add_upsample) {
      auto upsamplers = register_module("upsamplers", make_container());
      auto up = upsamplers->register_module("0", make_container());  // diffusers' Upsample2D
      upsample_conv_ = up->register_module("conv", std::make_shared<Conv2d>(spec.channels, spec.channels, 3, 1, 1, f));
    }
  }

  std::size_t num_resnets() const { return resnets_.size(); }

  /// skips: this block's skip connections in the order the down path made
  /// them; consumed from the back. upsample_size: explicit output size when
  /// the input size is not a multiple of 2^(levels-1); empty = x2.
  /// run: each layer as its own unit (layer granularity); a resnet's unit
  /// includes the concatenation with its skip connection.
  Tensor forward(Tensor x, const variable_list& skips, const Tensor& temb, const Tensor& context,
                 const std::vector<std::int64_t>& upsample_size, const LayerRunner* run = nullptr) const {
    for (std::size_t i = 0; i < resnets_.size(); ++i) {
      x = run_layer(run, {x, skips[skips.size() - 1 - i], temb}, [r = resnets_[i].get()](const variable_list& in) {
        return variable_list{r->forward(torch::cat({in[0], in[1]}, 1), in[2])};
      });
      if (!attentions_.empty()) x = attentions_[i]->forward(x, context, run);
    }
    if (upsample_conv_) {
      x = run_layer(run, {x}, [conv = upsample_conv_.get(), upsample_size](const variable_list& in) {
        namespace F = torch::nn::functional;
        const Tensor& h = in[0];
        std::vector<std::int64_t> size =
            upsample_size.empty() ? std::vector<std::int64_t>{2 * h.size(2), 2 * h.size(3)} : upsample_size;
        return variable_list{conv->forward(F::interpolate(h, F::InterpolateFuncOptions().size(size).mode(torch::kNearest)))};
      });
    }
    return x;
  }

  /// The units forward(..., run) runs, in that order.
  void add_units(const std::string& prefix, std::vector<ParameterUnit>& units) const {
    add_level_units(prefix, resnets_, attentions_, "upsamplers", upsample_conv_, units);
  }

 private:
  std::vector<std::shared_ptr<ResnetBlock2D>> resnets_;
  std::vector<std::shared_ptr<Transformer2DModel>> attentions_;
  std::shared_ptr<Conv2d> upsample_conv_;
};

// ---------------------------------------------------------------- the model

UNet2DConditionModelImpl::UNet2DConditionModelImpl(UNetConfig config, UNetBuildOptions options)
    : config_(std::move(config)),
      activation_checkpointing_(options.activation_checkpointing),
      unit_granularity_(options.units) {
  config_.validate();
  const UNetConfig& cfg = config_;
  const ParamFactory f{options.tensor_options, options.initialize};
  const std::size_t levels = cfg.num_levels();
  const std::int64_t temb = cfg.time_embed_dim();
  const BlockCommon common{temb, cfg.norm_num_groups, cfg.norm_eps, cfg.use_linear_projection, cfg.upcast_attention};

  // Registration order = diffusers' state-dict order: conv_in, time_embedding,
  // add_embedding, down_blocks, up_blocks, mid_block, conv_norm_out, conv_out.
  const std::int64_t c0 = cfg.block_out_channels[0];
  conv_in_ = register_module(
      "conv_in", std::make_shared<Conv2d>(cfg.in_channels, c0, cfg.conv_in_kernel, 1, (cfg.conv_in_kernel - 1) / 2, f));
  time_embedding_ = register_module("time_embedding", std::make_shared<TimestepEmbedding>(c0, temb, f));
  if (cfg.addition_embed_text_time) {
    add_embedding_ = register_module(
        "add_embedding", std::make_shared<TimestepEmbedding>(cfg.projection_class_embeddings_input_dim, temb, f));
  }

  // Skip connections, in the order the down path produces them; the up path
  // consumes them from the back.
  std::vector<std::int64_t> skip_channels{c0};
  auto down_list = register_module("down_blocks", make_container());
  std::int64_t channels = c0;
  for (std::size_t i = 0; i < levels; ++i) {
    const LevelSpec spec = cfg.down_level(i);
    const bool last = i + 1 == levels;
    down_blocks_.push_back(down_list->register_module(
        std::to_string(i),
        std::make_shared<DownBlock>(channels, spec, cfg.down_block_types[i] == DownBlockType::kCrossAttnDown,
                                    !last, common, f)));
    for (std::int64_t l = 0; l < spec.num_layers + (last ? 0 : 1); ++l) skip_channels.push_back(spec.channels);
    channels = spec.channels;
  }

  auto up_list = register_module("up_blocks", make_container());
  for (std::size_t i = 0; i < levels; ++i) {
    const LevelSpec spec = cfg.up_level(i);
    const bool last = i + 1 == levels;
    std::vector<std::int64_t> skips;  // consumption order: from the back of skip_channels
    for (std::int64_t l = 0; l < spec.num_layers; ++l) {
      ZERO_CHECK(!skip_channels.empty(), "UNet config: up block ", i, " needs more skip connections than the down "
                 "path makes (layers_per_block mismatch)");
      skips.push_back(skip_channels.back());
      skip_channels.pop_back();
    }
    up_blocks_.push_back(up_list->register_module(
        std::to_string(i),
        std::make_shared<UpBlock>(channels, skips, spec, cfg.up_block_types[i] == UpBlockType::kCrossAttnUp, !last,
                                  common, f)));
    channels = spec.channels;
  }

  if (cfg.has_mid_block) {
    mid_block_ = register_module("mid_block", std::make_shared<MidBlock>(cfg.mid_level(), cfg.mid_block_scale_factor,
                                                                        common, f));
  }
  conv_norm_out_ = register_module("conv_norm_out", std::make_shared<GroupNorm>(cfg.norm_num_groups, c0,
                                                                                cfg.norm_eps, f));
  conv_out_ = register_module("conv_out", std::make_shared<Conv2d>(c0, cfg.out_channels, cfg.conv_out_kernel, 1,
                                                                   (cfg.conv_out_kernel - 1) / 2, f));
}

Tensor UNet2DConditionModelImpl::time_embedding(const Tensor& sample, const Tensor& timestep,
                                                const Tensor& text_embeds, const Tensor& time_ids) {
  const UNetConfig& cfg = config_;
  const std::int64_t batch = sample.size(0);
  ZERO_CHECK(timestep.defined(), "UNet forward: timestep is required");
  Tensor t = timestep.to(sample.device());
  if (t.dim() == 0) t = t.unsqueeze(0);
  ZERO_CHECK(t.dim() == 1 && (t.size(0) == batch || t.size(0) == 1), "UNet forward: timestep must have shape [",
             batch, "], [1] or [], got ", t.sizes());
  t = t.expand({batch});
  // Sinusoidal features are float32 (as in diffusers), then cast to the model dtype.
  Tensor t_emb = timestep_features(t, cfg.block_out_channels[0], cfg.flip_sin_to_cos, cfg.freq_shift)
                     .to(sample.scalar_type());
  Tensor emb = time_embedding_->forward(t_emb);

  if (add_embedding_) {
    ZERO_CHECK(text_embeds.defined() && time_ids.defined(),
               "UNet forward: addition_embed_type \"text_time\" needs text_embeds and time_ids");
    ZERO_CHECK(text_embeds.dim() == 2 && text_embeds.size(0) == batch, "UNet forward: text_embeds must be [", batch,
               ", P], got ", text_embeds.sizes());
    ZERO_CHECK(time_ids.dim() == 2 && time_ids.size(0) == batch, "UNet forward: time_ids must be [", batch,
               ", K], got ", time_ids.sizes());
    const std::int64_t width = text_embeds.size(1) + time_ids.size(1) * cfg.addition_time_embed_dim;
    ZERO_CHECK(width == cfg.projection_class_embeddings_input_dim, "UNet forward: text_embeds width ",
               text_embeds.size(1), " + time_ids count ", time_ids.size(1), " x addition_time_embed_dim ",
               cfg.addition_time_embed_dim, " = ", width, ", but projection_class_embeddings_input_dim is ",
               cfg.projection_class_embeddings_input_dim);
    Tensor time_embeds =
        timestep_features(time_ids.to(sample.device()).flatten(), cfg.addition_time_embed_dim, cfg.flip_sin_to_cos,
                          cfg.freq_shift)
            .reshape({batch, -1});
    // diffusers concatenates with type promotion (float32 at least) and then
    // casts to the embedding's dtype; do the same.
    Tensor text = text_embeds.to(sample.device());
    const auto cat_dtype = c10::promoteTypes(text.scalar_type(), torch::kFloat32);
    Tensor add_embeds = torch::cat({text.to(cat_dtype), time_embeds.to(cat_dtype)}, -1).to(emb.scalar_type());
    emb = emb + add_embedding_->forward(add_embeds);
  }
  return emb;
}

void UNet2DConditionModelImpl::set_recomputed_units(std::vector<bool> recomputed) {
  const std::size_t count = units().size();
  ZERO_CHECK(recomputed.empty() || recomputed.size() == count, "UNet: the recomputed units are given for ",
             recomputed.size(), " units, the model has ", count, " (", unit_granularity_ == UnitGranularity::layers
                                                                          ? "layers"
                                                                          : "blocks",
             ")");
  recomputed_units_ = std::move(recomputed);
}

Tensor UNet2DConditionModelImpl::forward(const Tensor& sample_in, const Tensor& timestep,
                                         const Tensor& encoder_hidden_states, const Tensor& text_embeds,
                                         const Tensor& time_ids) {
  const UNetConfig& cfg = config_;
  ZERO_CHECK(sample_in.defined() && sample_in.dim() == 4 && sample_in.size(1) == cfg.in_channels,
             "UNet forward: sample must be [B, ", cfg.in_channels, ", H, W], got ",
             sample_in.defined() ? sample_in.sizes() : torch::IntArrayRef{});
  ZERO_CHECK(encoder_hidden_states.defined() && encoder_hidden_states.dim() == 3 &&
                 encoder_hidden_states.size(0) == sample_in.size(0),
             "UNet forward: encoder_hidden_states must be [", sample_in.size(0), ", T, C], got ",
             encoder_hidden_states.defined() ? encoder_hidden_states.sizes() : torch::IntArrayRef{});
  for (std::size_t i = 0; i < cfg.num_levels(); ++i) {
    ZERO_CHECK(encoder_hidden_states.size(2) == cfg.cross_attention_dim[i], "UNet forward: encoder_hidden_states has ",
               encoder_hidden_states.size(2), " features, cross_attention_dim is ", cfg.cross_attention_dim[i]);
  }

  // When H or W is not a multiple of 2^(upsamplers), each upsampler targets
  // the size of the skip connection it meets instead of doubling (diffusers).
  const std::int64_t up_factor = std::int64_t{1} << (cfg.num_levels() - 1);
  const bool forward_upsample_size = sample_in.size(2) % up_factor != 0 || sample_in.size(3) % up_factor != 0;

  // Every unit's computation goes through run(): plain, recomputed in
  // backward (activation checkpointing), or, with a runner installed, wrapped
  // by the caller (ZeRO stage 3 gathers the unit's parameters around it).
  const bool recompute = activation_checkpointing_ && torch::GradMode::is_enabled();
  std::size_t unit = 0;
  auto run = [&](bool checkpointed, const variable_list& inputs, const UnitBody& body) -> variable_list {
    const std::size_t index = unit++;
    if (checkpointed && !recomputed_units_.empty()) checkpointed = recomputed_units_.at(index);
    if (unit_runner_) return unit_runner_(index, inputs, body, checkpointed);
    if (checkpointed) return checkpoint(body, inputs);
    return body(inputs);
  };

  // Unit "embed": time (and text-time) embedding and conv_in.
  variable_list embedded = run(false, {sample_in}, [&](const variable_list& in) {
    Tensor emb = time_embedding(in[0], timestep, text_embeds, time_ids);
    Tensor s = cfg.center_input_sample ? in[0] * 2.0 - 1.0 : in[0];
    if (channels_last_) s = s.contiguous(torch::MemoryFormat::ChannelsLast);  // and so is everything after
    return variable_list{emb, conv_in_->forward(s)};
  });
  const Tensor emb = embedded[0];
  const Tensor& context = encoder_hidden_states;
  Tensor sample = embedded[1];

  // Layer granularity: the blocks run each of their layers through run();
  // block granularity: each block's whole computation is one run().
  const bool per_layer = unit_granularity_ == UnitGranularity::layers;
  const LayerRunner layer_run = [&](const variable_list& in, const Body& body) { return run(recompute, in, body); };
  variable_list skips{sample};
  for (const auto& block : down_blocks_) {
    auto* raw = block.get();
    variable_list outs = per_layer ? raw->forward(sample, emb, context, &layer_run)
                                   : run(recompute, {sample, emb, context},
                                         [raw](const variable_list& in) { return raw->forward(in[0], in[1], in[2]); });
    sample = outs.back();
    skips.insert(skips.end(), outs.begin(), outs.end());
  }

  if (mid_block_) {
    auto* raw = mid_block_.get();
    sample = per_layer ? raw->forward(sample, emb, context, &layer_run)
                       : run(recompute, {sample, emb, context}, [raw](const variable_list& in) {
                           return variable_list{raw->forward(in[0], in[1], in[2])};
                         })[0];
  }

  for (std::size_t i = 0; i < up_blocks_.size(); ++i) {
    const auto& block = up_blocks_[i];
    const std::size_t n = block->num_resnets();
    variable_list block_skips(skips.end() - static_cast<std::ptrdiff_t>(n), skips.end());
    skips.resize(skips.size() - n);
    std::vector<std::int64_t> upsample_size;
    if (i + 1 < up_blocks_.size() && forward_upsample_size) {
      upsample_size = {skips.back().size(2), skips.back().size(3)};
    }
    auto* raw = block.get();
    if (per_layer) {
      sample = raw->forward(sample, block_skips, emb, context, upsample_size, &layer_run);
      continue;
    }
    variable_list in{sample, emb, context};
    in.insert(in.end(), block_skips.begin(), block_skips.end());
    sample = run(recompute, in, [raw, upsample_size](const variable_list& args) {
      variable_list s(args.begin() + 3, args.end());
      return variable_list{raw->forward(args[0], s, args[1], args[2], upsample_size)};
    })[0];
  }

  // Unit "head".
  return run(false, {sample}, [this](const variable_list& in) {
    return variable_list{conv_out_->forward(conv_norm_out_->forward_silu(in[0])).contiguous()};
  })[0];
}

std::vector<std::string> UNet2DConditionModelImpl::add_lora(const LoraOptions& options, torch::Generator generator) {
  ZERO_CHECK(options.rank >= 1, "LoRA: rank must be >= 1, got ", options.rank);
  ZERO_CHECK(std::isfinite(options.alpha) && options.alpha > 0, "LoRA: alpha must be > 0, got ", options.alpha);
  ZERO_CHECK(options.dropout >= 0 && options.dropout < 1, "LoRA: dropout must be in [0, 1), got ", options.dropout);
  ZERO_CHECK(!options.targets.empty(), "LoRA: targets is empty (glob patterns of Linear module names)");
  ZERO_CHECK(lora_modules_.empty(), "LoRA: the model already has adapters");
  std::vector<std::pair<std::string, std::shared_ptr<Linear>>> linears;
  std::vector<std::string> others;  // parameterised leaf layers that are not Linear
  for (const auto& item : named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    if (auto linear = std::dynamic_pointer_cast<Linear>(item.value())) {
      linears.emplace_back(item.key(), linear);
    } else if (std::dynamic_pointer_cast<Conv2d>(item.value())) {
      others.push_back(item.key());
    }
  }
  std::vector<bool> chosen(linears.size(), false);
  for (const std::string& pattern : options.targets) {
    for (const std::string& conv : others)
      ZERO_CHECK(!zero::name_matches(pattern, conv), "LoRA: target '", pattern, "' matches the convolution '", conv,
                 "': LoRA on convolutions is not supported (targets must name Linear layers, e.g. \"*.to_q\")");
    bool used = false;
    for (std::size_t i = 0; i < linears.size(); ++i) {
      if (!zero::name_matches(pattern, linears[i].first)) continue;
      chosen[i] = true;
      used = true;
    }
    ZERO_CHECK(used, "LoRA: target '", pattern, "' matches no Linear layer of the UNet (glob patterns on diffusers "
               "module names such as \"down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q\"; '*' matches dots)");
  }
  const double scale = options.alpha / static_cast<double>(options.rank);
  for (std::size_t i = 0; i < linears.size(); ++i) {
    if (!chosen[i]) continue;
    linears[i].second->add_lora(options.rank, scale, options.dropout, generator);
    lora_modules_.push_back(linears[i].first);
  }
  return lora_modules_;
}

std::vector<ParameterUnit> UNet2DConditionModelImpl::units() const {
  std::vector<ParameterUnit> units;
  NamedModules embed{{"conv_in", conv_in_}, {"time_embedding", time_embedding_}};
  if (add_embedding_) embed.emplace_back("add_embedding", add_embedding_);
  add_unit(units, "embed", embed);
  const bool per_layer = unit_granularity_ == UnitGranularity::layers;
  for (std::size_t i = 0; i < down_blocks_.size(); ++i) {
    const std::string name = "down_blocks." + std::to_string(i);
    if (per_layer) down_blocks_[i]->add_units(name, units);
    else add_unit(units, name, {{name, down_blocks_[i]}});
  }
  if (mid_block_) {
    if (per_layer) mid_block_->add_units("mid_block", units);
    else add_unit(units, "mid_block", {{"mid_block", mid_block_}});
  }
  for (std::size_t i = 0; i < up_blocks_.size(); ++i) {
    const std::string name = "up_blocks." + std::to_string(i);
    if (per_layer) up_blocks_[i]->add_units(name, units);
    else add_unit(units, name, {{name, up_blocks_[i]}});
  }
  add_unit(units, "head", {{"conv_norm_out", conv_norm_out_}, {"conv_out", conv_out_}});
  return units;
}

}  // namespace sdxl
