#include "data/cached_dataset.hpp"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <span>
#include <sstream>
#include <system_error>

#include "zero/core/error.hpp"
#include "zero/io/atomic_file.hpp"
#include "zero/io/safetensors.hpp"

namespace sdxl::data {
namespace {

using Json = nlohmann::json;

// Every message starts with the offending file, so that one bad shard among
// thousands is found without a debugger.
#define SDXL_BAD_FILE(path, ...) \
  ZERO_THROW(::zero::IoError, "cached dataset file '", (path).string(), "': ", __VA_ARGS__)

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::ostringstream out;
  out << "[";
  for (std::size_t i = 0; i < shape.size(); ++i) out << (i ? "," : "") << shape[i];
  out << "]";
  return out.str();
}

// Typed accessors for index.json: each names the JSON path of a bad field.
const Json& member(const Json& object, const std::string& key, const std::string& where,
                   const std::filesystem::path& file) {
  if (!object.is_object()) SDXL_BAD_FILE(file, where, " is not a JSON object");
  auto it = object.find(key);
  if (it == object.end()) SDXL_BAD_FILE(file, "missing field '", where, ".", key, "'");
  return *it;
}

std::int64_t integer(const Json& value, const std::string& where, const std::filesystem::path& file,
                     std::int64_t min_value) {
  if (!value.is_number_integer())
    SDXL_BAD_FILE(file, "field '", where, "' must be an integer, found ", value.type_name());
  const std::int64_t v = value.get<std::int64_t>();
  if (v < min_value) SDXL_BAD_FILE(file, "field '", where, "' is ", v, ", expected >= ", min_value);
  return v;
}

std::string string_field(const Json& value, const std::string& where, const std::filesystem::path& file) {
  if (!value.is_string())
    SDXL_BAD_FILE(file, "field '", where, "' must be a string, found ", value.type_name());
  return value.get<std::string>();
}

std::vector<std::int64_t> int_array(const Json& value, std::size_t length, const std::string& where,
                                    const std::filesystem::path& file, std::int64_t min_value) {
  if (!value.is_array() || value.size() != length)
    SDXL_BAD_FILE(file, "field '", where, "' must be an array of ", length, " integers");
  std::vector<std::int64_t> result;
  for (std::size_t i = 0; i < length; ++i)
    result.push_back(integer(value[i], where + "[" + std::to_string(i) + "]", file, min_value));
  return result;
}

std::array<std::int64_t, 2> pair_of(const std::vector<std::int64_t>& v) { return {v[0], v[1]}; }

bool is_plain_file_name(const std::string& name) {
  // Shard names are relative to the dataset directory; a name with a
  // separator or "..", or an absolute path, would let an index read elsewhere.
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

}  // namespace

std::string shard_file_name(std::size_t shard_index) {
  char name[64];
  std::snprintf(name, sizeof name, "shard-%05zu.safetensors", shard_index);
  return name;
}

std::array<float, kTimeIdCount> SampleRecord::time_ids() const {
  return {static_cast<float>(original_size[0]), static_cast<float>(original_size[1]),
          static_cast<float>(crop_top_left[0]), static_cast<float>(crop_top_left[1]),
          static_cast<float>(target_size[0]),   static_cast<float>(target_size[1])};
}

// ---------------------------------------------------------------- reader

CachedDataset::~CachedDataset() {
  for (int fd : shard_fds_)
    if (fd >= 0) ::close(fd);
}

namespace {

/// Every shard stays open (one descriptor each) for the whole run. Raises the
/// soft limit on open files toward the hard one when the shards need it,
/// leaving room for what else the process opens (MPI, checkpoints, metrics).
void reserve_file_descriptors(std::size_t shards, const std::filesystem::path& directory) {
  constexpr rlim_t kHeadroom = 256;
  const rlim_t needed = static_cast<rlim_t>(shards) + kHeadroom;
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY || limit.rlim_cur >= needed) return;
  if (limit.rlim_max != RLIM_INFINITY && limit.rlim_max < needed)
    ZERO_THROW(zero::IoError, "cached dataset '", directory.string(), "' has ", shards,
               " shards, each kept open while training, but this process may open at most ", limit.rlim_max,
               " files (hard limit, ulimit -Hn); raise it, or rewrite the dataset with more samples per shard");
  limit.rlim_cur = needed;
  if (::setrlimit(RLIMIT_NOFILE, &limit) != 0) {
    const int error = errno;
    ZERO_THROW(zero::IoError, "cached dataset '", directory.string(), "' has ", shards,
               " shards, each kept open while training; raising the open-file limit to ", needed,
               " failed: ", std::strerror(error));
  }
}

}  // namespace

