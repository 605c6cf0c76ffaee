#include "prepare_shards.hpp"

#include <cstdio>
#include <fstream>
#include <iterator>
#include <span>
#include <string_view>

#include "data/cached_dataset.hpp"
#include "zero/io/atomic_file.hpp"
#include "zero/io/crc32c.hpp"
#include "zero/io/safetensors.hpp"

namespace sdxl::prepare {

namespace fs = std::filesystem;

std::string state_name(std::size_t shard) {
  char name[64];
  std::snprintf(name, sizeof name, "shard-%05zu.json", shard);
  return name;
}

namespace {

torch::ScalarType storage_type(const std::string& name) {
  return name == "fp16" ? torch::kFloat16 : name == "bf16" ? torch::kBFloat16 : torch::kFloat32;
}
zero::io::TensorDType storage_dtype(const std::string& name) {
  return name == "fp16" ? zero::io::TensorDType::F16
                        : name == "bf16" ? zero::io::TensorDType::BF16 : zero::io::TensorDType::F32;
}

std::vector<std::int64_t> shape_of(const torch::Tensor& t) { return {t.sizes().begin(), t.sizes().end()}; }

std::optional<Json> read_json(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  try {
    return Json::parse(in);
  } catch (const Json::exception&) {
    return std::nullopt;
  }
}

}  // namespace

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

}  // namespace sdxl::prepare
