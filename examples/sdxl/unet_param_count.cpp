// Mirrors the constructors in unet.cpp and unet_transformer.hpp: each helper
// appends the tensors one module registers, in registration order (which is
// named_parameters() order).
#include "unet_param_count.hpp"

#include <algorithm>

#include "sdxl_calibration.hpp"
#include "zero/core/error.hpp"

namespace sdxl {

double UnitParameterCount::freed_elements() const { return std::max(0.0, saved_elements - input_elements); }

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

// Activation estimates (elements per sample) and forward FLOPs of each
// layer kind at P = h * w positions, following what the layers save for
// backward (unet.cpp, unet_transformer.cpp): a weighting of the units for
// partial checkpointing, not a byte count (the planner's totals stay the
// calibrated ones).
struct Cost {
  double saved = 0, flops = 0;
  Cost& operator+=(const Cost& o) {
    saved += o.saved;
    flops += o.flops;
    return *this;
  }
};
// A unit's input stays saved when it is recomputed (the checkpoint keeps it):
// what recomputing frees is the rest. A block unit's input is its first
// layer's.

// GroupNorm+SiLU keeps its input, conv1 its input; the second GroupNorm+SiLU
// and conv2 the same at out channels, plus conv1's output.
Cost resnet_cost(double in, double out, double p) {
  return {p * (2 * in + 3 * out), 2 * p * (9 * in * out + 9 * out * out + (in != out ? in * out : 0))};
}
// One BasicTransformerBlock: LayerNorm in/out, q, k, v and the attention's
// output for self-attention; LayerNorm, q and output for cross-attention
// (k, v over the text); LayerNorm, the GEGLU projection (8C) and its output
// (4C) for the feed-forward: about 24 C a position.
Cost transformer_block_cost(double c, double p, double cross) {
  const double t = static_cast<double>(kEstimateTextTokens);
  Cost cost;
  cost.saved = p * 24 * c + 2 * t * c;
  cost.flops = 2 * p * (4 * c * c + 2 * c * c + 12 * c * c) + 2 * 2 * t * cross * c + 2 * 2 * p * p * c +
               2 * 2 * p * t * c;
  return cost;
}
Cost proj_cost(double c, double p) { return {p * c, 2 * p * c * c}; }  // proj_in (with GroupNorm) or proj_out

// The units of one Transformer2DModel at layer granularity (unet_transformer.hpp's
// Transformer2DModel::add_units): one per transformer layer, the first with
// norm and proj_in, the last with proj_out.
void transformer_2d_units(std::vector<UnitParameterCount>& units, const std::string& prefix, const LevelSpec& spec,
                          double positions) {
  const std::int64_t n = std::max<std::int64_t>(1, spec.transformer_layers);
  const double c = static_cast<double>(spec.channels);
  for (std::int64_t k = 0; k < n; ++k) {
    UnitParameterCount unit{spec.transformer_layers > 0 ? prefix + ".transformer_blocks." + std::to_string(k) : prefix,
                            {}, true};
    Cost cost;
    if (k == 0) {
      norm(unit.tensors, spec.channels);
      linear(unit.tensors, spec.channels, spec.channels, true);  // proj_in
      cost += proj_cost(c, positions);
      cost.saved += positions * c;  // the GroupNorm's input
    }
    if (k < spec.transformer_layers) {
      transformer_block(unit.tensors, spec.channels, spec.cross_attention_dim);
      cost += transformer_block_cost(c, positions, static_cast<double>(spec.cross_attention_dim));
    }
    if (k + 1 == n) {
      linear(unit.tensors, spec.channels, spec.channels, true);  // proj_out
      cost += proj_cost(c, positions);
    }
    unit.saved_elements = cost.saved;
    unit.input_elements = positions * c;
    unit.forward_flops = cost.flops;
    units.push_back(std::move(unit));
  }
}

/// A whole Transformer2DModel's cost (block granularity).
Cost transformer_2d_cost(const LevelSpec& spec, double positions) {
  const double c = static_cast<double>(spec.channels);
  Cost cost = proj_cost(c, positions);
  cost.saved += positions * c;
  for (std::int64_t k = 0; k < spec.transformer_layers; ++k)
    cost += transformer_block_cost(c, positions, static_cast<double>(spec.cross_attention_dim));
  cost += proj_cost(c, positions);
  return cost;
}

Cost downsampler_cost(double c, double p) { return {p * c, 2 * 9 * c * c * p / 4}; }  // 3x3 conv, stride 2
Cost upsampler_cost(double c, double p) { return {4 * p * c, 2 * 9 * c * c * 4 * p}; }  // nearest x2, 3x3 conv

}  // namespace