std::unique_ptr<CachedDataset> CachedDataset::open(const std::filesystem::path& directory) {
  std::unique_ptr<CachedDataset> dataset(new CachedDataset());
  dataset->directory_ = directory;
  dataset->load_index();
  // Sample indices per shard, so that validation is linear in the sample count.
  std::vector<std::vector<std::size_t>> members(dataset->shards_.size());
  for (std::size_t i = 0; i < dataset->records_.size(); ++i) members[dataset->records_[i].shard].push_back(i);
  reserve_file_descriptors(dataset->shards_.size(), directory);
  dataset->locations_.resize(dataset->records_.size());
  dataset->shard_fds_.assign(dataset->shards_.size(), -1);
  for (std::size_t s = 0; s < dataset->shards_.size(); ++s) dataset->validate_shard(s, members[s]);
  return dataset;
}

namespace {

/// index.json's "shards": file names inside the directory, each once.
std::vector<ShardRecord> read_shard_records(const Json& index, const std::filesystem::path& path) {
  std::vector<ShardRecord> shards;
  const Json& listed = member(index, "shards", "index", path);
  if (!listed.is_array()) SDXL_BAD_FILE(path, "field 'shards' must be an array");
  std::set<std::string> shard_names;
  for (std::size_t s = 0; s < listed.size(); ++s) {
    const std::string where = "shards[" + std::to_string(s) + "]";
    ShardRecord shard;
    shard.file = string_field(member(listed[s], "file", where, path), where + ".file", path);
    if (!is_plain_file_name(shard.file))
      SDXL_BAD_FILE(path, where, ".file '", shard.file, "' must be a file name inside the dataset directory");
    if (!shard_names.insert(shard.file).second)
      SDXL_BAD_FILE(path, where, ".file '", shard.file, "' is listed twice");
    shard.num_samples = static_cast<std::size_t>(
        integer(member(listed[s], "num_samples", where, path), where + ".num_samples", path, 1));
    shard.size = static_cast<std::uint64_t>(
        integer(member(listed[s], "size", where, path), where + ".size", path, 8));
    if (auto it = listed[s].find("sha256"); it != listed[s].end())
      shard.sha256 = string_field(*it, where + ".sha256", path);
    shards.push_back(std::move(shard));
  }

  return shards;
}

/// index.json's "samples": each pointing at a listed shard, keys unique per
/// shard, and as many per shard as the shard declares.
std::vector<SampleRecord> read_sample_records(const Json& index, const std::vector<ShardRecord>& shards,
                                              const std::filesystem::path& path) {
  std::vector<SampleRecord> records;
  const Json& samples = member(index, "samples", "index", path);
  if (!samples.is_array()) SDXL_BAD_FILE(path, "field 'samples' must be an array");
  const std::int64_t declared = integer(member(index, "num_samples", "index", path), "num_samples", path, 0);
  if (static_cast<std::size_t>(declared) != samples.size())
    SDXL_BAD_FILE(path, "num_samples is ", declared, " but 'samples' holds ", samples.size(), " records");
  if (samples.empty()) SDXL_BAD_FILE(path, "the dataset holds no samples");

  std::vector<std::size_t> per_shard(shards.size(), 0);
  std::vector<std::set<std::string>> keys(shards.size());
  records.reserve(samples.size());
  for (std::size_t i = 0; i < samples.size(); ++i) {
    const std::string where = "samples[" + std::to_string(i) + "]";
    const Json& entry = samples[i];
    SampleRecord record;
    const std::int64_t shard = integer(member(entry, "shard", where, path), where + ".shard", path, 0);
    if (static_cast<std::size_t>(shard) >= shards.size())
      SDXL_BAD_FILE(path, where, " points at shard ", shard, " but the index lists ", shards.size(),
                    " shards");
    record.shard = static_cast<std::size_t>(shard);
    record.key = string_field(member(entry, "key", where, path), where + ".key", path);
    if (record.key.empty()) SDXL_BAD_FILE(path, where, ".key is empty");
    if (!keys[record.shard].insert(record.key).second)
      SDXL_BAD_FILE(path, where, ".key '", record.key, "' is used twice in shard ", shards[record.shard].file);
    const auto shape = int_array(member(entry, "latent_shape", where, path), 3, where + ".latent_shape", path, 1);
    if (shape[0] != kLatentChannels)
      SDXL_BAD_FILE(path, where, ".latent_shape is ", shape_text(shape), ", expected [", kLatentChannels,
                    ",h,w]");
    record.latent_size = {shape[1], shape[2]};
    record.original_size =
        pair_of(int_array(member(entry, "original_size", where, path), 2, where + ".original_size", path, 1));
    record.crop_top_left =
        pair_of(int_array(member(entry, "crop_top_left", where, path), 2, where + ".crop_top_left", path, 0));
    record.target_size =
        pair_of(int_array(member(entry, "target_size", where, path), 2, where + ".target_size", path, 1));
    if (auto it = entry.find("caption"); it != entry.end() && !it->is_null())
      record.caption = string_field(*it, where + ".caption", path);
    ++per_shard[record.shard];
    records.push_back(std::move(record));
  }
  for (std::size_t s = 0; s < shards.size(); ++s) {
    if (per_shard[s] != shards[s].num_samples)
      SDXL_BAD_FILE(path, "shard ", shards[s].file, " declares ", shards[s].num_samples,
                    " samples but ", per_shard[s], " sample records point at it");
  }
  return records;
}

}  // namespace

