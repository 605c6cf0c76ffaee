// CachedDatasetWriter -> CachedDataset round trips, and every kind of damage
// to a dataset directory reported as zero::IoError naming the damaged file.
#include <doctest/doctest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "data/cached_dataset.hpp"
#include "test_util.hpp"
#include "zero/io/safetensors.hpp"

using namespace sdxl::data;
using sdxl::data::testing::random_sample;
using sdxl::data::testing::TempDir;
using Json = nlohmann::json;

namespace {

const TextDims kText{.sequence_length = 5, .width = 24, .pooled_width = 12};
const std::vector<LatentSize> kBuckets{{8, 8}, {6, 10}, {10, 6}};

struct Written {
  std::vector<Sample> samples;
  std::vector<std::array<std::int64_t, 2>> original, crop, target;
};

// Writes `count` fresh random samples spread over kBuckets, with sizes and
// captions that differ per sample, and finishes the dataset.
Written write_dataset(const std::filesystem::path& dir, std::size_t count, CachedDatasetWriterOptions options,
                      std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  CachedDatasetWriter writer(dir, options);
  Written w;
  for (std::size_t i = 0; i < count; ++i) {
    const LatentSize size = kBuckets[(i * 7 + 3) % kBuckets.size()];
    std::string caption = i % 4 == 0 ? "" : "caption " + std::to_string(i) + " \xc3\xa9t\xc3\xa9 \"quoted\"";
    Sample s = random_sample(rng, size, kText, caption);
    const std::array<std::int64_t, 2> original{static_cast<std::int64_t>(300 + i), static_cast<std::int64_t>(500 + 2 * i)};
    const std::array<std::int64_t, 2> crop{static_cast<std::int64_t>(i), static_cast<std::int64_t>(3 * i)};
    const std::array<std::int64_t, 2> target{8 * size.height, 8 * size.width};
    writer.add(s, original, crop, target);
    w.samples.push_back(std::move(s));
    w.original.push_back(original);
    w.crop.push_back(crop);
    w.target.push_back(target);
  }
  CHECK(writer.finish() == count);
  return w;
}

std::vector<float> rounded(const std::vector<float>& values, zero::DType dtype) {
  std::vector<float> out(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) out[i] = zero::round_to(dtype, values[i]);
  return out;
}

Json read_json(const std::filesystem::path& path) {
  std::ifstream in(path);
  return Json::parse(in);
}

void write_json(const std::filesystem::path& path, const Json& json) {
  std::ofstream out(path, std::ios::binary);
  out << json.dump(1);
}

// Opening must fail with IoError whose message names `file` and holds every
// one of `fragments`.
void expect_io_error(const std::filesystem::path& dir, const std::string& file,
                     const std::vector<std::string>& fragments = {}) {
  try {
    CachedDataset::open(dir);
    FAIL("open succeeded; expected an IoError naming " << file);
  } catch (const zero::IoError& e) {
    const std::string message = e.what();
    INFO("message: " << message);
    // SDXL_DATA_SHOW_ERRORS=1 prints every message, to review their wording.
    if (std::getenv("SDXL_DATA_SHOW_ERRORS")) MESSAGE(message);
    CHECK(message.find(file) != std::string::npos);
    for (const std::string& fragment : fragments) CHECK(message.find(fragment) != std::string::npos);
  }
}

// Rewrites a shard through `edit` (which may change the list of tensors) and
// records the new size in index.json, so that only the edited defect remains.
struct OwnedTensor {
  std::string name;
  zero::io::TensorDType dtype;
  std::vector<std::int64_t> shape;
  std::vector<std::byte> bytes;
};

void rewrite_shard(const std::filesystem::path& dir, std::size_t shard,
                   const std::function<void(std::vector<OwnedTensor>&)>& edit) {
  const std::filesystem::path path = dir / shard_file_name(shard);
  std::vector<OwnedTensor> tensors;
  {
    auto file = zero::io::SafeTensorsFile::open(path);
    for (const auto& info : file.tensors()) {
      auto data = file.data(info);
      tensors.push_back({info.name, info.dtype, info.shape, std::vector<std::byte>(data.begin(), data.end())});
    }
  }
  edit(tensors);
  std::vector<zero::io::TensorView> views;
  for (const auto& t : tensors) views.push_back({t.name, t.dtype, t.shape, t.bytes.data()});
  zero::io::write_safetensors(path, views);
  Json index = read_json(dir / kIndexFileName);
  index["shards"][shard]["size"] = std::filesystem::file_size(path);
  write_json(dir / kIndexFileName, index);
}

CachedDatasetWriterOptions small_options() {
  return {.samples_per_shard = 4, .latents_dtype = zero::DType::fp16, .text_dtype = zero::DType::fp16,
          .text_dims = kText};
}

}  // namespace

