// Checkpoint folders (zero/checkpoint/checkpoint.hpp): the manifest round trip and
// its reader's errors, version-1 manifests, listing, rotation, per-file
// verification; CRC-32C; the streaming safetensors writer.
#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "io_error_of.hpp"
#include "temp_dir.hpp"
#include "zero/checkpoint/checkpoint.hpp"
#include "zero/io/crc32c.hpp"
#include "zero/io/safetensors.hpp"

using namespace zero;
using namespace zero::io;
using zero::io::testing::read_bytes;
using zero::io::testing::read_text;
using zero::io::testing::TempDir;
using zero::io::testing::write_text;
using zero::testing::io_error_of;
namespace fs = std::filesystem;

namespace {

CheckpointManifest sample_manifest(int world = 2) {
  CheckpointManifest m;
  m.step = 100;
  m.world_size = world;
  m.stage = 2;
  m.param_dtype = "bf16";
  m.optimizer = {.name = "adamw", .lr = 1e-4, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01,
                 .momentum = 0, .dampening = 0, .nesterov = false, .state_slots = 2};
  m.loss_scale = 65536;
  m.layout = {.param_count = 6, .param_numel = 1000, .padded_numel = 1024, .alignment = 8, .bucket_count = 3};
  m.data_position = {{"sampler.epoch", "1"}, {"sampler.batch_in_epoch", "7"}};
  m.seed = 1234;
  for (int r = 0; r < world; ++r) m.files.push_back({rank_file_name(r), 4096u + static_cast<unsigned>(r), 0xdeadbeefu + r});
  m.config = "[train]\nsteps = 100\n";
  return m;
}

nlohmann::json sample_json() { return nlohmann::json::parse(manifest_to_json(sample_manifest())); }

std::string error_for(const nlohmann::json& j) {
  return io_error_of([&] { parse_manifest(j.dump(), "/ckpt/step-00000100/manifest.json"); });
}

}  // namespace

TEST_CASE("crc32c: test vectors, continuation, files") {
  CHECK(crc32c(std::string_view("123456789")) == 0xE3069283u);
  CHECK(crc32c(std::string_view()) == 0u);
  const std::string zeros(32, '\0');
  CHECK(crc32c(zeros) == 0x8A9136AAu);
  // Lengths around the 8-byte step, split anywhere: the same as in one piece.
  std::string text;
  for (int i = 0; i < 100; ++i) text += static_cast<char>(i * 37 + 11);
  for (std::size_t cut = 0; cut <= text.size(); cut += 7) {
    const std::string_view a(text.data(), cut), b(text.data() + cut, text.size() - cut);
    CHECK(crc32c(b, crc32c(a)) == crc32c(text));
  }
  TempDir dir;
  write_text(dir / "f", text);
  CHECK(file_crc32c(dir / "f") == crc32c(text));
  CHECK(io_error_of([&] { file_crc32c(dir / "absent"); }).find("absent") != std::string::npos);
}

TEST_CASE("manifest: written, read back, every field kept") {
  const CheckpointManifest m = sample_manifest(3);
  const std::string text = manifest_to_json(m);
  const CheckpointManifest r = parse_manifest(text, "x");
  CHECK(r.version == 2);
  CHECK(r.step == 100);
  CHECK(r.world_size == 3);
  CHECK(r.stage == 2);
  CHECK(r.param_dtype == "bf16");
  CHECK(r.optimizer.name == "adamw");
  CHECK(r.optimizer.lr == 1e-4);
  CHECK(r.optimizer.eps == 1e-8);
  CHECK(r.optimizer.state_slots == 2);
  CHECK(r.loss_scale == 65536);
  CHECK(r.layout.padded_numel == 1024);
  CHECK(r.layout.bucket_count == 3);
  CHECK(r.data_position == m.data_position);
  CHECK(r.seed == std::optional<std::uint64_t>(1234));
  REQUIRE(r.files.size() == 3);
  CHECK(r.files[2].file == "rank-00002.safetensors");
  CHECK(r.files[2].bytes == 4098);
  CHECK(r.files[2].crc32c == std::optional<std::uint32_t>(0xdeadbeefu + 2));
  CHECK(r.config == m.config);
  CHECK(nlohmann::json::parse(text)["format"] == "zero.checkpoint");
}

