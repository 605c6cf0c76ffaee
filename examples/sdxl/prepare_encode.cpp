#include "prepare_encode.hpp"

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <string>

#include "zero/core/error.hpp"

namespace sdxl::prepare {

namespace fs = std::filesystem;

Models load_models(const Options& o, const zero::MpiCommunicator& comm) {
  Models m;
  if (o.device == "cuda") {
    ZERO_CHECK(torch::cuda::is_available(), "--device cuda: LibTorch sees no CUDA device (this build or machine)");
    m.device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(comm.local_rank() %
                                                                            std::max<int>(1, torch::cuda::device_count())));
  }
  const auto options = torch::TensorOptions().dtype(o.dtype == "bf16" ? torch::kBFloat16 : torch::kFloat32).device(m.device);
  m.vae = sdxl::load_source_vae(o.models, options);
  m.text.emplace(o.models, options);
  m.text_dims = m.text->text_dims();
  m.scaling_factor = m.vae->config().scaling_factor;
  m.vae_factor = std::int64_t{1} << (m.vae->config().block_out_channels.size() - 1);
  return m;
}

namespace {

struct PreparedImage {
  std::size_t position;  // in the sorted list
  torch::Tensor pixels;  // [3, h, w] in [-1, 1], the bucket's size
  Bucket bucket;
  std::array<std::int64_t, 2> original_size, crop_top_left;
  std::string caption;
};

std::string read_caption(const fs::path& image, bool& missing) {
  fs::path path = image;
  path.replace_extension(".txt");
  std::ifstream in(path, std::ios::binary);
  missing = !in;
  if (!in) return {};
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto is_space = [](unsigned char ch) { return std::isspace(ch) != 0; };
  while (!text.empty() && is_space(static_cast<unsigned char>(text.back()))) text.pop_back();
  std::size_t start = 0;
  while (start < text.size() && is_space(static_cast<unsigned char>(text[start]))) ++start;
  return text.substr(start);
}

// Resized to cover the bucket (bicubic with antialiasing, so that downscaling
// averages instead of aliasing) and cropped at the centre: [3, h, w] in [-1, 1].
torch::Tensor fit_to_bucket(const sdxl::prepare::RgbImage& image, const Bucket& bucket,
                            const sdxl::prepare::Placement& place) {
  torch::Tensor pixels = torch::from_blob(const_cast<std::uint8_t*>(image.rgb.data()), {image.height, image.width, 3},
                                          torch::kUInt8)
                             .permute({2, 0, 1})
                             .to(torch::kFloat32)
                             .div(255.0);
  if (place.resized_height != image.height || place.resized_width != image.width) {
    namespace F = torch::nn::functional;
    pixels = F::interpolate(pixels.unsqueeze(0), F::InterpolateFuncOptions()
                                                     .size(std::vector<std::int64_t>{place.resized_height,
                                                                                     place.resized_width})
                                                     .mode(torch::kBicubic)
                                                     .align_corners(false)
                                                     .antialias(true))
                 .squeeze(0)
                 .clamp(0.0, 1.0);
  }
  using torch::indexing::Slice;
  pixels = pixels.index({Slice(), Slice(place.crop_top, place.crop_top + bucket.height),
                         Slice(place.crop_left, place.crop_left + bucket.width)});
  return pixels.mul(2.0).sub(1.0).contiguous();
}

// Reports a bad image: recorded (skip) or the end of the run (refuse).
void bad_image(const Options& o, ShardResult& result, const ImageEntry& e, const std::string& reason) {
  const std::string where = (fs::path(o.images) / e.relative).string();
  if (o.bad_images == "refuse")
    ZERO_THROW(zero::InvalidArgument, "bad image '", where, "': ", reason,
               " (--bad_images refuse; remove the file or run with --bad_images skip)");
  std::fprintf(stderr, "prepare: skipping image '%s': %s\n", where.c_str(), reason.c_str());
  result.skipped.push_back({{"image", e.relative}, {"reason", reason}});
}

}  // namespace

