// diffusers' AutoencoderKL (the SDXL VAE) in LibTorch, with diffusers'
// parameter names ("encoder.down_blocks.0.resnets.0.conv1.weight", ...) so a
// pipeline's vae/ folder loads by name.
//
// Precision: the model runs in fp32 or bf16. fp16 is accepted only when the
// config's force_upcast is false (a VAE fine-tuned not to overflow, like
// madebyollin's sdxl-vae-fp16-fix); with force_upcast true — SDXL's own VAE,
// whose decoder activations exceed fp16's range — asking for fp16 builds the
// model in fp32 instead, as diffusers' pipelines do, and compute_dtype() says
// so. encode() and decode() take inputs of any float dtype and return
// tensors of compute_dtype().
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "pipeline_folder.hpp"

namespace sdxl {

/// The subset of diffusers' AutoencoderKL config.json this model implements
/// (keys of the same names). Keys with other values are refused by name.
struct VaeConfig {
  std::int64_t in_channels = 3;
  std::int64_t out_channels = 3;
  std::vector<std::int64_t> block_out_channels;  // one per level; required
  std::int64_t layers_per_block = 1;             // required
  std::int64_t latent_channels = 4;              // required
  std::int64_t norm_num_groups = 32;             // required
  double scaling_factor = 0.18215;               // SDXL: 0.13025
  bool force_upcast = true;
  bool mid_block_add_attention = true;
  bool use_quant_conv = true;
  bool use_post_quant_conv = true;
  std::int64_t sample_size = 0;  // informational (pixels); 0 when absent

  /// Parses a diffusers config.json's text; zero::IoError naming `source`
  /// and the key for a missing required key or an unsupported value.
  static VaeConfig from_json(const std::string& text, const std::string& source);
  /// SDXL 1.0's VAE (block_out_channels 128..512, scaling 0.13025).
  static VaeConfig sdxl();
};

class VaeEncoder;
class VaeDecoder;

/// The posterior of encode(): a diagonal Gaussian over latents, as
/// diffusers' DiagonalGaussianDistribution (logvar clamped to [-30, 20]).
struct LatentDistribution {
  torch::Tensor mean;
  torch::Tensor logvar;
  torch::Tensor std() const { return torch::exp(0.5 * logvar); }
  /// mean + std * N(0, 1) drawn (in fp32) from `generator`, the caller's, on
  /// mean's device, so sampling never disturbs another stream of random numbers.
  torch::Tensor sample(torch::Generator generator) const;
  /// The mode (the mean).
  torch::Tensor mode() const { return mean; }
};

class AutoencoderKLImpl : public torch::nn::Module {
 public:
  explicit AutoencoderKLImpl(VaeConfig config, torch::TensorOptions options = {});

  /// Images [B, in_channels, H, W] in [-1, 1] (H, W multiples of
  /// 2^(levels-1)) -> the latent distribution, unscaled.
  LatentDistribution encode(const torch::Tensor& images);
  /// Latents [B, latent_channels, h, w], unscaled (divide the diffusion
  /// model's latents by scaling_factor first) -> images, roughly in [-1, 1].
  torch::Tensor decode(const torch::Tensor& latents);

  const VaeConfig& config() const { return config_; }
  torch::ScalarType compute_dtype() const { return compute_dtype_; }

 private:
  VaeConfig config_;
  torch::ScalarType compute_dtype_;
  std::shared_ptr<VaeEncoder> encoder_;
  std::shared_ptr<VaeDecoder> decoder_;
  torch::nn::Conv2d quant_conv_{nullptr};       // null unless use_quant_conv
  torch::nn::Conv2d post_quant_conv_{nullptr};  // null unless use_post_quant_conv
};
TORCH_MODULE(AutoencoderKL);

/// Loads a VAE from `path`: a component folder (config.json plus
/// diffusion_pytorch_model weights, see pipeline_folder.hpp) or a pipeline
/// root (its vae/ component). `options` gives the dtype (fp32, bf16, or fp16
/// as described at the top) and device.
AutoencoderKL load_vae(const std::filesystem::path& path,
                       torch::TensorOptions options = torch::TensorOptions().dtype(torch::kFloat32),
                       WeightVariant variant = WeightVariant::kPreferFull);

/// Loads the VAE from an original (Stability AI, ldm-layout) single-file
/// SDXL checkpoint: its "first_stage_model.*" tensors (encoder.down.I.block.J,
/// mid.block_1/attn_1/block_2, decoder.up.I with I counted from the lowest
/// resolution, norm_out, nin_shortcut, 1x1-conv attention projections) are
/// mapped to diffusers' names; the file's other models are ignored. The file
/// holds no config: `config` (SDXL 1.0's by default) must describe it.
AutoencoderKL load_vae_from_single_file(const std::filesystem::path& file,
                                        torch::TensorOptions options = torch::TensorOptions().dtype(torch::kFloat32),
                                        const VaeConfig& config = VaeConfig::sdxl());

}  // namespace sdxl
