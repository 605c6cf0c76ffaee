// prepare: a folder of images and captions -> the cached SDXL dataset the
// trainer reads (docs/dataset.md), in C++ with LibTorch, across MPI ranks.
//
//   mpirun -np N prepare --pipeline DIR --images DIR --output DATASET [options]
//
// The story of one run:
//   1. Every rank lists --images the same way (sorted by relative path) and
//      cuts the list into work shards of --shard_size images; shard k is
//      encoded by rank k % N, so the dataset does not depend on N.
//   2. A shard whose state record (prepare-state/shard-K.json) says it was
//      finished with the same settings and inputs, and whose file still has
//      the recorded size and CRC, is kept; the others are encoded: images
//      decoded and checked (prepare_images.hpp), resized to cover their
//      aspect-ratio bucket and centre-cropped, VAE-encoded (posterior mean,
//      times the scaling factor), captions encoded by both text encoders.
//      The shard file is written atomically, then its state record.
//   3. After a barrier rank 0 encodes the empty prompt (and the validation
//      prompts), checks every shard's record and writes index.json last,
//      atomically: a directory with index.json is a complete dataset.
// Any exception on any rank ends every rank (zero::run_or_abort): nothing
// waits forever for a rank that failed.
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <thread>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "clip_text.hpp"
#include "clip_tokenizer.hpp"
#include "pipeline_source.hpp"
#include "data/cached_dataset.hpp"
#include "pipeline_folder.hpp"
#include "prepare_images.hpp"
#include "torch_errors.hpp"
#include "vae.hpp"
#include "zero/comm/mpi_communicator.hpp"
#include "zero/core/error.hpp"
#include "zero/io/atomic_file.hpp"
#include "zero/io/crc32c.hpp"
#include "zero/io/safetensors.hpp"

namespace {

using Json = nlohmann::json;
namespace fs = std::filesystem;
using sdxl::prepare::Bucket;

constexpr const char* kStateDir = "prepare-state";
constexpr const char* kValidationPromptsFile = "validation_prompts.safetensors";

// ------------------------------------------------------------------ options

struct Options {
  sdxl::PipelineSource models;
  std::string images, output;
  std::int64_t resolution = 1024;
  std::int64_t bucket_step = 64;
  double max_aspect_ratio = 4.0;
  std::string buckets;  // explicit "HxW,..." list, replaces the generated ones
  bool flip = false;
  std::string bad_images = "skip";
  std::int64_t max_image_pixels = 100'000'000;
  std::string device = "cpu";
  std::string dtype = "fp32";
  std::string save_dtype = "fp16";
  std::int64_t batch_size = 4;
  std::int64_t shard_size = 256;
  std::string validation_prompts;
  bool overwrite = false;
  int threads = 0;  // 0: the host's cores / ranks on it
};

bool parse_options(int argc, char** argv, Options& o, int rank) {
  CLI::App app{"prepare: images + .txt captions -> the cached SDXL dataset (docs/dataset.md)"};
  auto* pipeline = app.add_option("--pipeline", o.models.pipeline, "diffusers SDXL pipeline folder (vae/, text_encoder/, "
                                                            "text_encoder_2/, tokenizer/, tokenizer_2/)");
  auto* single = app.add_option("--single_file", o.models.single_file, "original single-file SDXL checkpoint (.safetensors); "
                                                                "needs --tokenizer and --tokenizer_2");
  pipeline->excludes(single);
  app.add_option("--tokenizer", o.models.tokenizer, "tokenizer folder (default: PIPELINE/tokenizer)");
  app.add_option("--tokenizer_2", o.models.tokenizer_2, "second tokenizer folder (default: PIPELINE/tokenizer_2)");
  app.add_option("--images", o.images, "folder of images (.jpg .jpeg .png .webp, searched recursively) with "
                                       "same-named .txt captions")->required();
  app.add_option("--output", o.output, "dataset folder to write")->required();
  app.add_option("--resolution", o.resolution, "bucket area is about resolution^2 pixels")->capture_default_str();
  app.add_option("--bucket_step", o.bucket_step, "bucket sides are multiples of this (pixels)")->capture_default_str();
  app.add_option("--max_aspect_ratio", o.max_aspect_ratio, "longest over shortest bucket side at most")
      ->capture_default_str();
  app.add_option("--buckets", o.buckets, "explicit buckets HxW,HxW,... (replaces the generated ones)");
  app.add_flag("--flip", o.flip, "also write a horizontally flipped copy of every image");
  app.add_option("--bad_images", o.bad_images, "skip (report and go on) or refuse (stop at the first)")
      ->check(CLI::IsMember({"skip", "refuse"}))->capture_default_str();
  app.add_option("--max_image_pixels", o.max_image_pixels, "larger images are bad images")->capture_default_str();
  app.add_option("--device", o.device, "cpu or cuda (rank r uses GPU local_rank)")
      ->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  app.add_option("--dtype", o.dtype, "compute dtype of the VAE and text encoders")
      ->check(CLI::IsMember({"fp32", "bf16"}))->capture_default_str();
  app.add_option("--save_dtype", o.save_dtype, "storage dtype of latents and embeddings")
      ->check(CLI::IsMember({"fp16", "bf16", "fp32"}))->capture_default_str();
  app.add_option("--batch_size", o.batch_size, "images per VAE / text-encoder call")->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--shard_size", o.shard_size, "images per shard (the unit of work, of resume and of files)")
      ->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--validation_prompts", o.validation_prompts, "text file, one prompt per line: their embeddings "
                                                               "are cached too (validation_prompts.safetensors)");
  app.add_option("--threads", o.threads, "LibTorch CPU threads per rank (0: the host's cores / ranks on it); "
                                       "the same count on every run gives byte-identical shards")
      ->capture_default_str();
  app.add_flag("--overwrite", o.overwrite, "replace a finished dataset in --output (finished shards of an "
                                           "interrupted run are kept without it)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (rank == 0 || e.get_exit_code() != 0) app.exit(e);
    if (e.get_exit_code() == 0) return false;
    std::exit(e.get_exit_code());
  }
  o.models.resolve(/*needs_tokenizers=*/true);
  return true;
}

