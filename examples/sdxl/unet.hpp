// UNet2DConditionModel: the SDXL denoising UNet as LibTorch modules whose
// parameter names and shapes are exactly those of Hugging Face diffusers, so
// diffusers checkpoints load without renaming and the numerics can be checked
// against diffusers' reference output.
//
// Blocks (ResnetBlock2D, Transformer2DModel, the down/mid/up blocks, ...) are
// defined in unet.cpp, unet_layers.hpp and unet_transformer.hpp; this header
// exposes the model, its ZeRO stage-3 units and the activation-checkpointing
// switch.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "activation_checkpoint.hpp"
#include "unet_config.hpp"

namespace sdxl {

class TimestepEmbedding;
class DownBlock;
class MidBlock;
class UpBlock;
class Conv2d;
class GroupNorm;

/// How the model creates its parameters.
struct UNetBuildOptions {
  /// dtype and device of every parameter. The meta device builds the full
  /// module tree (names, shapes) without allocating any storage.
  torch::TensorOptions tensor_options = torch::TensorOptions().dtype(torch::kFloat32);
  /// PyTorch's default initialisation (uniform +-1/sqrt(fan_in) for weights
  /// and biases, ones/zeros for norms). Off leaves parameters uninitialised,
  /// for when weights are loaded right after construction.
  bool initialize = true;
  /// Recompute each unit in backward instead of keeping its activations (see
  /// set_activation_checkpointing()).
  bool activation_checkpointing = false;
  /// The stage-3 units (units(); also the checkpointing granularity).
  UnitGranularity units = UnitGranularity::layers;
};

/// LoRA adapters on the UNet's Linear layers, as PEFT applies them:
///   y = W x + b + (alpha / rank) * B (A dropout(x)),
/// A [rank, in] drawn like a Linear weight (uniform +-1/sqrt(in)), B [out,
/// rank] zero, so an adapted model starts out equal to its base. The
/// parameters are "<module>.lora_A.weight" and "<module>.lora_B.weight"
/// (PEFT's names), in the same ZeRO unit as the layer they adapt.
struct LoraOptions {
  std::int64_t rank = 0;  // 0: no adapters
  double alpha = 0;       // the scale is alpha / rank
  /// Applied to the adapter's input while gradients are computed (training),
  /// never in inference; it draws from LibTorch's default generator.
  double dropout = 0;
  /// Glob patterns over module names ("*.to_q"; '*' matches dots too).
  std::vector<std::string> targets;
};

/// A group of parameters that ZeRO stage 3 gathers and frees together.
struct ParameterUnit {
  /// "embed", then per layer ("down_blocks.0.resnets.0",
  /// "down_blocks.1.attentions.0.transformer_blocks.0",
  /// "down_blocks.0.downsamplers.0", ...) or per block ("down_blocks.0", ...,
  /// "mid_block", "up_blocks.0", ...), then "head".
  std::string name;
  /// The top-level submodules that make up the unit, in execution order.
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  /// (full diffusers name, parameter) in state-dict order.
  std::vector<std::pair<std::string, torch::Tensor>> parameters;
};

class UNet2DConditionModelImpl : public torch::nn::Module {
 public:
  explicit UNet2DConditionModelImpl(UNetConfig config, UNetBuildOptions options = {});

  /// Predicts the noise (or v) for `sample`.
  ///   sample                 [B, in_channels, H, W], the model's dtype
  ///   timestep               [B] or [] (broadcast), float or integer, any device
  ///   encoder_hidden_states  [B, T, cross_attention_dim]
  ///   text_embeds, time_ids  [B, P] and [B, 6]: SDXL's pooled text embedding
  ///                          and (orig size, crop, target size); required when
  ///                          addition_embed_type is "text_time", else ignored.
  /// Returns [B, out_channels, H, W] in the model's dtype. Any H, W work;
  /// multiples of 2^(levels-1) avoid diffusers' upsample-size fallback.
  torch::Tensor forward(const torch::Tensor& sample, const torch::Tensor& timestep,
                        const torch::Tensor& encoder_hidden_states, const torch::Tensor& text_embeds = {},
                        const torch::Tensor& time_ids = {});

