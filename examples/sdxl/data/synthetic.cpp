#include "data/synthetic.hpp"

#include <cmath>
#include <string>

#include "zero/core/error.hpp"

namespace sdxl::data {
namespace {

// Stream tags: one per purpose, so that e.g. the noise of sample 3 and the
// pattern of caption 3 are unrelated.
constexpr std::uint64_t kDrawStream = 1;
constexpr std::uint64_t kNoiseStream = 2;
constexpr std::uint64_t kPatternStream = 3;
constexpr std::uint64_t kEmbedStream = 4;
constexpr std::uint64_t kPooledStream = 5;

constexpr float kTwoPi = 6.28318530717958647692f;
// Uniform on [-sqrt(3), sqrt(3)] has unit variance.
constexpr float kSqrt3 = 1.73205080756887729353f;

float symmetric_unit_variance(SplitMix64& rng) { return (2.0f * rng.uniform() - 1.0f) * kSqrt3; }

}  // namespace

SyntheticDataset::SyntheticDataset(SyntheticOptions options) : options_(std::move(options)) {
  ZERO_CHECK(!options_.latent_sizes.empty(), "SyntheticDataset: latent_sizes is empty");
  for (const LatentSize& s : options_.latent_sizes)
    ZERO_CHECK(s.height > 0 && s.width > 0, "SyntheticDataset: latent size ", s, " is not positive");
  const TextDims& t = options_.text_dims;
  ZERO_CHECK(t.sequence_length > 0 && t.width > 0 && t.pooled_width > 0,
             "SyntheticDataset: text dims must be positive, got ", t);
  ZERO_CHECK(options_.num_captions > 0, "SyntheticDataset: num_captions must be > 0");
  ZERO_CHECK(options_.noise_std >= 0.0f, "SyntheticDataset: noise_std must be >= 0");
  constexpr std::uint64_t kEmptyPromptCode = ~std::uint64_t{0};
  empty_prompt_.prompt_embeds.resize(static_cast<std::size_t>(t.sequence_length * t.width));
  SplitMix64 embed(SplitMix64::combine(options_.seed, kEmbedStream, kEmptyPromptCode));
  for (float& v : empty_prompt_.prompt_embeds) v = symmetric_unit_variance(embed);
  empty_prompt_.pooled_prompt_embeds.resize(static_cast<std::size_t>(t.pooled_width));
  SplitMix64 pooled(SplitMix64::combine(options_.seed, kPooledStream, kEmptyPromptCode));
  for (float& v : empty_prompt_.pooled_prompt_embeds) v = symmetric_unit_variance(pooled);
}

SyntheticDataset::Draw SyntheticDataset::draw(std::size_t i) const {
  ZERO_CHECK(i < options_.num_samples, "sample index ", i, " out of range for a dataset of ",
             options_.num_samples);
  SplitMix64 rng(SplitMix64::combine(options_.seed, kDrawStream, i));
  const auto code = static_cast<std::size_t>(rng.bounded(options_.num_captions));
  const auto size_index = static_cast<std::size_t>(rng.bounded(options_.latent_sizes.size()));
  return {code, size_index};
}

LatentSize SyntheticDataset::bucket_of(std::size_t i) const { return options_.latent_sizes[draw(i).size_index]; }

std::size_t SyntheticDataset::caption_code(std::size_t i) const { return draw(i).code; }

Sample SyntheticDataset::sample(std::size_t i) const {
  const Draw d = draw(i);
  const LatentSize size = options_.latent_sizes[d.size_index];
  const TextDims& text = options_.text_dims;
  const auto code = static_cast<std::uint64_t>(d.code);

  Sample sample;
  sample.index = i;
  sample.latent_shape = {kLatentChannels, size.height, size.width};
  sample.latents.resize(static_cast<std::size_t>(kLatentChannels * size.height * size.width));
  SplitMix64 pattern(SplitMix64::combine(options_.seed, kPatternStream, code));
  SplitMix64 noise(SplitMix64::combine(options_.seed, kNoiseStream, i));
  float* out = sample.latents.data();
  for (std::int64_t k = 0; k < kLatentChannels; ++k) {
    // Up to two cycles per axis keeps the pattern low-frequency at any latent
    // size; amplitudes near 1 match the unit scale of VAE-scaled latents.
    const float fy = 2.0f * pattern.uniform();
    const float fx = 2.0f * pattern.uniform();
    const float phase = kTwoPi * pattern.uniform();
    const float amplitude = 0.5f + 0.5f * pattern.uniform();
    const float offset = pattern.uniform() - 0.5f;
    for (std::int64_t y = 0; y < size.height; ++y) {
      const float yn = (static_cast<float>(y) + 0.5f) / static_cast<float>(size.height);
      for (std::int64_t x = 0; x < size.width; ++x) {
        const float xn = (static_cast<float>(x) + 0.5f) / static_cast<float>(size.width);
        float value = offset + amplitude * std::cos(kTwoPi * (fy * yn + fx * xn) + phase);
        if (options_.noise_std > 0.0f) value += options_.noise_std * symmetric_unit_variance(noise);
        *out++ = value;
      }
    }
  }

  sample.prompt_embeds_shape = {text.sequence_length, text.width};
  sample.prompt_embeds.resize(static_cast<std::size_t>(text.sequence_length * text.width));
  SplitMix64 embed(SplitMix64::combine(options_.seed, kEmbedStream, code));
  for (float& v : sample.prompt_embeds) v = symmetric_unit_variance(embed);

  sample.pooled_prompt_embeds.resize(static_cast<std::size_t>(text.pooled_width));
  SplitMix64 pooled(SplitMix64::combine(options_.seed, kPooledStream, code));
  for (float& v : sample.pooled_prompt_embeds) v = symmetric_unit_variance(pooled);

  const auto h = static_cast<float>(8 * size.height);
  const auto w = static_cast<float>(8 * size.width);
  sample.time_ids = {h, w, 0.0f, 0.0f, h, w};
  sample.caption = "synthetic pattern " + std::to_string(d.code);
  return sample;
}

}  // namespace sdxl::data
