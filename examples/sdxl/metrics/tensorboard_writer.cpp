#include "tensorboard_writer.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <array>
#include <bit>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <system_error>
#include <utility>

#include "zero/core/error.hpp"
#include "zero/io/crc32c.hpp"

namespace sdxl::metrics {
namespace {

// ---------------------------------------------------------------- protobuf wire format

enum class WireType : std::uint8_t { varint = 0, fixed64 = 1, length_delimited = 2, fixed32 = 5 };

void put_varint(std::string& out, std::uint64_t value) {
  while (value >= 0x80) {
    out.push_back(static_cast<char>((value & 0x7F) | 0x80));
    value >>= 7;
  }
  out.push_back(static_cast<char>(value));
}

void put_key(std::string& out, std::uint32_t field, WireType type) {
  put_varint(out, (static_cast<std::uint64_t>(field) << 3) | static_cast<std::uint8_t>(type));
}

// Protobuf's fixed-width fields are little-endian whatever the host is.
template <typename Unsigned>
void put_little_endian(std::string& out, Unsigned value) {
  for (std::size_t i = 0; i < sizeof(Unsigned); ++i)
    out.push_back(static_cast<char>((value >> (8 * i)) & 0xFF));
}

void put_double(std::string& out, std::uint32_t field, double value) {
  put_key(out, field, WireType::fixed64);
  put_little_endian(out, std::bit_cast<std::uint64_t>(value));
}

void put_float(std::string& out, std::uint32_t field, float value) {
  put_key(out, field, WireType::fixed32);
  put_little_endian(out, std::bit_cast<std::uint32_t>(value));
}

// int64 is a plain varint of the two's complement value: a negative step
// takes ten bytes, as protobuf itself encodes it (zigzag is only for sint64).
void put_int64(std::string& out, std::uint32_t field, std::int64_t value) {
  put_key(out, field, WireType::varint);
  put_varint(out, static_cast<std::uint64_t>(value));
}

void put_bytes(std::string& out, std::uint32_t field, std::string_view bytes) {
  put_key(out, field, WireType::length_delimited);
  put_varint(out, bytes.size());
  out.append(bytes);
}

// Event fields (tensorflow/core/util/event.proto).
constexpr std::uint32_t kEventWallTime = 1;
constexpr std::uint32_t kEventStep = 2;
constexpr std::uint32_t kEventFileVersion = 3;
constexpr std::uint32_t kEventSummary = 5;
constexpr std::uint32_t kEventSessionLog = 7;
// Summary and Summary.Value (tensorflow/core/framework/summary.proto).
constexpr std::uint32_t kSummaryValue = 1;
constexpr std::uint32_t kValueTag = 1;
constexpr std::uint32_t kValueSimpleValue = 2;
constexpr std::uint32_t kValueImage = 4;
constexpr std::uint32_t kImageHeight = 1;
constexpr std::uint32_t kImageWidth = 2;
constexpr std::uint32_t kImageColorspace = 3;
constexpr std::uint32_t kImageEncoded = 4;
// SessionLog.status and its START value.
constexpr std::uint32_t kSessionLogStatus = 1;
constexpr std::uint64_t kSessionLogStart = 1;

// The fields every Event starts with. proto3 leaves a zero step out, as
// protobuf's own serializer does, so our bytes match a TensorFlow writer's.
std::string event_header(double wall_time, std::int64_t step) {
  std::string event;
  put_double(event, kEventWallTime, wall_time);
  if (step != 0) put_int64(event, kEventStep, step);
  return event;
}

double unix_time_now() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') return "localhost";
  return name;
}

}  // namespace

// ---------------------------------------------------------------- framing

// One implementation for the project: zero's (slicing-by-8), also used for
// checkpoint manifests.
std::uint32_t crc32c(std::span<const std::byte> data, std::uint32_t crc) noexcept {
  return zero::io::crc32c(data, crc);
}

std::uint32_t crc32c(std::string_view data, std::uint32_t crc) noexcept { return zero::io::crc32c(data, crc); }

void append_tfrecord(std::string& out, std::string_view payload) {
  std::string length;
  put_little_endian(length, static_cast<std::uint64_t>(payload.size()));
  out.append(length);
  put_little_endian(out, mask_crc32c(crc32c(length)));
  out.append(payload);
  put_little_endian(out, mask_crc32c(crc32c(payload)));
}

// ---------------------------------------------------------------- events

std::string encode_file_version_event(double wall_time, std::string_view file_version) {
  std::string event = event_header(wall_time, 0);
  put_bytes(event, kEventFileVersion, file_version);
  return event;
}

std::string encode_scalars_event(double wall_time, std::int64_t step, std::span<const Scalar> scalars) {
  std::string summary;
  std::string value;
  for (const Scalar& scalar : scalars) {
    value.clear();
    put_bytes(value, kValueTag, scalar.tag);
    // simple_value sits in a oneof, so it is written even when it is 0.0:
    // without it TensorBoard would see a value of no kind and drop it.
    put_float(value, kValueSimpleValue, static_cast<float>(scalar.value));
    put_bytes(summary, kSummaryValue, value);
  }
  std::string event = event_header(wall_time, step);
  put_bytes(event, kEventSummary, summary);
  return event;
}

std::string encode_image_event(double wall_time, std::int64_t step, const Image& image) {
  std::string fields;
  put_int64(fields, kImageHeight, image.height);
  put_int64(fields, kImageWidth, image.width);
  put_int64(fields, kImageColorspace, image.colorspace);
  put_bytes(fields, kImageEncoded, image.encoded);
  std::string value;
  put_bytes(value, kValueTag, image.tag);
  put_bytes(value, kValueImage, fields);
  std::string summary;
  put_bytes(summary, kSummaryValue, value);
  std::string event = event_header(wall_time, step);
  put_bytes(event, kEventSummary, summary);
  return event;
}