TEST_CASE("manifest: the writer refuses what would not read back") {
  CheckpointManifest m = sample_manifest(2);
  m.files.pop_back();
  CHECK_THROWS_AS(manifest_to_json(m), InvalidArgument);
  m = sample_manifest(2);
  m.files[1].file = "../rank-00001.safetensors";
  CHECK_THROWS_AS(manifest_to_json(m), InvalidArgument);
  m = sample_manifest(2);
  m.config = "bad \xff utf-8";
  CHECK_THROWS_AS(manifest_to_json(m), InvalidArgument);
  m = sample_manifest(2);
  m.loss_scale = 0;
  CHECK_THROWS_AS(manifest_to_json(m), InvalidArgument);
}

TEST_CASE("manifest: the reader names the path, the key and what it expected") {
  const std::string where = "/ckpt/step-00000100/manifest.json";
  SUBCASE("missing key") {
    auto j = sample_json();
    j.erase("world_size");
    const std::string e = error_for(j);
    CHECK(e.find(where) != std::string::npos);
    CHECK(e.find("key 'world_size' should be an integer >= 1") != std::string::npos);
    CHECK(e.find("the key is missing") != std::string::npos);
  }
  SUBCASE("wrong type") {
    auto j = sample_json();
    j["world_size"] = "abc";
    CHECK(error_for(j).find("key 'world_size' should be an integer >= 1 (and <= 1048576), found \"abc\"") !=
          std::string::npos);
    j = sample_json();
    j["step"] = 1.5;
    CHECK(error_for(j).find("key 'step' should be an integer >= 0, found 1.5") != std::string::npos);
    j = sample_json();
    j["optimizer"]["nesterov"] = 1;
    CHECK(error_for(j).find("key 'optimizer.nesterov' should be true or false, found 1") != std::string::npos);
    j = sample_json();
    j["files"][1]["crc32c"] = "0xdeadbeef";
    CHECK(error_for(j).find("key 'files[1].crc32c' should be an integer in [0, 4294967295]") != std::string::npos);
    j = sample_json();
    j["data_position"]["sampler.epoch"] = 1;
    CHECK(error_for(j).find("key 'data_position.sampler.epoch' should be a string, found 1") != std::string::npos);
  }
  SUBCASE("out of range") {
    auto j = sample_json();
    j["world_size"] = -2;
    CHECK(error_for(j).find("key 'world_size' should be an integer >= 1 (and <= 1048576), found -2") !=
          std::string::npos);
    j = sample_json();
    j["stage"] = 4;
    CHECK(error_for(j).find("key 'stage' should be an integer in [0, 3], found 4") != std::string::npos);
    j = sample_json();
    j["loss_scale"] = 0;
    CHECK(error_for(j).find("key 'loss_scale' should be a finite number > 0, found 0") != std::string::npos);
    j = sample_json();
    j["files"][0]["crc32c"] = 4294967296ull;
    CHECK(error_for(j).find("files[0].crc32c") != std::string::npos);
    j = sample_json();
    j["layout"]["padded_numel"] = 999;
    CHECK(error_for(j).find("key 'layout.padded_numel' should be an integer >= param_numel (1000)") !=
          std::string::npos);
    j = sample_json();
    j["param_dtype"] = "fp8";
    CHECK(error_for(j).find("key 'param_dtype' should be \"fp32\", \"bf16\" or \"fp16\", found \"fp8\"") !=
          std::string::npos);
  }
  SUBCASE("files list length differs from world_size") {
    auto j = sample_json();
    j["world_size"] = 3;
    CHECK(error_for(j).find("key 'files' should be an array of 3 entries (one per rank, world_size), found an "
                            "array of 2") != std::string::npos);
    j = sample_json();
    j["files"] = nlohmann::json::object();
    CHECK(error_for(j).find("key 'files' should be an array of 2 entries") != std::string::npos);
  }
  SUBCASE("file names must be the ranks' files, in order") {
    auto j = sample_json();
    std::swap(j["files"][0], j["files"][1]);
    CHECK(error_for(j).find("key 'files[0].file' should be \"rank-00000.safetensors\", found "
                            "\"rank-00001.safetensors\"") != std::string::npos);
    j = sample_json();
    j["files"][1]["file"] = "/etc/passwd";
    CHECK(error_for(j).find("files[1].file") != std::string::npos);
  }
  SUBCASE("format and version") {
    auto j = sample_json();
    j["format"] = "something.else";
    CHECK(error_for(j).find("key 'format' should be \"zero.checkpoint\"") != std::string::npos);
    j = sample_json();
    j["version"] = 3;
    CHECK(error_for(j).find("key 'version' should be 2, found 3") != std::string::npos);
  }
  SUBCASE("not JSON, not an object, NUL bytes, huge values") {
    CHECK(io_error_of([&] { parse_manifest("{\"format\": ", where); }).find("not valid JSON") != std::string::npos);
    CHECK(io_error_of([&] { parse_manifest("[1, 2]", where); }).find("should hold a JSON object, found an array of 2") !=
          std::string::npos);
    CHECK(io_error_of([&] { parse_manifest(std::string("{}\0\0", 4), where); }).find("NUL byte") != std::string::npos);
    auto j = sample_json();
    j["world_size"] = std::string(100000, 'x');
    const std::string e = error_for(j);
    CHECK(e.size() < 400);  // the value is cut short in the message
    // Deep nesting is reported, not recursed into.
    std::string deep(200000, '[');
    deep += std::string(200000, ']');
    j = sample_json();
    const std::string text = j.dump();
    const std::string nested = text.substr(0, text.size() - 1) + ",\"stage\":" + deep + "}";
    CHECK_THROWS_AS(parse_manifest(nested, where), IoError);
  }
}

