// The trainer's view of a dataset: one training example (Sample), the latent
// size that decides its aspect-ratio bucket (LatentSize), the text-encoder
// dimensions (TextDims), and the abstract Dataset that CachedDataset and
// SyntheticDataset implement. Plain C++ buffers, no LibTorch: the trainer
// wraps the float vectors in tensors (torch::from_blob) itself.
#pragma once

#include <array>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "zero/core/error.hpp"

namespace sdxl::data {

/// SDXL's VAE has 4 latent channels; every latent is [4, h, w].
inline constexpr std::int64_t kLatentChannels = 4;
/// The SDXL VAE's scaling factor. Cached latents are stored already multiplied
/// by it (diffusers: `vae.encode(x).latent_dist.sample() * vae.config.scaling_factor`),
/// so the trainer uses them as they are.
inline constexpr double kSdxlVaeScalingFactor = 0.13025;
/// add_time_ids: original_size (h, w) + crop_top_left (top, left) + target_size (h, w).
inline constexpr std::size_t kTimeIdCount = 6;

/// Height and width of a latent in latent pixels (image pixels / 8). Samples
/// with equal LatentSize form one aspect-ratio bucket. Ordered by (height, width).
struct LatentSize {
  std::int64_t height = 0;
  std::int64_t width = 0;
  auto operator<=>(const LatentSize&) const = default;
};

inline std::ostream& operator<<(std::ostream& out, const LatentSize& size) {
  return out << size.height << "x" << size.width;
}

/// Dimensions of the text conditioning. SDXL: 77 tokens of 768 + 1280 = 2048
/// (the two encoders' penultimate hidden states concatenated) and a pooled
/// vector of 1280 (encoder 2's projected output). Tiny test models use smaller
/// ones; the caller checks them against the UNet config (cross_attention_dim,
/// and projection_class_embeddings_input_dim - 6 * addition_time_embed_dim).
struct TextDims {
  std::int64_t sequence_length = 77;
  std::int64_t width = 2048;
  std::int64_t pooled_width = 1280;
  bool operator==(const TextDims&) const = default;
};

inline std::ostream& operator<<(std::ostream& out, const TextDims& dims) {
  return out << "[" << dims.sequence_length << "," << dims.width << "] + pooled ["
             << dims.pooled_width << "]";
}

/// One training example, converted to float32 whatever its storage dtype.
struct Sample {
  std::size_t index = 0;
  /// [4, h, w], row-major, already scaled by the VAE scaling factor.
  std::vector<float> latents;
  std::array<std::int64_t, 3> latent_shape{kLatentChannels, 0, 0};
  /// [sequence_length, width], row-major.
  std::vector<float> prompt_embeds;
  std::array<std::int64_t, 2> prompt_embeds_shape{0, 0};
  /// [pooled_width].
  std::vector<float> pooled_prompt_embeds;
  /// SDXL's add_time_ids order: orig_h, orig_w, crop_top, crop_left, target_h, target_w.
  std::array<float, kTimeIdCount> time_ids{};
  /// May be empty (captions are optional in the cached format).
  std::string caption;

  LatentSize latent_size() const { return {latent_shape[1], latent_shape[2]}; }
};

/// The text conditioning of the empty prompt "": what the two text encoders
/// give for it (prompt_embeds [sequence_length, width], row-major, and the
/// second encoder's pooled output [pooled_width]). Caption dropout trains on
/// it in place of a sample's own, so that classifier-free guidance has an
/// unconditional prediction to subtract.
struct EmptyPrompt {
  std::vector<float> prompt_embeds;
  std::vector<float> pooled_prompt_embeds;
};

/// Prompts cached for the trainer's validation images: their text and what
/// the two text encoders give for them, row-major float32:
/// prompt_embeds [P, sequence_length, width], pooled_prompt_embeds
/// [P, pooled_width], P = prompts.size().
struct ValidationPrompts {
  std::vector<std::string> prompts;
  std::vector<float> prompt_embeds;
  std::vector<float> pooled_prompt_embeds;
};

/// A random-access collection of samples.
///
/// sample() and bucket_of() are const and may be called from several threads
/// at once (the PrefetchingLoader calls them from its background thread).
class Dataset {
 public:
  virtual ~Dataset() = default;

