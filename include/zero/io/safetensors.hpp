// Reading and writing the safetensors checkpoint format
// (https://github.com/huggingface/safetensors): an 8-byte little-endian header
// length N, N bytes of JSON header, then the raw tensor bytes.
//
// The reader validates the whole header before exposing anything: a file that
// opens is one whose every tensor lies inside the file, does not overlap any
// other, and whose byte length matches its shape and dtype. Malformed input is
// reported as zero::IoError, never as a crash, so files from untrusted sources
// may be opened.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "zero/core/dtype.hpp"
#include "zero/io/atomic_file.hpp"

namespace zero::io {

/// Element types of safetensors tensors (the subset zero reads and writes).
/// The enumerator names are the strings used in the file's "dtype" field.
enum class TensorDType : std::uint8_t { F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL };

inline constexpr TensorDType kAllTensorDTypes[] = {
    TensorDType::F64, TensorDType::F32, TensorDType::F16, TensorDType::BF16, TensorDType::I64,
    TensorDType::I32, TensorDType::I16, TensorDType::I8,  TensorDType::U8,   TensorDType::BOOL};

/// Bytes per element (BOOL is one byte per element, 0 or 1).
constexpr std::size_t size_of(TensorDType dtype) {
  switch (dtype) {
    case TensorDType::F64: return 8;
    case TensorDType::F32: return 4;
    case TensorDType::F16: return 2;
    case TensorDType::BF16: return 2;
    case TensorDType::I64: return 8;
    case TensorDType::I32: return 4;
    case TensorDType::I16: return 2;
    case TensorDType::I8: return 1;
    case TensorDType::U8: return 1;
    case TensorDType::BOOL: return 1;
  }
  return 0;
}

/// The dtype's name as written in safetensors headers ("F32", "BF16", ...).
constexpr std::string_view name_of(TensorDType dtype) {
  switch (dtype) {
    case TensorDType::F64: return "F64";
    case TensorDType::F32: return "F32";
    case TensorDType::F16: return "F16";
    case TensorDType::BF16: return "BF16";
    case TensorDType::I64: return "I64";
    case TensorDType::I32: return "I32";
    case TensorDType::I16: return "I16";
    case TensorDType::I8: return "I8";
    case TensorDType::U8: return "U8";
    case TensorDType::BOOL: return "BOOL";
  }
  return "unknown";
}

inline std::ostream& operator<<(std::ostream& out, TensorDType dtype) { return out << name_of(dtype); }

/// True when the value is one of the enumerators (guards casts from integers).
constexpr bool is_valid(TensorDType dtype) {
  return static_cast<std::uint8_t>(dtype) <= static_cast<std::uint8_t>(TensorDType::BOOL);
}

/// Parses a header dtype name; exact, case-sensitive match as the format requires.
std::optional<TensorDType> parse_tensor_dtype(std::string_view name);

/// The zero::DType with the same encoding: F32, BF16 and F16. Others have none.
constexpr std::optional<DType> to_dtype(TensorDType dtype) {
  switch (dtype) {
    case TensorDType::F32: return DType::fp32;
    case TensorDType::BF16: return DType::bf16;
    case TensorDType::F16: return DType::fp16;
    default: return std::nullopt;
  }
}

/// The safetensors dtype that stores a zero::DType.
constexpr TensorDType to_tensor_dtype(DType dtype) {
  switch (dtype) {
    case DType::fp32: return TensorDType::F32;
    case DType::bf16: return TensorDType::BF16;
    case DType::fp16: return TensorDType::F16;
  }
  return TensorDType::F32;
}

/// One tensor of an opened file.
struct TensorInfo {
  std::string name;
  TensorDType dtype = TensorDType::F32;
  /// Dimensions, outermost first; empty for a 0-d scalar (one element).
  std::vector<std::int64_t> shape;
  /// Byte offset of the first element from the start of the file (not of the
  /// data section), so it can be used with pread() directly.
  std::uint64_t data_offset = 0;
  /// Bytes of data; always element_count() * size_of(dtype).
  std::uint64_t byte_size = 0;

  /// Product of the shape (1 for a scalar, 0 when any dimension is 0).
  std::uint64_t element_count() const noexcept {
    std::uint64_t count = 1;
    for (std::int64_t d : shape) count *= static_cast<std::uint64_t>(d);
    return count;
  }
};

/// A validated, read-only safetensors file.
///
/// open() memory-maps the file (read-only, MAP_PRIVATE) and validates the
/// header; the tensor data is not copied, so opening a multi-GB checkpoint is
/// cheap and pages are read on first access. The mapping lives as long as the
/// object: spans from data() must not outlive it. Truncating the file on disk
/// while it is mapped makes later accesses fault (SIGBUS), as with any mmap.
///
/// Const methods may be called from several threads at once.
class SafeTensorsFile {
 public:
  /// Opens and validates `path`. Throws zero::IoError naming the path and the
  /// defect when the file cannot be read or is not a valid safetensors file.
  static SafeTensorsFile open(const std::filesystem::path& path);
  explicit SafeTensorsFile(const std::filesystem::path& path);

  /// Validates an in-memory file. `name` stands in for the path in error
  /// messages and path().
  static SafeTensorsFile from_bytes(std::vector<std::byte> bytes, std::string name);