CachedIndex parse_cached_index(std::string_view text, const std::filesystem::path& path) {
  Json index;
  try {
    index = Json::parse(text);
  } catch (const Json::exception& e) {
    // Not only parse_error: a number past double's range (1e400) is an out_of_range.
    SDXL_BAD_FILE(path, "not valid JSON: ", e.what());
  }
  if (!index.is_object()) SDXL_BAD_FILE(path, "top level must be a JSON object");

  CachedIndex parsed;
  const std::string format = string_field(member(index, "format", "index", path), "format", path);
  if (format != kCachedFormatName)
    SDXL_BAD_FILE(path, "format is '", format, "', expected '", kCachedFormatName, "'");
  const std::int64_t version = integer(member(index, "version", "index", path), "version", path, 1);
  if (version < kCachedFormatOldestVersion || version > kCachedFormatVersion)
    SDXL_BAD_FILE(path, "format version ", version, " is not supported (this reader reads versions ",
                  kCachedFormatOldestVersion, " to ", kCachedFormatVersion, ")");
  const std::int64_t channels =
      integer(member(index, "latent_channels", "index", path), "latent_channels", path, 1);
  if (channels != kLatentChannels)
    SDXL_BAD_FILE(path, "latent_channels is ", channels, ", expected ", kLatentChannels, " (SDXL VAE)");
  if (auto it = index.find("vae_scaling_factor"); it != index.end()) {
    if (!it->is_number()) SDXL_BAD_FILE(path, "field 'vae_scaling_factor' must be a number");
    parsed.vae_scaling_factor = it->get<double>();
  }

  const Json& text_dims = member(index, "text", "index", path);
  parsed.text_dims.sequence_length =
      integer(member(text_dims, "sequence_length", "text", path), "text.sequence_length", path, 1);
  parsed.text_dims.width = integer(member(text_dims, "width", "text", path), "text.width", path, 1);
  parsed.text_dims.pooled_width =
      integer(member(text_dims, "pooled_width", "text", path), "text.pooled_width", path, 1);

  parsed.shards = read_shard_records(index, path);
  parsed.records = read_sample_records(index, parsed.shards, path);
  if (auto it = index.find("empty_prompt"); it != index.end()) {
    if (version < 2)
      SDXL_BAD_FILE(path, "field 'empty_prompt' needs format version 2, the index says version ", version);
    ShardRecord entry;
    entry.file = string_field(member(*it, "file", "empty_prompt", path), "empty_prompt.file", path);
    if (!is_plain_file_name(entry.file))
      SDXL_BAD_FILE(path, "empty_prompt.file '", entry.file, "' must be a file name inside the dataset directory");
    for (const ShardRecord& shard : parsed.shards)
      if (shard.file == entry.file)
        SDXL_BAD_FILE(path, "empty_prompt.file '", entry.file, "' is also listed as a shard");
    entry.size = static_cast<std::uint64_t>(integer(member(*it, "size", "empty_prompt", path), "empty_prompt.size", path, 8));
    parsed.empty_prompt = std::move(entry);
  }
  if (auto it = index.find("validation_prompts"); it != index.end()) {
    if (version < 2)
      SDXL_BAD_FILE(path, "field 'validation_prompts' needs format version 2, the index says version ", version);
    ShardRecord entry;
    entry.file = string_field(member(*it, "file", "validation_prompts", path), "validation_prompts.file", path);
    if (!is_plain_file_name(entry.file))
      SDXL_BAD_FILE(path, "validation_prompts.file '", entry.file,
                    "' must be a file name inside the dataset directory");
    for (const ShardRecord& shard : parsed.shards)
      if (shard.file == entry.file)
        SDXL_BAD_FILE(path, "validation_prompts.file '", entry.file, "' is also listed as a shard");
    if (parsed.empty_prompt && parsed.empty_prompt->file == entry.file)
      SDXL_BAD_FILE(path, "validation_prompts.file '", entry.file, "' is also the empty prompt's file");
    entry.size = static_cast<std::uint64_t>(
        integer(member(*it, "size", "validation_prompts", path), "validation_prompts.size", path, 8));
    const Json& prompts = member(*it, "prompts", "validation_prompts", path);
    if (!prompts.is_array() || prompts.empty())
      SDXL_BAD_FILE(path, "field 'validation_prompts.prompts' must be a non-empty array of strings");
    for (std::size_t i = 0; i < prompts.size(); ++i)
      parsed.validation_prompt_texts.push_back(
          string_field(prompts[i], "validation_prompts.prompts[" + std::to_string(i) + "]", path));
    parsed.validation_prompts = std::move(entry);
  }
  return parsed;
}