  virtual std::size_t size() const = 0;
  /// The latent (h, w) of sample i without loading it; the sampler buckets by it.
  virtual LatentSize bucket_of(std::size_t i) const = 0;
  /// Loads sample i. Throws zero::InvalidArgument for i >= size().
  virtual Sample sample(std::size_t i) const = 0;
  virtual TextDims text_dims() const = 0;
  /// The dataset's empty-prompt conditioning, or nullptr when it carries none
  /// (cached datasets written before it was part of the format).
  virtual const EmptyPrompt* empty_prompt() const { return nullptr; }
  /// The dataset's cached validation prompts, or nullptr when it carries none.
  virtual const ValidationPrompts* validation_prompts() const { return nullptr; }

  /// Every sample's bucket, in index order (what the sampler consumes).
  std::vector<LatentSize> buckets() const {
    std::vector<LatentSize> result(size());
    for (std::size_t i = 0; i < result.size(); ++i) result[i] = bucket_of(i);
    return result;
  }
};

/// Throws zero::InvalidArgument unless the dataset's text dimensions are the
/// model's. Called by the trainer once, before the first step, so a dataset
/// cached for another model fails with both shapes in the message instead of a
/// shape error deep inside the UNet's cross-attention.
inline void check_text_dims(const Dataset& dataset, const TextDims& model) {
  const TextDims have = dataset.text_dims();
  ZERO_CHECK(have == model, "dataset text embeddings are ", have, " but the model expects ", model,
             " (width: the UNet config's cross_attention_dim; pooled: its projection_class_embeddings_input_dim - 6 x "
             "addition_time_embed_dim; the sequence length: the dataset's, text_length for synthetic data)");
}

// ---------------------------------------------------------------------------
// A small PRNG whose output is fixed by its definition, not by the standard
// library's implementation: the sampler's shuffles and the synthetic data must
// be identical on every platform and compiler. (std::shuffle and the
// std::*_distribution classes are allowed to differ between libraries.)

/// SplitMix64 (Steele, Lea, Flood 2014): a 64-bit counter passed through a
/// strong mixing function. Statistically good enough for shuffling and
/// synthetic data, trivially seekable, and specified in a few lines.
class SplitMix64 {
 public:
  explicit SplitMix64(std::uint64_t seed) : state_(seed) {}

  std::uint64_t next() {
    state_ += 0x9e3779b97f4a7c15ull;
    return mix(state_);
  }

  /// Uniform in [0, bound), unbiased: rejects the few draws below 2^64 mod
  /// bound, so every residue class is equally likely. bound must be > 0.
  std::uint64_t bounded(std::uint64_t bound) {
    const std::uint64_t threshold = (0 - bound) % bound;  // 2^64 mod bound
    for (;;) {
      const std::uint64_t r = next();
      if (r >= threshold) return r % bound;
    }
  }

  /// Uniform in [0, 1) with 24 bits: exactly representable, so the same on
  /// every platform.
  float uniform() { return static_cast<float>(next() >> 40) * 0x1.0p-24f; }

  /// The finalizer of SplitMix64 (a bijection on 64-bit integers).
  static std::uint64_t mix(std::uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }

  /// A seed derived from several values, order-sensitive: combine(a, b) and
  /// combine(b, a) give unrelated streams.
  template <typename... Values>
  static std::uint64_t combine(std::uint64_t first, Values... rest) {
    std::uint64_t h = mix(first + 0x9e3779b97f4a7c15ull);
    ((h = mix(h ^ (static_cast<std::uint64_t>(rest) + 0x9e3779b97f4a7c15ull))), ...);
    return h;
  }

 private:
  std::uint64_t state_;
};

/// Caption dropout's draw: whether sample `sample_index` (global, the
/// dataset's index) of micro-step `micro` of step `step` trains on the empty
/// prompt, with probability `probability`. A function of its arguments only,
/// on its own SplitMix64 stream: no other draw (noise, timesteps, shuffles)
/// moves when it is on or off, and any world size or a resumed run drops the
/// same samples. p <= 0 never drops, p >= 1 always does (no draw at all).
inline bool drop_caption(std::uint64_t seed, std::int64_t step, std::int64_t micro, std::size_t sample_index,
                         double probability) {
  if (probability <= 0) return false;
  if (probability >= 1) return true;
  // The tag keeps this stream apart from the others seeded from `seed`.
  constexpr std::uint64_t kCaptionDropoutStream = 0x63617074696f6e00ull;  // "caption"
  SplitMix64 rng(SplitMix64::combine(seed, kCaptionDropoutStream, static_cast<std::uint64_t>(step),
                                     static_cast<std::uint64_t>(micro), static_cast<std::uint64_t>(sample_index)));
  return static_cast<double>(rng.uniform()) < probability;
}

}  // namespace sdxl::data
