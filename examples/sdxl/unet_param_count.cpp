// Mirrors the constructors in unet.cpp and unet_transformer.hpp: each helper
// appends the tensors one module registers, in registration order (which is
// named_parameters() order).
#include "unet_param_count.hpp"

#include <algorithm>

#include "sdxl_calibration.hpp"
#include "zero/core/error.hpp"

namespace sdxl {

std::int64_t UnitParameterCount::total() const {
  std::int64_t n = 0;
  for (std::int64_t t : tensors) n += t;
  return n;
}

namespace {

using Tensors = std::vector<std::int64_t>;

void linear(Tensors& t, std::int64_t in, std::int64_t out, bool bias) {
  t.push_back(out * in);
  if (bias) t.push_back(out);
}
void conv(Tensors& t, std::int64_t in, std::int64_t out, std::int64_t kernel) {
  t.push_back(out * in * kernel * kernel);
  t.push_back(out);
}
void norm(Tensors& t, std::int64_t channels) {  // GroupNorm and LayerNorm: weight, bias
  t.push_back(channels);
  t.push_back(channels);
}
void timestep_embedding(Tensors& t, std::int64_t in, std::int64_t dim) {
  linear(t, in, dim, true);
  linear(t, dim, dim, true);
}
void resnet(Tensors& t, std::int64_t in, std::int64_t out, std::int64_t temb) {
  norm(t, in);
  conv(t, in, out, 3);
  linear(t, temb, out, true);
  norm(t, out);
  conv(t, out, out, 3);
  if (in != out) conv(t, in, out, 1);
}
void attention(Tensors& t, std::int64_t query, std::int64_t context) {
  linear(t, query, query, false);    // to_q
  linear(t, context, query, false);  // to_k
  linear(t, context, query, false);  // to_v
  linear(t, query, query, true);     // to_out.0
}
void transformer_block(Tensors& t, std::int64_t dim, std::int64_t cross) {
  norm(t, dim);
  attention(t, dim, dim);
  norm(t, dim);
  attention(t, dim, cross);
  norm(t, dim);
  linear(t, dim, 2 * 4 * dim, true);  // ff.net.0.proj (GEGLU)
  linear(t, 4 * dim, dim, true);      // ff.net.2
}
// proj_in/proj_out are a linear layer or a 1x1 conv: the same element counts.
void transformer_2d(Tensors& t, const LevelSpec& spec) {
  norm(t, spec.channels);
  linear(t, spec.channels, spec.channels, true);
  for (std::int64_t i = 0; i < spec.transformer_layers; ++i) transformer_block(t, spec.channels, spec.cross_attention_dim);
  linear(t, spec.channels, spec.channels, true);
}

// The units of one Transformer2DModel at layer granularity (unet_transformer.hpp's
// Transformer2DModel::add_units): one per transformer layer, the first with
// norm and proj_in, the last with proj_out.
void transformer_2d_units(std::vector<UnitParameterCount>& units, const std::string& prefix, const LevelSpec& spec) {
  const std::int64_t n = std::max<std::int64_t>(1, spec.transformer_layers);
  for (std::int64_t k = 0; k < n; ++k) {
    UnitParameterCount unit{spec.transformer_layers > 0 ? prefix + ".transformer_blocks." + std::to_string(k) : prefix,
                            {}, true};
    if (k == 0) {
      norm(unit.tensors, spec.channels);
      linear(unit.tensors, spec.channels, spec.channels, true);  // proj_in
    }
    if (k < spec.transformer_layers) transformer_block(unit.tensors, spec.channels, spec.cross_attention_dim);
    if (k + 1 == n) linear(unit.tensors, spec.channels, spec.channels, true);  // proj_out
    units.push_back(std::move(unit));
  }
}

}  // namespace

std::vector<UnitParameterCount> count_unit_parameters(const UNetConfig& cfg, UnitGranularity granularity) {
  cfg.validate();
  const bool per_layer = granularity == UnitGranularity::layers;
  const std::size_t levels = cfg.num_levels();
  const std::int64_t temb = cfg.time_embed_dim();
  const std::int64_t c0 = cfg.block_out_channels[0];
  std::vector<UnitParameterCount> units;

  UnitParameterCount embed{"embed", {}, false};
  conv(embed.tensors, cfg.in_channels, c0, cfg.conv_in_kernel);
  timestep_embedding(embed.tensors, c0, temb);
  if (cfg.addition_embed_text_time) timestep_embedding(embed.tensors, cfg.projection_class_embeddings_input_dim, temb);
  units.push_back(std::move(embed));

  // Per block: registration order, attentions, resnets, then the resampler.
  // Per layer: execution order, resnet i, attention i, ..., the resampler.
  auto resnet_unit = [&](const std::string& name, std::int64_t in, std::int64_t out) {
    UnitParameterCount unit{name, {}, true};
    resnet(unit.tensors, in, out, temb);
    units.push_back(std::move(unit));
  };
  auto sampler_unit = [&](const std::string& name, std::int64_t channels) {
    UnitParameterCount unit{name, {}, true};
    conv(unit.tensors, channels, channels, 3);
    units.push_back(std::move(unit));
  };

  std::vector<std::int64_t> skip_channels{c0};
  std::int64_t channels = c0;
  for (std::size_t i = 0; i < levels; ++i) {
    const LevelSpec spec = cfg.down_level(i);
    const bool last = i + 1 == levels;
    const bool attention = cfg.down_block_types[i] == DownBlockType::kCrossAttnDown;
    const std::string name = "down_blocks." + std::to_string(i);
    if (per_layer) {
      for (std::int64_t l = 0; l < spec.num_layers; ++l) {
        resnet_unit(name + ".resnets." + std::to_string(l), l == 0 ? channels : spec.channels, spec.channels);
        if (attention) transformer_2d_units(units, name + ".attentions." + std::to_string(l), spec);
      }
      if (!last) sampler_unit(name + ".downsamplers.0", spec.channels);
    } else {
      UnitParameterCount unit{name, {}, true};
      if (attention)
        for (std::int64_t l = 0; l < spec.num_layers; ++l) transformer_2d(unit.tensors, spec);
      for (std::int64_t l = 0; l < spec.num_layers; ++l)
        resnet(unit.tensors, l == 0 ? channels : spec.channels, spec.channels, temb);
      if (!last) conv(unit.tensors, spec.channels, spec.channels, 3);
      units.push_back(std::move(unit));
    }
    for (std::int64_t l = 0; l < spec.num_layers + (last ? 0 : 1); ++l) skip_channels.push_back(spec.channels);
    channels = spec.channels;
  }

  if (cfg.has_mid_block) {
    const LevelSpec spec = cfg.mid_level();
    if (per_layer) {
      resnet_unit("mid_block.resnets.0", spec.channels, spec.channels);
      for (std::int64_t l = 0; l < spec.num_layers; ++l) {
        transformer_2d_units(units, "mid_block.attentions." + std::to_string(l), spec);
        resnet_unit("mid_block.resnets." + std::to_string(l + 1), spec.channels, spec.channels);
      }
    } else {
      UnitParameterCount mid{"mid_block", {}, true};
      for (std::int64_t l = 0; l < spec.num_layers; ++l) transformer_2d(mid.tensors, spec);
      for (std::int64_t l = 0; l <= spec.num_layers; ++l) resnet(mid.tensors, spec.channels, spec.channels, temb);
      units.push_back(std::move(mid));
    }
  }

  for (std::size_t i = 0; i < levels; ++i) {
    const LevelSpec spec = cfg.up_level(i);
    const bool last = i + 1 == levels;
    const bool attention = cfg.up_block_types[i] == UpBlockType::kCrossAttnUp;
    const std::string name = "up_blocks." + std::to_string(i);
    std::vector<std::int64_t> resnet_in;
    for (std::int64_t l = 0; l < spec.num_layers; ++l) {
      ZERO_CHECK(!skip_channels.empty(), "UNet config: up block ", i,
                 " needs more skip connections than the down path makes (layers_per_block mismatch)");
      resnet_in.push_back((l == 0 ? channels : spec.channels) + skip_channels.back());
      skip_channels.pop_back();
    }
    if (per_layer) {
      for (std::int64_t l = 0; l < spec.num_layers; ++l) {
        resnet_unit(name + ".resnets." + std::to_string(l), resnet_in[static_cast<std::size_t>(l)], spec.channels);
        if (attention) transformer_2d_units(units, name + ".attentions." + std::to_string(l), spec);
      }
      if (!last) sampler_unit(name + ".upsamplers.0", spec.channels);
    } else {
      UnitParameterCount unit{name, {}, true};
      if (attention)
        for (std::int64_t l = 0; l < spec.num_layers; ++l) transformer_2d(unit.tensors, spec);
      for (std::int64_t in : resnet_in) resnet(unit.tensors, in, spec.channels, temb);
      if (!last) conv(unit.tensors, spec.channels, spec.channels, 3);
      units.push_back(std::move(unit));
    }
    channels = spec.channels;
  }

  UnitParameterCount head{"head", {}, false};
  norm(head.tensors, c0);
  conv(head.tensors, c0, cfg.out_channels, cfg.conv_out_kernel);
  units.push_back(std::move(head));
  return units;
}

std::int64_t count_parameters(const UNetConfig& config) {
  std::int64_t n = 0;
  for (const UnitParameterCount& unit : count_unit_parameters(config)) n += unit.total();
  return n;
}

std::vector<zero::plan::PlanUnit> plan_units(const UNetConfig& config, UnitGranularity granularity) {
  std::vector<zero::plan::PlanUnit> units;
  for (const UnitParameterCount& unit : count_unit_parameters(config, granularity)) {
    zero::plan::PlanUnit u{unit.name, {}, unit.checkpointed, {}};
    for (std::int64_t t : unit.tensors) u.tensors.push_back(static_cast<std::size_t>(t));
    units.push_back(std::move(u));
  }
  return units;
}

zero::plan::ActivationModel plan_activations(const UNetConfig& config, std::int64_t latent_size) {
  ZERO_CHECK(latent_size > 0, "latent size must be positive, got ", latent_size);
  zero::plan::ActivationModel model =
      config == UNetConfig::sdxl_base()
          ? calibration::activation_model()
          : calibration::scaled_activation_model(static_cast<std::size_t>(count_parameters(config)));
  model.area_scale = static_cast<double>(latent_size * latent_size) / (128.0 * 128.0);
  return model;
}

}  // namespace sdxl
