#include "sampling.hpp"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <memory>
#include <string>

#include "zero/core/error.hpp"

namespace sdxl {

using torch::Tensor;

torch::Tensor initial_noise(torch::IntArrayRef shape, std::uint64_t seed) {
  // A generator of its own: drawing from LibTorch's default generator would
  // shift a training run's random stream (and its resume determinism).
  torch::Generator generator = at::detail::createCPUGenerator(seed);
  return torch::randn(shape, generator, torch::TensorOptions().dtype(torch::kFloat32));
}

namespace {

void check_shape(const Tensor& t, const char* name, std::vector<std::int64_t> expected) {
  ZERO_CHECK(t.defined(), "sampling: '", name, "' is missing");
  bool same = t.dim() == static_cast<std::int64_t>(expected.size());
  for (std::size_t i = 0; same && i < expected.size(); ++i) same = expected[i] < 0 || t.size(i) == expected[i];
  if (!same) {
    std::string want = "[";
    for (std::size_t i = 0; i < expected.size(); ++i)
      want += (i ? ", " : "") + (expected[i] < 0 ? std::string("*") : std::to_string(expected[i]));
    ZERO_THROW(zero::InvalidArgument, "sampling: '", name, "' has shape ", t.sizes(), "; expected ", want, "]");
  }
}

}  // namespace

SamplingResult sample_latents(UNet2DConditionModelImpl& unet, const TextConditioning& text,
                              const SamplingOptions& options) {
  const UNetConfig& config = unet.config();
  const std::int64_t f = options.vae_scale_factor;
  ZERO_CHECK(f >= 1, "sampling: vae_scale_factor = ", f, "; expected >= 1");
  ZERO_CHECK(options.height > 0 && options.width > 0 && options.height % f == 0 && options.width % f == 0,
             "sampling: image size ", options.height, "x", options.width, " must be positive multiples of ", f,
             " (the VAE's scale factor)");
  const std::int64_t latent_h = options.height / f, latent_w = options.width / f;
  const std::int64_t levels = static_cast<std::int64_t>(config.block_out_channels.size());
  const std::int64_t grid = std::int64_t{1} << (levels - 1);
  ZERO_CHECK(latent_h % grid == 0 && latent_w % grid == 0, "sampling: latent size ", latent_h, "x", latent_w,
             " (image ", options.height, "x", options.width, " / ", f, ") must be a multiple of ", grid,
             " for this UNet's ", levels, " levels");
  ZERO_CHECK(std::isfinite(options.guidance_scale) && options.guidance_scale >= 0, "sampling: guidance_scale = ",
             options.guidance_scale, "; expected a finite number >= 0");

  // The model's dtype and device: everything fed to it goes there.
  const Tensor any_parameter = unet.parameters().front();
  const auto model = torch::TensorOptions().dtype(any_parameter.scalar_type()).device(any_parameter.device());

  const std::int64_t context_dim = config.cross_attention_dim.empty() ? -1 : config.cross_attention_dim.front();
  check_shape(text.prompt_embeds, "prompt_embeds", {-1, -1, context_dim});
  const std::int64_t batch = text.prompt_embeds.size(0), tokens = text.prompt_embeds.size(1);
  ZERO_CHECK(batch >= 1, "sampling: 'prompt_embeds' holds no prompt (batch size 0)");
  const bool guided = options.guidance_scale > 1.0;  // diffusers' do_classifier_free_guidance
  const bool text_time = config.addition_embed_text_time;
  const std::int64_t pooled_dim =
      text_time ? config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim : -1;
  if (text_time) check_shape(text.pooled_prompt_embeds, "pooled_prompt_embeds", {batch, pooled_dim});
  if (guided) {
    check_shape(text.negative_prompt_embeds, "negative_prompt_embeds", {batch, tokens, context_dim});
    if (text_time) check_shape(text.negative_pooled_prompt_embeds, "negative_pooled_prompt_embeds", {batch, pooled_dim});
  }

  torch::NoGradGuard no_grad;
  std::unique_ptr<Scheduler> scheduler = make_scheduler(options.scheduler);
  scheduler->set_timesteps(options.steps);

  const std::vector<std::int64_t> latent_shape{batch, config.in_channels, latent_h, latent_w};
  Tensor noise = options.initial_noise;
  if (noise.defined()) {
    check_shape(noise, "initial_noise", latent_shape);
  } else {
    noise = initial_noise(latent_shape, options.seed);
  }
  Tensor latents = noise.to(model) * scheduler->init_noise_sigma();

  // The unconditional half first, as the pipeline concatenates them.
  Tensor context = guided ? torch::cat({text.negative_prompt_embeds, text.prompt_embeds}) : text.prompt_embeds;
  context = context.to(model);
  Tensor text_embeds, time_ids;
  if (text_time) {
    text_embeds = guided ? torch::cat({text.negative_pooled_prompt_embeds, text.pooled_prompt_embeds})
                         : text.pooled_prompt_embeds;
    text_embeds = text_embeds.to(model);
    const auto size = std::array<std::int64_t, 2>{options.height, options.width};
    const auto original = options.micro.original_size.value_or(size);
    const auto target = options.micro.target_size.value_or(size);
    const auto& crop = options.micro.crop_top_left;
    time_ids = torch::tensor({static_cast<float>(original[0]), static_cast<float>(original[1]),
                              static_cast<float>(crop[0]), static_cast<float>(crop[1]),
                              static_cast<float>(target[0]), static_cast<float>(target[1])},
                             torch::kFloat32)
                   .reshape({1, 6})
                   .to(model)
                   .repeat({context.size(0), 1});
  }

  SamplingResult result;
  for (std::int64_t i = 0; i < scheduler->num_steps(); ++i) {
    Tensor model_input = guided ? torch::cat({latents, latents}) : latents;
    model_input = scheduler->scale_model_input(model_input, i);
    const Tensor timestep = scheduler->timesteps()[i].to(model.device());
    Tensor prediction = unet.forward(model_input, timestep, context, text_embeds, time_ids);
    if (guided) {
      const auto halves = prediction.chunk(2);
      prediction = halves[0] + options.guidance_scale * (halves[1] - halves[0]);
    }
    latents = scheduler->step(prediction, i, latents);
    if (options.keep_steps) result.steps.push_back(latents);
  }
  result.latents = latents;
  return result;
}

}  // namespace sdxl