std::string encode_session_start_event(double wall_time, std::int64_t step) {
  std::string session_log;
  put_key(session_log, kSessionLogStatus, WireType::varint);
  put_varint(session_log, kSessionLogStart);
  std::string event = event_header(wall_time, step);
  put_bytes(event, kEventSessionLog, session_log);
  return event;
}

// ---------------------------------------------------------------- writer

TensorBoardWriter::TensorBoardWriter(std::filesystem::path log_dir, TensorBoardWriterOptions options)
    : options_(options), last_flush_(std::chrono::steady_clock::now()) {
  std::error_code error;
  std::filesystem::create_directories(log_dir, error);
  if (error)
    ZERO_THROW(zero::IoError, "cannot create the TensorBoard log directory ", log_dir.string(),
               ": ", error.message());

  const std::string base = "events.out.tfevents." + std::to_string(std::time(nullptr)) + "." +
                           host_name() + "." + std::to_string(::getpid()) + ".zero";
  // Two writers of one process in the same second (tests, or a trainer that
  // reopens its writer) would share a name. The counter goes after ".zero" so
  // that names sort in creation order, the order TensorBoard reads them in.
  for (int attempt = 0; fd_ < 0; ++attempt) {
    path_ = log_dir / (attempt == 0 ? base : base + "." + std::to_string(attempt));
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd_ < 0 && (errno != EEXIST || attempt >= 1000))
      ZERO_THROW(zero::IoError, "cannot create the event file ", path_.string(), ": ",
                 std::strerror(errno));
  }
  // The version record goes out at once: TensorBoard identifies the file by it.
  append_tfrecord(buffer_, encode_file_version_event(unix_time_now(), "brain.Event:2"));
  flush();
}

TensorBoardWriter::~TensorBoardWriter() {
  try {
    flush();
  } catch (...) {
    // A destructor must not throw; the caller who cares calls flush() first.
  }
  close();
}

TensorBoardWriter::TensorBoardWriter(TensorBoardWriter&& other) noexcept
    : path_(std::move(other.path_)),
      options_(other.options_),
      fd_(std::exchange(other.fd_, -1)),
      buffer_(std::move(other.buffer_)),
      written_(other.written_),
      last_flush_(other.last_flush_) {
  other.buffer_.clear();
}

TensorBoardWriter& TensorBoardWriter::operator=(TensorBoardWriter&& other) noexcept {
  if (this != &other) {
    try {
      flush();
    } catch (...) {
    }
    close();
    path_ = std::move(other.path_);
    options_ = other.options_;
    fd_ = std::exchange(other.fd_, -1);
    buffer_ = std::move(other.buffer_);
    other.buffer_.clear();
    written_ = other.written_;
    last_flush_ = other.last_flush_;
  }
  return *this;
}

void TensorBoardWriter::close() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void TensorBoardWriter::add_scalar(std::string_view tag, double value, std::int64_t step) {
  add_scalar(tag, value, step, unix_time_now());
}

void TensorBoardWriter::add_scalar(std::string_view tag, double value, std::int64_t step,
                                   double wall_time) {
  ZERO_CHECK(!tag.empty(), "TensorBoardWriter::add_scalar: empty tag");
  const Scalar scalar{std::string(tag), value};
  add_event(encode_scalars_event(wall_time, step, std::span<const Scalar>(&scalar, 1)));
}

void TensorBoardWriter::add_scalars(const std::vector<Scalar>& scalars, std::int64_t step) {
  for (const Scalar& scalar : scalars)
    ZERO_CHECK(!scalar.tag.empty(), "TensorBoardWriter::add_scalars: empty tag");
  if (scalars.empty()) return;
  add_event(encode_scalars_event(unix_time_now(), step, scalars));
}

void TensorBoardWriter::add_image(const Image& image, std::int64_t step) {
  ZERO_CHECK(!image.tag.empty(), "TensorBoardWriter::add_image: empty tag");
  ZERO_CHECK(image.height > 0 && image.width > 0 && !image.encoded.empty(),
             "TensorBoardWriter::add_image '", image.tag, "': no image");
  add_event(encode_image_event(unix_time_now(), step, image));
}

void TensorBoardWriter::add_session_start(std::int64_t first_step) {
  add_event(encode_session_start_event(unix_time_now(), first_step));
}

void TensorBoardWriter::add_event(const std::string& event) {
  ZERO_CHECK(fd_ >= 0, "TensorBoardWriter was moved from");
  append_tfrecord(buffer_, event);
  if (buffer_.size() >= options_.flush_bytes ||
      std::chrono::steady_clock::now() - last_flush_ >= options_.flush_interval)
    flush();
}

void TensorBoardWriter::flush() {
  last_flush_ = std::chrono::steady_clock::now();
  if (buffer_.empty() || fd_ < 0) return;
  std::size_t done = 0;
  while (done < buffer_.size()) {
    ssize_t n = ::write(fd_, buffer_.data() + done, buffer_.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int saved = errno;
      // Drop what did reach the file so that a retry does not repeat it.
      buffer_.erase(0, done);
      written_ += done;
      ZERO_THROW(zero::IoError, "cannot write the event file ", path_.string(), ": ",
                 std::strerror(saved));
    }
    done += static_cast<std::size_t>(n);
  }
  written_ += done;
  buffer_.clear();
}

}  // namespace sdxl::metrics