TEST_CASE("manifest: version 1 (the trainer's first format) is still read") {
  const std::string v1 = R"({"format": "zero.sdxl.checkpoint", "version": 1, "step": 40, "world_size": 2,
    "stage": 3, "files": [{"file": "rank-00000.safetensors", "bytes": 10, "crc32c": 5},
                          {"file": "rank-00001.safetensors", "bytes": 11}], "config": "x = 1"})";
  const CheckpointManifest m = parse_manifest(v1, "v1");
  CHECK(m.version == 1);
  CHECK(m.step == 40);
  CHECK(m.stage == 3);
  CHECK(m.files[0].crc32c == std::optional<std::uint32_t>(5));
  CHECK(!m.files[1].crc32c);
  CHECK(m.config == "x = 1");
  CHECK(m.param_dtype.empty());
  CHECK(io_error_of([&] {
          parse_manifest(R"({"format": "zero.sdxl.checkpoint", "version": 2, "step": 1, "world_size": 1, "stage": 0,
                             "files": [{"file": "rank-00000.safetensors", "bytes": 1}]})",
                         "v1");
        }).find("key 'version' should be 1 (for this format), found 2") != std::string::npos);
}

TEST_CASE("checkpoint folders: listing, verification, rotation") {
  TempDir root;
  CHECK(list_complete_checkpoints(root / "absent").empty());
  CHECK(checkpoint_folder_name(100) == "step-00000100");
  CHECK(rank_file_name(3) == "rank-00003.safetensors");
  CHECK_THROWS_AS(checkpoint_folder_name(-1), InvalidArgument);
  auto make = [&](std::int64_t step, bool complete) {
    const fs::path dir = checkpoint_folder(root.path(), step);
    fs::create_directories(dir);
    CheckpointManifest m = sample_manifest(2);
    m.step = step;
    for (int r = 0; r < 2; ++r) {
      const std::string text = "shard " + std::to_string(r) + " of step " + std::to_string(step);
      write_text(dir / rank_file_name(r), text);
      m.files[static_cast<std::size_t>(r)] = {rank_file_name(r), text.size(), crc32c(text)};
    }
    if (complete) write_manifest(dir, m);
    return m;
  };
  make(200, true);
  const CheckpointManifest m100 = make(100, true);
  make(300, false);  // interrupted: no manifest
  make(1000, true);
  fs::create_directories(root / "step-abc");
  write_text(root / "step-00000050", "a file, not a folder");
  const auto all = list_complete_checkpoints(root.path());
  REQUIRE(all.size() == 3);
  CHECK(all[0].step == 100);
  CHECK(all[1].step == 200);
  CHECK(all[2].step == 1000);
  CHECK(read_manifest(all[0].path).step == 100);
  CHECK(read_manifest(all[0].path / "manifest.json").step == 100);

  const fs::path dir = all[0].path;
  verify_checkpoint_files(dir, m100);
  auto bytes = read_text(dir / rank_file_name(1));
  write_text(dir / rank_file_name(1), bytes.substr(0, bytes.size() - 1) + "X");
  std::string e = io_error_of([&] { verify_checkpoint_files(dir, m100); });
  CHECK(e.find("rank-00001.safetensors is corrupted") != std::string::npos);
  write_text(dir / rank_file_name(1), bytes.substr(0, 3));
  e = io_error_of([&] { verify_checkpoint_files(dir, m100); });
  CHECK(e.find("rank-00001.safetensors has 3 bytes, the manifest says") != std::string::npos);
  fs::remove(dir / rank_file_name(0));
  e = io_error_of([&] { verify_checkpoint_files(dir, m100); });
  CHECK(e.find("rank-00000.safetensors is missing") != std::string::npos);
  e = io_error_of([&] { read_manifest(checkpoint_folder(root.path(), 300)); });
  CHECK(e.find("step-00000300/manifest.json is missing") != std::string::npos);

  const auto removed = rotate_checkpoints(root.path(), 1);
  CHECK(removed.size() == 2);
  CHECK(!fs::exists(checkpoint_folder(root.path(), 100)));
  CHECK(!fs::exists(checkpoint_folder(root.path(), 200)));
  CHECK(fs::exists(checkpoint_folder(root.path(), 300)));  // not complete: not counted, not removed
  const auto left = list_complete_checkpoints(root.path());
  REQUIRE(left.size() == 1);
  CHECK(left[0].step == 1000);
}