void CachedDataset::load_index() {
  const std::filesystem::path path = directory_ / kIndexFileName;
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error))
    SDXL_BAD_FILE(path, "missing (a dataset directory holds index.json, written last by the "
                        "writer; its absence means the dataset is incomplete)");
  std::ifstream in(path, std::ios::binary);
  if (!in) SDXL_BAD_FILE(path, "cannot be read");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());

  CachedIndex parsed = parse_cached_index(text, path);
  text_dims_ = parsed.text_dims;
  vae_scaling_factor_ = parsed.vae_scaling_factor;
  shards_ = std::move(parsed.shards);
  records_ = std::move(parsed.records);
  if (parsed.empty_prompt) load_empty_prompt(*parsed.empty_prompt);
  if (parsed.validation_prompts)
    load_validation_prompts(*parsed.validation_prompts, std::move(parsed.validation_prompt_texts));
}

namespace {

// Reads a small conditioning file of the dataset (the empty prompt, the
// validation prompts) whole, after checking its size against index.json and
// against what `rows` prompts in F32 and a header need; returns its two
// tensors as float32 with `rows` leading (none when rows is 0).
std::pair<std::vector<float>, std::vector<float>> read_conditioning_file(const std::filesystem::path& path,
                                                                        const ShardRecord& entry,
                                                                        const TextDims& dims, std::int64_t rows,
                                                                        const char* what) {
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error))
    SDXL_BAD_FILE(path, "missing (index.json names it as ", what, ", ", entry.size, " bytes)");
  const std::uint64_t size = std::filesystem::file_size(path, error);
  if (error) SDXL_BAD_FILE(path, "cannot stat: ", error.message());
  if (size != entry.size)
    SDXL_BAD_FILE(path, "is ", size, " bytes but index.json records ", entry.size,
                  " (truncated, or replaced after the index was written)");
  const std::uint64_t per_row = static_cast<std::uint64_t>(dims.sequence_length * dims.width + dims.pooled_width);
  const std::uint64_t most = 4 * per_row * static_cast<std::uint64_t>(std::max<std::int64_t>(rows, 1)) + 65536;
  if (size > most)
    SDXL_BAD_FILE(path, "is ", size, " bytes, more than the ", most, " that the text dims ", dims,
                  " in F32 and a header need");
  std::ifstream in(path, std::ios::binary);
  if (!in) SDXL_BAD_FILE(path, "cannot be read");
  std::vector<std::byte> bytes(static_cast<std::size_t>(size));
  in.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(size));
  if (static_cast<std::uint64_t>(in.gcount()) != size)
    SDXL_BAD_FILE(path, "read ", in.gcount(), " of ", size, " bytes (changed while being read)");
  const zero::io::SafeTensorsFile file = zero::io::SafeTensorsFile::from_bytes(std::move(bytes), path.string());
  if (file.tensors().size() != 2)
    SDXL_BAD_FILE(path, "holds ", file.tensors().size(),
                  " tensors, expected 2 (prompt_embeds and pooled_prompt_embeds)");
  auto values = [&](const char* name, std::vector<std::int64_t> expected) {
    if (rows > 0) expected.insert(expected.begin(), rows);
    const zero::io::TensorInfo* info = file.find(name);
    if (!info) SDXL_BAD_FILE(path, "no tensor '", name, "'");
    const std::optional<zero::DType> dtype = zero::io::to_dtype(info->dtype);
    if (!dtype) SDXL_BAD_FILE(path, "tensor '", name, "' has dtype ", info->dtype, ", expected F16, BF16 or F32");
    if (info->shape != expected)
      SDXL_BAD_FILE(path, "tensor '", name, "' has shape ", shape_text(info->shape), ", expected ",
                    shape_text(expected), " (the dataset's text dims", rows > 0 ? " and prompt count" : "",
                    ", from index.json)");
    return file.read_as_float32(name);
  };
  auto embeds = values("prompt_embeds", {dims.sequence_length, dims.width});
  auto pooled = values("pooled_prompt_embeds", {dims.pooled_width});
  return {std::move(embeds), std::move(pooled)};
}

}  // namespace