std::vector<UnitParameterCount> count_unit_parameters(const UNetConfig& cfg, UnitGranularity granularity,
                                                      std::int64_t latent_size) {
  cfg.validate();
  ZERO_CHECK(latent_size > 0, "latent size must be positive, got ", latent_size);
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
  // Positions (h * w) at resolution level i (0: the latent's).
  const auto positions = [&](std::size_t level) {
    const double side = static_cast<double>(latent_size) / static_cast<double>(std::int64_t{1} << level);
    return side * side;
  };
  const auto with_cost = [](UnitParameterCount& unit, const Cost& cost, double input) {
    unit.saved_elements = cost.saved;
    unit.input_elements = input;
    unit.forward_flops = cost.flops;
  };
  auto resnet_unit = [&](const std::string& name, std::int64_t in, std::int64_t out, double p) {
    UnitParameterCount unit{name, {}, true};
    resnet(unit.tensors, in, out, temb);
    with_cost(unit, resnet_cost(static_cast<double>(in), static_cast<double>(out), p), p * static_cast<double>(in));
    units.push_back(std::move(unit));
  };
  auto sampler_unit = [&](const std::string& name, std::int64_t channels, const Cost& cost, double p) {
    UnitParameterCount unit{name, {}, true};
    conv(unit.tensors, channels, channels, 3);
    with_cost(unit, cost, p * static_cast<double>(channels));
    units.push_back(std::move(unit));
  };

  std::vector<std::int64_t> skip_channels{c0};
  std::int64_t channels = c0;
  for (std::size_t i = 0; i < levels; ++i) {
    const LevelSpec spec = cfg.down_level(i);
    const bool last = i + 1 == levels;
    const bool attention = cfg.down_block_types[i] == DownBlockType::kCrossAttnDown;
    const std::string name = "down_blocks." + std::to_string(i);
    const double p = positions(i);
    const double c = static_cast<double>(spec.channels);
    if (per_layer) {
      for (std::int64_t l = 0; l < spec.num_layers; ++l) {
        resnet_unit(name + ".resnets." + std::to_string(l), l == 0 ? channels : spec.channels, spec.channels, p);
        if (attention) transformer_2d_units(units, name + ".attentions." + std::to_string(l), spec, p);
      }
      if (!last) sampler_unit(name + ".downsamplers.0", spec.channels, downsampler_cost(c, p), p);
    } else {
      UnitParameterCount unit{name, {}, true};
      Cost cost;
      if (attention)
        for (std::int64_t l = 0; l < spec.num_layers; ++l) {
          transformer_2d(unit.tensors, spec);
          cost += transformer_2d_cost(spec, p);
        }
      for (std::int64_t l = 0; l < spec.num_layers; ++l) {
        const std::int64_t in = l == 0 ? channels : spec.channels;
        resnet(unit.tensors, in, spec.channels, temb);
        cost += resnet_cost(static_cast<double>(in), c, p);
      }
      if (!last) {
        conv(unit.tensors, spec.channels, spec.channels, 3);
        cost += downsampler_cost(c, p);
      }
      with_cost(unit, cost, p * static_cast<double>(channels));
      units.push_back(std::move(unit));
    }
    for (std::int64_t l = 0; l < spec.num_layers + (last ? 0 : 1); ++l) skip_channels.push_back(spec.channels);
    channels = spec.channels;
  }

  if (cfg.has_mid_block) {
    const LevelSpec spec = cfg.mid_level();
    const double p = positions(levels - 1);
    const double c = static_cast<double>(spec.channels);
    if (per_layer) {
      resnet_unit("mid_block.resnets.0", spec.channels, spec.channels, p);
      for (std::int64_t l = 0; l < spec.num_layers; ++l) {
        transformer_2d_units(units, "mid_block.attentions." + std::to_string(l), spec, p);
        resnet_unit("mid_block.resnets." + std::to_string(l + 1), spec.channels, spec.channels, p);
      }
    } else {
      UnitParameterCount mid{"mid_block", {}, true};
      Cost cost;
      for (std::int64_t l = 0; l < spec.num_layers; ++l) {
        transformer_2d(mid.tensors, spec);
        cost += transformer_2d_cost(spec, p);
      }
      for (std::int64_t l = 0; l <= spec.num_layers; ++l) {
        resnet(mid.tensors, spec.channels, spec.channels, temb);
        cost += resnet_cost(c, c, p);
      }
      with_cost(mid, cost, p * c);
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
    const double p = positions(levels - 1 - i);
    const double c = static_cast<double>(spec.channels);
    if (per_layer) {
      for (std::int64_t l = 0; l < spec.num_layers; ++l) {
        resnet_unit(name + ".resnets." + std::to_string(l), resnet_in[static_cast<std::size_t>(l)], spec.channels, p);
        if (attention) transformer_2d_units(units, name + ".attentions." + std::to_string(l), spec, p);
      }
      if (!last) sampler_unit(name + ".upsamplers.0", spec.channels, upsampler_cost(c, p), p);
    } else {
      UnitParameterCount unit{name, {}, true};
      Cost cost;
      if (attention)
        for (std::int64_t l = 0; l < spec.num_layers; ++l) {
          transformer_2d(unit.tensors, spec);
          cost += transformer_2d_cost(spec, p);
        }
      for (std::int64_t in : resnet_in) {
        resnet(unit.tensors, in, spec.channels, temb);
        cost += resnet_cost(static_cast<double>(in), c, p);
      }
      if (!last) {
        conv(unit.tensors, spec.channels, spec.channels, 3);
        cost += upsampler_cost(c, p);
      }
      with_cost(unit, cost, p * static_cast<double>(channels));
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

std::vector<zero::plan::PlanUnit> plan_units(const UNetConfig& config, UnitGranularity granularity,
                                             std::int64_t latent_size) {
  std::vector<zero::plan::PlanUnit> units;
  for (const UnitParameterCount& unit : count_unit_parameters(config, granularity, latent_size)) {
    zero::plan::PlanUnit u{unit.name, {}, unit.checkpointed, {}};
    for (std::int64_t t : unit.tensors) u.tensors.push_back(static_cast<std::size_t>(t));
    u.activation_weight = unit.freed_elements();
    u.recompute_weight = unit.forward_flops;
    units.push_back(std::move(u));
  }
  return units;
}

std::vector<bool> recomputed_unit_mask(const UNetConfig& config, UnitGranularity granularity,
                                       std::int64_t latent_size, std::int64_t count) {
  if (count == 0) return {};
  const std::vector<zero::plan::PlanUnit> units = plan_units(config, granularity, latent_size);
  const std::vector<std::size_t> order = zero::plan::recompute_order(units);
  ZERO_CHECK(count > 0 && static_cast<std::size_t>(count) <= order.size(), "checkpoint_units = ", count,
             ": the UNet has ", order.size(), " checkpointable units at this granularity (0: all of them)");
  std::vector<bool> mask(units.size(), false);
  for (std::int64_t i = 0; i < count; ++i) mask[order[static_cast<std::size_t>(i)]] = true;
  return mask;
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
