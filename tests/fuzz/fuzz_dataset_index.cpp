// libFuzzer target for the cached SDXL dataset's index.json reader
// (sdxl::data::parse_cached_index in examples/sdxl/data/cached_dataset.cpp),
// the part of CachedDataset::open that runs before any shard is opened.
// Any input must either parse or raise zero::IoError naming index.json; every
// other exception, crash, sanitizer report, leak or hang is a bug. An index
// that parses must hold what open() relies on when it indexes by it: every
// sample points at a listed shard, each shard holds as many samples as it
// declares, shard names are plain and distinct, sizes and shapes positive.
// Built by tests/fuzz/CMakeLists.txt (see README.md there).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "data/cached_dataset.hpp"
#include "zero/core/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  sdxl::data::CachedIndex index;
  try {
    index = sdxl::data::parse_cached_index(text, "fuzz/index.json");
  } catch (const zero::IoError&) {
    return 0;  // malformed index, reported properly
  }
  if (index.records.empty()) std::abort();
  if (index.text_dims.sequence_length < 1 || index.text_dims.width < 1 || index.text_dims.pooled_width < 1)
    std::abort();
  std::set<std::string> names;
  for (const auto& shard : index.shards) {
    if (shard.file.empty() || shard.file.find('/') != std::string::npos || shard.file == "." ||
        shard.file == ".." || !names.insert(shard.file).second || shard.num_samples < 1)
      std::abort();
  }
  std::vector<std::size_t> per_shard(index.shards.size(), 0);
  for (const auto& record : index.records) {
    if (record.shard >= index.shards.size() || record.key.empty()) std::abort();
    if (record.latent_size.height < 1 || record.latent_size.width < 1) std::abort();
    ++per_shard[record.shard];
  }
  for (std::size_t s = 0; s < index.shards.size(); ++s)
    if (per_shard[s] != index.shards[s].num_samples) std::abort();
  return 0;
}
