// The run's claim on output_dir, settled before anything is built: the folder
// is writable, no other live run writes into it (a lock file), and it holds no
// earlier run that this one would silently overwrite.
//
// output_dir/.lock holds the pid, host and start time of the run that holds
// it. Rank 0 creates it (O_EXCL) and keeps an flock(2) on it while the run
// lives; it is removed at exit, also when the run fails with an error. A run
// killed outright leaves the file without the flock: the next run on the same
// host sees the flock free, says that the lock was stale, and takes it over.
// A lock written on another host is refused (whether that run is alive cannot
// be told from here), with the command that removes it.
#pragma once

#include <filesystem>
#include <memory>

#include "train_config.hpp"
#include "zero/comm/mpi_communicator.hpp"

namespace sdxl {

/// output_dir/.lock while this process holds it; released (the file removed)
/// when destroyed.
class OutputDirLock {
 public:
  /// Takes the lock or throws zero::InvalidArgument naming the holder (pid,
  /// host, since when) and what to do; zero::IoError when the folder is not
  /// writable.
  explicit OutputDirLock(const std::filesystem::path& output_dir);
  ~OutputDirLock();
  OutputDirLock(const OutputDirLock&) = delete;
  OutputDirLock& operator=(const OutputDirLock&) = delete;

  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  int fd_ = -1;
};

/// Rank 0: creates output_dir (it must be writable), takes its lock, refuses
/// a checkpoints folder that is a link and a folder holding another run unless
/// resuming or --overwrite (which removes the earlier run's checkpoints,
/// metrics and TensorBoard events, saying so), and refuses --resume latest
/// when only incomplete checkpoints are there (unless --overwrite). The other
/// ranks wait for rank 0's verdict: an error there ends every rank
/// (run_or_abort). Returns the lock on rank 0, null elsewhere.
std::unique_ptr<OutputDirLock> claim_output_dir(const TrainConfig& c, zero::MpiCommunicator& host);

}  // namespace sdxl