  /// When on and grad mode is enabled, each unit but "embed" and "head" runs
  /// without saving activations and is recomputed during backward (LibTorch
  /// has no torch.utils.checkpoint; see activation_checkpoint.hpp). Gradients are unchanged.
  void set_activation_checkpointing(bool enabled) { activation_checkpointing_ = enabled; }
  bool activation_checkpointing() const { return activation_checkpointing_; }
  /// Partial checkpointing: under activation checkpointing, only the units
  /// whose entry is true (indexed as units()) are recomputed; the others keep
  /// their activations. Empty (the default): every unit but embed and head.
  /// zero::InvalidArgument unless the size is units().size() or 0.
  void set_recomputed_units(std::vector<bool> recomputed);
  const std::vector<bool>& recomputed_units() const { return recomputed_units_; }
  /// Runs the convolutional path in channels-last (NHWC) memory order: cuDNN
  /// then needs no NCHW<->NHWC transposes around each convolution, and the
  /// GroupNorms (+SiLU) run a fused NHWC kernel on CUDA. The output is
  /// returned NCHW-contiguous either way; the values differ from NCHW only by
  /// rounding (other kernels, other summation orders).
  void set_channels_last(bool enabled) { channels_last_ = enabled; }
  bool channels_last() const { return channels_last_; }

  /// Wraps each unit's computation (in units() order) during forward: the
  /// runner gets the unit's index, its tensor inputs, the body to run and
  /// whether activation checkpointing asks for recompute; it returns the
  /// body's outputs. ZeRO stage 3 gathers parameters here (zero::adapter).
  /// Unset: bodies run directly (or checkpointed).
  using UnitBody = std::function<torch::autograd::variable_list(const torch::autograd::variable_list&)>;
  using UnitRunner = std::function<torch::autograd::variable_list(
      std::size_t unit, const torch::autograd::variable_list& inputs, const UnitBody& body, bool recompute)>;
  void set_unit_runner(UnitRunner runner) { unit_runner_ = std::move(runner); }

  /// The stage-3 units in execution order: "embed" (conv_in, time_embedding,
  /// add_embedding), the down path, the mid block, the up path (per layer or
  /// per block, UNetBuildOptions::units), "head" (conv_norm_out, conv_out).
  /// Every parameter is in exactly one unit.
  std::vector<ParameterUnit> units() const;
  UnitGranularity unit_granularity() const { return unit_granularity_; }

  /// Adds LoRA adapters to every Linear layer whose module name matches one
  /// of options.targets, A drawn from `generator`; returns the adapted module
  /// names in module order. zero::InvalidArgument for a pattern that matches
  /// no Linear layer, or one that matches a convolution (LoRA on convolutions
  /// is not supported).
  /// Call before units(): the adapters are parameters of their layer's unit.
  std::vector<std::string> add_lora(const LoraOptions& options, torch::Generator generator);
  /// The adapted module names (empty without adapters).
  const std::vector<std::string>& lora_modules() const { return lora_modules_; }

  const UNetConfig& config() const { return config_; }

 private:
  torch::Tensor time_embedding(const torch::Tensor& sample, const torch::Tensor& timestep,
                               const torch::Tensor& text_embeds, const torch::Tensor& time_ids);

  UNetConfig config_;
  bool activation_checkpointing_ = false;
  std::vector<bool> recomputed_units_;  // empty: every unit (checkpointing on)
  UnitGranularity unit_granularity_ = UnitGranularity::layers;
  bool channels_last_ = false;
  UnitRunner unit_runner_;
  std::vector<std::string> lora_modules_;

  std::shared_ptr<Conv2d> conv_in_;
  std::shared_ptr<TimestepEmbedding> time_embedding_;
  std::shared_ptr<TimestepEmbedding> add_embedding_;  // null unless addition_embed_type == "text_time"
  std::vector<std::shared_ptr<DownBlock>> down_blocks_;
  std::vector<std::shared_ptr<UpBlock>> up_blocks_;
  std::shared_ptr<MidBlock> mid_block_;  // null when mid_block_type is null
  std::shared_ptr<GroupNorm> conv_norm_out_;
  std::shared_ptr<Conv2d> conv_out_;
};
TORCH_MODULE(UNet2DConditionModel);

/// Sinusoidal timestep features as diffusers' get_timestep_embedding(), always
/// computed in float32 (as diffusers does): [N] -> [N, dim].
torch::Tensor timestep_features(const torch::Tensor& timesteps, std::int64_t dim, bool flip_sin_to_cos,
                                double downscale_freq_shift);

/// Multi-head attention core: q [B, Nq, H*D], k and v [B, Nk, H*D] -> [B, Nq, H*D].
/// Uses at::scaled_dot_product_attention on LibTorch 2, else softmax(QK^T/sqrt(D))V.
/// `upcast` computes in float32 when the inputs are half precision.
torch::Tensor multi_head_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                   std::int64_t heads, bool upcast);

}  // namespace sdxl
