// prepare: a folder of images and captions -> the cached SDXL dataset the
// trainer reads (docs/dataset.md), in C++ with LibTorch, across MPI ranks.
//
//   mpirun -np N prepare --pipeline DIR --images DIR --output DATASET [options]
//
// The story of one run:
//   1. Every rank lists --images the same way (sorted by relative path) and
//      cuts the list into work shards of --shard_size images; shard k is
//      encoded by rank k % N, so the dataset does not depend on N
//      (prepare_work_list.hpp).
//   2. A shard whose state record (prepare-state/shard-K.json) says it was
//      finished with the same settings and inputs, and whose file still has
//      the recorded size and CRC, is kept; the others are encoded: images
//      decoded and checked (prepare_images.hpp), resized to cover their
//      aspect-ratio bucket and centre-cropped, VAE-encoded (posterior mean,
//      times the scaling factor), captions encoded by both text encoders
//      (prepare_encode.hpp). The shard file is written atomically, then its
//      state record (prepare_shards.hpp).
//   3. After a barrier rank 0 encodes the empty prompt (and the validation
//      prompts), checks every shard's record and writes index.json last,
//      atomically: a directory with index.json is a complete dataset.
// Any exception on any rank ends every rank (zero::run_or_abort): nothing
// waits forever for a rank that failed.
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <thread>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "data/cached_dataset.hpp"
#include "prepare_encode.hpp"
#include "prepare_images.hpp"
#include "prepare_options.hpp"
#include "prepare_shards.hpp"
#include "prepare_work_list.hpp"
#include "torch_errors.hpp"
#include "zero/comm/mpi_communicator.hpp"
#include "zero/core/error.hpp"
#include "zero/io/atomic_file.hpp"

namespace {

using Json = nlohmann::json;
namespace fs = std::filesystem;
using namespace sdxl::prepare;  // the options, the work list, encode_shard, the shard files

constexpr const char* kValidationPromptsFile = "validation_prompts.safetensors";

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
  Json settings_common{
      {"pipeline", o.models.pipeline.empty() ? "" : fs::absolute(o.models.pipeline).lexically_normal().string()},
      {"single_file", o.models.single_file.empty() ? "" : fs::absolute(o.models.single_file).lexically_normal().string()},
      {"tokenizers", {fs::absolute(o.models.tokenizer).lexically_normal().string(),
                      fs::absolute(o.models.tokenizer_2).lexically_normal().string()}},
      {"buckets", bucket_list}, {"flip", o.flip}, {"dtype", o.dtype}, {"save_dtype", o.save_dtype},
      {"max_image_pixels", o.max_image_pixels}, {"batch_size", o.batch_size}, {"shard_size", o.shard_size}};
  if (!o.models.single_file_config.empty())  // absent otherwise: earlier runs' finished shards stay valid
    settings_common["single_file_config"] = fs::absolute(o.models.single_file_config).lexically_normal().string();
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