// ------------------------------------------------------------------ the work list

struct ImageEntry {
  std::string relative;  // sorted by this (byte order)
  fs::path path;
  bool supported = true;  // false: an extension prepare does not read (reported as bad)
};

std::vector<ImageEntry> list_images(const fs::path& root) {
  std::error_code error;
  ZERO_CHECK(fs::is_directory(root, error), "--images '", root.string(), "' is not a folder");
  std::vector<ImageEntry> entries;
  for (auto it = fs::recursive_directory_iterator(root, fs::directory_options::skip_permission_denied);
       it != fs::recursive_directory_iterator(); ++it) {
    const std::string name = it->path().filename().string();
    if (!name.empty() && name[0] == '.') {  // hidden files and folders
      if (it->is_directory()) it.disable_recursion_pending();
      continue;
    }
    if (!it->is_regular_file()) continue;
    const auto kind = sdxl::prepare::classify_file(it->path());
    if (kind == sdxl::prepare::FileKind::other) continue;
    entries.push_back({fs::relative(it->path(), root).generic_string(), it->path(),
                       kind == sdxl::prepare::FileKind::image});
  }
  std::sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) { return a.relative < b.relative; });
  return entries;
}

// The inputs of one image as they are on disk, for the shard fingerprint:
// a changed image or caption makes its shard be encoded again.
Json input_identity(const ImageEntry& e) {
  auto stamp = [](const fs::path& p) -> Json {
    std::error_code error;
    const auto size = fs::file_size(p, error);
    if (error) return nullptr;
    const auto time = fs::last_write_time(p, error).time_since_epoch().count();
    return Json::array({size, static_cast<long long>(time)});
  };
  fs::path caption = e.path;
  caption.replace_extension(".txt");
  return Json::array({e.relative, stamp(e.path), stamp(caption)});
}

struct ShardRange {
  std::size_t begin = 0, end = 0;
};
ShardRange shard_range(std::size_t shard, std::size_t shard_size, std::size_t total) {
  return {shard * shard_size, std::min(total, (shard + 1) * shard_size)};
}

std::string state_name(std::size_t shard) {
  char name[64];
  std::snprintf(name, sizeof name, "shard-%05zu.json", shard);
  return name;
}

// ------------------------------------------------------------------ models

struct Models {
  sdxl::AutoencoderKL vae{nullptr};
  std::optional<sdxl::PromptEncoder> text;
  torch::Device device{torch::kCPU};
  sdxl::data::TextDims text_dims;
  double scaling_factor = 0;
  std::int64_t vae_factor = 8;  // image pixels per latent pixel
};

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

// ------------------------------------------------------------------ one shard

struct SampleOut {
  Json record;  // key, latent_shape, original_size, crop_top_left, target_size, caption
  torch::Tensor latents, prompt_embeds, pooled;
};

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

