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
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>
#include <utility>

#include "zero/core/error.hpp"

namespace zero::io {
namespace {

// std::map-backed objects: ordered_json looks keys up linearly, which makes a
// header of n tensors cost O(n^2) to parse, a hang for a hostile 100 MB header.
using Json = nlohmann::json;

using detail::brief_text;
using detail::kMaxHeaderBytes;

// Bounds on one entry of a header, so that a tensor's description costs
// memory in proportion to what a valid one holds: no tensor has more than
// kMaxTensorRank dimensions, and a valid entry is a handful of values.
constexpr std::size_t kMaxTensorRank = 64;
constexpr std::size_t kMaxEntryValues = 4 + kMaxTensorRank + 2 + 64;  // slack: errors still name the field
constexpr std::size_t kMaxEntryDepth = 3;           // entry object, shape, one level more for messages
constexpr std::size_t kMaxMetadataValues = 65536;
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

struct RawEntry {
  std::string name;
  TensorDType dtype = TensorDType::F32;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
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
  if (shape.size() > kMaxTensorRank) {
    ZERO_BAD_FILE(where, tensor, " has a shape of ", shape.size(), " dimensions; expected at most ",
                  kMaxTensorRank, " (kMaxTensorRank)");
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

// The first pass over the header: syntax only, and the number of top-level
// entries, in constant memory. Text that is not JSON is refused before
// anything is built; the count sizes the tensor list exactly.
class EntryCounter {
 public:
  using string_t = Json::string_t;
  bool null() { return true; }
  bool boolean(bool) { return true; }
  bool number_integer(Json::number_integer_t) { return true; }
  bool number_unsigned(Json::number_unsigned_t) { return true; }
  bool number_float(Json::number_float_t, const string_t&) { return true; }
  bool string(string_t&) { return true; }
  bool binary(Json::binary_t&) { return true; }
  bool start_object(std::size_t) { return ++depth_, true; }
  bool start_array(std::size_t) { return ++depth_, true; }
  bool end_object() { return --depth_, true; }
  bool end_array() { return --depth_, true; }
  bool key(string_t&) {
    if (depth_ == 1) ++entries;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const Json::exception& e) {
    error = e.what();
    return false;
  }

  std::size_t entries = 0;
  std::optional<std::string> error;

 private:
  std::size_t depth_ = 0;
};

std::size_t count_entries(const std::string& where, std::string_view text) {
  EntryCounter counter;
  const bool parsed = Json::sax_parse(text.data(), text.data() + text.size(), &counter);
  if (!parsed || counter.error) {
    ZERO_BAD_FILE(where, "header is not valid JSON: ",
                  parse_error_text(counter.error.value_or("rejected by the parser")),
                  "; expected UTF-8 JSON text of an object");
  }
  return counter.entries;
}

// The second pass: each top-level entry is built as a small JSON tree of its
// own, checked (parse_tensor_entry, the metadata's strings) and dropped
// before the next one is read. The header is never a tree as a whole: that
// costs 20-40 times its bytes (a map node per key, a node per number), which
// for a header within the 100 MB limit is gigabytes.
class EntryReader {
 public:
  using string_t = Json::string_t;

  EntryReader(const std::string& where, std::uint64_t data_size, std::vector<TensorInfo>& tensors,
              std::map<std::string, std::string>& metadata)
      : where_(where), data_size_(data_size), tensors_(tensors), metadata_(metadata) {}

  bool null() { return add(Json(nullptr)); }
  bool boolean(bool v) { return add(Json(v)); }
  bool number_integer(Json::number_integer_t v) { return add(Json(v)); }
  bool number_unsigned(Json::number_unsigned_t v) { return add(Json(v)); }
  bool number_float(Json::number_float_t v, const string_t&) { return add(Json(v)); }
  bool string(string_t& v) { return add(Json(std::move(v))); }
  bool binary(Json::binary_t&) { return add(Json(nullptr)); }
  bool start_object(std::size_t) { return open(Json::object()); }
  bool start_array(std::size_t) { return open(Json::array()); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }

  bool key(string_t& key) {
    if (open_.empty()) {  // a top-level key: the next entry's name
      name_ = std::move(key);
      if (name_ == "__metadata__") {
        if (seen_metadata_) ZERO_BAD_FILE(where_, "header names '__metadata__' more than once; expected it once");
        seen_metadata_ = true;
      }
      return true;
    }
    const Json& container = *open_.back();
    if (container.contains(key)) {
      ZERO_BAD_FILE(where_, "header entry '", brief_text(name_), "' has field '", brief_text(key),
                    "' more than once; expected each field once");
    }
    if (open_.size() == 1 && name_ != "__metadata__" && key != "dtype" && key != "shape" &&
        key != "data_offsets") {
      ZERO_BAD_FILE(where_, "tensor '", brief_text(name_), "' has unexpected field '", brief_text(key),
                    "'; expected only dtype, shape and data_offsets");
    }
    pending_key_ = std::move(key);
    return true;
  }

  bool parse_error(std::size_t, const std::string&, const Json::exception& e) {
    // The first pass found the text to be JSON; nothing else is expected here.
    ZERO_BAD_FILE(where_, "header is not valid JSON: ", parse_error_text(e.what()),
                  "; expected UTF-8 JSON text of an object");
  }

 private:
  // The top-level object itself is not kept: its entries are handled one by one.
  bool open(Json container) {
    if (depth_++ == 0) return true;
    if (open_.size() >= kMaxEntryDepth) {
      ZERO_BAD_FILE(where_, "header entry '", brief_text(name_), "' nests arrays or objects more than ",
                    kMaxEntryDepth, " deep; expected a tensor entry (dtype, shape, data_offsets) or the "
                    "string-to-string __metadata__");
    }
    Json* placed = place(std::move(container));
    open_.push_back(placed);
    return true;
  }

  bool close() {
    if (--depth_ == 0) return true;
    open_.pop_back();
    if (open_.empty()) finish_entry();
    return true;
  }

  bool add(Json value) {
    if (open_.empty()) {  // a top-level entry that is not an object: refused by its check
      entry_ = std::move(value);
      finish_entry();
      return true;
    }
    place(std::move(value));
    return true;
  }

  // Puts a value into the entry being built: as the entry itself, or into
  // the innermost open array or object.
  Json* place(Json value) {
    const bool metadata = name_ == "__metadata__";
    if (++entry_values_ > (metadata ? kMaxMetadataValues : kMaxEntryValues)) {
      if (metadata) {
        ZERO_BAD_FILE(where_, "__metadata__ holds more than ", kMaxMetadataValues,
                      " values; expected a few strings (kMaxMetadataValues)");
      }
      ZERO_BAD_FILE(where_, "tensor '", brief_text(name_), "' is described by more than ", kMaxEntryValues,
                    " JSON values; expected dtype, a shape of at most ", kMaxTensorRank,
                    " dimensions and data_offsets");
    }
    if (open_.empty()) {
      entry_ = std::move(value);
      return &entry_;
    }
    Json& container = *open_.back();
    if (container.is_array()) {
      container.push_back(std::move(value));
      return &container.back();
    }
    Json& slot = container[pending_key_];
    slot = std::move(value);
    return &slot;
  }

  void finish_entry() {
    if (name_ == "__metadata__") {
      read_metadata(entry_);
    } else {
      RawEntry raw = parse_tensor_entry(where_, name_, entry_, data_size_);
      // data_offset counts from the data section until parse() knows where it starts.
      tensors_.push_back({.name = std::move(raw.name), .dtype = raw.dtype, .shape = std::move(raw.shape),
                          .data_offset = raw.begin, .byte_size = raw.end - raw.begin});
    }
    entry_ = Json();
    entry_values_ = 0;
  }

  // The __metadata__ entry: strings to strings, moved into place.
  void read_metadata(Json& meta) {
    if (!meta.is_object()) {
      ZERO_BAD_FILE(where_, "__metadata__ is a JSON ", meta.type_name(),
                    "; expected an object mapping strings to strings");
    }
    for (auto m = meta.begin(); m != meta.end(); ++m) {
      if (!m.value().is_string()) {
        ZERO_BAD_FILE(where_, "__metadata__ entry '", brief_text(m.key()), "' is a JSON ",
                      m.value().type_name(), " (", brief(m.value()),
                      "); expected a string (metadata maps strings to strings)");
      }
      metadata_.emplace(m.key(), std::move(m.value().get_ref<std::string&>()));
    }
  }

  const std::string& where_;
  const std::uint64_t data_size_;
  std::vector<TensorInfo>& tensors_;
  std::map<std::string, std::string>& metadata_;
  std::size_t depth_ = 0;
  std::string name_;         // of the top-level entry being read
  std::string pending_key_;  // the key whose value comes next
  Json entry_;
  std::vector<Json*> open_;  // the entry's open arrays and objects, innermost last
  std::size_t entry_values_ = 0;
  bool seen_metadata_ = false;
};

// Every tensor entry of the header, in header order (data_offset from the
// start of the data section), and its __metadata__.
std::vector<TensorInfo> read_entries(const std::string& where, std::string_view text, std::uint64_t data_size,
                                     std::map<std::string, std::string>& metadata) {
  std::vector<TensorInfo> entries;
  entries.reserve(count_entries(where, text));
  EntryReader reader(where, data_size, entries, metadata);
  Json::sax_parse(text.data(), text.data() + text.size(), &reader);
  return entries;
}

// Unique tensor names: a sort of positions, not a set of copies of the names.
void check_unique_names(const std::string& where, const std::vector<TensorInfo>& entries) {
  std::vector<std::uint32_t> by_name(entries.size());
  for (std::size_t i = 0; i < by_name.size(); ++i) by_name[i] = static_cast<std::uint32_t>(i);
  std::sort(by_name.begin(), by_name.end(),
            [&](std::uint32_t a, std::uint32_t b) { return entries[a].name < entries[b].name; });
  for (std::size_t i = 1; i < by_name.size(); ++i) {
    if (entries[by_name[i]].name == entries[by_name[i - 1]].name) {
      ZERO_BAD_FILE(where, "header names '", brief_text(entries[by_name[i]].name),
                    "' more than once; expected unique tensor names");
    }
  }
}

// Sorts the tensors by offset and walks them: each must start where the
// previous ended, so the data section has no overlaps, no holes and no
// trailing bytes.
void sort_and_check_tiling(const std::string& where, std::vector<TensorInfo>& entries, std::uint64_t data_size) {
  // Stable: zero-sized tensors at one offset keep their header order.
  std::stable_sort(entries.begin(), entries.end(), [](const TensorInfo& a, const TensorInfo& b) {
    if (a.data_offset != b.data_offset) return a.data_offset < b.data_offset;
    return a.byte_size < b.byte_size;
  });
  std::uint64_t covered = 0;
  const TensorInfo* previous = nullptr;
  for (const TensorInfo& e : entries) {
    const std::uint64_t begin = e.data_offset, end = e.data_offset + e.byte_size;
    if (begin < covered) {
      ZERO_BAD_FILE(where, "tensor '", brief_text(e.name), "' at data_offsets [", begin, ", ", end,
                    "] overlaps tensor '", brief_text(previous->name), "' at [", previous->data_offset, ", ",
                    previous->data_offset + previous->byte_size, "]; expected disjoint tensors");
    }
    if (begin > covered) {
      ZERO_BAD_FILE(where, "data bytes [", covered, ", ", begin,
                    ") belong to no tensor (a hole before tensor '", brief_text(e.name),
                    "'); expected tensors to cover the data section without gaps");
    }
    covered = end;
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
      by_name_(std::move(other.by_name_)),
      metadata_(std::move(other.metadata_)) {}

SafeTensorsFile& SafeTensorsFile::operator=(SafeTensorsFile&& other) noexcept {
  if (this != &other) {
    release();
    path_ = std::move(other.path_);
    mapping_ = std::exchange(other.mapping_, nullptr);
    owned_ = std::move(other.owned_);
    size_ = std::exchange(other.size_, 0);
    tensors_ = std::move(other.tensors_);
    by_name_ = std::move(other.by_name_);
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
  const std::uint64_t data_start = 8 + header_size;
  const std::uint64_t data_size = size_ - data_start;
  tensors_ = read_entries(where, text, data_size, metadata_);
  check_unique_names(where, tensors_);
  sort_and_check_tiling(where, tensors_, data_size);
  for (TensorInfo& info : tensors_) info.data_offset += data_start;
  by_name_.resize(tensors_.size());
  for (std::size_t i = 0; i < by_name_.size(); ++i) by_name_[i] = i;
  std::sort(by_name_.begin(), by_name_.end(),
            [&](std::size_t a, std::size_t b) { return tensors_[a].name < tensors_[b].name; });
}

const TensorInfo* SafeTensorsFile::find(std::string_view name) const {
  const auto it = std::lower_bound(by_name_.begin(), by_name_.end(), name,
                                   [&](std::size_t i, std::string_view n) { return tensors_[i].name < n; });
  return it == by_name_.end() || tensors_[*it].name != name ? nullptr : &tensors_[*it];
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
