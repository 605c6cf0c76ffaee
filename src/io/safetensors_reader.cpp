// The safetensors reader: SafeTensorsFile maps a file (or takes bytes), checks
// its header strictly (repeated keys, unknown fields, holes and overlaps in the
// data section are refused) and hands out the tensors' bytes in place.
#include "error_text.hpp"
#include "safetensors_format.hpp"
#include "zero/io/safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "zero/core/error.hpp"

namespace zero::io {
namespace {

// std::map-backed objects: ordered_json looks keys up linearly, which makes a
// header of n tensors cost O(n^2) to parse, a hang for a hostile 100 MB header.
using Json = nlohmann::json;

using detail::brief_text;
using detail::kMaxHeaderBytes;
using detail::load_le64;
using detail::shape_text;

constexpr std::string_view kExpectedDTypes = "F64, F32, F16, BF16, I64, I32, I16, I8, U8 or BOOL";

// Every message starts with the file so that a failing load among hundreds of
// shards says which one.
#define ZERO_BAD_FILE(where, ...) \
  ZERO_THROW(::zero::IoError, "safetensors file '", where, "': ", __VA_ARGS__)

// A short rendering of a header value for messages. Not Json::dump(): a
// hostile header may hold megabytes in one field or nest arrays a million
// deep, and dump() would copy all of it or recurse until the stack overflows.
void render_brief(const Json& value, int depth, std::string& out, std::size_t limit) {
  if (out.size() >= limit) return;
  if (value.is_string()) {
    out += Json(brief_text(value.get_ref<const std::string&>())).dump();
    return;
  }
  if (!value.is_array() && !value.is_object()) {
    out += value.dump();
    return;
  }
  const bool array = value.is_array();
  out += array ? '[' : '{';
  if (depth >= 3 && !value.empty()) {
    out += "...";
  } else {
    bool first = true;
    for (auto it = value.begin(); it != value.end(); ++it) {
      if (out.size() >= limit) break;
      if (!first) out += ", ";
      first = false;
      if (!array) out += Json(it.key()).dump() + ": ";
      render_brief(it.value(), depth + 1, out, limit);
    }
  }
  out += array ? ']' : '}';
}

std::string brief(const Json& value) {
  std::string out;
  render_brief(value, 0, out, 80);
  return brief_text(out);
}

// nlohmann's parse errors quote the offending input, which may be arbitrary
// bytes; escape them so that logs and JSON log sinks get clean text. The
// "[json.exception.parse_error.101] " prefix says nothing to a user.
std::string parse_error_text(std::string_view what) { return detail::printable_error_text(what); }

// Reads a JSON value as a non-negative integer that fits `limit`; false for
// floats (even 2.0), negatives, strings and out-of-range values.
bool as_count(const Json& value, std::uint64_t limit, std::uint64_t& out) {
  if (value.is_number_unsigned()) {
    out = value.get<std::uint64_t>();
    return out <= limit;
  }
  if (value.is_number_integer()) {
    const std::int64_t v = value.get<std::int64_t>();
    if (v < 0) return false;
    out = static_cast<std::uint64_t>(v);
    return out <= limit;
  }
  return false;
}

// A first, DOM-less pass over the header. It finds repeated keys, which the
// DOM would silently collapse into one, and records the order of the
// top-level keys, which the DOM's std::map forgets. (nlohmann's parser
// callback could find repeats too, but it rescans the parent object after
// every nested one: O(n^2) in the number of tensors.)
class KeyScanner {
 public:
  using string_t = Json::string_t;

  bool null() { return true; }
  bool boolean(bool) { return true; }
  bool number_integer(Json::number_integer_t) { return true; }
  bool number_unsigned(Json::number_unsigned_t) { return true; }
  bool number_float(Json::number_float_t, const string_t&) { return true; }
  bool string(string_t&) { return true; }
  bool binary(Json::binary_t&) { return true; }
  bool start_array(std::size_t) {
    ++depth_;
    return true;
  }
  bool end_array() {
    --depth_;
    return true;
  }
  bool start_object(std::size_t) {
    ++depth_;
    if (depth_ > 1) nested_keys_.emplace_back();
    return true;
  }
  bool end_object() {
    if (depth_ > 1) nested_keys_.pop_back();
    --depth_;
    return true;
  }
  bool key(string_t& key) {
    if (depth_ == 1) {
      current_top_level_ = key;
      if (!top_level_order.emplace(key, top_level_order.size()).second) {
        duplicate = key;
        return false;
      }
    } else if (!nested_keys_.back().insert(key).second) {
      duplicate = key;
      duplicate_parent = current_top_level_;
      return false;
    }
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::json::exception& e) {
    error = e.what();
    return false;
  }

