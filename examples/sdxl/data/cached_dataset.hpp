// The cached SDXL dataset on disk: VAE latents and text-encoder outputs
// computed once (examples/sdxl/prepare, or CachedDatasetWriter), so that
// training runs only the UNet. The format is specified in docs/dataset.md:
//
//   <dir>/index.json                 format, text dims, shards, per-sample records
//   <dir>/shard-00000.safetensors    per sample with key K: K.latents [4,h,w],
//   <dir>/shard-00001.safetensors    K.prompt_embeds [seq,width], K.pooled_prompt_embeds [pooled]
//
// Time ids are not stored as tensors: they come from the index record
// (original_size + crop_top_left + target_size, SDXL's add_time_ids order).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "data/dataset.hpp"
#include "zero/core/dtype.hpp"

namespace sdxl::data {

/// The `format` field of index.json, and the version this code reads and writes.
inline constexpr const char* kCachedFormatName = "zero-sdxl-cached-latents";
/// Version 1: shards and samples. Version 2 adds the optional "empty_prompt"
/// entry (written only when the dataset carries one, so datasets without it
/// stay version 1 and readable by older readers). This reader reads both.
inline constexpr int kCachedFormatVersion = 2;
inline constexpr int kCachedFormatOldestVersion = 1;
/// The file holding the empty prompt's conditioning (tensors prompt_embeds
/// [seq, width] and pooled_prompt_embeds [pooled]), named in index.json.
inline constexpr const char* kEmptyPromptFileName = "empty_prompt.safetensors";
inline constexpr const char* kIndexFileName = "index.json";
/// The file holding the validation prompts' conditioning (version 2,
/// optional): prompt_embeds [P, seq, width], pooled_prompt_embeds [P, pooled].
inline constexpr const char* kValidationPromptsFileName = "validation_prompts.safetensors";

/// The per-sample record of index.json.
struct SampleRecord {
  /// Position of the sample's shard in the index's shard list.
  std::size_t shard = 0;
  /// Tensor names in the shard are `<key>.latents`, `<key>.prompt_embeds`,
  /// `<key>.pooled_prompt_embeds`.
  std::string key;
  LatentSize latent_size;
  /// Image size before resizing and cropping, (height, width) in pixels.
  std::array<std::int64_t, 2> original_size{0, 0};
  /// Top-left corner of the crop in the resized image, (top, left) in pixels.
  std::array<std::int64_t, 2> crop_top_left{0, 0};
  /// Size of the image the latent was encoded from, (height, width) in pixels.
  std::array<std::int64_t, 2> target_size{0, 0};
  std::string caption;

  /// SDXL add_time_ids: original_size + crop_top_left + target_size.
  std::array<float, kTimeIdCount> time_ids() const;
};

/// A shard entry of index.json.
struct ShardRecord {
  std::string file;  // name relative to the dataset directory
  std::size_t num_samples = 0;
  std::uint64_t size = 0;  // bytes
  std::string sha256;      // optional; recorded for external checks, not verified on open
};

/// index.json as parsed and checked on its own, before any shard is opened.
struct CachedIndex {
  TextDims text_dims;
  double vae_scaling_factor = kSdxlVaeScalingFactor;
  std::vector<ShardRecord> shards;
  std::vector<SampleRecord> records;
  /// index.json's optional "empty_prompt" (version 2): file and byte size.
  std::optional<ShardRecord> empty_prompt;
  /// index.json's optional "validation_prompts" (version 2): file, byte size
  /// and the prompts' text, in the order of the tensors' rows.
  std::optional<ShardRecord> validation_prompts;
  std::vector<std::string> validation_prompt_texts;
};

/// Parses and validates the text of index.json (schema, shard names, sample
/// records); `path` only names the file in messages. Throws zero::IoError.
/// Separate from CachedDataset::open so that it can be fuzzed without files.
CachedIndex parse_cached_index(std::string_view text, const std::filesystem::path& path);

/// A cached dataset opened from a directory.
///
/// open() validates everything except the tensor values before returning:
/// index.json's schema, that every shard exists with the recorded byte size,
/// that each shard is a valid safetensors file holding exactly the tensors of
/// its samples, with the recorded shapes and a float dtype (F16, BF16, F32).
/// Any defect is a zero::IoError naming the file and what was expected. After
/// that, sample() only reads and converts bytes, so a training run cannot fail
/// on a bad sample hours in. Opening reads only headers.
///
/// Shards are read with pread() into buffers, never memory-mapped: a shard
/// truncated or rewritten while a run reads it (on disk, by another process)
/// must be an IoError naming the shard, the sample and both sizes, not a
/// SIGBUS that kills the rank without a word. Each open shard holds one file
/// descriptor (the soft RLIMIT_NOFILE is raised toward the hard one when the
/// shard count needs it); a shard replaced by rename keeps being read from
/// the file that was validated.
class CachedDataset final : public Dataset {
 public:
  static std::unique_ptr<CachedDataset> open(const std::filesystem::path& directory);
  ~CachedDataset() override;
  CachedDataset(const CachedDataset&) = delete;
  CachedDataset& operator=(const CachedDataset&) = delete;

  std::size_t size() const override { return records_.size(); }
  LatentSize bucket_of(std::size_t i) const override;
  Sample sample(std::size_t i) const override;
  TextDims text_dims() const override { return text_dims_; }
  const EmptyPrompt* empty_prompt() const override { return empty_prompt_ ? &*empty_prompt_ : nullptr; }
  const ValidationPrompts* validation_prompts() const override {
    return validation_prompts_ ? &*validation_prompts_ : nullptr;
  }

