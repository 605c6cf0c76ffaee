// prepare's work list: every rank lists --images the same way (sorted by
// relative path) and cuts the list into shards of --shard_size images, so the
// dataset does not depend on the number of ranks.
#pragma once

#include <cstddef>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace sdxl::prepare {

using Json = nlohmann::json;

struct ImageEntry {
  std::string relative;  // sorted by this (byte order)
  std::filesystem::path path;
  bool supported = true;  // false: an extension prepare does not read (reported as bad)
};

/// The image files under `root` (prepare_images.hpp classify_file; hidden
/// files and folders left out), sorted by relative path.
std::vector<ImageEntry> list_images(const std::filesystem::path& root);

// The inputs of one image as they are on disk, for the shard fingerprint:
// a changed image or caption makes its shard be encoded again.
Json input_identity(const ImageEntry& e);

/// Shard k's images: [begin, end) in the sorted list.
struct ShardRange {
  std::size_t begin = 0, end = 0;
};
ShardRange shard_range(std::size_t shard, std::size_t shard_size, std::size_t total);

}  // namespace sdxl::prepare
