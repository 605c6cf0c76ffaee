// The safetensors writers: a whole file from tensors in memory
// (serialize_safetensors, write_safetensors) and a file whose data is appended
// as it is produced (SafeTensorsStreamWriter). Both write the header by hand,
// in the given order, and replace the target atomically.
#include "error_text.hpp"
#include "safetensors_format.hpp"
#include "zero/io/safetensors.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "zero/core/error.hpp"
#include "zero/io/atomic_file.hpp"

namespace zero::io {

using detail::brief_text;
using detail::kMaxHeaderBytes;
using detail::shape_text;
using detail::store_le64;

// ---------------------------------------------------------------- writer

namespace {

using Json = nlohmann::json;

struct Plan {
  std::string header;  // JSON, already padded
  std::vector<std::uint64_t> sizes;
  std::uint64_t data_size = 0;
};

// JSON text of a string, rejecting invalid UTF-8 instead of replacing it.
std::string json_string(const std::string& text, std::string_view what) {
  try {
    return Json(text).dump(-1, ' ', false, Json::error_handler_t::strict);
  } catch (const nlohmann::json::exception&) {
    ZERO_THROW(InvalidArgument, "write_safetensors: ", what, " '", brief_text(text),
               "' is not valid UTF-8");
  }
}

// `with_data`: the views carry their data (false for the stream writer,
// whose data comes later).
Plan plan_layout(const std::vector<TensorView>& tensors,
                 const std::map<std::string, std::string>& metadata, bool with_data = true) {
  // The header is assembled by hand, entry by entry in the given order: an
  // ordered_json object would keep the order but look up every key linearly.
  Plan plan;
  std::string& header = plan.header;
  header += '{';
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [key, value] : metadata) {
      if (!first) header += ',';
      first = false;
      header += json_string(key, "metadata key");
      header += ':';
      header += json_string(value, "value of metadata key");
    }
    header += '}';
  }
  std::set<std::string_view> seen;
  plan.sizes.reserve(tensors.size());
  for (const TensorView& t : tensors) {
    ZERO_CHECK(t.name != "__metadata__",
               "write_safetensors: '__metadata__' is reserved and cannot name a tensor");
    ZERO_CHECK(seen.insert(t.name).second, "write_safetensors: tensor name '", t.name,
               "' appears more than once; names must be unique");
    ZERO_CHECK(is_valid(t.dtype), "write_safetensors: tensor '", t.name,
               "' has invalid dtype value ", static_cast<int>(t.dtype));
    for (std::int64_t d : t.shape) {
      ZERO_CHECK(d >= 0, "write_safetensors: tensor '", t.name, "' has shape ",
                 shape_text(t.shape), " with a negative dimension");
    }
    const std::optional<std::uint64_t> size = detail::tensor_byte_size(t.dtype, t.shape);
    const std::uint64_t bytes = size.value_or(0);
    std::uint64_t end = 0;
    ZERO_CHECK(size && !__builtin_add_overflow(plan.data_size, bytes, &end),
               "write_safetensors: tensor '", t.name, "' with shape ", shape_text(t.shape),
               " overflows 64-bit byte offsets");
    ZERO_CHECK(!with_data || t.data != nullptr || bytes == 0, "write_safetensors: tensor '", t.name,
               "' has ", bytes, " bytes of data but a null data pointer");
    if (header.size() > 1) header += ',';
    header += json_string(t.name, "tensor name");
    header += ":{\"dtype\":\"";
    header += name_of(t.dtype);
    header += "\",\"shape\":[";
    for (std::size_t i = 0; i < t.shape.size(); ++i) {
      if (i) header += ',';
      header += std::to_string(t.shape[i]);
    }
    header += "],\"data_offsets\":[";
    header += std::to_string(plan.data_size);
    header += ',';
    header += std::to_string(end);
    header += "]}";
    plan.sizes.push_back(bytes);
    plan.data_size = end;
  }
  header += '}';
  // Spaces are what the reference pads with and any JSON parser skips; the
  // data section then starts 8-byte aligned for in-place use.
  header.append((8 - header.size() % 8) % 8, ' ');
  ZERO_CHECK(header.size() <= kMaxHeaderBytes, "write_safetensors: header of ", header.size(),
             " bytes exceeds the ", kMaxHeaderBytes, "-byte limit readers enforce");
  return plan;
}

}  // namespace

