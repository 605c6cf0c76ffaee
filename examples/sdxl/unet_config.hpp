// UNetConfig: the subset of diffusers' UNet2DConditionModel configuration that
// the SDXL family uses, parsed from (and written back to) a diffusers
// config.json. Anything the C++ model does not implement is rejected by key
// name at parse time, so a checkpoint never half-loads into the wrong model.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace sdxl {

/// How the UNet's parameters are grouped into ZeRO stage-3 units. A unit is
/// what stage 3 gathers and frees at once, the engine's bucket (what is
/// reduced at once) and what activation checkpointing recomputes at once, so
/// its largest member bounds the gathered-parameter, gradient-bucket and
/// recompute memory.
enum class UnitGranularity {
  /// One unit per ResNet block, per transformer layer (BasicTransformerBlock;
  /// a Transformer2DModel's first layer also holds its norm and proj_in, its
  /// last one proj_out) and per resampler: 93 units for SDXL, the largest
  /// (up_blocks.0.resnets.0) 49 M parameters (FSDP's per-layer wrapping).
  layers,
  /// One unit per down, mid and up block: 9 units for SDXL, the largest
  /// (up_blocks.0) 1.3 B parameters.
  blocks,
};


/// Kinds of down/up blocks (diffusers class names in parentheses).
enum class DownBlockType { kDown, kCrossAttnDown };  // DownBlock2D, CrossAttnDownBlock2D
enum class UpBlockType { kUp, kCrossAttnUp };        // UpBlock2D, CrossAttnUpBlock2D

std::string_view name_of(UnitGranularity units);  // "layers", "blocks"
/// "layers" or "blocks"; zero::InvalidArgument naming `what` otherwise.
UnitGranularity unit_granularity_from(std::string_view name, std::string_view what);
std::string_view name_of(DownBlockType type);
std::string_view name_of(UpBlockType type);

/// Everything one level (down block i, or up block i) of the UNet needs, with
/// diffusers' per-level lists already expanded and reversed for the up path.
struct LevelSpec {
  std::int64_t channels = 0;                 // output channels of the block
  std::int64_t num_layers = 0;               // resnets in the block
  std::int64_t num_heads = 0;                // attention heads (count, not size)
  std::int64_t transformer_layers = 0;       // BasicTransformerBlocks per attention
  std::int64_t cross_attention_dim = 0;
};

/// Bounds on a config, checked by from_json() and validate() before anything
/// is built: a few bytes of config can otherwise ask for terabytes (SDXL base,
/// for scale: 3 levels, 320..1280 channels, 2 layers, 10 transformer layers,
/// 2.6 B parameters in a 1.7 KB config.json).
struct UNetLimits {
  static constexpr std::size_t kMaxConfigBytes = 1 << 20;      // config.json text
  static constexpr std::size_t kMaxConfigJsonValues = 10'000;  // numbers, strings, lists... in it
  static constexpr std::size_t kMaxConfigJsonDepth = 8;
  static constexpr std::int64_t kMaxLevels = 8;                // down_block_types entries
  static constexpr std::int64_t kMaxChannels = 32768;          // every channel and embedding width
  static constexpr std::int64_t kMaxLayersPerBlock = 64;
  static constexpr std::int64_t kMaxTransformerLayers = 64;    // per attention block
  static constexpr std::int64_t kMaxHeads = 1024;
  static constexpr std::int64_t kMaxKernel = 15;               // conv_in_kernel, conv_out_kernel
  static constexpr std::int64_t kMaxSampleSize = 16384;        // latent pixels
  static constexpr std::int64_t kMaxParameters = 20'000'000'000;  // about 8x SDXL base
};

/// A diffusers UNet2DConditionModel config restricted to what this model
/// implements. Field names follow diffusers' JSON keys.
struct UNetConfig {
  std::vector<std::int64_t> sample_size;  // empty = null; one value = square
  std::int64_t in_channels = 4;
  std::int64_t out_channels = 4;
  bool center_input_sample = false;
  bool flip_sin_to_cos = true;
  double freq_shift = 0.0;
  std::vector<DownBlockType> down_block_types;
  bool has_mid_block = true;  // mid_block_type "UNetMidBlock2DCrossAttn" or null
  std::vector<UpBlockType> up_block_types;
  std::vector<std::int64_t> block_out_channels;
  std::vector<std::int64_t> layers_per_block;          // one per down block
  double mid_block_scale_factor = 1.0;
  std::int64_t norm_num_groups = 32;
  double norm_eps = 1e-5;
  std::vector<std::int64_t> cross_attention_dim;       // one per down block
  std::vector<std::int64_t> transformer_layers_per_block;  // one per down block
  /// Diffusers' "attention_head_dim", which for this model family is really
  /// the number of heads per level (a naming quirk kept for compatibility).
  std::vector<std::int64_t> attention_head_dim;        // one per down block
  /// Explicit head counts; empty when the config has null (the usual case).
  std::vector<std::int64_t> num_attention_heads;
  bool use_linear_projection = false;
  bool upcast_attention = false;
  /// "text_time" (SDXL) when true; null when false.
  bool addition_embed_text_time = false;
  std::int64_t addition_time_embed_dim = 0;
  std::int64_t projection_class_embeddings_input_dim = 0;
  /// Width of the time embedding; 0 = 4 * block_out_channels[0] (diffusers' default).
  std::int64_t time_embedding_dim = 0;
  std::int64_t conv_in_kernel = 3;
  std::int64_t conv_out_kernel = 3;

  /// The SDXL 1.0 base UNet (stabilityai/stable-diffusion-xl-base-1.0, unet/config.json).
  static UNetConfig sdxl_base();

  /// Parses a diffusers config.json text. Missing keys take diffusers'
  /// defaults; keys starting with '_' (diffusers bookkeeping) are ignored;
  /// unknown keys and values this model does not implement throw
  /// zero::InvalidArgument naming the key.
  static UNetConfig from_json(std::string_view json_text);
  /// The same, its errors prefixed with where the text came from (a file's
  /// path, or "FILE metadata 'config'").
  static UNetConfig from_json(std::string_view json_text, const std::string& source);

  /// A diffusers-style config.json for this config (round-trips through from_json).
  std::string to_json() const;

  /// Checks lengths, divisibility and the per-field UNetLimits (each named in
  /// its message); from_json() and the model call it.
  void validate() const;
  /// The UNetLimits part of validate() (lengths must already agree).
  void check_limits() const;
  /// The parameter count within UNetLimits::kMaxParameters (from_json()
  /// checks it after validate(); count_parameters() itself validates).
  void check_parameter_count() const;

  // Derived values.
  std::int64_t time_embed_dim() const {
    return time_embedding_dim > 0 ? time_embedding_dim : 4 * block_out_channels.at(0);
  }
  std::size_t num_levels() const { return down_block_types.size(); }
  /// Head count of down level i (num_attention_heads[i], else attention_head_dim[i]).
  std::int64_t heads_of_level(std::size_t level) const;
  LevelSpec down_level(std::size_t i) const;
  /// Up block i works at level num_levels()-1-i; num_layers is layers_per_block + 1.
  LevelSpec up_level(std::size_t i) const;
  LevelSpec mid_level() const;

  bool operator==(const UNetConfig&) const = default;
};

}  // namespace sdxl
