#include "error_text.hpp"
#include "zero/io/safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "zero/core/error.hpp"
#include "zero/io/atomic_file.hpp"

// Tensor bytes are handed out and converted as they lie in the file, which the
// format defines as little-endian.
static_assert(std::endian::native == std::endian::little,
              "zero::io reads safetensors data in place and needs a little-endian host");

namespace zero::io {
namespace {

// std::map-backed objects: ordered_json looks keys up linearly, which makes a
// header of n tensors cost O(n^2) to parse, a hang for a hostile 100 MB header.
using Json = nlohmann::json;

// The reference implementation's limit: a larger header is far more likely a
// corrupt length than a real checkpoint, and parsing it would cost gigabytes.
constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;

constexpr std::string_view kExpectedDTypes = "F64, F32, F16, BF16, I64, I32, I16, I8, U8 or BOOL";

// Every message starts with the file so that a failing load among hundreds of
// shards says which one.
#define ZERO_BAD_FILE(where, ...) \
  ZERO_THROW(::zero::IoError, "safetensors file '", where, "': ", __VA_ARGS__)

std::uint64_t load_le64(const std::byte* p) {
  std::uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | std::to_integer<std::uint64_t>(p[i]);
  return value;
}

void store_le64(std::byte* p, std::uint64_t value) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<std::byte>((value >> (8 * i)) & 0xffu);
}

bool mul_overflows(std::uint64_t a, std::uint64_t b, std::uint64_t& out) {
  return __builtin_mul_overflow(a, b, &out);
}

using detail::brief_text;

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

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) text += ", ";
    text += std::to_string(shape[i]);
  }
  return text + "]";
}

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

  // Zero if any dimension is zero, whatever the others: [0, 2^40, 2^40] is a
  // valid empty tensor, not an overflow.
  std::uint64_t needed = size_of(raw.dtype);
  bool overflow = false;
  for (std::int64_t d : raw.shape) {
    if (d == 0) {
      needed = 0;
      overflow = false;
      break;
    }
    if (!overflow) overflow = mul_overflows(needed, static_cast<std::uint64_t>(d), needed);
  }
  if (overflow) {
    ZERO_BAD_FILE(where, tensor, " has shape ", shape_text(raw.shape), " of dtype ", raw.dtype,
                  " whose byte size overflows 64 bits; expected a size matching data_offsets [",
                  begin, ", ", end, "] (", end - begin, " bytes)");
  }
  if (needed != end - begin) {
    ZERO_BAD_FILE(where, tensor, " has data_offsets [", begin, ", ", end, "] spanning ",
                  end - begin, " bytes, but shape ", shape_text(raw.shape), " of dtype ",
                  raw.dtype, " needs ", needed, " bytes; expected the two to agree");
  }
  if (end > data_size) {
    ZERO_BAD_FILE(where, tensor, " has data_offsets [", begin, ", ", end,
                  "] that run past the end of the data section; expected end <= ", data_size,
                  " (the bytes after the header)");
  }
  return raw;
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
  const std::byte* base = bytes();
  if (size_ < 8) {
    ZERO_BAD_FILE(where, "file is ", size_,
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
  if (header_size > size_ - 8) {
    ZERO_BAD_FILE(where, "header length ", header_size,
                  " runs past the end of the file; expected at most ", size_ - 8,
                  " (file size ", size_, " minus 8)");
  }
  const char* text = reinterpret_cast<const char*>(base + 8);
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

  KeyScanner scanner;
  const bool scanned = Json::sax_parse(text, text + header_size, &scanner);
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
  Json header;
  try {
    header = Json::parse(text, text + header_size);
  } catch (const nlohmann::json::exception& e) {
    ZERO_BAD_FILE(where, "header is not valid JSON: ", parse_error_text(e.what()),
                  "; expected UTF-8 JSON text of an object");
  }
  if (!header.is_object()) {
    ZERO_BAD_FILE(where, "header is a JSON ", header.type_name(), "; expected an object");
  }

  const std::uint64_t data_start = 8 + header_size;
  const std::uint64_t data_size = size_ - data_start;
  std::vector<RawEntry> entries;
  entries.reserve(header.size());
  for (auto item = header.begin(); item != header.end(); ++item) {
    if (item.key() == "__metadata__") {
      const Json& meta = item.value();
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
        metadata_.emplace(m.key(), m.value().get<std::string>());
      }
      continue;
    }
    entries.push_back(parse_tensor_entry(where, item.key(), item.value(), data_size));
    entries.back().header_index = scanner.top_level_order.at(item.key());
  }

  // Walk the tensors by offset: each must start where the previous ended, so
  // the data section has no overlaps, no holes and no trailing bytes.
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

// ---------------------------------------------------------------- writer

namespace {

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
    std::uint64_t bytes = size_of(t.dtype);
    bool overflow = false;
    for (std::int64_t d : t.shape) {
      if (d == 0) {
        bytes = 0;
        overflow = false;
        break;
      }
      if (!overflow) overflow = mul_overflows(bytes, static_cast<std::uint64_t>(d), bytes);
    }
    std::uint64_t end = 0;
    ZERO_CHECK(!overflow && !__builtin_add_overflow(plan.data_size, bytes, &end),
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
