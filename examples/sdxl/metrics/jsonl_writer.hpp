// JsonlWriter: the trainer's machine-readable metrics log, one JSON object per
// logged step and line (JSON Lines), which survives crashes and resumes
// without duplicated steps.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace sdxl::metrics {

/// The metrics of one logged optimizer step. Fields left empty are not
/// written; a field set to NaN or infinity is written as JSON `null` (JSON has
/// no such numbers), so a diverged loss still shows up as a present key.
struct StepRecord {
  std::int64_t step = 0;
  std::optional<double> loss;                 ///< mean over ranks and micro-steps
  std::optional<double> lr;
  std::optional<double> grad_norm;            ///< global, before clipping
  std::optional<double> images_per_s;         ///< all ranks together
  std::optional<std::uint64_t> mem_max_bytes; ///< peak device memory, largest rank
  std::optional<std::uint64_t> mem_min_bytes; ///< peak device memory, smallest rank
  std::optional<double> loss_scale;           ///< fp16 dynamic loss scale
  std::optional<std::int64_t> skipped_steps;  ///< steps skipped for inf/nan gradients, total so far
  std::optional<double> elapsed_s;            ///< seconds since this run started
  std::optional<double> time;                 ///< Unix time; the writer fills it in when empty
  /// Anything else (e.g. "timing/forward_s"). A key equal to one of the fields
  /// above is rejected with zero::InvalidArgument.
  std::map<std::string, double> extra;

  /// The record as a JSON object; empty fields are absent, `time` only if set.
  nlohmann::json to_json() const;
};

/// Appends one JSON object per line to a file, writing each line with a single
/// write(2) as soon as it is logged, so that a crash loses at most the line
/// being written and `tail -f` shows every step at once.
///
/// Opening an existing file continues it (append mode). A last line without
/// its newline, left by a crash in the middle of a write, is cut off at open;
/// any other line that is not a JSON object with an integer "step" is an
/// error (zero::IoError naming the file and line), since the file is not ours.
///
/// Steps must increase from line to line: write() rejects a step that is not
/// after last_step() (zero::InvalidArgument). A trainer resuming from a
/// checkpoint at step S therefore calls truncate_after(S) first, dropping the
/// lines that the crashed run logged after its last checkpoint.
///
/// Not thread-safe; meant for rank 0 only.
class JsonlWriter {
 public:
  /// Opens or creates `path`; its directory must exist. Throws zero::IoError.
  explicit JsonlWriter(std::filesystem::path path);
  ~JsonlWriter();

  JsonlWriter(JsonlWriter&& other) noexcept;
  JsonlWriter& operator=(JsonlWriter&& other) noexcept;
  JsonlWriter(const JsonlWriter&) = delete;
  JsonlWriter& operator=(const JsonlWriter&) = delete;

  /// Writes record.to_json() with "time" set to now when it is empty.
  void write(const StepRecord& record);

  /// Writes `object`, which must be a JSON object with an integer "step"
  /// greater than last_step(). "step" is written first, the other keys after
  /// it; "time" (Unix seconds) is added when absent. Strings that are not valid
  /// UTF-8 are written with U+FFFD in place of the bad bytes.
  void write(const nlohmann::json& object);

  /// Removes every line whose step is greater than `step`, replacing the file
  /// atomically (a crash leaves either the old or the new file), and keeps
  /// appending after the remaining lines. Returns how many lines were removed.
  std::size_t truncate_after(std::int64_t step);

  /// The step of the last line in the file; empty for an empty file.
  std::optional<std::int64_t> last_step() const noexcept { return last_step_; }
  /// Lines in the file.
  std::size_t line_count() const noexcept { return line_count_; }
  const std::filesystem::path& path() const noexcept { return path_; }

  /// Parses every line of a JSON Lines file (for tests and tools). Throws
  /// zero::IoError on a line that is not a JSON object.
  static std::vector<nlohmann::json> read_all(const std::filesystem::path& path);

 private:
  void append_line(const std::string& line);
  void close() noexcept;

  std::filesystem::path path_;
  int fd_ = -1;
  std::optional<std::int64_t> last_step_;
  std::size_t line_count_ = 0;
};

}  // namespace sdxl::metrics