TEST_CASE("cached dataset: writer -> reader round trip in several buckets and dtypes") {
  const std::uint64_t seed = std::random_device{}();
  INFO("random seed " << seed);
  struct Case {
    zero::DType latents, text;
  };
  for (const Case c : {Case{zero::DType::fp32, zero::DType::fp32}, Case{zero::DType::fp16, zero::DType::bf16},
                       Case{zero::DType::bf16, zero::DType::fp16}}) {
    CAPTURE(c.latents);
    CAPTURE(c.text);
    TempDir dir;
    CachedDatasetWriterOptions options = small_options();
    options.latents_dtype = c.latents;
    options.text_dtype = c.text;
    const std::size_t count = 11;  // three shards, the last one partial
    const Written w = write_dataset(dir.path(), count, options, seed);

    auto dataset = CachedDataset::open(dir.path());
    REQUIRE(dataset->size() == count);
    CHECK(dataset->text_dims() == kText);
    CHECK(dataset->shards().size() == 3);
    CHECK(dataset->shards()[2].num_samples == 3);
    CHECK(dataset->vae_scaling_factor() == doctest::Approx(kSdxlVaeScalingFactor));
    for (std::size_t i = 0; i < count; ++i) {
      CAPTURE(i);
      const Sample& in = w.samples[i];
      const Sample out = dataset->sample(i);
      CHECK(out.index == i);
      CHECK(dataset->bucket_of(i) == in.latent_size());
      CHECK(out.latent_shape == in.latent_shape);
      CHECK(out.latents == rounded(in.latents, c.latents));
      CHECK(out.prompt_embeds_shape == std::array<std::int64_t, 2>{kText.sequence_length, kText.width});
      CHECK(out.prompt_embeds == rounded(in.prompt_embeds, c.text));
      CHECK(out.pooled_prompt_embeds == rounded(in.pooled_prompt_embeds, c.text));
      CHECK(out.caption == in.caption);
      const std::array<float, 6> time_ids{
          static_cast<float>(w.original[i][0]), static_cast<float>(w.original[i][1]),
          static_cast<float>(w.crop[i][0]),     static_cast<float>(w.crop[i][1]),
          static_cast<float>(w.target[i][0]),   static_cast<float>(w.target[i][1])};
      CHECK(out.time_ids == time_ids);
    }
    CHECK_THROWS_AS(dataset->sample(count), zero::InvalidArgument);
    CHECK_NOTHROW(check_text_dims(*dataset, kText));
    CHECK_THROWS_AS(check_text_dims(*dataset, TextDims{}), zero::InvalidArgument);
  }
}

