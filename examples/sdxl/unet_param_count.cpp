// Mirrors the constructors in unet.cpp: each helper appends the tensors one
// module registers, in registration order (which is named_parameters() order).
#include "unet_param_count.hpp"

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

}  // namespace

std::vector<UnitParameterCount> count_unit_parameters(const UNetConfig& cfg) {
  cfg.validate();
  const std::size_t levels = cfg.num_levels();
  const std::int64_t temb = cfg.time_embed_dim();
  const std::int64_t c0 = cfg.block_out_channels[0];
  std::vector<UnitParameterCount> units;

  UnitParameterCount embed{"embed", {}, false};
  conv(embed.tensors, cfg.in_channels, c0, cfg.conv_in_kernel);
  timestep_embedding(embed.tensors, c0, temb);
  if (cfg.addition_embed_text_time) timestep_embedding(embed.tensors, cfg.projection_class_embeddings_input_dim, temb);
  units.push_back(std::move(embed));

  // Registration order within a block: attentions, resnets, then the resampler.
  std::vector<std::int64_t> skip_channels{c0};
  std::int64_t channels = c0;
  for (std::size_t i = 0; i < levels; ++i) {
    const LevelSpec spec = cfg.down_level(i);
    const bool last = i + 1 == levels;
    UnitParameterCount unit{"down_blocks." + std::to_string(i), {}, true};
    if (cfg.down_block_types[i] == DownBlockType::kCrossAttnDown)
      for (std::int64_t l = 0; l < spec.num_layers; ++l) transformer_2d(unit.tensors, spec);
    for (std::int64_t l = 0; l < spec.num_layers; ++l)
      resnet(unit.tensors, l == 0 ? channels : spec.channels, spec.channels, temb);
    if (!last) conv(unit.tensors, spec.channels, spec.channels, 3);
    for (std::int64_t l = 0; l < spec.num_layers + (last ? 0 : 1); ++l) skip_channels.push_back(spec.channels);
    channels = spec.channels;
    units.push_back(std::move(unit));
  }

  if (cfg.has_mid_block) {
    const LevelSpec spec = cfg.mid_level();
    UnitParameterCount mid{"mid_block", {}, true};
    for (std::int64_t l = 0; l < spec.num_layers; ++l) transformer_2d(mid.tensors, spec);
    for (std::int64_t l = 0; l <= spec.num_layers; ++l) resnet(mid.tensors, spec.channels, spec.channels, temb);
    units.push_back(std::move(mid));
  }

  for (std::size_t i = 0; i < levels; ++i) {
    const LevelSpec spec = cfg.up_level(i);
    const bool last = i + 1 == levels;
    UnitParameterCount unit{"up_blocks." + std::to_string(i), {}, true};
    if (cfg.up_block_types[i] == UpBlockType::kCrossAttnUp)
      for (std::int64_t l = 0; l < spec.num_layers; ++l) transformer_2d(unit.tensors, spec);
    for (std::int64_t l = 0; l < spec.num_layers; ++l) {
      ZERO_CHECK(!skip_channels.empty(), "UNet config: up block ", i,
                 " needs more skip connections than the down path makes (layers_per_block mismatch)");
      const std::int64_t skip = skip_channels.back();
      skip_channels.pop_back();
      resnet(unit.tensors, (l == 0 ? channels : spec.channels) + skip, spec.channels, temb);
    }
    if (!last) conv(unit.tensors, spec.channels, spec.channels, 3);
    channels = spec.channels;
    units.push_back(std::move(unit));
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

std::vector<zero::plan::PlanUnit> plan_units(const UNetConfig& config) {
  std::vector<zero::plan::PlanUnit> units;
  for (const UnitParameterCount& unit : count_unit_parameters(config)) {
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