void CachedDataset::load_empty_prompt(const ShardRecord& entry) {
  auto [embeds, pooled] =
      read_conditioning_file(directory_ / entry.file, entry, text_dims_, 0, "the empty prompt's conditioning");
  EmptyPrompt empty;
  empty.prompt_embeds = std::move(embeds);
  empty.pooled_prompt_embeds = std::move(pooled);
  empty_prompt_ = std::move(empty);
}

void CachedDataset::load_validation_prompts(const ShardRecord& entry, std::vector<std::string> prompts) {
  auto [embeds, pooled] = read_conditioning_file(directory_ / entry.file, entry, text_dims_,
                                                 static_cast<std::int64_t>(prompts.size()),
                                                 "the validation prompts' conditioning");
  ValidationPrompts validation;
  validation.prompts = std::move(prompts);
  validation.prompt_embeds = std::move(embeds);
  validation.pooled_prompt_embeds = std::move(pooled);
  validation_prompts_ = std::move(validation);
}

void CachedDataset::validate_shard(std::size_t shard_index, const std::vector<std::size_t>& members) {
  const ShardRecord& shard = shards_[shard_index];
  const std::filesystem::path path = directory_ / shard.file;
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error))
    SDXL_BAD_FILE(path, "missing shard (index.json lists it with ", shard.num_samples, " samples, ",
                  shard.size, " bytes)");
  // The descriptor the samples will be read from, opened first: what is
  // validated below must be the file behind it (checked by inode after).
  // O_NONBLOCK: a FIFO put in a shard's place must fail, not block.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int open_error = errno;
    SDXL_BAD_FILE(path, "cannot open: ", std::strerror(open_error));
  }
  shard_fds_[shard_index] = fd;  // closed by the destructor, also when validation throws
  struct stat opened {};
  if (::fstat(fd, &opened) != 0) {
    const int stat_error = errno;
    SDXL_BAD_FILE(path, "cannot stat: ", std::strerror(stat_error));
  }
  if (!S_ISREG(opened.st_mode)) SDXL_BAD_FILE(path, "is not a regular file");
  const auto size = static_cast<std::uint64_t>(opened.st_size);
  if (size != shard.size)
    SDXL_BAD_FILE(path, "is ", size, " bytes but index.json records ", shard.size,
                  " (truncated, or replaced after the index was written)");

  // The header is validated through a short-lived mapping; samples are read
  // with pread (sample()), so nothing stays mapped.
  const zero::io::SafeTensorsFile file = zero::io::SafeTensorsFile::open(path);
  struct stat now {};
  if (::stat(path.c_str(), &now) != 0 || now.st_ino != opened.st_ino || now.st_dev != opened.st_dev ||
      file.file_size() != size)
    SDXL_BAD_FILE(path, "was replaced or changed while the dataset was being opened; open it again");
  const std::size_t expected_tensors = 3 * shard.num_samples;
  if (file.tensors().size() != expected_tensors)
    SDXL_BAD_FILE(path, "holds ", file.tensors().size(), " tensors, expected ", expected_tensors,
                  " (3 per sample for the ", shard.num_samples, " samples index.json assigns to it)");

  auto check = [&](const SampleRecord& record, std::size_t sample_index, const std::string& suffix,
                   const std::vector<std::int64_t>& expected) {
    const std::string name = record.key + suffix;
    const zero::io::TensorInfo* info = file.find(name);
    if (!info) SDXL_BAD_FILE(path, "no tensor '", name, "' for sample ", sample_index);
    const std::optional<zero::DType> dtype = zero::io::to_dtype(info->dtype);
    if (!dtype)
      SDXL_BAD_FILE(path, "tensor '", name, "' has dtype ", info->dtype, ", expected F16, BF16 or F32");
    if (info->shape != expected)
      SDXL_BAD_FILE(path, "tensor '", name, "' has shape ", shape_text(info->shape), ", expected ",
                    shape_text(expected), " (from index.json)");
    return TensorLocation{.offset = info->data_offset, .bytes = info->byte_size, .dtype = *dtype};
  };
  for (std::size_t i : members) {
    const SampleRecord& record = records_[i];
    SampleLocation& where = locations_[i];
    where.latents =
        check(record, i, ".latents", {kLatentChannels, record.latent_size.height, record.latent_size.width});
    where.prompt_embeds = check(record, i, ".prompt_embeds", {text_dims_.sequence_length, text_dims_.width});
    where.pooled_prompt_embeds = check(record, i, ".pooled_prompt_embeds", {text_dims_.pooled_width});
  }
}

