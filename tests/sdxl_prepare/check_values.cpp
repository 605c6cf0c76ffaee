// Checks the values prepare wrote against the models, computed here without
// prepare's code: the reference image's sample (and its flipped copy) must be
// the VAE posterior mean of the expected crop times the scaling factor, its
// text tensors both encoders' conditioning of its caption, and the cached
// empty prompt and validation prompts what the encoders give for them (read
// through CachedDataset's accessors). Used by check_prepare.py.
//
//   check_values PIPELINE DATASET IMAGE CAPTION TOP LEFT HEIGHT WIDTH
// (PIPELINE holds vae/, text_encoder*/ and tokenizer*/; the crop of IMAGE at
// (TOP, LEFT) of HEIGHT x WIDTH is the expected one: the test picks an image
// that needs no resizing.) Exit 0 when everything matches, 1 otherwise.
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "clip_text.hpp"
#include "clip_tokenizer.hpp"
#include "data/cached_dataset.hpp"
#include "vae.hpp"

#define STB_IMAGE_IMPLEMENTATION
#define STB_IMAGE_STATIC
#define STBI_ONLY_PNG
#include <stb_image.h>

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "ok  " : "FAIL", what.c_str());
  if (!ok) ++failures;
}

double relative_error(const torch::Tensor& got, const torch::Tensor& want) {
  return (got - want).norm().item<double>() / std::max(1e-12, want.norm().item<double>());
}

torch::Tensor ids(const sdxl::ClipTokenizer& tokenizer, const std::vector<std::string>& prompts) {
  std::vector<int64_t> flat;
  for (const auto& p : prompts) {
    const auto e = tokenizer.encode(p);
    flat.insert(flat.end(), e.input_ids.begin(), e.input_ids.end());
  }
  return torch::tensor(flat, torch::kInt64).view({static_cast<int64_t>(prompts.size()), -1});
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 9) {
    std::fprintf(stderr, "usage: check_values PIPELINE DATASET IMAGE CAPTION TOP LEFT HEIGHT WIDTH\n");
    return 2;
  }
  const std::string pipeline = argv[1], dataset_dir = argv[2], image_path = argv[3], caption = argv[4];
  const int64_t top = std::atoll(argv[5]), left = std::atoll(argv[6]), height = std::atoll(argv[7]),
                width = std::atoll(argv[8]);
  torch::NoGradGuard no_grad;
  auto vae = sdxl::load_vae(pipeline);
  auto encoders = sdxl::load_sdxl_text_encoders(pipeline);
  const auto tokenizer = sdxl::ClipTokenizer::load(pipeline + "/tokenizer");
  const auto tokenizer_2 = sdxl::ClipTokenizer::load(pipeline + "/tokenizer_2");
  auto condition = [&](const std::vector<std::string>& prompts) {
    return sdxl::sdxl_text_conditioning(*encoders.text_encoder, ids(tokenizer, prompts), *encoders.text_encoder_2,
                                        ids(tokenizer_2, prompts));
  };
  const auto dataset = sdxl::data::CachedDataset::open(dataset_dir);

  int w = 0, h = 0, n = 0;
  unsigned char* pixels = stbi_load(image_path.c_str(), &w, &h, &n, 3);
  if (!pixels) {
    std::fprintf(stderr, "cannot read %s\n", image_path.c_str());
    return 1;
  }
  const torch::Tensor image =
      torch::from_blob(pixels, {h, w, 3}, torch::kUInt8).permute({2, 0, 1}).to(torch::kFloat32).div(255.0);
  using torch::indexing::Slice;
  const torch::Tensor crop = image.index({Slice(), Slice(top, top + height), Slice(left, left + width)}).clone();
  stbi_image_free(pixels);

  const auto text = condition({caption});
  int found = 0;
  for (std::size_t i = 0; i < dataset->size(); ++i) {
    const auto& record = dataset->record(i);
    if (record.caption != caption) continue;
    ++found;
    const bool flipped = record.key.size() > 5 && record.key.substr(record.key.size() - 5) == "-flip";
    const torch::Tensor input = (flipped ? crop.flip({2}) : crop).mul(2).sub(1).unsqueeze(0);
    const torch::Tensor want = vae->encode(input).mean[0] * vae->config().scaling_factor;
    const auto sample = dataset->sample(i);
    const torch::Tensor got =
        torch::from_blob(const_cast<float*>(sample.latents.data()), {sample.latent_shape[0], sample.latent_shape[1],
                                                                     sample.latent_shape[2]}, torch::kFloat32);
    const std::string name = "sample " + record.key + (flipped ? " (flipped)" : "");
    check(got.sizes() == want.sizes(), name + ": latent shape is the crop's / VAE factor");
    if (got.sizes() == want.sizes())
      check(relative_error(got, want) < 1e-5,
            name + ": latents = VAE mean of the expected crop x scaling factor (rel. error " +
                std::to_string(relative_error(got, want)) + ")");
    // The flipped copy's crop is mirrored: its left edge in the flipped image.
    const int64_t want_left = flipped ? w - width - left : left;
    check(record.original_size == std::array<int64_t, 2>{h, w} &&
              record.crop_top_left == std::array<int64_t, 2>{top, want_left} &&
              record.target_size == std::array<int64_t, 2>{height, width},
          name + ": original_size, crop_top_left, target_size");
    const torch::Tensor embeds = torch::from_blob(const_cast<float*>(sample.prompt_embeds.data()),
                                                  {sample.prompt_embeds_shape[0], sample.prompt_embeds_shape[1]});
    const torch::Tensor pooled = torch::from_blob(const_cast<float*>(sample.pooled_prompt_embeds.data()),
                                                  {static_cast<int64_t>(sample.pooled_prompt_embeds.size())});
    check(relative_error(embeds, text.prompt_embeds[0]) < 1e-5 && relative_error(pooled, text.pooled_prompt_embeds[0]) < 1e-5,
          name + ": prompt_embeds and pooled are the encoders' of the caption");
  }
  check(found == 2, "the reference image has a sample and its flipped copy (found " + std::to_string(found) + ")");

  const auto* empty = dataset->empty_prompt();
  check(empty != nullptr, "the dataset carries the empty prompt");
  if (empty) {
    const auto want = condition({""});
    const torch::Tensor got = torch::from_blob(const_cast<float*>(empty->prompt_embeds.data()),
                                               want.prompt_embeds[0].sizes(), torch::kFloat32);
    check(relative_error(got, want.prompt_embeds[0]) < 1e-5, "empty prompt's prompt_embeds");
  }
  const auto* validation = dataset->validation_prompts();
  check(validation != nullptr, "the dataset carries validation prompts");
  if (validation) {
    const auto want = condition(validation->prompts);
    const torch::Tensor got = torch::from_blob(const_cast<float*>(validation->prompt_embeds.data()),
                                               want.prompt_embeds.sizes(), torch::kFloat32);
    const torch::Tensor got_pooled = torch::from_blob(const_cast<float*>(validation->pooled_prompt_embeds.data()),
                                                      want.pooled_prompt_embeds.sizes(), torch::kFloat32);
    check(validation->prompt_embeds.size() == static_cast<std::size_t>(want.prompt_embeds.numel()) &&
              relative_error(got, want.prompt_embeds) < 1e-5 && relative_error(got_pooled, want.pooled_prompt_embeds) < 1e-5,
          "validation prompts' embeddings (" + std::to_string(validation->prompts.size()) + " prompts)");
  }
  return failures ? 1 : 0;
}