TEST_CASE("checkpoint folders: links are refused, never followed to delete") {
  TempDir other, root;
  const fs::path theirs = checkpoint_folder(other.path(), 5);
  fs::create_directories(theirs);
  write_text(theirs / "rank-00000.safetensors", "another run's shard");
  write_text(theirs / "manifest.json", "{}");
  fs::create_directory_symlink(theirs, checkpoint_folder(root.path(), 1));
  const std::string e = io_error_of([&] { list_complete_checkpoints(root.path()); });
  CHECK(e.find("step-00000001 is a symbolic link (to " + theirs.string() + ")") != std::string::npos);
  CHECK_THROWS_AS(rotate_checkpoints(root.path(), 0), IoError);
  CHECK(io_error_of([&] { remove_checkpoint(checkpoint_folder(root.path(), 1)); }).find("is a symbolic link") !=
        std::string::npos);
  CHECK(fs::exists(theirs / "rank-00000.safetensors"));
  CHECK(fs::exists(theirs / "manifest.json"));
  // A link inside a folder being removed goes, its target stays.
  fs::remove(checkpoint_folder(root.path(), 1));
  const fs::path mine = checkpoint_folder(root.path(), 2);
  fs::create_directories(mine);
  fs::create_symlink(theirs / "rank-00000.safetensors", mine / "rank-00000.safetensors");
  remove_checkpoint(mine);
  CHECK(!fs::exists(fs::symlink_status(mine)));
  CHECK(read_text(theirs / "rank-00000.safetensors") == "another run's shard");
}