std::vector<std::byte> serialize_safetensors(const std::vector<TensorView>& tensors,
                                             const std::map<std::string, std::string>& metadata) {
  const Plan plan = plan_layout(tensors, metadata);
  const std::uint64_t total = 8 + plan.header.size() + plan.data_size;
  ZERO_CHECK(total <= std::numeric_limits<std::size_t>::max(),
             "serialize_safetensors: ", total, " bytes do not fit in memory");
  std::vector<std::byte> out(static_cast<std::size_t>(total));
  store_le64(out.data(), plan.header.size());
  std::memcpy(out.data() + 8, plan.header.data(), plan.header.size());
  std::byte* cursor = out.data() + 8 + plan.header.size();
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (plan.sizes[i]) std::memcpy(cursor, tensors[i].data, plan.sizes[i]);
    cursor += plan.sizes[i];
  }
  return out;
}

void write_safetensors(const std::filesystem::path& path, const std::vector<TensorView>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  const Plan plan = plan_layout(tensors, metadata);
  AtomicFileWriter writer(path);
  std::byte length[8];
  store_le64(length, plan.header.size());
  writer.write(length, sizeof length);
  writer.write(plan.header.data(), plan.header.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (plan.sizes[i]) writer.write(tensors[i].data, plan.sizes[i]);
  }
  writer.commit();
}

// ---------------------------------------------------------------- stream writer

SafeTensorsStreamWriter::SafeTensorsStreamWriter(const std::filesystem::path& path,
                                                 const std::vector<TensorSpec>& tensors,
                                                 const std::map<std::string, std::string>& metadata) {
  std::vector<TensorView> views;
  views.reserve(tensors.size());
  for (const TensorSpec& t : tensors) views.push_back({t.name, t.dtype, t.shape, nullptr});
  const Plan plan = plan_layout(views, metadata, /*with_data=*/false);
  // Created only once the specs are known to be valid: no temporary file for a refused call.
  writer_.emplace(path);
  std::byte length[8];
  store_le64(length, plan.header.size());
  writer_->write(length, sizeof length);
  writer_->write(plan.header.data(), plan.header.size());
  sizes_ = plan.sizes;
  data_size_ = plan.data_size;
  file_size_ = 8 + plan.header.size() + plan.data_size;
  skip_empty();
}

void SafeTensorsStreamWriter::skip_empty() {
  while (current_ < sizes_.size() && written_in_current_ == sizes_[current_]) {
    ++current_;
    written_in_current_ = 0;
  }
}

void SafeTensorsStreamWriter::append(std::span<const std::byte> bytes) {
  ZERO_CHECK(bytes.size() <= data_size_ - written_, "SafeTensorsStreamWriter(", writer_->target().string(),
             "): ", bytes.size(), " bytes appended with only ", data_size_ - written_, " left to write");
  writer_->write(bytes);
  written_ += bytes.size();
  std::uint64_t left = bytes.size();
  while (left > 0) {
    const std::uint64_t take = std::min(left, sizes_[current_] - written_in_current_);
    written_in_current_ += take;
    left -= take;
    skip_empty();
  }
}

void SafeTensorsStreamWriter::commit() {
  ZERO_CHECK(written_ == data_size_, "SafeTensorsStreamWriter(", writer_->target().string(), "): committed after ",
             written_, " of ", data_size_, " data bytes",
             current_ < sizes_.size() ? " (tensor " + std::to_string(current_) + " is incomplete)" : std::string());
  writer_->commit();
}

}  // namespace zero::io