ShardResult encode_shard(const Options& o, Models& m, const std::vector<Bucket>& buckets,
                         const std::vector<ImageEntry>& entries, ShardRange range,
                         const std::function<void(std::size_t)>& progress) {
  ShardResult result;
  std::vector<PreparedImage> prepared;
  sdxl::prepare::ImageLimits limits{o.max_image_pixels};
  for (std::size_t i = range.begin; i < range.end; ++i) {
    const ImageEntry& e = entries[i];
    if (!e.supported) {
      bad_image(o, result, e, "unsupported format (extension " + e.path.extension().string() +
                                  "); prepare reads JPEG, PNG and WebP");
      continue;
    }
    sdxl::prepare::ImageResult read = sdxl::prepare::read_image(e.path, limits);
    if (!read.image) {
      bad_image(o, result, e, read.problem);
      continue;
    }
    const auto& image = *read.image;
    const Bucket bucket = sdxl::prepare::nearest_bucket(image.height, image.width, buckets);
    const auto place = sdxl::prepare::place_in_bucket(image.height, image.width, bucket);
    bool missing = false;
    std::string caption = read_caption(e.path, missing);
    try {
      (void)m.text->tokenizer().token_ids(caption);
    } catch (const zero::InvalidArgument&) {
      bad_image(o, result, e, "its caption file is not valid UTF-8");
      continue;
    }
    if (missing) ++result.missing_captions;
    prepared.push_back({i, fit_to_bucket(image, bucket, place), bucket, {image.height, image.width},
                        {place.crop_top, place.crop_left}, std::move(caption)});
  }

  // Samples in image order, the flipped copy right after its original.
  struct Pending {
    std::size_t prepared_index;
    bool flipped;
  };
  std::vector<Pending> order;
  for (std::size_t p = 0; p < prepared.size(); ++p) {
    order.push_back({p, false});
    if (o.flip) order.push_back({p, true});
  }
  result.samples.resize(order.size());

  // Latents: batches of one bucket each (the VAE takes one size per call),
  // buckets in (height, width) order, images in sample order within a bucket.
  torch::NoGradGuard no_grad;
  std::map<Bucket, std::vector<std::size_t>> by_bucket;
  for (std::size_t s = 0; s < order.size(); ++s) by_bucket[prepared[order[s].prepared_index].bucket].push_back(s);
  const auto batch = static_cast<std::size_t>(o.batch_size);
  std::size_t done = 0;
  for (const auto& [bucket, members] : by_bucket) {
    for (std::size_t start = 0; start < members.size(); start += batch) {
      const std::size_t stop = std::min(members.size(), start + batch);
      std::vector<torch::Tensor> images;
      for (std::size_t k = start; k < stop; ++k) {
        const Pending& pending = order[members[k]];
        const torch::Tensor& pixels = prepared[pending.prepared_index].pixels;
        images.push_back(pending.flipped ? pixels.flip({2}) : pixels);
      }
      const torch::Tensor input = torch::stack(images).to(m.device, m.vae->compute_dtype());
      const torch::Tensor latents =
          (m.vae->encode(input).mode().to(torch::kFloat32) * m.scaling_factor).to(torch::kCPU).contiguous();
      for (std::size_t k = start; k < stop; ++k) result.samples[members[k]].latents = latents[static_cast<std::int64_t>(k - start)];
      done += stop - start;
      progress(o.flip ? done / 2 : done);
    }
  }

  // Text, in sample order.
  for (std::size_t start = 0; start < order.size(); start += batch) {
    const std::size_t stop = std::min(order.size(), start + batch);
    std::vector<std::string> captions;
    for (std::size_t s = start; s < stop; ++s) captions.push_back(prepared[order[s].prepared_index].caption);
    auto [embeds, pooled] = m.text->encode(captions);
    for (std::size_t s = start; s < stop; ++s) {
      result.samples[s].prompt_embeds = embeds[static_cast<std::int64_t>(s - start)];
      result.samples[s].pooled = pooled[static_cast<std::int64_t>(s - start)];
    }
  }

  for (std::size_t s = 0; s < order.size(); ++s) {
    const PreparedImage& p = prepared[order[s].prepared_index];
    const Bucket& b = p.bucket;
    // The flipped copy's crop is the mirror image of the original's: its left
    // edge measured in the flipped resized image.
    const auto place = sdxl::prepare::place_in_bucket(p.original_size[0], p.original_size[1], b);
    const std::int64_t left = order[s].flipped ? place.resized_width - b.width - p.crop_top_left[1] : p.crop_top_left[1];
    Json record{{"key", std::to_string(p.position) + (order[s].flipped ? "-flip" : "")},
                {"latent_shape", {sdxl::data::kLatentChannels, b.height / m.vae_factor, b.width / m.vae_factor}},
                {"original_size", p.original_size},
                {"crop_top_left", {p.crop_top_left[0], left}},
                {"target_size", {b.height, b.width}},
                {"image", entries[p.position].relative}};
    if (!p.caption.empty()) record["caption"] = p.caption;
    result.samples[s].record = std::move(record);
  }
  return result;
}

}  // namespace sdxl::prepare