TEST_CASE("checkpoint saves: staging folder, commit, leftovers") {
  TempDir root;
  auto save = [&](std::int64_t step, std::uint64_t nonce, const std::string& text, bool commit) {
    const fs::path staging = begin_checkpoint(root.path(), step, nonce);
    CHECK(staging == checkpoint_staging_folder(root.path(), step, nonce));
    CHECK(staging.filename().string().rfind("." + checkpoint_folder_name(step) + ".tmp-", 0) == 0);
    CheckpointManifest m = sample_manifest(1);
    m.step = step;
    write_text(staging / rank_file_name(0), text);
    m.files[0] = {rank_file_name(0), text.size(), crc32c(text)};
    if (!commit) return staging;
    write_manifest(staging, m);
    return commit_checkpoint(staging, root.path(), step);
  };
  CHECK(save(10, 1, "first", true) == checkpoint_folder(root.path(), 10));
  // An interrupted save of the same step: the old checkpoint is untouched,
  // the leftover is hidden, listed as interrupted, never as a checkpoint.
  const fs::path leftover = save(10, 2, "second, cut short", false);
  CHECK(read_text(checkpoint_folder(root.path(), 10) / rank_file_name(0)) == "first");
  CheckpointScan scan = scan_checkpoints(root.path());
  REQUIRE(scan.complete.size() == 1);
  REQUIRE(scan.interrupted.size() == 1);
  CHECK(scan.interrupted[0].path == leftover);
  CHECK(scan.interrupted[0].step == 10);
  CHECK(scan.incomplete.empty());
  // A commit without a manifest is refused.
  CHECK(io_error_of([&] { commit_checkpoint(leftover, root.path(), 10); }).find("has no manifest.json") !=
        std::string::npos);
  // The next save clears the leftover and replaces step 10 whole.
  save(10, 3, "third", true);
  CHECK(read_text(checkpoint_folder(root.path(), 10) / rank_file_name(0)) == "third");
  scan = scan_checkpoints(root.path());
  CHECK(scan.complete.size() == 1);
  CHECK(scan.interrupted.empty());
  CHECK(root.entries().size() == 1);
  // A commit cut between the two renames of the fallback (no RENAME_EXCHANGE):
  // the old checkpoint is put back by the next save's cleanup.
  const fs::path aside = root / ".step-00000010.replaced-0000000000000004";
  fs::rename(checkpoint_folder(root.path(), 10), aside);
  CHECK(list_complete_checkpoints(root.path()).empty());
  CHECK(remove_interrupted_saves(root.path()).empty());
  CHECK(read_text(checkpoint_folder(root.path(), 10) / rank_file_name(0)) == "third");
  // ... and removed when the step folder is there.
  fs::create_directories(aside);
  const auto removed = remove_interrupted_saves(root.path());
  REQUIRE(removed.size() == 1);
  CHECK(removed[0] == aside);
  CHECK(!fs::exists(aside));
  // An old-style interrupted save (a step folder without manifest) is replaced whole.
  fs::create_directories(checkpoint_folder(root.path(), 20));
  write_text(checkpoint_folder(root.path(), 20) / rank_file_name(0), "half");
  CHECK(scan_checkpoints(root.path()).incomplete.size() == 1);
  save(20, 5, "whole", true);
  CHECK(read_text(checkpoint_folder(root.path(), 20) / rank_file_name(0)) == "whole");
  CHECK(scan_checkpoints(root.path()).incomplete.empty());
  // A step folder that is a link is never replaced through.
  TempDir other;
  fs::create_directories(other / "target");
  fs::create_directory_symlink(other / "target", checkpoint_folder(root.path(), 30));
  const fs::path staging = checkpoint_staging_folder(root.path(), 30, 6);
  fs::create_directories(staging);
  CheckpointManifest m = sample_manifest(1);
  m.step = 30;
  write_text(staging / rank_file_name(0), "x");
  m.files[0] = {rank_file_name(0), 1, crc32c(std::string("x"))};
  write_manifest(staging, m);
  CHECK(io_error_of([&] { commit_checkpoint(staging, root.path(), 30); }).find("is a symbolic link") !=
        std::string::npos);
  CHECK(fs::is_empty(other / "target"));
}