  ~SafeTensorsFile();
  SafeTensorsFile(SafeTensorsFile&& other) noexcept;
  SafeTensorsFile& operator=(SafeTensorsFile&& other) noexcept;
  SafeTensorsFile(const SafeTensorsFile&) = delete;
  SafeTensorsFile& operator=(const SafeTensorsFile&) = delete;

  const std::filesystem::path& path() const noexcept { return path_; }

  /// Every tensor in file order, i.e. by ascending data_offset (zero-sized
  /// tensors sharing an offset keep their header order).
  const std::vector<TensorInfo>& tensors() const noexcept { return tensors_; }

  /// The tensor called `name`, or nullptr.
  const TensorInfo* find(std::string_view name) const;

  /// Like find() but throws zero::IoError naming the file when absent.
  const TensorInfo& at(std::string_view name) const;

  /// The raw bytes of a tensor of this file, in the file's (little-endian)
  /// byte order. Not aligned beyond one byte in general. Throws
  /// zero::InvalidArgument when `info` does not lie inside this file.
  std::span<const std::byte> data(const TensorInfo& info) const;

  /// The string->string `__metadata__` entry of the header (empty if absent).
  const std::map<std::string, std::string>& metadata() const noexcept { return metadata_; }

  /// Total size of the file in bytes.
  std::uint64_t file_size() const noexcept { return size_; }

  /// The tensor's elements converted to float (F64 is rounded to nearest).
  /// Throws zero::IoError naming the tensor and its dtype when it is absent or
  /// its dtype is not F32, F16, BF16 or F64.
  std::vector<float> read_as_float32(std::string_view name) const;

 private:
  SafeTensorsFile() = default;
  void parse();
  const std::byte* bytes() const noexcept;
  void release() noexcept;

  std::filesystem::path path_;
  // Exactly one of mapping_ (open()) and owned_ (from_bytes()) holds the bytes.
  void* mapping_ = nullptr;
  std::vector<std::byte> owned_;
  std::uint64_t size_ = 0;
  std::vector<TensorInfo> tensors_;
  std::vector<std::size_t> by_name_;  // positions in tensors_, sorted by name (find() bisects)
  std::map<std::string, std::string> metadata_;
};

/// A tensor to write: `data` points at element_count(shape) * size_of(dtype)
/// bytes in little-endian order (may be null when that is 0).
struct TensorView {
  std::string name;
  TensorDType dtype = TensorDType::F32;
  std::vector<std::int64_t> shape;
  const void* data = nullptr;
};

/// The bytes of a safetensors file holding `tensors`, laid out in the given
/// order, with `metadata` as its `__metadata__` entry (omitted when empty).
/// The header is padded with spaces to a multiple of 8 bytes so that the data
/// section starts 8-byte aligned. Throws zero::InvalidArgument for duplicate
/// or reserved ("__metadata__") names, negative or overflowing shapes, null
/// data with a non-zero size, names or metadata that are not valid UTF-8.
std::vector<std::byte> serialize_safetensors(const std::vector<TensorView>& tensors,
                                             const std::map<std::string, std::string>& metadata = {});

/// Writes the same bytes as serialize_safetensors() to `path` atomically
/// (through AtomicFileWriter), streaming tensor data without an extra copy.
/// Throws zero::InvalidArgument as serialize_safetensors() does, zero::IoError
/// when writing fails; `path` is then left as it was.
void write_safetensors(const std::filesystem::path& path, const std::vector<TensorView>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

/// A tensor's name, dtype and shape, without its data (SafeTensorsStreamWriter).
struct TensorSpec {
  std::string name;
  TensorDType dtype = TensorDType::F32;
  std::vector<std::int64_t> shape;
};

/// Writes a safetensors file whose tensors are known up front but whose data
/// arrives piece by piece, so that a file larger than memory can be written:
/// the header (the same bytes write_safetensors would produce) is computed
/// from the specs and written at construction, then append() streams the data
/// of the tensors in the given order, and commit() makes the file visible
/// atomically (temporary file, fsync, rename; AtomicFileWriter). A writer
/// destroyed uncommitted leaves `path` as it was.
///
/// Throws zero::InvalidArgument as write_safetensors does for bad specs, when
/// more data is appended than the tensors hold, or when commit() comes before
/// all of it; zero::IoError when writing fails.
class SafeTensorsStreamWriter {
 public:
  SafeTensorsStreamWriter(const std::filesystem::path& path, const std::vector<TensorSpec>& tensors,
                          const std::map<std::string, std::string>& metadata = {});

  /// Appends the next bytes of the data section (little-endian elements);
  /// one call may cover part of a tensor or run across several.
  void append(std::span<const std::byte> bytes);
  void commit();

  /// Index of the tensor the next appended byte belongs to (== the tensor
  /// count once all data is written).
  std::size_t current_tensor() const noexcept { return current_; }
  std::uint64_t bytes_left() const noexcept { return data_size_ - written_; }
  /// Size of the complete file.
  std::uint64_t file_size() const noexcept { return file_size_; }

 private:
  void skip_empty();

  std::optional<AtomicFileWriter> writer_;
  std::vector<std::uint64_t> sizes_;
  std::uint64_t data_size_ = 0;
  std::uint64_t written_ = 0;
  std::uint64_t file_size_ = 0;
  std::size_t current_ = 0;
  std::uint64_t written_in_current_ = 0;
};

}  // namespace zero::io