const SampleRecord& CachedDataset::record(std::size_t i) const {
  ZERO_CHECK(i < records_.size(), "sample index ", i, " out of range for a dataset of ", records_.size());
  return records_[i];
}

LatentSize CachedDataset::bucket_of(std::size_t i) const { return record(i).latent_size; }

void CachedDataset::check_shard_size(std::size_t shard, std::size_t sample_index) const {
  struct stat now {};
  if (::fstat(shard_fds_[shard], &now) != 0) {
    const int error = errno;
    SDXL_BAD_FILE(directory_ / shards_[shard].file, "cannot stat while reading sample ", sample_index, ": ",
                  std::strerror(error));
  }
  if (static_cast<std::uint64_t>(now.st_size) != shards_[shard].size)
    SDXL_BAD_FILE(directory_ / shards_[shard].file, "is now ", now.st_size, " bytes but index.json records ",
                  shards_[shard].size, ": truncated or rewritten while training; cannot read sample ",
                  sample_index, " (key '", records_[sample_index].key, "')");
}

void CachedDataset::read_bytes(std::size_t sample_index, std::uint64_t offset, std::span<std::byte> into,
                               const std::string& what) const {
  const std::size_t shard = records_[sample_index].shard;
  std::size_t done = 0;
  while (done < into.size()) {
    const ssize_t got = ::pread(shard_fds_[shard], into.data() + done, into.size() - done,
                                static_cast<off_t>(offset + done));
    if (got > 0) {
      done += static_cast<std::size_t>(got);
      continue;
    }
    if (got < 0 && errno == EINTR) continue;
    const int error = got < 0 ? errno : 0;
    struct stat now {};
    const long long size = ::fstat(shard_fds_[shard], &now) == 0 ? static_cast<long long>(now.st_size) : -1;
    SDXL_BAD_FILE(directory_ / shards_[shard].file, "reading ", what, " of sample ", sample_index, " (",
                  into.size(), " bytes at offset ", offset, ") failed: ",
                  error ? std::strerror(error) : "the file ends before them", "; the file is now ", size,
                  " bytes, index.json records ", shards_[shard].size,
                  (error ? "" : " (truncated or rewritten while training)"));
  }
}

