// Encoding one shard for prepare: its images decoded and checked
// (prepare_images.hpp), resized to cover their aspect-ratio bucket and
// centre-cropped, VAE-encoded (posterior mean, times the scaling factor), and
// their captions encoded by both text encoders.
#pragma once

#include <torch/torch.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "data/dataset.hpp"
#include "pipeline_source.hpp"
#include "prepare_images.hpp"
#include "prepare_options.hpp"
#include "prepare_work_list.hpp"
#include "vae.hpp"
#include "zero/comm/mpi_communicator.hpp"

namespace sdxl::prepare {

/// The VAE and both text encoders of --pipeline (or --single_file) on
/// --device in --dtype, and what the dataset's index records of them.
struct Models {
  sdxl::AutoencoderKL vae{nullptr};
  std::optional<sdxl::PromptEncoder> text;
  torch::Device device{torch::kCPU};
  sdxl::data::TextDims text_dims;
  double scaling_factor = 0;
  std::int64_t vae_factor = 8;  // image pixels per latent pixel
};

/// On --device cuda rank r uses the GPU local_rank (modulo the GPUs seen).
Models load_models(const Options& o, const zero::MpiCommunicator& comm);

struct SampleOut {
  Json record;  // key, latent_shape, original_size, crop_top_left, target_size, caption
  torch::Tensor latents, prompt_embeds, pooled;
};

struct ShardResult {
  std::vector<SampleOut> samples;
  Json skipped = Json::array();  // [{"image", "reason"}]
  std::size_t missing_captions = 0;
};

/// The images of `range` encoded into samples in image order, each flipped
/// copy (--flip) right after its original; bad images are reported and left
/// out (--bad_images skip) or end the run (refuse). `progress` is told the
/// shard's images done so far.
ShardResult encode_shard(const Options& o, Models& m, const std::vector<Bucket>& buckets,
                         const std::vector<ImageEntry>& entries, ShardRange range,
                         const std::function<void(std::size_t)>& progress);

}  // namespace sdxl::prepare