TEST_CASE("cached dataset: the index is written last and never over an existing dataset by accident") {
  TempDir dir;
  std::mt19937_64 rng(7);
  {
    CachedDatasetWriter writer(dir.path(), small_options());
    for (int i = 0; i < 6; ++i) writer.add(random_sample(rng, {8, 8}, kText, ""));
    // Destroyed without finish(): one full shard on disk, no index.
  }
  CHECK(std::filesystem::exists(dir.path() / shard_file_name(0)));
  expect_io_error(dir.path(), "index.json", {"missing"});

  write_dataset(dir.path(), 5, small_options(), 1);
  CHECK_THROWS_AS(CachedDatasetWriter(dir.path(), small_options()), zero::InvalidArgument);
  CachedDatasetWriterOptions overwrite = small_options();
  overwrite.overwrite = true;
  {
    CachedDatasetWriter writer(dir.path(), overwrite);
    // The old index is gone as soon as the overwriting writer exists.
    CHECK_FALSE(std::filesystem::exists(dir.path() / kIndexFileName));
    writer.add(random_sample(rng, {6, 10}, kText, "new"));
    writer.finish();
  }
  auto dataset = CachedDataset::open(dir.path());
  CHECK(dataset->size() == 1);
  CHECK(dataset->sample(0).caption == "new");

  // Writer input validation.
  CachedDatasetWriter writer((dir.path() / "other"), small_options());
  Sample wrong = random_sample(rng, {8, 8}, TextDims{.sequence_length = 5, .width = 25, .pooled_width = 12}, "");
  CHECK_THROWS_AS(writer.add(wrong), zero::InvalidArgument);
  Sample bad_caption = random_sample(rng, {8, 8}, kText, "\xff\xfe");
  CHECK_THROWS_AS(writer.add(bad_caption), zero::InvalidArgument);
  CHECK_THROWS_AS(writer.finish(), zero::InvalidArgument);  // nothing added
}

