// SyntheticDataset: generated samples with a structure a model can learn, for
// smoke tests, benchmarks and the tiny configurations, where no cached
// dataset exists.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "data/dataset.hpp"

namespace sdxl::data {

struct SyntheticOptions {
  std::size_t num_samples = 1024;
  std::uint64_t seed = 0;
  /// Aspect-ratio buckets; each sample's is drawn from (seed, index).
  std::vector<LatentSize> latent_sizes{{128, 128}};
  /// Defaults to SDXL's; tiny UNet configs use e.g. {7, 64, 32}.
  TextDims text_dims;
  /// Number of distinct "captions" (pattern classes).
  std::size_t num_captions = 16;
  /// Per-sample noise added to the latent pattern, so that samples of one
  /// caption differ (uniform, this standard deviation; 0 for none).
  float noise_std = 0.1f;
};

/// Sample i of a SyntheticDataset is a function of (seed, i) only:
///
///  - a caption code c in [0, num_captions) and a latent size from
///    latent_sizes are drawn from (seed, i);
///  - the latent is, per channel k, a low-frequency plane wave
///      offset[c,k] + amplitude[c,k] * cos(2*pi*(fy[c,k]*y' + fx[c,k]*x') + phase[c,k])
///    over normalised coordinates y' = (y + 0.5)/h, x' = (x + 0.5)/w (at most
///    two cycles across the image, the same picture at every aspect ratio),
///    plus noise_std uniform noise from (seed, i). The pattern parameters are a
///    function of (seed, c);
///  - prompt_embeds and pooled_prompt_embeds are fixed pseudo-random vectors of
///    (seed, c), unit variance per element; so the caption code, and with it
///    the pattern, can be read off the text conditioning, which is what a UNet
///    learns to do through cross-attention and the added embedding;
///  - caption is "synthetic pattern <c>"; time ids are
///    (8h, 8w, 0, 0, 8h, 8w): the image "was" generated at the bucket size.
///
/// Integer-only draws make the codes, sizes and noise identical everywhere;
/// the latent values go through std::cos and are reproducible on a given
/// platform (libm's cos is not correctly rounded everywhere).
class SyntheticDataset final : public Dataset {
 public:
  /// Throws zero::InvalidArgument for an empty size list, non-positive sizes
  /// or text dims, zero captions, or negative noise.
  explicit SyntheticDataset(SyntheticOptions options);

  std::size_t size() const override { return options_.num_samples; }
  LatentSize bucket_of(std::size_t i) const override;
  Sample sample(std::size_t i) const override;
  TextDims text_dims() const override { return options_.text_dims; }
  /// Deterministic in the seed: the embedding streams of a caption code no
  /// sample has (2^64 - 1), so the "empty prompt" differs from every caption.
  const EmptyPrompt* empty_prompt() const override { return &empty_prompt_; }

  /// The caption code of sample i.
  std::size_t caption_code(std::size_t i) const;
  const SyntheticOptions& options() const noexcept { return options_; }

 private:
  struct Draw {
    std::size_t code;
    std::size_t size_index;
  };
  Draw draw(std::size_t i) const;

  SyntheticOptions options_;
  EmptyPrompt empty_prompt_;
};

}  // namespace sdxl::data