struct ShardResult {
  std::vector<SampleOut> samples;
  Json skipped = Json::array();  // [{"image", "reason"}]
  std::size_t missing_captions = 0;
};

// Reports a bad image: recorded (skip) or the end of the run (refuse).
void bad_image(const Options& o, ShardResult& result, const ImageEntry& e, const std::string& reason) {
  const std::string where = (fs::path(o.images) / e.relative).string();
  if (o.bad_images == "refuse")
    ZERO_THROW(zero::InvalidArgument, "bad image '", where, "': ", reason,
               " (--bad_images refuse; remove the file or run with --bad_images skip)");
  std::fprintf(stderr, "prepare: skipping image '%s': %s\n", where.c_str(), reason.c_str());
  result.skipped.push_back({{"image", e.relative}, {"reason", reason}});
}

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

torch::ScalarType storage_type(const std::string& name) {
  return name == "fp16" ? torch::kFloat16 : name == "bf16" ? torch::kBFloat16 : torch::kFloat32;
}
zero::io::TensorDType storage_dtype(const std::string& name) {
  return name == "fp16" ? zero::io::TensorDType::F16
                        : name == "bf16" ? zero::io::TensorDType::BF16 : zero::io::TensorDType::F32;
}

std::vector<std::int64_t> shape_of(const torch::Tensor& t) { return {t.sizes().begin(), t.sizes().end()}; }

// Writes tensors (already contiguous CPU float32) in the storage dtype.
void write_tensors(const fs::path& path, const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                   const std::string& save_dtype) {
  std::vector<torch::Tensor> stored;
  std::vector<zero::io::TensorView> views;
  for (const auto& [name, tensor] : tensors) stored.push_back(tensor.to(storage_type(save_dtype)).contiguous());
  for (std::size_t i = 0; i < tensors.size(); ++i)
    views.push_back({tensors[i].first, storage_dtype(save_dtype), shape_of(stored[i]), stored[i].data_ptr()});
  zero::io::write_safetensors(path, views, {{"format", sdxl::data::kCachedFormatName}});
}

std::uint32_t file_crc(const fs::path& path, std::uint64_t& size) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return 0;
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  size = bytes.size();
  return zero::io::crc32c(std::string_view(bytes));
}

void write_json_atomically(const fs::path& path, const Json& value) {
  const std::string text = value.dump(1) + "\n";
  zero::io::write_file_atomically(path, std::as_bytes(std::span<const char>(text.data(), text.size())));
}

std::optional<Json> read_json(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  try {
    return Json::parse(in);
  } catch (const Json::exception&) {
    return std::nullopt;
  }
}

// A finished shard's state record, if it is valid for `settings`: same
// settings and inputs, and the shard file (if it has samples) with the
// recorded size and CRC. Anything else means the shard is encoded again.
std::optional<Json> finished_shard(const fs::path& output, std::size_t shard, const Json& settings) {
  std::optional<Json> state = read_json(output / kStateDir / state_name(shard));
  if (!state || !state->is_object() || !state->contains("settings") || (*state)["settings"] != settings ||
      !state->contains("samples") || !(*state)["samples"].is_array())
    return std::nullopt;
  if ((*state)["samples"].empty()) return state;
  std::uint64_t size = 0;
  const std::uint32_t crc = file_crc(output / sdxl::data::shard_file_name(shard), size);
  if (!state->contains("size") || !state->contains("crc32c") || (*state)["size"] != size || (*state)["crc32c"] != crc)
    return std::nullopt;
  return state;
}

// ------------------------------------------------------------------ progress (rank 0)

class Progress {
 public:
  Progress(std::size_t total, std::size_t already) : total_(total), start_done_(already) {}
  // `done`: images finished on all ranks as far as rank 0 can see.
  void report(std::size_t done, bool force = false) {
    const auto now = std::chrono::steady_clock::now();
    if (!force && now - last_ < std::chrono::seconds(2)) return;
    last_ = now;
    const double seconds = std::chrono::duration<double>(now - start_).count();
    const double rate = seconds > 0 ? static_cast<double>(done - std::min(done, start_done_)) / seconds : 0.0;
    char eta[32] = "?";
    if (rate > 0) std::snprintf(eta, sizeof eta, "%.0f s", static_cast<double>(total_ - std::min(total_, done)) / rate);
    std::printf("prepare: %zu/%zu images, %.2f images/s, ETA %s\n", done, total_, rate, eta);
    std::fflush(stdout);
  }

