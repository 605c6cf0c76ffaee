// Helpers shared by the data-layer tests: a scratch directory and random samples.
#pragma once

#include <stdlib.h>

#include <filesystem>
#include <random>
#include <stdexcept>
#include <string>

#include "data/dataset.hpp"

namespace sdxl::data::testing {

/// A fresh directory under the system temp dir, removed with its content.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "sdxl_data_test.XXXXXX").string();
    if (!::mkdtemp(pattern.data())) throw std::runtime_error("mkdtemp failed for " + pattern);
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

/// A sample of random normal values (the distribution does not matter, only
/// that the values are fresh and not representable-by-accident).
inline Sample random_sample(std::mt19937_64& rng, LatentSize size, const TextDims& text, std::string caption) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Sample s;
  s.latent_shape = {kLatentChannels, size.height, size.width};
  s.latents.resize(static_cast<std::size_t>(kLatentChannels * size.height * size.width));
  for (float& v : s.latents) v = normal(rng);
  s.prompt_embeds_shape = {text.sequence_length, text.width};
  s.prompt_embeds.resize(static_cast<std::size_t>(text.sequence_length * text.width));
  for (float& v : s.prompt_embeds) v = normal(rng);
  s.pooled_prompt_embeds.resize(static_cast<std::size_t>(text.pooled_width));
  for (float& v : s.pooled_prompt_embeds) v = normal(rng);
  s.caption = std::move(caption);
  return s;
}

}  // namespace sdxl::data::testing