  const std::filesystem::path& directory() const noexcept { return directory_; }
  const SampleRecord& record(std::size_t i) const;
  const std::vector<ShardRecord>& shards() const noexcept { return shards_; }
  /// The factor the latents were multiplied by (recorded by the writer).
  double vae_scaling_factor() const noexcept { return vae_scaling_factor_; }

 private:
  CachedDataset() = default;
  // Where one tensor of a sample lies in its shard, as validated by open().
  struct TensorLocation {
    std::uint64_t offset = 0;  // from the start of the file
    std::uint64_t bytes = 0;
    zero::DType dtype = zero::DType::fp32;
  };
  struct SampleLocation {
    TensorLocation latents, prompt_embeds, pooled_prompt_embeds;
  };

  void load_index();
  void load_empty_prompt(const ShardRecord& entry);
  void load_validation_prompts(const ShardRecord& entry, std::vector<std::string> prompts);
  void validate_shard(std::size_t shard_index, const std::vector<std::size_t>& members);
  /// Throws IoError unless shard `shard` still has the size index.json records.
  void check_shard_size(std::size_t shard, std::size_t sample_index) const;
  /// pread of `into.size()` bytes at `offset` of sample_index's shard; a short
  /// read is an IoError naming the shard, the sample, `what` and both sizes.
  void read_bytes(std::size_t sample_index, std::uint64_t offset, std::span<std::byte> into,
                  const std::string& what) const;

  std::filesystem::path directory_;
  TextDims text_dims_;
  double vae_scaling_factor_ = kSdxlVaeScalingFactor;
  std::vector<ShardRecord> shards_;
  std::vector<SampleRecord> records_;
  std::vector<SampleLocation> locations_;  // per sample, parallel to records_
  std::vector<int> shard_fds_;              // per shard, -1 until opened; closed by the destructor
  std::optional<EmptyPrompt> empty_prompt_;
  std::optional<ValidationPrompts> validation_prompts_;
};

struct CachedDatasetWriterOptions {
  /// Samples per shard file. ~100 MB shards keep the file count low without
  /// making one file unwieldy (SDXL at 1024^2 in fp16: ~440 KiB per sample).
  std::size_t samples_per_shard = 256;
  /// Storage dtypes; the reader converts to float32 either way.
  zero::DType latents_dtype = zero::DType::fp16;
  zero::DType text_dtype = zero::DType::fp16;
  TextDims text_dims;
  double vae_scaling_factor = kSdxlVaeScalingFactor;
  /// When false, a directory that already holds index.json is refused.
  bool overwrite = false;
};

/// Writes a cached dataset.
///
/// add() buffers samples (converted to the storage dtypes); every
/// samples_per_shard samples a shard is written atomically (temporary file +
/// rename, zero::io::write_safetensors). finish() writes the last shard and
/// then index.json, also atomically, so a directory whose index.json exists is
/// complete: a writer that fails or is destroyed before finish() leaves no
/// index, and CachedDataset::open() refuses the directory. With overwrite, an
/// existing index.json is removed first for the same reason.
class CachedDatasetWriter {
 public:
  /// Creates the directory if needed. Throws zero::InvalidArgument for bad
  /// options or an existing dataset without overwrite, zero::IoError when the
  /// directory cannot be created.
  CachedDatasetWriter(std::filesystem::path directory, CachedDatasetWriterOptions options = {});
  ~CachedDatasetWriter();
  CachedDatasetWriter(const CachedDatasetWriter&) = delete;
  CachedDatasetWriter& operator=(const CachedDatasetWriter&) = delete;

  /// Appends a sample; its index in the dataset is the number of samples added
  /// before it. Only the tensors, the caption and the sizes below are used
  /// (sample.time_ids and sample.index are ignored: time ids are derived from
  /// the sizes). Throws zero::InvalidArgument when shapes disagree with the
  /// buffers, the latent is not [4,h,w] or the text dims are not the options'.
  void add(const Sample& sample, const std::array<std::int64_t, 2>& original_size,
           const std::array<std::int64_t, 2>& crop_top_left,
           const std::array<std::int64_t, 2>& target_size);
  /// Same, with original_size = target_size = 8 * latent (h, w) and no crop:
  /// for data generated at the bucket resolution.
  void add(const Sample& sample);

  /// Records the empty prompt's conditioning (what the text encoders give for
  /// ""), written by finish() as empty_prompt.safetensors in the text dtype;
  /// the index then says version 2. Throws zero::InvalidArgument when the
  /// buffers do not match the writer's text dims.
  void set_empty_prompt(const EmptyPrompt& empty);

  /// Writes the remaining shard and index.json. Returns the number of samples.
  std::size_t finish();

  std::size_t samples_added() const noexcept { return records_.size(); }

 private:
  void flush_shard();

  std::filesystem::path directory_;
  CachedDatasetWriterOptions options_;
  std::vector<ShardRecord> shards_;
  std::vector<SampleRecord> records_;
  // Pending tensors of the shard being filled: names and bytes in storage dtype.
  struct PendingTensor {
    std::string name;
    zero::DType dtype;
    std::vector<std::int64_t> shape;
    std::vector<std::byte> bytes;
  };
  std::vector<PendingTensor> pending_;
  std::size_t pending_samples_ = 0;
  std::optional<EmptyPrompt> empty_prompt_;
  bool finished_ = false;
};

/// The shard file name for a shard index: shard-00000.safetensors.
std::string shard_file_name(std::size_t shard_index);

}  // namespace sdxl::data