TEST_CASE("cached dataset: every corruption is an IoError naming the file") {
  TempDir dir;
  const auto& d = dir.path();
  write_dataset(d, 10, small_options(), 3);  // shards 0, 1 (4 each), 2 (2)
  REQUIRE_NOTHROW(CachedDataset::open(d));
  const std::string index_bytes = [&] {
    std::ifstream in(d / kIndexFileName, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }();
  // doctest runs the test case once per SUBCASE, each time with a fresh
  // directory, so every corruption below is applied to an intact dataset.
  const std::string shard1 = shard_file_name(1);

  SUBCASE("missing shard") {
    std::filesystem::remove(d / shard1);
    expect_io_error(d, shard1, {"missing shard", "4 samples"});
  }
  SUBCASE("truncated shard") {
    std::filesystem::resize_file(d / shard1, std::filesystem::file_size(d / shard1) - 100);
    expect_io_error(d, shard1, {"truncated"});
  }
  SUBCASE("truncated shard whose size the index agrees with") {
    // Only the safetensors validation can tell: the header now points past the end.
    std::filesystem::resize_file(d / shard1, std::filesystem::file_size(d / shard1) - 100);
    Json index = read_json(d / kIndexFileName);
    index["shards"][1]["size"] = std::filesystem::file_size(d / shard1);
    write_json(d / kIndexFileName, index);
    expect_io_error(d, shard1);
  }
  SUBCASE("wrong latent shape in the index") {
    Json index = read_json(d / kIndexFileName);
    index["samples"][5]["latent_shape"] = {4, 16, 16};
    write_json(d / kIndexFileName, index);
    expect_io_error(d, shard1, {"5.latents", "shape", "[4,16,16]"});
  }
  SUBCASE("wrong latent shape in the shard") {
    rewrite_shard(d, 1, [](std::vector<OwnedTensor>& tensors) {
      for (auto& t : tensors)
        if (t.name == "4.latents") {
          t.shape = {4, t.shape[1] * t.shape[2], 1};
        }
    });
    expect_io_error(d, shard1, {"4.latents", "shape"});
  }
  SUBCASE("text width differs from the index") {
    Json index = read_json(d / kIndexFileName);
    index["text"]["width"] = 2048;
    write_json(d / kIndexFileName, index);
    expect_io_error(d, shard_file_name(0), {"prompt_embeds", "[5,2048]"});
  }
  SUBCASE("latent channels other than 4") {
    Json index = read_json(d / kIndexFileName);
    index["samples"][0]["latent_shape"] = {3, 8, 8};
    write_json(d / kIndexFileName, index);
    expect_io_error(d, "index.json", {"samples[0].latent_shape"});
  }
  SUBCASE("wrong dtype") {
    rewrite_shard(d, 1, [](std::vector<OwnedTensor>& tensors) {
      for (auto& t : tensors)
        if (t.name == "6.pooled_prompt_embeds") t.dtype = zero::io::TensorDType::I16;
    });
    expect_io_error(d, shard1, {"6.pooled_prompt_embeds", "I16"});
  }
  SUBCASE("tensor missing from its shard") {
    rewrite_shard(d, 2, [](std::vector<OwnedTensor>& tensors) {
      for (auto& t : tensors)
        if (t.name == "9.prompt_embeds") t.name = "99.prompt_embeds";
    });
    expect_io_error(d, shard_file_name(2), {"9.prompt_embeds"});
  }
  SUBCASE("extra tensor in a shard") {
    rewrite_shard(d, 0, [](std::vector<OwnedTensor>& tensors) {
      tensors.push_back({"stray", zero::io::TensorDType::F32, {1}, std::vector<std::byte>(4)});
    });
    expect_io_error(d, shard_file_name(0), {"13 tensors", "expected 12"});
  }
  SUBCASE("index pointing past the shard list") {
    Json index = read_json(d / kIndexFileName);
    index["samples"][9]["shard"] = 3;
    write_json(d / kIndexFileName, index);
    expect_io_error(d, "index.json", {"samples[9]", "shard 3"});
  }
  SUBCASE("index assigning more samples to a shard than it holds") {
    Json index = read_json(d / kIndexFileName);
    index["samples"][9]["shard"] = 1;  // shard 1 now has 5 records, declares 4
    write_json(d / kIndexFileName, index);
    expect_io_error(d, "index.json", {"shard-00001.safetensors declares 4"});
  }
  SUBCASE("sample count disagrees") {
    Json index = read_json(d / kIndexFileName);
    index["num_samples"] = 11;
    write_json(d / kIndexFileName, index);
    expect_io_error(d, "index.json", {"num_samples"});
  }
  SUBCASE("bad JSON") {
    std::ofstream(d / kIndexFileName, std::ios::binary) << index_bytes.substr(0, index_bytes.size() / 2);
    expect_io_error(d, "index.json", {"not valid JSON"});
  }
  SUBCASE("a number past double's range (found by fuzz_dataset_index)") {
    // nlohmann reports it as out_of_range, not parse_error: it escaped as a non-IoError.
    std::string text = index_bytes;
    const std::string channels = "\"latent_channels\": 4";
    REQUIRE(text.find(channels) != std::string::npos);
    text.replace(text.find(channels), channels.size(), "\"latent_channels\": 1e400");
    std::ofstream(d / kIndexFileName, std::ios::binary) << text;
    expect_io_error(d, "index.json", {"not valid JSON", "1e400"});
  }
  SUBCASE("wrong types and unknown format or version") {
    for (const auto& [pointer, value] : std::vector<std::pair<std::string, Json>>{
             {"/format", "something-else"},
             {"/version", 3},
             {"/version", 0},
             {"/samples/0/key", 5},
             {"/samples/0/crop_top_left", Json::array({-1, 0})},
             {"/shards/0/file", "../elsewhere.safetensors"},
             {"/text", Json::array()}}) {
      CAPTURE(pointer);
      Json index = Json::parse(index_bytes);
      index[Json::json_pointer(pointer)] = value;
      write_json(d / kIndexFileName, index);
      expect_io_error(d, "index.json");
    }
  }
  SUBCASE("missing index") {
    std::filesystem::remove(d / kIndexFileName);
    expect_io_error(d, "index.json", {"missing"});
  }
}

TEST_CASE("cached dataset: a shard that changes on disk after open is an IoError naming it, never a crash") {
  // Shards are read with pread, not memory-mapped: a truncated mapping would
  // kill the process with SIGBUS at the first access past the new end.
  TempDir dir;
  const auto& d = dir.path();
  const Written written = write_dataset(d, 10, small_options(), 11);  // shards 0, 1 (4 each), 2 (2)
  const auto dataset = CachedDataset::open(d);
  const std::filesystem::path shard1 = d / shard_file_name(1);
  const std::uintmax_t size = std::filesystem::file_size(shard1);
  const Sample before = dataset->sample(5);

  auto expect_read_error = [&](std::size_t sample, const std::vector<std::string>& fragments) {
    try {
      (void)dataset->sample(sample);
      FAIL("sample(" << sample << ") succeeded; expected an IoError naming " << shard1.string());
    } catch (const zero::IoError& e) {
      const std::string message = e.what();
      INFO("message: " << message);
      if (std::getenv("SDXL_DATA_SHOW_ERRORS")) MESSAGE(message);
      CHECK(message.find(shard1.string()) != std::string::npos);
      for (const std::string& fragment : fragments) CHECK(message.find(fragment) != std::string::npos);
    }
  };
  SUBCASE("truncated") {
    std::filesystem::resize_file(shard1, 64);
    for (std::size_t i = 4; i < 8; ++i)
      expect_read_error(i, {"sample " + std::to_string(i), "is now 64 bytes", "records " + std::to_string(size),
                            "truncated or rewritten while training"});
    // The other shards are intact and still read.
    CHECK(dataset->sample(0).latents == rounded(written.samples[0].latents, zero::DType::fp16));
    CHECK(dataset->sample(9).latents == rounded(written.samples[9].latents, zero::DType::fp16));
  }
  SUBCASE("grown: a sample whose bytes are still there is refused too") {
    std::ofstream(shard1, std::ios::binary | std::ios::app) << "appended";
    expect_read_error(5, {"sample 5", "is now " + std::to_string(size + 8) + " bytes"});
  }
  SUBCASE("replaced by a rename: the file that was validated is read on") {
    write_dataset(d / "other", 10, small_options(), 12);
    std::filesystem::rename(d / "other" / shard_file_name(1), shard1);
    CHECK(dataset->sample(5).latents == before.latents);
    CHECK(dataset->sample(5).prompt_embeds == before.prompt_embeds);
  }
}

TEST_CASE("cached dataset: the optional empty prompt (format version 2) round trip and refusals") {
  TempDir dir;
  const auto& d = dir.path();
  SUBCASE("a dataset without it stays version 1 and has none") {
    TempDir old;
    write_dataset(old.path(), 3, small_options(), 5);
    CHECK(read_json(old.path() / kIndexFileName)["version"] == 1);
    CHECK_FALSE(read_json(old.path() / kIndexFileName).contains("empty_prompt"));
    CHECK_FALSE(std::filesystem::exists(old.path() / kEmptyPromptFileName));
    CHECK(CachedDataset::open(old.path())->empty_prompt() == nullptr);
  }

  std::mt19937_64 rng(11);
  const Sample reference = random_sample(rng, {8, 8}, kText, "");
  const EmptyPrompt empty{reference.prompt_embeds, reference.pooled_prompt_embeds};
  {
    CachedDatasetWriter writer(d, small_options());
    for (std::size_t i = 0; i < 5; ++i) writer.add(random_sample(rng, {8, 8}, kText, "x"));
    CHECK_THROWS_AS(writer.set_empty_prompt(EmptyPrompt{{1.0f}, empty.pooled_prompt_embeds}), zero::InvalidArgument);
    writer.set_empty_prompt(empty);
    writer.finish();
  }
  const Json index = read_json(d / kIndexFileName);
  CHECK(index["version"] == 2);
  CHECK(index["empty_prompt"]["file"] == kEmptyPromptFileName);
  CHECK(index["empty_prompt"]["size"] == std::filesystem::file_size(d / kEmptyPromptFileName));

  SUBCASE("round trip in the text dtype") {
    auto opened = CachedDataset::open(d);
    REQUIRE(opened->empty_prompt() != nullptr);
    CHECK(opened->empty_prompt()->prompt_embeds == rounded(empty.prompt_embeds, zero::DType::fp16));
    CHECK(opened->empty_prompt()->pooled_prompt_embeds == rounded(empty.pooled_prompt_embeds, zero::DType::fp16));
    CHECK(opened->size() == 5);
  }
  SUBCASE("missing file") {
    std::filesystem::remove(d / kEmptyPromptFileName);
    expect_io_error(d, kEmptyPromptFileName, {"missing", "empty prompt"});
  }
  SUBCASE("truncated file") {
    std::filesystem::resize_file(d / kEmptyPromptFileName, std::filesystem::file_size(d / kEmptyPromptFileName) - 8);
    expect_io_error(d, kEmptyPromptFileName, {"truncated"});
  }
  SUBCASE("huge size recorded and present is refused before reading") {
    std::filesystem::resize_file(d / kEmptyPromptFileName, 1 << 24);
    Json edited = index;
    edited["empty_prompt"]["size"] = 1 << 24;
    write_json(d / kIndexFileName, edited);
    expect_io_error(d, kEmptyPromptFileName, {"more than"});
  }
  auto rewrite = [&](const std::vector<zero::io::TensorView>& views) {
    zero::io::write_safetensors(d / kEmptyPromptFileName, views);
    Json edited = index;
    edited["empty_prompt"]["size"] = std::filesystem::file_size(d / kEmptyPromptFileName);
    write_json(d / kIndexFileName, edited);
  };
  const std::vector<float> wrong(kText.sequence_length * (kText.width + 1), 0.0f);
  SUBCASE("wrong shape names the tensor and the text dims") {
    rewrite({{"prompt_embeds", zero::io::TensorDType::F32, {kText.sequence_length, kText.width + 1}, wrong.data()},
             {"pooled_prompt_embeds", zero::io::TensorDType::F32, {kText.pooled_width}, wrong.data()}});
    expect_io_error(d, kEmptyPromptFileName, {"prompt_embeds", "[5,25]", "[5,24]"});
  }
  SUBCASE("a missing tensor") {
    rewrite({{"prompt_embeds", zero::io::TensorDType::F32, {kText.sequence_length, kText.width}, wrong.data()}});
    expect_io_error(d, kEmptyPromptFileName, {"expected 2"});
  }
  SUBCASE("a wrongly named tensor") {
    rewrite({{"prompt_embeds", zero::io::TensorDType::F32, {kText.sequence_length, kText.width}, wrong.data()},
             {"pooled", zero::io::TensorDType::F32, {kText.pooled_width}, wrong.data()}});
    expect_io_error(d, kEmptyPromptFileName, {"pooled_prompt_embeds"});
  }
  SUBCASE("not safetensors") {
    std::ofstream(d / kEmptyPromptFileName, std::ios::binary | std::ios::trunc) << "not a safetensors file at all";
    Json edited = index;
    edited["empty_prompt"]["size"] = std::filesystem::file_size(d / kEmptyPromptFileName);
    write_json(d / kIndexFileName, edited);
    expect_io_error(d, kEmptyPromptFileName);
  }
  SUBCASE("index entries") {
    for (const auto& [pointer, value] : std::vector<std::pair<std::string, Json>>{
             {"/empty_prompt/file", "../empty_prompt.safetensors"},
             {"/empty_prompt/file", shard_file_name(0)},
             {"/empty_prompt/size", -1},
             {"/empty_prompt/size", "12"},
             {"/empty_prompt", Json::array()},
             {"/version", 1}}) {
      CAPTURE(pointer);
      Json edited = index;
      edited[Json::json_pointer(pointer)] = value;
      write_json(d / kIndexFileName, edited);
      expect_io_error(d, "index.json");
    }
  }
}

TEST_CASE("cached dataset: the optional validation prompts (format version 2) round trip and refusals") {
  TempDir dir;
  const auto& d = dir.path();
  std::mt19937_64 rng(12);
  {
    CachedDatasetWriter writer(d, small_options());
    for (std::size_t i = 0; i < 3; ++i) writer.add(random_sample(rng, {8, 8}, kText, "x"));
    const Sample reference = random_sample(rng, {8, 8}, kText, "");
    writer.set_empty_prompt(EmptyPrompt{reference.prompt_embeds, reference.pooled_prompt_embeds});
    writer.finish();
  }
  CHECK(CachedDataset::open(d)->validation_prompts() == nullptr);
  // Two prompts: rows [2, seq, width] and [2, pooled] with distinct values.
  std::vector<float> embeds(2 * kText.sequence_length * kText.width), pooled(2 * kText.pooled_width);
  for (std::size_t i = 0; i < embeds.size(); ++i) embeds[i] = static_cast<float>(i) * 0.25f;
  for (std::size_t i = 0; i < pooled.size(); ++i) pooled[i] = -static_cast<float>(i);
  auto write = [&](std::int64_t rows, const Json& prompts) {
    zero::io::write_safetensors(
        d / kValidationPromptsFileName,
        {{"prompt_embeds", zero::io::TensorDType::F32, {rows, kText.sequence_length, kText.width}, embeds.data()},
         {"pooled_prompt_embeds", zero::io::TensorDType::F32, {rows, kText.pooled_width}, pooled.data()}});
    Json edited = read_json(d / kIndexFileName);
    edited["validation_prompts"] = {{"file", kValidationPromptsFileName},
                                    {"size", std::filesystem::file_size(d / kValidationPromptsFileName)},
                                    {"prompts", prompts}};
    write_json(d / kIndexFileName, edited);
  };
  SUBCASE("round trip: prompts and rows in order") {
    write(2, {"a cat", "a dog"});
    auto opened = CachedDataset::open(d);
    REQUIRE(opened->validation_prompts() != nullptr);
    CHECK(opened->validation_prompts()->prompts == std::vector<std::string>{"a cat", "a dog"});
    CHECK(opened->validation_prompts()->prompt_embeds == embeds);
    CHECK(opened->validation_prompts()->pooled_prompt_embeds == pooled);
  }
  SUBCASE("rows and prompt count disagree") {
    write(2, {"a cat", "a dog", "a third"});
    expect_io_error(d, kValidationPromptsFileName, {"prompt_embeds", "[3,5,24]", "prompt count"});
  }
  SUBCASE("missing and truncated file") {
    write(2, {"a cat", "a dog"});
    std::filesystem::resize_file(d / kValidationPromptsFileName,
                                 std::filesystem::file_size(d / kValidationPromptsFileName) - 8);
    expect_io_error(d, kValidationPromptsFileName, {"truncated"});
    std::filesystem::remove(d / kValidationPromptsFileName);
    expect_io_error(d, kValidationPromptsFileName, {"missing", "validation prompts"});
  }
  SUBCASE("index entries") {
    write(2, {"a cat", "a dog"});
    const Json index = read_json(d / kIndexFileName);
    for (const auto& [pointer, value] : std::vector<std::pair<std::string, Json>>{
             {"/validation_prompts/file", "../v.safetensors"},
             {"/validation_prompts/file", kEmptyPromptFileName},
             {"/validation_prompts/prompts", Json::array()},
             {"/validation_prompts/prompts", "a cat"},
             {"/validation_prompts/prompts", Json::array({"a cat", 3})},
             {"/validation_prompts/size", -1},
             {"/version", 1}}) {
      CAPTURE(pointer);
      Json edited = index;
      edited[Json::json_pointer(pointer)] = value;
      if (pointer == "/version") edited.erase("empty_prompt");
      write_json(d / kIndexFileName, edited);
      expect_io_error(d, "index.json");
    }
  }
}

TEST_CASE("caption dropout draw: deterministic per (seed, step, micro, sample), rate near p") {
  CHECK_FALSE(drop_caption(1, 0, 0, 0, 0.0));
  CHECK(drop_caption(1, 0, 0, 0, 1.0));
  std::size_t dropped = 0, differ_by_seed = 0, differ_by_step = 0;
  const std::size_t n = 20000;
  for (std::size_t i = 0; i < n; ++i) {
    const bool d = drop_caption(7, 3, 0, i, 0.25);
    CHECK(d == drop_caption(7, 3, 0, i, 0.25));
    dropped += d;
    differ_by_seed += d != drop_caption(8, 3, 0, i, 0.25);
    differ_by_step += d != drop_caption(7, 4, 0, i, 0.25);
  }
  // Binomial(20000, 0.25): sd ~61; 6 sd either side.
  CHECK(dropped > 4630);
  CHECK(dropped < 5370);
  // Independent streams disagree on ~2 p (1 - p) = 37.5 % of the samples.
  CHECK(differ_by_seed > 6000);
  CHECK(differ_by_step > 6000);
}
