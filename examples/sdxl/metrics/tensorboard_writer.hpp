// TensorBoardWriter: scalar summaries in TensorBoard's event file format
// (TFRecord framing around hand-encoded `tensorflow.Event` protobufs), so that
// `tensorboard --logdir` shows the trainer's curves without TensorFlow,
// protobuf or Python in the trainer.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace sdxl::metrics {

// ---------------------------------------------------------------- framing

/// CRC-32C (Castagnoli polynomial, reflected 0x82F63B78), the checksum of
/// TFRecord framing. `crc` is a previous result to continue from, so
/// crc32c(b, crc32c(a)) == crc32c(a + b). crc32c("123456789") == 0xE3069283.
/// Forwards to zero::io::crc32c (zero/io/crc32c.hpp), the one implementation.
std::uint32_t crc32c(std::span<const std::byte> data, std::uint32_t crc = 0) noexcept;
std::uint32_t crc32c(std::string_view data, std::uint32_t crc = 0) noexcept;

/// TFRecord's masked CRC: rotate right by 15 and add 0xa282ead8, so that a CRC
/// stored inside checksummed data does not weaken the outer checksum.
constexpr std::uint32_t mask_crc32c(std::uint32_t crc) noexcept {
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

/// Appends one TFRecord to `out`: uint64 length (little-endian), masked
/// CRC-32C of those 8 bytes, the payload, masked CRC-32C of the payload.
void append_tfrecord(std::string& out, std::string_view payload);

// ---------------------------------------------------------------- events

/// One scalar of an Event's Summary.
struct Scalar {
  std::string tag;
  double value;  ///< stored as a float (Summary.Value.simple_value)
};

/// Serialized `tensorflow.Event` messages (proto3 wire format).
/// Event{wall_time = 1 (double), step = 2 (int64), file_version = 3 (string)}.
std::string encode_file_version_event(double wall_time, std::string_view file_version);
/// Event{wall_time, step, summary = 5 {value = 1 (repeated) {tag = 1, simple_value = 2}}}.
std::string encode_scalars_event(double wall_time, std::int64_t step, std::span<const Scalar> scalars);
/// One image of an Event's Summary (Summary.Value.image = 4).
struct Image {
  std::string tag;
  std::int32_t height = 0;
  std::int32_t width = 0;
  std::int32_t colorspace = 3;  ///< 1 grey, 3 RGB, 4 RGBA
  std::string encoded;          ///< the PNG (or JPEG) file bytes
};
/// Event{wall_time, step, summary = 5 {value = 1 {tag = 1, image = 4 {height = 1,
/// width = 2, colorspace = 3, encoded_image_string = 4}}}}.
std::string encode_image_event(double wall_time, std::int64_t step, const Image& image);
/// Event{wall_time, step, session_log = 7 {status = 1: START}}: tells TensorBoard
/// that the run restarted at `step`, so it drops points logged at or after it.
std::string encode_session_start_event(double wall_time, std::int64_t step);

// ---------------------------------------------------------------- writer

struct TensorBoardWriterOptions {
  /// Buffered events are written once they reach this many bytes ...
  std::size_t flush_bytes = 64 * 1024;
  /// ... or when an event is added this long after the last write, so that a
  /// slow run still shows progress in TensorBoard.
  std::chrono::duration<double> flush_interval = std::chrono::seconds(30);
};

/// Writes `<log_dir>/events.out.tfevents.<unix time>.<hostname>.<pid>.zero`.
/// The file starts with the Event{file_version: "brain.Event:2"} record, written
/// at construction; each add_* call adds one Event record.
///
/// Records are buffered and written by flush() (also called by the destructor,
/// ignoring errors there), by the options' size and age limits, never partly:
/// a reader of a live file sees whole records only, unless the disk fills up.
///
/// Values are floats in the file (TensorBoard's simple_value): a double beyond
/// float's range becomes infinity, and NaN stays NaN.
///
/// Not thread-safe; meant for rank 0 only. Every failure throws zero::IoError.
class TensorBoardWriter {
 public:
  /// Creates `log_dir` (and its parents) if needed.
  explicit TensorBoardWriter(std::filesystem::path log_dir, TensorBoardWriterOptions options = {});
  ~TensorBoardWriter();

  TensorBoardWriter(TensorBoardWriter&& other) noexcept;
  TensorBoardWriter& operator=(TensorBoardWriter&& other) noexcept;
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  /// One Event with one scalar at the current wall time.
  void add_scalar(std::string_view tag, double value, std::int64_t step);
  /// The same with an explicit wall time (Unix seconds).
  void add_scalar(std::string_view tag, double value, std::int64_t step, double wall_time);
  /// One Event holding several scalars of the same step (smaller than one
  /// Event each). Tags must not be empty.
  void add_scalars(const std::vector<Scalar>& scalars, std::int64_t step);
  /// Marks a restart (SessionLog START): TensorBoard's event loader discards
  /// the points of earlier event files whose step is >= `first_step`, the
  /// first step this run will log (the checkpoint's step + 1 on a resume).
  /// An image summary (e.g. a validation sample as PNG bytes) at `step`.
  void add_image(const Image& image, std::int64_t step);
  void add_session_start(std::int64_t first_step);

  /// Writes the buffered records to the file (write(2); no fsync).
  void flush();

  /// The event file.
  const std::filesystem::path& path() const noexcept { return path_; }
  /// Bytes written to the file plus those still buffered.
  std::size_t bytes() const noexcept { return written_ + buffer_.size(); }

 private:
  void add_event(const std::string& event);
  void close() noexcept;

  std::filesystem::path path_;
  TensorBoardWriterOptions options_;
  int fd_ = -1;
  std::string buffer_;
  std::size_t written_ = 0;
  std::chrono::steady_clock::time_point last_flush_;
};

}  // namespace sdxl::metrics