 private:
  std::size_t total_, start_done_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point last_{};
};

// Images in shards whose state record exists (any rank's): what rank 0 can
// count without a collective.
std::size_t images_in_finished_shards(const fs::path& output, std::size_t shards, std::size_t shard_size,
                                      std::size_t total) {
  std::size_t done = 0;
  std::error_code error;
  for (std::size_t k = 0; k < shards; ++k)
    if (fs::exists(output / kStateDir / state_name(k), error)) {
      const ShardRange r = shard_range(k, shard_size, total);
      done += r.end - r.begin;
    }
  return done;
}

// ------------------------------------------------------------------ index (rank 0)

std::vector<std::string> read_prompt_lines(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  ZERO_CHECK(static_cast<bool>(in), "--validation_prompts '", file, "': cannot be read");
  std::vector<std::string> prompts;
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;  // blank lines separate nothing
    prompts.push_back(line);
  }
  ZERO_CHECK(!prompts.empty(), "--validation_prompts '", file, "': no prompt in it (one prompt per line)");
  return prompts;
}

std::uint64_t size_of(const fs::path& path) {
  std::error_code error;
  const auto size = fs::file_size(path, error);
  if (error) ZERO_THROW(zero::IoError, "cannot stat '", path.string(), "': ", error.message());
  return size;
}

void write_index(const Options& o, Models& m, std::size_t shards, const std::function<Json(std::size_t)>& settings_of,
                 std::size_t images) {
  const fs::path output = o.output;
  Json shard_entries = Json::array();
  std::vector<Json> samples;
  Json skipped = Json::array();
  std::size_t missing_captions = 0;
  for (std::size_t k = 0; k < shards; ++k) {
    const std::optional<Json> state = finished_shard(output, k, settings_of(k));
    ZERO_CHECK(state.has_value(), "prepare: shard ", k, " is not finished after every rank was done (",
               (output / kStateDir / state_name(k)).string(), "): the output folder must be shared by all ranks");
    for (const Json& s : (*state)["skipped"]) skipped.push_back(s);
    missing_captions += (*state)["missing_captions"].get<std::size_t>();
    if ((*state)["samples"].empty()) continue;
    const std::size_t position = shard_entries.size();
    shard_entries.push_back({{"file", sdxl::data::shard_file_name(k)},
                             {"num_samples", (*state)["samples"].size()},
                             {"size", (*state)["size"]}});
    for (Json record : (*state)["samples"]) {
      record.erase("image");
      Json entry{{"shard", position}};
      for (auto it = record.begin(); it != record.end(); ++it) entry[it.key()] = it.value();
      samples.push_back(std::move(entry));
    }
  }
  ZERO_CHECK(!samples.empty(), "prepare: no usable image in '", o.images, "' (", skipped.size(),
             " bad images); nothing written");

  // The empty prompt (caption dropout) and the validation prompts.
  const auto& dims = m.text_dims;
  auto [empty_embeds, empty_pooled] = m.text->encode({""});
  write_tensors(output / sdxl::data::kEmptyPromptFileName,
                {{"prompt_embeds", empty_embeds[0]}, {"pooled_prompt_embeds", empty_pooled[0]}}, o.save_dtype);
  std::optional<Json> validation;
  if (!o.validation_prompts.empty()) {
    const std::vector<std::string> prompts = read_prompt_lines(o.validation_prompts);
    std::vector<torch::Tensor> embeds, pooled;
    for (std::size_t start = 0; start < prompts.size(); start += static_cast<std::size_t>(o.batch_size)) {
      const std::vector<std::string> part(prompts.begin() + static_cast<std::ptrdiff_t>(start),
                                          prompts.begin() + static_cast<std::ptrdiff_t>(std::min(
                                                                prompts.size(), start + static_cast<std::size_t>(o.batch_size))));
      auto [e, p] = m.text->encode(part);
      embeds.push_back(e);
      pooled.push_back(p);
    }
    write_tensors(output / kValidationPromptsFile,
                  {{"prompt_embeds", torch::cat(embeds)}, {"pooled_prompt_embeds", torch::cat(pooled)}}, o.save_dtype);
    validation = Json{{"file", kValidationPromptsFile}, {"size", size_of(output / kValidationPromptsFile)},
                      {"prompts", prompts}};
  }

  std::ostringstream out;
  out << "{\n";
  out << "  \"format\": " << Json(sdxl::data::kCachedFormatName).dump() << ",\n";
  out << "  \"version\": " << sdxl::data::kCachedFormatVersion << ",\n";
  out << "  \"latent_channels\": " << sdxl::data::kLatentChannels << ",\n";
  out << "  \"vae_scaling_factor\": " << Json(m.scaling_factor).dump() << ",\n";
  out << "  \"text\": "
      << Json{{"sequence_length", dims.sequence_length}, {"width", dims.width}, {"pooled_width", dims.pooled_width}}.dump()
      << ",\n";
  out << "  \"empty_prompt\": "
      << Json{{"file", sdxl::data::kEmptyPromptFileName}, {"size", size_of(output / sdxl::data::kEmptyPromptFileName)}}
             .dump()
      << ",\n";
  if (validation) out << "  \"validation_prompts\": " << validation->dump() << ",\n";
  out << "  \"num_samples\": " << samples.size() << ",\n";
  out << "  \"shards\": [\n";
  for (std::size_t s = 0; s < shard_entries.size(); ++s)
    out << "    " << shard_entries[s].dump() << (s + 1 < shard_entries.size() ? ",\n" : "\n");
  out << "  ],\n  \"samples\": [\n";
  for (std::size_t i = 0; i < samples.size(); ++i)
    out << "    " << samples[i].dump() << (i + 1 < samples.size() ? ",\n" : "\n");
  out << "  ]\n}\n";
  const std::string text = out.str();
  zero::io::write_file_atomically(output / sdxl::data::kIndexFileName,
                                  std::as_bytes(std::span<const char>(text.data(), text.size())));

  // Checked as the trainer will open it.
  const auto dataset = sdxl::data::CachedDataset::open(output);
  std::printf("prepare: wrote %s: %zu samples from %zu images in %zu shards (%s)\n", o.output.c_str(),
              dataset->size(), images - skipped.size(), shard_entries.size(), o.flip ? "with flipped copies" : "no flip");
  if (missing_captions)
    std::printf("prepare: %zu images have no .txt caption: trained with the empty caption\n", missing_captions);
  if (!skipped.empty()) {
    std::printf("prepare: skipped %zu bad images:\n", skipped.size());
    for (const Json& s : skipped)
      std::printf("  %s: %s\n", s["image"].get<std::string>().c_str(), s["reason"].get<std::string>().c_str());
  }
}

