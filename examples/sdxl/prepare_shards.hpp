// The files of prepare's shards: the shard file (its tensors in --save_dtype)
// is written atomically, then its state record (prepare-state/shard-K.json,
// atomically too), which says the shard is finished: with which settings and
// inputs, and the shard file's size and CRC. A rerun keeps a shard whose
// record still holds; rank 0 builds index.json from the records.
#pragma once

#include <torch/torch.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace sdxl::prepare {

using Json = nlohmann::json;

inline constexpr const char* kStateDir = "prepare-state";

/// The state record's file name in kStateDir: shard-K.json.
std::string state_name(std::size_t shard);

/// Writes tensors (already contiguous CPU float32) in the storage dtype
/// (--save_dtype: fp16, bf16 or fp32): the shard files and the prompt files.
void write_tensors(const std::filesystem::path& path, const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                   const std::string& save_dtype);

/// The CRC32C of the file and its size in bytes (`size`); 0 when it cannot be opened.
std::uint32_t file_crc(const std::filesystem::path& path, std::uint64_t& size);

/// `value` as indented JSON text, written atomically.
void write_json_atomically(const std::filesystem::path& path, const Json& value);

/// A finished shard's state record, if it is valid for `settings`: same
/// settings and inputs, and the shard file (if it has samples) with the
/// recorded size and CRC. Anything else means the shard is encoded again.
std::optional<Json> finished_shard(const std::filesystem::path& output, std::size_t shard, const Json& settings);

}  // namespace sdxl::prepare