TEST_CASE("read_manifest: oversized and unreadable files are refused, named") {
  TempDir dir;
  write_text(dir / "manifest.json", std::string(kMaxManifestBytes + 1, ' '));
  CHECK(io_error_of([&] { read_manifest(dir.path()); }).find("too large for a manifest") != std::string::npos);
  write_text(dir / "manifest.json", "not json");
  const std::string e = io_error_of([&] { read_manifest(dir.path()); });
  CHECK(e.find((dir / "manifest.json").string()) != std::string::npos);
  CHECK(e.find("not valid JSON") != std::string::npos);
}

TEST_CASE("SafeTensorsStreamWriter writes what write_safetensors writes, in pieces") {
  TempDir dir;
  std::vector<float> a(1000), c(7);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i) * 0.5f;
  for (std::size_t i = 0; i < c.size(); ++i) c[i] = -static_cast<float>(i);
  const std::vector<std::uint16_t> b = {1, 2, 3, 4, 5, 6};
  const std::vector<TensorView> views = {{"a", TensorDType::F32, {10, 100}, a.data()},
                                         {"empty", TensorDType::F32, {0, 4}, nullptr},
                                         {"b", TensorDType::BF16, {2, 3}, b.data()},
                                         {"c", TensorDType::F32, {7}, c.data()}};
  const std::map<std::string, std::string> meta = {{"k", "v"}};
  write_safetensors(dir / "whole.safetensors", views, meta);
  {
    SafeTensorsStreamWriter w(dir / "stream.safetensors",
                              {{"a", TensorDType::F32, {10, 100}}, {"empty", TensorDType::F32, {0, 4}},
                               {"b", TensorDType::BF16, {2, 3}}, {"c", TensorDType::F32, {7}}},
                              meta);
    const auto all_a = std::as_bytes(std::span<const float>(a));
    w.append(all_a.subspan(0, 1001));
    CHECK(w.current_tensor() == 0);
    w.append(all_a.subspan(1001));
    CHECK(w.current_tensor() == 2);  // "empty" is skipped
    // One append across two tensors.
    std::vector<std::byte> rest(12 + 28);
    std::memcpy(rest.data(), b.data(), 12);
    std::memcpy(rest.data() + 12, c.data(), 28);
    CHECK_THROWS_AS(w.commit(), InvalidArgument);
    w.append(rest);
    CHECK(w.bytes_left() == 0);
    CHECK_THROWS_AS(w.append(std::as_bytes(std::span<const float>(c))), InvalidArgument);
    w.commit();
    CHECK(w.file_size() == fs::file_size(dir / "stream.safetensors"));
  }
  CHECK(read_bytes(dir / "stream.safetensors") == read_bytes(dir / "whole.safetensors"));
  {
    SafeTensorsStreamWriter w(dir / "abandoned.safetensors", {{"a", TensorDType::F32, {4}}});
    w.append(std::as_bytes(std::span<const float>(a.data(), 2)));
  }
  CHECK(!fs::exists(dir / "abandoned.safetensors"));
  CHECK_THROWS_AS(SafeTensorsStreamWriter(dir / "dup.safetensors", {{"x", TensorDType::F32, {1}}, {"x", TensorDType::F32, {1}}}),
                  InvalidArgument);
}