// ------------------------------------------------------------------ main

int run(int argc, char** argv) {
  zero::MpiSession session(&argc, &argv);
  zero::MpiCommunicator comm;
  const bool leader = comm.rank() == 0;
  Options o;
  if (!parse_options(argc, argv, o, comm.rank())) return 0;
  at::set_num_threads(o.threads > 0 ? o.threads
                                     : std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / comm.local_size()));
  const fs::path output = o.output;

  // An existing finished dataset is replaced only when asked; its index goes
  // first, so an interrupted rewrite never looks finished.
  if (leader) {
    std::error_code error;
    fs::create_directories(output / kStateDir, error);
    if (error) ZERO_THROW(zero::IoError, "--output '", o.output, "': cannot create: ", error.message());
    // Temporary files of writers that were killed (AtomicFileWriter names
    // them .<target>.tmp.<pid>.<random>): never a finished file, only litter.
    for (const fs::path& dir : {output, output / kStateDir})
      for (const auto& entry : fs::directory_iterator(dir)) {
        const std::string name = entry.path().filename().string();
        if (name.size() > 1 && name[0] == '.' && name.find(".tmp.") != std::string::npos) fs::remove(entry.path());
      }
    if (fs::exists(output / sdxl::data::kIndexFileName)) {
      ZERO_CHECK(o.overwrite, "--output '", o.output, "' already holds a finished dataset (index.json); pass --overwrite "
                 "to replace it");
      fs::remove(output / sdxl::data::kIndexFileName);
      for (const auto& entry : fs::directory_iterator(output / kStateDir)) fs::remove(entry.path());
      zero::io::fsync_directory(output);
    }
  }
  comm.barrier();

  Models m = load_models(o, comm);
  ZERO_CHECK(o.bucket_step % m.vae_factor == 0, "--bucket_step ", o.bucket_step,
             " must be a multiple of the VAE's downsampling factor ", m.vae_factor);
  const std::vector<Bucket> buckets = o.buckets.empty()
                                          ? sdxl::prepare::make_buckets(o.resolution, o.bucket_step, o.max_aspect_ratio)
                                          : sdxl::prepare::parse_buckets(o.buckets, m.vae_factor);
  const std::vector<ImageEntry> entries = list_images(o.images);
  ZERO_CHECK(!entries.empty(), "--images '", o.images, "': no image files (.jpg .jpeg .png .webp) in it");
  const std::size_t shard_size = static_cast<std::size_t>(o.shard_size);
  const std::size_t shards = (entries.size() + shard_size - 1) / shard_size;

  Json bucket_list = Json::array();
  for (const Bucket& b : buckets) bucket_list.push_back({b.height, b.width});
  const Json settings_common{
      {"pipeline", o.models.pipeline.empty() ? "" : fs::absolute(o.models.pipeline).lexically_normal().string()},
      {"single_file", o.models.single_file.empty() ? "" : fs::absolute(o.models.single_file).lexically_normal().string()},
      {"tokenizers", {fs::absolute(o.models.tokenizer).lexically_normal().string(),
                      fs::absolute(o.models.tokenizer_2).lexically_normal().string()}},
      {"buckets", bucket_list}, {"flip", o.flip}, {"dtype", o.dtype}, {"save_dtype", o.save_dtype},
      {"max_image_pixels", o.max_image_pixels}, {"batch_size", o.batch_size}, {"shard_size", o.shard_size}};
  auto settings_of = [&](std::size_t k) {
    Json settings = settings_common;
    const ShardRange r = shard_range(k, shard_size, entries.size());
    Json inputs = Json::array();
    for (std::size_t i = r.begin; i < r.end; ++i) inputs.push_back(input_identity(entries[i]));
    settings["inputs"] = std::move(inputs);
    return settings;
  };

  if (leader)
    std::printf("prepare: %zu images in %zu shards of %zu, %d ranks, %zu buckets (%s)\n", entries.size(), shards,
                shard_size, comm.size(), buckets.size(),
                o.buckets.empty() ? ("resolution " + std::to_string(o.resolution)).c_str() : "--buckets");
  std::optional<Progress> progress;
  if (leader) progress.emplace(entries.size(), images_in_finished_shards(output, shards, shard_size, entries.size()));

  double counts[2] = {0, 0};  // shards kept, shards encoded
  for (std::size_t k = static_cast<std::size_t>(comm.rank()); k < shards; k += static_cast<std::size_t>(comm.size())) {
    const Json settings = settings_of(k);
    if (finished_shard(output, k, settings)) {
      ++counts[0];
      continue;
    }
    const ShardRange range = shard_range(k, shard_size, entries.size());
    // A stale record goes before the shard file is replaced: a crash in
    // between leaves a shard without a record, which is encoded again.
    std::error_code ignored;
    fs::remove(output / kStateDir / state_name(k), ignored);
    ShardResult result = encode_shard(o, m, buckets, entries, range, [&](std::size_t images_done) {
      if (progress)
        progress->report(images_in_finished_shards(output, shards, shard_size, entries.size()) + images_done);
    });
    Json state{{"settings", settings}, {"samples", Json::array()}, {"skipped", result.skipped},
               {"missing_captions", result.missing_captions}};
    if (!result.samples.empty()) {
      std::vector<std::pair<std::string, torch::Tensor>> tensors;
      for (const SampleOut& s : result.samples) {
        const std::string key = s.record["key"];
        tensors.push_back({key + ".latents", s.latents});
        tensors.push_back({key + ".prompt_embeds", s.prompt_embeds});
        tensors.push_back({key + ".pooled_prompt_embeds", s.pooled});
        state["samples"].push_back(s.record);
      }
      const fs::path shard_path = output / sdxl::data::shard_file_name(k);
      write_tensors(shard_path, tensors, o.save_dtype);
      std::uint64_t size = 0;
      state["crc32c"] = file_crc(shard_path, size);
      state["size"] = size;
    }
    write_json_atomically(output / kStateDir / state_name(k), state);
    ++counts[1];
    if (progress) progress->report(images_in_finished_shards(output, shards, shard_size, entries.size()));
  }
  comm.all_reduce_host_f64(counts, 2, zero::ReduceOp::sum);  // also the barrier before the index
  if (leader) {
    progress->report(entries.size(), true);
    std::printf("prepare: shards: %.0f kept from an earlier run, %.0f encoded now\n", counts[0], counts[1]);
    write_index(o, m, shards, settings_of, entries.size());
  }
  comm.barrier();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return zero::run_or_abort([&] { return run(argc, argv); }, sdxl::describe_torch_failure);
}
