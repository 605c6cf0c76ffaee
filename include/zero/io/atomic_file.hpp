// Crash-safe file replacement: a reader of the target path sees either the
// old content or the complete new content, never a prefix of the new one.
#pragma once

#include <cstddef>
#include <filesystem>
#include <span>
#include <string>

namespace zero::io {

/// Writes a file under a temporary name in the target's directory and renames
/// it over the target on commit().
///
/// The temporary file is `<dir>/.<name>.tmp.<pid>.<random>`, so it lives on the
/// same file system as the target (rename(2) is atomic only there) and is
/// hidden from plain `ls`. commit() fsyncs the file, renames it over the target
/// and fsyncs the directory so that the rename itself survives a power loss.
/// Destroying a writer that was not committed removes the temporary file and
/// leaves the target untouched.
///
/// Every failure throws zero::IoError naming the path involved and
/// strerror(errno), e.g. a read-only directory (EACCES) or a full disk (ENOSPC).
///
/// Not thread-safe: one writer is used by one thread at a time.
///
/// Fault injection (tests only): with the environment variable
/// `ZERO_FAULT_KILL_DURING_WRITE=<substring>[:<nth>]` set, the nth writer
/// (default the first) of the process whose target path contains
/// `<substring>` cuts its temporary file to half of the bytes written and
/// sends SIGKILL to its own process at commit(), before the rename: what a
/// process killed halfway through writing leaves on disk. Example, rank 1
/// killed while writing its shard of the trainer's second checkpoint (each
/// save writes into its own staging folder, so the count tells them apart):
/// `ZERO_FAULT_KILL_DURING_WRITE=rank-00001.safetensors:2`.
/// `ZERO_FAULT_STOP_DURING_WRITE` (same syntax) sends SIGSTOP instead and
/// leaves the file whole: a process hung in its write (a dead disk or network
/// mount), for timeout tests; continued with SIGCONT it commits normally. The
/// variables are read once, at the first commit(); unset, they cost one
/// branch per commit.
class AtomicFileWriter {
 public:
  /// Creates the temporary file next to `target`. The target's directory must
  /// exist; the target itself need not.
  explicit AtomicFileWriter(std::filesystem::path target);
  ~AtomicFileWriter();

  AtomicFileWriter(AtomicFileWriter&& other) noexcept;
  AtomicFileWriter& operator=(AtomicFileWriter&& other) noexcept;
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  /// Appends `size` bytes. Short writes and EINTR are retried until every byte
  /// is written or an error occurs. Throws zero::InvalidArgument after commit().
  void write(const void* data, std::size_t size);
  void write(std::span<const std::byte> bytes) { write(bytes.data(), bytes.size()); }

  /// Makes the content durable and visible under the target name. May be
  /// called once; a writer whose write() or commit() threw must not be
  /// committed again (it throws zero::InvalidArgument).
  void commit();

  const std::filesystem::path& target() const noexcept { return target_; }
  /// The temporary file's path (empty once committed or moved from).
  const std::filesystem::path& temp_path() const noexcept { return temp_; }
  std::size_t bytes_written() const noexcept { return bytes_written_; }
  bool committed() const noexcept { return committed_; }

 private:
  void discard() noexcept;

  std::filesystem::path target_;
  std::filesystem::path temp_;
  int fd_ = -1;
  std::size_t bytes_written_ = 0;
  bool committed_ = false;
  bool failed_ = false;
};

/// Replaces `target` with `bytes` through an AtomicFileWriter.
void write_file_atomically(const std::filesystem::path& target, std::span<const std::byte> bytes);

/// fsyncs a directory so that entries created, renamed or removed in it are
/// durable. File systems that cannot fsync a directory (EINVAL) are accepted
/// silently. Throws zero::IoError otherwise.
void fsync_directory(const std::filesystem::path& directory);

}  // namespace zero::io