  std::unordered_map<std::string, std::size_t> top_level_order;
  std::optional<std::string> duplicate;
  std::string duplicate_parent;  // the top-level entry holding a repeated field
  std::optional<std::string> error;

 private:
  int depth_ = 0;
  std::string current_top_level_;
  std::vector<std::unordered_set<std::string>> nested_keys_;
};

struct RawEntry {
  std::string name;
  TensorDType dtype = TensorDType::F32;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
  std::size_t header_index = 0;  // position among the header's top-level keys
};

RawEntry parse_tensor_entry(const std::string& where, const std::string& name, const Json& entry,
                            std::uint64_t data_size) {
  const std::string tensor = "tensor '" + brief_text(name) + "'";
  if (!entry.is_object()) {
    ZERO_BAD_FILE(where, tensor, " is described by a JSON ", entry.type_name(),
                  "; expected an object with fields dtype, shape and data_offsets");
  }
  for (auto field = entry.begin(); field != entry.end(); ++field) {
    if (field.key() != "dtype" && field.key() != "shape" && field.key() != "data_offsets") {
      ZERO_BAD_FILE(where, tensor, " has unexpected field '", brief_text(field.key()),
                    "'; expected only dtype, shape and data_offsets");
    }
  }
  for (const char* required : {"dtype", "shape", "data_offsets"}) {
    if (!entry.contains(required)) {
      ZERO_BAD_FILE(where, tensor, " lacks field '", required,
                    "'; expected fields dtype, shape and data_offsets");
    }
  }

  RawEntry raw;
  raw.name = name;
  const Json& dtype = entry["dtype"];
  if (!dtype.is_string()) {
    ZERO_BAD_FILE(where, tensor, " has dtype ", brief(dtype), " (a ", dtype.type_name(),
                  "); expected a string, one of ", kExpectedDTypes);
  }
  const auto parsed_dtype = parse_tensor_dtype(dtype.get_ref<const std::string&>());
  if (!parsed_dtype) {
    ZERO_BAD_FILE(where, tensor, " has unknown dtype ", brief(dtype), "; expected one of ",
                  kExpectedDTypes);
  }
  raw.dtype = *parsed_dtype;

  const Json& shape = entry["shape"];
  if (!shape.is_array()) {
    ZERO_BAD_FILE(where, tensor, " has shape ", brief(shape),
                  "; expected an array of non-negative integers");
  }
  raw.shape.reserve(shape.size());
  for (std::size_t i = 0; i < shape.size(); ++i) {
    std::uint64_t dim = 0;
    if (!as_count(shape[i], std::numeric_limits<std::int64_t>::max(), dim)) {
      ZERO_BAD_FILE(where, tensor, " has shape ", brief(shape), " whose element ", i, " (",
                    brief(shape[i]), ") is not a non-negative 64-bit integer",
                    "; expected an array of non-negative integers");
    }
    raw.shape.push_back(static_cast<std::int64_t>(dim));
  }

  const Json& offsets = entry["data_offsets"];
  std::uint64_t begin = 0, end = 0;
  if (!offsets.is_array() || offsets.size() != 2 ||
      !as_count(offsets[0], std::numeric_limits<std::uint64_t>::max(), begin) ||
      !as_count(offsets[1], std::numeric_limits<std::uint64_t>::max(), end)) {
    ZERO_BAD_FILE(where, tensor, " has data_offsets ", brief(offsets),
                  "; expected an array of two non-negative integers [begin, end]");
  }
  if (begin > end) {
    ZERO_BAD_FILE(where, tensor, " has data_offsets [", begin, ", ", end,
                  "] whose begin exceeds its end; expected begin <= end");
  }
  raw.begin = begin;
  raw.end = end;

  const std::optional<std::uint64_t> needed = detail::tensor_byte_size(raw.dtype, raw.shape);
  if (!needed) {
    ZERO_BAD_FILE(where, tensor, " has shape ", shape_text(raw.shape), " of dtype ", raw.dtype,
                  " whose byte size overflows 64 bits; expected a size matching data_offsets [",
                  begin, ", ", end, "] (", end - begin, " bytes)");
  }
  if (*needed != end - begin) {
    ZERO_BAD_FILE(where, tensor, " has data_offsets [", begin, ", ", end, "] spanning ",
                  end - begin, " bytes, but shape ", shape_text(raw.shape), " of dtype ",
                  raw.dtype, " needs ", *needed, " bytes; expected the two to agree");
  }
  if (end > data_size) {
    ZERO_BAD_FILE(where, tensor, " has data_offsets [", begin, ", ", end,
                  "] that run past the end of the data section; expected end <= ", data_size,
                  " (the bytes after the header)");
  }
  return raw;
}

// ---------------------------------------------------------------- parse() in steps

// The header's byte length, from the first 8 bytes: at least 1, within the
// limit and within the file.
std::uint64_t header_length(const std::string& where, const std::byte* base, std::uint64_t file_size) {
  if (file_size < 8) {
    ZERO_BAD_FILE(where, "file is ", file_size,
                  " bytes, shorter than the 8-byte header length; expected at least 8 bytes "
                  "followed by a JSON header");
  }
  const std::uint64_t header_size = load_le64(base);
  if (header_size == 0) {
    ZERO_BAD_FILE(where, "header length is 0; expected the byte length of a JSON object (>= 2)");
  }
  if (header_size > kMaxHeaderBytes) {
    ZERO_BAD_FILE(where, "header length ", header_size, " exceeds the limit of ",
                  kMaxHeaderBytes, " bytes; expected a smaller header (is the file corrupt?)");
  }
  if (header_size > file_size - 8) {
    ZERO_BAD_FILE(where, "header length ", header_size,
                  " runs past the end of the file; expected at most ", file_size - 8,
                  " (file size ", file_size, " minus 8)");
  }
  return header_size;
}

// The header's text: it must open an object and hold no NUL byte.
std::string_view header_text(const std::string& where, const std::byte* start, std::uint64_t header_size) {
  const char* text = reinterpret_cast<const char*>(start);
  if (text[0] != '{') {
    char shown[8];
    std::snprintf(shown, sizeof shown, "0x%02x", static_cast<unsigned char>(text[0]));
    ZERO_BAD_FILE(where, "header starts with byte ", shown,
                  " instead of '{'; expected UTF-8 JSON text of an object");
  }
  // nlohmann's lexer takes a NUL byte for the end of input, so "{}\0junk"
  // would parse; valid JSON text never holds a raw NUL, even inside strings.
  if (const void* nul = std::memchr(text, '\0', header_size)) {
    ZERO_BAD_FILE(where, "header is not valid JSON: it holds a NUL byte at header offset ",
                  static_cast<const char*>(nul) - text,
                  "; expected UTF-8 JSON text of an object, padded with spaces only");
  }
  return {text, static_cast<std::size_t>(header_size)};
}

// The DOM-less pass (KeyScanner): refuses repeated keys and text that is not JSON.
KeyScanner scan_header(const std::string& where, std::string_view text) {
  KeyScanner scanner;
  const bool scanned = Json::sax_parse(text.data(), text.data() + text.size(), &scanner);
  if (scanner.duplicate) {
    if (scanner.duplicate_parent.empty()) {
      ZERO_BAD_FILE(where, "header names '", brief_text(*scanner.duplicate),
                    "' more than once; expected unique tensor names");
    }
    ZERO_BAD_FILE(where, "header entry '", brief_text(scanner.duplicate_parent), "' has field '",
                  brief_text(*scanner.duplicate), "' more than once; expected each field once");
  }
  if (!scanned || scanner.error) {
    ZERO_BAD_FILE(where, "header is not valid JSON: ",
                  parse_error_text(scanner.error.value_or("rejected by the parser")),
                  "; expected UTF-8 JSON text of an object");
  }
  return scanner;
}

// The header as a DOM, which must be an object.
Json parse_header(const std::string& where, std::string_view text) {
  Json header;
  try {
    header = Json::parse(text.data(), text.data() + text.size());
  } catch (const nlohmann::json::exception& e) {
    ZERO_BAD_FILE(where, "header is not valid JSON: ", parse_error_text(e.what()),
                  "; expected UTF-8 JSON text of an object");
  }
  if (!header.is_object()) {
    ZERO_BAD_FILE(where, "header is a JSON ", header.type_name(), "; expected an object");
  }
  return header;
}

// The __metadata__ entry: strings to strings.
void read_metadata(const std::string& where, const Json& meta, std::map<std::string, std::string>& metadata) {
  if (!meta.is_object()) {
    ZERO_BAD_FILE(where, "__metadata__ is a JSON ", meta.type_name(),
                  "; expected an object mapping strings to strings");
  }
  for (auto m = meta.begin(); m != meta.end(); ++m) {
    if (!m.value().is_string()) {
      ZERO_BAD_FILE(where, "__metadata__ entry '", brief_text(m.key()), "' is a JSON ",
                    m.value().type_name(), " (", brief(m.value()),
                    "); expected a string (metadata maps strings to strings)");
    }
    metadata.emplace(m.key(), m.value().get<std::string>());
  }
}

// Every tensor entry of the header (and its __metadata__ into `metadata`), in
// the DOM's key order, each knowing its position in the header.
std::vector<RawEntry> read_entries(const std::string& where, const Json& header,
                                   const std::unordered_map<std::string, std::size_t>& header_order,
                                   std::uint64_t data_size, std::map<std::string, std::string>& metadata) {
  std::vector<RawEntry> entries;
  entries.reserve(header.size());
  for (auto item = header.begin(); item != header.end(); ++item) {
    if (item.key() == "__metadata__") {
      read_metadata(where, item.value(), metadata);
      continue;
    }
    entries.push_back(parse_tensor_entry(where, item.key(), item.value(), data_size));
    entries.back().header_index = header_order.at(item.key());
  }
  return entries;
}

// Sorts the tensors by offset and walks them: each must start where the
// previous ended, so the data section has no overlaps, no holes and no
// trailing bytes.
void sort_and_check_tiling(const std::string& where, std::vector<RawEntry>& entries, std::uint64_t data_size) {
  std::sort(entries.begin(), entries.end(), [](const RawEntry& a, const RawEntry& b) {
    if (a.begin != b.begin) return a.begin < b.begin;
    if (a.end != b.end) return a.end < b.end;
    return a.header_index < b.header_index;
  });
  std::uint64_t covered = 0;
  const RawEntry* previous = nullptr;
  for (const RawEntry& e : entries) {
    if (e.begin < covered) {
      ZERO_BAD_FILE(where, "tensor '", brief_text(e.name), "' at data_offsets [", e.begin, ", ",
                    e.end, "] overlaps tensor '", brief_text(previous->name), "' at [",
                    previous->begin, ", ", previous->end, "]; expected disjoint tensors");
    }
    if (e.begin > covered) {
      ZERO_BAD_FILE(where, "data bytes [", covered, ", ", e.begin,
                    ") belong to no tensor (a hole before tensor '", brief_text(e.name),
                    "'); expected tensors to cover the data section without gaps");
    }
    covered = e.end;
    previous = &e;
  }
  if (covered != data_size) {
    ZERO_BAD_FILE(where, "the last ", data_size - covered, " of the ", data_size,
                  " data bytes belong to no tensor; expected the tensors to end at the end of "
                  "the file");
  }
}

}  // namespace

std::optional<TensorDType> parse_tensor_dtype(std::string_view name) {
  for (TensorDType dtype : kAllTensorDTypes) {
    if (name_of(dtype) == name) return dtype;
  }
  return std::nullopt;
}

// ---------------------------------------------------------------- reader

SafeTensorsFile SafeTensorsFile::open(const std::filesystem::path& path) {
  SafeTensorsFile file;
  file.path_ = path;
  // O_NONBLOCK: opening a FIFO by mistake must fail below, not block forever.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int error = errno;
    ZERO_BAD_FILE(path.string(), "cannot open: ", std::strerror(error));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int error = errno;
    ::close(fd);
    ZERO_BAD_FILE(path.string(), "cannot stat: ", std::strerror(error));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    ZERO_BAD_FILE(path.string(), "is not a regular file; expected a safetensors file");
  }
  file.size_ = static_cast<std::uint64_t>(st.st_size);
  // mmap rejects a zero length; such a file fails the size check in parse().
  if (file.size_ > 0) {
    void* mapping = ::mmap(nullptr, file.size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (mapping == MAP_FAILED) {
      const int error = errno;
      ::close(fd);
      ZERO_BAD_FILE(path.string(), "cannot mmap ", file.size_, " bytes: ", std::strerror(error));
    }
    file.mapping_ = mapping;
  }
  ::close(fd);  // the mapping keeps the file open
  file.parse();
  return file;
}

SafeTensorsFile::SafeTensorsFile(const std::filesystem::path& path)
    : SafeTensorsFile(open(path)) {}

SafeTensorsFile SafeTensorsFile::from_bytes(std::vector<std::byte> bytes, std::string name) {
  SafeTensorsFile file;
  file.path_ = std::move(name);
  file.owned_ = std::move(bytes);
  file.size_ = file.owned_.size();
  file.parse();
  return file;
}

SafeTensorsFile::~SafeTensorsFile() { release(); }

SafeTensorsFile::SafeTensorsFile(SafeTensorsFile&& other) noexcept
    : path_(std::move(other.path_)),
      mapping_(std::exchange(other.mapping_, nullptr)),
      owned_(std::move(other.owned_)),
      size_(std::exchange(other.size_, 0)),
      tensors_(std::move(other.tensors_)),
      index_(std::move(other.index_)),
      metadata_(std::move(other.metadata_)) {}

SafeTensorsFile& SafeTensorsFile::operator=(SafeTensorsFile&& other) noexcept {
  if (this != &other) {
    release();
    path_ = std::move(other.path_);
    mapping_ = std::exchange(other.mapping_, nullptr);
    owned_ = std::move(other.owned_);
    size_ = std::exchange(other.size_, 0);
    tensors_ = std::move(other.tensors_);
    index_ = std::move(other.index_);
    metadata_ = std::move(other.metadata_);
  }
  return *this;
}

void SafeTensorsFile::release() noexcept {
  if (mapping_) {
    ::munmap(mapping_, size_);
    mapping_ = nullptr;
  }
  owned_.clear();
  size_ = 0;
}

const std::byte* SafeTensorsFile::bytes() const noexcept {
  return mapping_ ? static_cast<const std::byte*>(mapping_) : owned_.data();
}

void SafeTensorsFile::parse() {
  const std::string where = path_.string();
  const std::uint64_t header_size = header_length(where, bytes(), size_);
  const std::string_view text = header_text(where, bytes() + 8, header_size);
  const KeyScanner scanner = scan_header(where, text);
  const Json header = parse_header(where, text);
  const std::uint64_t data_start = 8 + header_size;
  const std::uint64_t data_size = size_ - data_start;
  std::vector<RawEntry> entries = read_entries(where, header, scanner.top_level_order, data_size, metadata_);
  sort_and_check_tiling(where, entries, data_size);

  tensors_.reserve(entries.size());
  for (RawEntry& e : entries) {
    TensorInfo info;
    info.name = std::move(e.name);
    info.dtype = e.dtype;
    info.shape = std::move(e.shape);
    info.data_offset = data_start + e.begin;
    info.byte_size = e.end - e.begin;
    index_.emplace(info.name, tensors_.size());
    tensors_.push_back(std::move(info));
  }
}

const TensorInfo* SafeTensorsFile::find(std::string_view name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const TensorInfo& SafeTensorsFile::at(std::string_view name) const {
  const TensorInfo* info = find(name);
  if (!info) {
    ZERO_BAD_FILE(path_.string(), "has no tensor named '", brief_text(name), "' (it holds ",
                  tensors_.size(), " tensors)");
  }
  return *info;
}

std::span<const std::byte> SafeTensorsFile::data(const TensorInfo& info) const {
  ZERO_CHECK(info.data_offset <= size_ && info.byte_size <= size_ - info.data_offset,
             "SafeTensorsFile::data: tensor '", info.name, "' (offset ", info.data_offset,
             ", ", info.byte_size, " bytes) does not lie inside '", path_.string(), "' (",
             size_, " bytes); was it taken from another file?");
  return {bytes() + info.data_offset, static_cast<std::size_t>(info.byte_size)};
}

std::vector<float> SafeTensorsFile::read_as_float32(std::string_view name) const {
  const TensorInfo& info = at(name);
  const std::span<const std::byte> raw = data(info);
  const std::size_t count = static_cast<std::size_t>(info.element_count());
  std::vector<float> out(count);
  // memcpy per element: the data is only byte-aligned in general.
  switch (info.dtype) {
    case TensorDType::F32:
      if (count) std::memcpy(out.data(), raw.data(), count * sizeof(float));
      break;
    case TensorDType::F64:
      for (std::size_t i = 0; i < count; ++i) {
        double v;
        std::memcpy(&v, raw.data() + i * sizeof v, sizeof v);
        out[i] = static_cast<float>(v);
      }
      break;
    case TensorDType::F16:
    case TensorDType::BF16: {
      const bool is_bf16 = info.dtype == TensorDType::BF16;
      for (std::size_t i = 0; i < count; ++i) {
        std::uint16_t bits;
        std::memcpy(&bits, raw.data() + i * sizeof bits, sizeof bits);
        out[i] = is_bf16 ? bf16_bits_to_float(bits) : fp16_bits_to_float(bits);
      }
      break;
    }
    default:
      ZERO_BAD_FILE(path_.string(), "tensor '", brief_text(name), "' has dtype ", info.dtype,
                    "; read_as_float32 converts only F32, F16, BF16 and F64");
  }
  return out;
}

}  // namespace zero::io
