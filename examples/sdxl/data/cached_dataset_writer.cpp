// The cached dataset's writer (prepare, tests): samples into safetensors
// shards and index.json, each file written atomically. The format and the
// reader: cached_dataset.cpp, docs/dataset.md.
#include <nlohmann/json.hpp>

#include "data/cached_dataset.hpp"
#include "zero/core/error.hpp"
#include "zero/io/atomic_file.hpp"
#include "zero/io/safetensors.hpp"
#include "zero/optim/optimizer.hpp"

namespace sdxl::data {
namespace {

using Json = nlohmann::json;

std::vector<std::byte> to_storage(const std::vector<float>& values, zero::DType dtype) {
  std::vector<std::byte> bytes(values.size() * zero::size_of(dtype));
  zero::cpu_convert(values.data(), zero::DType::fp32, bytes.data(), dtype, values.size());
  return bytes;
}

}  // namespace

CachedDatasetWriter::CachedDatasetWriter(std::filesystem::path directory, CachedDatasetWriterOptions options)
    : directory_(std::move(directory)), options_(options) {
  ZERO_CHECK(options_.samples_per_shard > 0, "CachedDatasetWriter: samples_per_shard must be > 0");
  zero::check_dtype(options_.latents_dtype, "CachedDatasetWriter latents_dtype");
  zero::check_dtype(options_.text_dtype, "CachedDatasetWriter text_dtype");
  ZERO_CHECK(options_.text_dims.sequence_length > 0 && options_.text_dims.width > 0 &&
                 options_.text_dims.pooled_width > 0,
             "CachedDatasetWriter: text dims must be positive, got ", options_.text_dims);
  std::error_code error;
  std::filesystem::create_directories(directory_, error);
  if (error)
    ZERO_THROW(zero::IoError, "cannot create dataset directory '", directory_.string(), "': ", error.message());
  const std::filesystem::path index = directory_ / kIndexFileName;
  if (std::filesystem::exists(index, error)) {
    ZERO_CHECK(options_.overwrite, "CachedDatasetWriter: '", directory_.string(),
               "' already holds a dataset (index.json); set overwrite to replace it");
    // Remove the old index before the first new shard replaces an old one: a
    // crash mid-write must not leave an index that describes mixed shards.
    std::filesystem::remove(index, error);
    if (error) ZERO_THROW(zero::IoError, "cannot remove '", index.string(), "': ", error.message());
    zero::io::fsync_directory(directory_);
  }
}

CachedDatasetWriter::~CachedDatasetWriter() = default;

void CachedDatasetWriter::add(const Sample& sample) {
  const std::array<std::int64_t, 2> size{8 * sample.latent_shape[1], 8 * sample.latent_shape[2]};
  add(sample, size, {0, 0}, size);
}

void CachedDatasetWriter::add(const Sample& sample, const std::array<std::int64_t, 2>& original_size,
                              const std::array<std::int64_t, 2>& crop_top_left,
                              const std::array<std::int64_t, 2>& target_size) {
  ZERO_CHECK(!finished_, "CachedDatasetWriter::add after finish()");
  const auto& ls = sample.latent_shape;
  ZERO_CHECK(ls[0] == kLatentChannels && ls[1] > 0 && ls[2] > 0, "CachedDatasetWriter::add: latent shape [",
             ls[0], ",", ls[1], ",", ls[2], "] is not [4,h,w]");
  ZERO_CHECK_EQ(sample.latents.size(), static_cast<std::size_t>(ls[0] * ls[1] * ls[2]),
                "latents buffer does not match latent_shape");
  const TextDims& text = options_.text_dims;
  ZERO_CHECK(sample.prompt_embeds_shape[0] == text.sequence_length &&
                 sample.prompt_embeds_shape[1] == text.width,
             "CachedDatasetWriter::add: prompt_embeds shape [", sample.prompt_embeds_shape[0], ",",
             sample.prompt_embeds_shape[1], "] differs from the writer's text dims ", text);
  ZERO_CHECK_EQ(sample.prompt_embeds.size(), static_cast<std::size_t>(text.sequence_length * text.width),
                "prompt_embeds buffer does not match its shape");
  ZERO_CHECK_EQ(sample.pooled_prompt_embeds.size(), static_cast<std::size_t>(text.pooled_width),
                "pooled_prompt_embeds does not match the writer's pooled width");
  ZERO_CHECK(original_size[0] > 0 && original_size[1] > 0 && target_size[0] > 0 && target_size[1] > 0 &&
                 crop_top_left[0] >= 0 && crop_top_left[1] >= 0,
             "CachedDatasetWriter::add: sizes must be positive and the crop non-negative");

  // Strict: a caption that is not UTF-8 is the caller's bug, not something to
  // replace silently when the index is written.
  try {
    (void)Json(sample.caption).dump(-1, ' ', false, Json::error_handler_t::strict);
  } catch (const Json::exception&) {
    ZERO_THROW(zero::InvalidArgument, "CachedDatasetWriter::add: caption of sample ", records_.size(),
               " is not valid UTF-8");
  }

  SampleRecord record;
  record.shard = shards_.size();
  // Keys are the global sample index: unique, and they tell which sample a
  // tensor belongs to when a shard is inspected by hand.
  record.key = std::to_string(records_.size());
  record.latent_size = {ls[1], ls[2]};
  record.original_size = original_size;
  record.crop_top_left = crop_top_left;
  record.target_size = target_size;
  record.caption = sample.caption;

  pending_.push_back({record.key + ".latents", options_.latents_dtype, {ls[0], ls[1], ls[2]},
                      to_storage(sample.latents, options_.latents_dtype)});
  pending_.push_back({record.key + ".prompt_embeds", options_.text_dtype, {text.sequence_length, text.width},
                      to_storage(sample.prompt_embeds, options_.text_dtype)});
  pending_.push_back({record.key + ".pooled_prompt_embeds", options_.text_dtype, {text.pooled_width},
                      to_storage(sample.pooled_prompt_embeds, options_.text_dtype)});
  records_.push_back(std::move(record));
  if (++pending_samples_ == options_.samples_per_shard) flush_shard();
}

void CachedDatasetWriter::flush_shard() {
  if (pending_samples_ == 0) return;
  ShardRecord shard;
  shard.file = shard_file_name(shards_.size());
  shard.num_samples = pending_samples_;
  std::vector<zero::io::TensorView> views;
  views.reserve(pending_.size());
  for (const PendingTensor& t : pending_)
    views.push_back({t.name, zero::io::to_tensor_dtype(t.dtype), t.shape, t.bytes.data()});
  const std::filesystem::path path = directory_ / shard.file;
  zero::io::write_safetensors(path, views, {{"format", kCachedFormatName}});
  std::error_code error;
  shard.size = std::filesystem::file_size(path, error);
  if (error) ZERO_THROW(zero::IoError, "cannot stat '", path.string(), "': ", error.message());
  shards_.push_back(std::move(shard));
  pending_.clear();
  pending_samples_ = 0;
}

void CachedDatasetWriter::set_empty_prompt(const EmptyPrompt& empty) {
  ZERO_CHECK(!finished_, "CachedDatasetWriter::set_empty_prompt after finish()");
  const TextDims& text = options_.text_dims;
  ZERO_CHECK(empty.prompt_embeds.size() == static_cast<std::size_t>(text.sequence_length * text.width) &&
                 empty.pooled_prompt_embeds.size() == static_cast<std::size_t>(text.pooled_width),
             "CachedDatasetWriter::set_empty_prompt: buffers of ", empty.prompt_embeds.size(), " and ",
             empty.pooled_prompt_embeds.size(), " values do not match the writer's text dims ", text);
  empty_prompt_ = empty;
}

std::size_t CachedDatasetWriter::finish() {
  ZERO_CHECK(!finished_, "CachedDatasetWriter::finish called twice");
  ZERO_CHECK(!records_.empty(), "CachedDatasetWriter::finish: no samples were added");
  flush_shard();
  std::uint64_t empty_prompt_size = 0;
  if (empty_prompt_) {
    const TextDims& text = options_.text_dims;
    const std::vector<std::byte> embeds = to_storage(empty_prompt_->prompt_embeds, options_.text_dtype);
    const std::vector<std::byte> pooled = to_storage(empty_prompt_->pooled_prompt_embeds, options_.text_dtype);
    const zero::io::TensorDType dtype = zero::io::to_tensor_dtype(options_.text_dtype);
    const std::filesystem::path path = directory_ / kEmptyPromptFileName;
    zero::io::write_safetensors(path,
                                {{"prompt_embeds", dtype, {text.sequence_length, text.width}, embeds.data()},
                                 {"pooled_prompt_embeds", dtype, {text.pooled_width}, pooled.data()}},
                                {{"format", kCachedFormatName}});
    std::error_code error;
    empty_prompt_size = std::filesystem::file_size(path, error);
    if (error) ZERO_THROW(zero::IoError, "cannot stat '", path.string(), "': ", error.message());
  }

  // Pretty at the top, one line per sample: readable, and a million samples
  // do not turn into ten million lines.
  std::ostringstream out;
  out << "{\n";
  out << "  \"format\": " << Json(kCachedFormatName).dump() << ",\n";
  // Version 1 unless the version-2 field is present: a dataset without an
  // empty prompt stays readable by readers of version 1.
  out << "  \"version\": " << (empty_prompt_ ? kCachedFormatVersion : kCachedFormatOldestVersion) << ",\n";
  out << "  \"latent_channels\": " << kLatentChannels << ",\n";
  out << "  \"vae_scaling_factor\": " << Json(options_.vae_scaling_factor).dump() << ",\n";
  out << "  \"text\": "
      << Json{{"sequence_length", options_.text_dims.sequence_length},
              {"width", options_.text_dims.width},
              {"pooled_width", options_.text_dims.pooled_width}}
             .dump()
      << ",\n";
  if (empty_prompt_)
    out << "  \"empty_prompt\": " << Json{{"file", kEmptyPromptFileName}, {"size", empty_prompt_size}}.dump()
        << ",\n";
  out << "  \"num_samples\": " << records_.size() << ",\n";
  out << "  \"shards\": [\n";
  for (std::size_t s = 0; s < shards_.size(); ++s) {
    Json entry{{"file", shards_[s].file}, {"num_samples", shards_[s].num_samples}, {"size", shards_[s].size}};
    out << "    " << entry.dump() << (s + 1 < shards_.size() ? ",\n" : "\n");
  }
  out << "  ],\n";
  out << "  \"samples\": [\n";
  for (std::size_t i = 0; i < records_.size(); ++i) {
    const SampleRecord& r = records_[i];
    Json entry{{"shard", r.shard},
               {"key", r.key},
               {"latent_shape", {kLatentChannels, r.latent_size.height, r.latent_size.width}},
               {"original_size", r.original_size},
               {"crop_top_left", r.crop_top_left},
               {"target_size", r.target_size}};
    if (!r.caption.empty()) entry["caption"] = r.caption;
    out << "    " << entry.dump() << (i + 1 < records_.size() ? ",\n" : "\n");
  }
  out << "  ]\n}\n";
  const std::string text = out.str();
  zero::io::write_file_atomically(directory_ / kIndexFileName,
                                  std::as_bytes(std::span<const char>(text.data(), text.size())));
  finished_ = true;
  return records_.size();
}

}  // namespace sdxl::data