namespace {

/// A tensor's elements as float, from its bytes in the file's little-endian
/// layout (not aligned in general: a span read holds several tensors).
std::vector<float> to_float32(const std::byte* bytes, std::uint64_t byte_count, zero::DType dtype) {
  const std::size_t count = static_cast<std::size_t>(byte_count / zero::size_of(dtype));
  std::vector<float> out(count);
  if (dtype == zero::DType::fp32) {
    if (count) std::memcpy(out.data(), bytes, count * sizeof(float));
    return out;
  }
  for (std::size_t k = 0; k < count; ++k) {
    std::uint16_t bits;
    std::memcpy(&bits, bytes + 2 * k, sizeof bits);
    out[k] = dtype == zero::DType::bf16 ? zero::bf16_bits_to_float(bits) : zero::fp16_bits_to_float(bits);
  }
  return out;
}

}  // namespace

Sample CachedDataset::sample(std::size_t i) const {
  const SampleRecord& rec = record(i);
  const SampleLocation& where = locations_[i];
  // Once per sample: a shard that changed size is reported even when this
  // sample's bytes still lie inside it (its content may have changed too).
  check_shard_size(rec.shard, i);
  Sample sample;
  sample.index = i;
  const TensorLocation* parts[] = {&where.latents, &where.prompt_embeds, &where.pooled_prompt_embeds};
  const char* suffixes[] = {".latents", ".prompt_embeds", ".pooled_prompt_embeds"};
  std::vector<float>* values[] = {&sample.latents, &sample.prompt_embeds, &sample.pooled_prompt_embeds};
  std::uint64_t begin = parts[0]->offset, end = 0, total = 0;
  for (const TensorLocation* t : parts) {
    begin = std::min(begin, t->offset);
    end = std::max(end, t->offset + t->bytes);
    total += t->bytes;
  }
  // The writers put a sample's three tensors one after the other: then one
  // read fetches them all (each read is a system call).
  constexpr std::uint64_t kMaxGapBytes = 4096;
  // Kept per thread: a fresh buffer of SDXL's ~450 KiB per sample would be a
  // fresh mapping from malloc each time, its pages faulted in on every read.
  thread_local std::vector<std::byte> raw;
  if (end - begin <= total + kMaxGapBytes) {
    raw.resize(static_cast<std::size_t>(end - begin));
    read_bytes(i, begin, raw, "the tensors");
    for (std::size_t k = 0; k < 3; ++k)
      *values[k] = to_float32(raw.data() + (parts[k]->offset - begin), parts[k]->bytes, parts[k]->dtype);
  } else {
    for (std::size_t k = 0; k < 3; ++k) {
      raw.resize(static_cast<std::size_t>(parts[k]->bytes));
      read_bytes(i, parts[k]->offset, raw, "tensor '" + rec.key + suffixes[k] + "'");
      *values[k] = to_float32(raw.data(), parts[k]->bytes, parts[k]->dtype);
    }
  }
  sample.latent_shape = {kLatentChannels, rec.latent_size.height, rec.latent_size.width};
  sample.prompt_embeds_shape = {text_dims_.sequence_length, text_dims_.width};
  sample.time_ids = rec.time_ids();
  sample.caption = rec.caption;
  return sample;
}

}  // namespace sdxl::data
