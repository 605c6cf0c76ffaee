// The SDXL denoising loop on precomputed text conditioning, as diffusers'
// StableDiffusionXLPipeline runs it with output_type="latent": classifier-free
// guidance with the unconditional and conditional halves in one UNet batch,
// SDXL's micro-conditioning (add_time_ids), and initial noise drawn from a
// generator of its own (never LibTorch's global one, so sampling leaves a
// training run's random stream untouched).
//
// Text encoding (CLIP), the VAE decode and the image files are not here: the
// caller brings the embeddings and gets latents back.
#pragma once

#include <torch/torch.h>

#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include "schedulers.hpp"
#include "unet.hpp"

namespace sdxl {

/// The text conditioning of a batch of B images, as the pipeline's
/// prompt_embeds / pooled_prompt_embeds / negative_* arguments.
struct TextConditioning {
  torch::Tensor prompt_embeds;                  // [B, T, cross_attention_dim]
  torch::Tensor pooled_prompt_embeds;           // [B, P] (text_embeds; SDXL: the second encoder's projection)
  torch::Tensor negative_prompt_embeds;         // [B, T, C]; used when guidance_scale > 1
  torch::Tensor negative_pooled_prompt_embeds;  // [B, P]
};

/// SDXL's micro-conditioning, in pixels as (height, width) pairs:
/// add_time_ids = original_size + crop_top_left + target_size. Unset sizes
/// default to the output's (height, width), as in the pipeline.
struct MicroConditioning {
  std::optional<std::array<std::int64_t, 2>> original_size;
  std::array<std::int64_t, 2> crop_top_left{0, 0};
  std::optional<std::array<std::int64_t, 2>> target_size;
};

struct SamplingOptions {
  SchedulerConfig scheduler;   // parse_scheduler_config / read_scheduler_config: sampler and noise schedule
  std::int64_t steps = 30;
  double guidance_scale = 5.0;  // > 1 enables classifier-free guidance
  std::uint64_t seed = 0;       // seeds the CPU generator of the initial noise
  std::int64_t height = 1024;   // output image size in pixels
  std::int64_t width = 1024;
  std::int64_t vae_scale_factor = 8;  // pixels per latent pixel (SDXL's VAE: 8)
  MicroConditioning micro;
  /// Noise to start from ([B, in_channels, height/f, width/f], unit variance)
  /// instead of drawing it; the seed is then unused.
  torch::Tensor initial_noise;
  bool keep_steps = false;  // also return the latents after every step
};

struct SamplingResult {
  torch::Tensor latents;             // [B, in_channels, height/f, width/f], the model's dtype and device
  std::vector<torch::Tensor> steps;  // with keep_steps: the latents after each step (the last == latents)
};

/// The initial noise diffusers' pipeline draws with
/// generator=torch.Generator("cpu").manual_seed(seed): one standard normal
/// draw of `shape` on the CPU in float32 (the pipeline draws in the model's
/// dtype; for fp32 models the values are the same).
torch::Tensor initial_noise(torch::IntArrayRef shape, std::uint64_t seed);

/// Runs the denoising loop with `unet` (in eval mode, any dtype/device; the
/// conditioning is moved to them) and returns the final latents: not scaled
/// by the VAE's scaling factor, exactly what the pipeline returns for
/// output_type="latent". Runs without autograd. zero::InvalidArgument for
/// mismatched shapes, sizes not divisible by the latent grid, or missing
/// negative conditioning under guidance.
SamplingResult sample_latents(UNet2DConditionModelImpl& unet, const TextConditioning& text,
                              const SamplingOptions& options);

}  // namespace sdxl
