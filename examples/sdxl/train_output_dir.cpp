#include "train_output_dir.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <string>
#include <system_error>
#include <vector>

#include "zero/checkpoint/checkpoint.hpp"
#include "zero/core/error.hpp"

namespace sdxl {

namespace fs = std::filesystem;

namespace {

constexpr const char* kLockName = ".lock";

std::string this_host() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return "unknown-host";
  return name;
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  ::gmtime_r(&now, &utc);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", &utc);
  return text;
}

/// Who holds a lock, as its file says ("pid=..", "host=..", "since=.." lines).
struct LockHolder {
  long pid = 0;
  std::string host, since;

  std::string describe() const {
    if (pid <= 0 && host.empty()) return "a run that did not finish writing it";
    return "pid " + std::to_string(pid) + " on host " + (host.empty() ? "?" : host) +
           (since.empty() ? "" : " since " + since);
  }
};

LockHolder read_holder(int fd) {
  char buffer[1024];
  const ssize_t n = ::pread(fd, buffer, sizeof buffer - 1, 0);
  LockHolder holder;
  if (n <= 0) return holder;
  const std::string text(buffer, static_cast<std::size_t>(n));
  std::size_t begin = 0;
  while (begin < text.size()) {
    std::size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(begin, end - begin);
    begin = end + 1;
    const std::size_t eq = line.find('=');
    if (eq == std::string::npos) continue;
    const std::string key = line.substr(0, eq), value = line.substr(eq + 1);
    if (key == "pid") holder.pid = std::strtol(value.c_str(), nullptr, 10);
    else if (key == "host") holder.host = value;
    else if (key == "since") holder.since = value;
  }
  return holder;
}

void write_holder(int fd, const fs::path& path) {
  const std::string text = "pid=" + std::to_string(::getpid()) + "\nhost=" + this_host() + "\nsince=" + utc_now() + "\n";
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size()) ||
      ::fsync(fd) != 0) {
    const int error = errno;
    ZERO_THROW(zero::IoError, "output_dir: cannot write the lock file ", path.string(), ": ", std::strerror(error));
  }
}

bool same_file(int fd, const fs::path& path) {
  struct stat open_one {}, named {};
  return ::fstat(fd, &open_one) == 0 && ::lstat(path.c_str(), &named) == 0 && open_one.st_dev == named.st_dev &&
         open_one.st_ino == named.st_ino;
}

}  // namespace

OutputDirLock::OutputDirLock(const fs::path& output_dir) : path_(output_dir / kLockName) {
  const std::string host = this_host();
  // A few rounds: the file may vanish or be replaced between the calls below
  // when another run releases or takes it at the same moment.
  for (int attempt = 0; attempt < 8; ++attempt) {
    int fd = ::open(path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd >= 0) {
      // Ours, unless a run that opened the new file first also locked it first.
      if (::flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK) {
        ::close(fd);
        continue;
      }
      fd_ = fd;
      write_holder(fd_, path_);
      return;
    }
    if (errno != EEXIST) {
      const int error = errno;
      ZERO_THROW(zero::IoError, "output_dir '", output_dir.string(), "' is not writable: cannot create ",
                 path_.string(), ": ", std::strerror(error));
    }
    fd = ::open(path_.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
      const int error = errno;
      if (error == ENOENT) continue;  // released meanwhile
      ZERO_THROW(zero::IoError, "output_dir: cannot open the lock file ", path_.string(), ": ", std::strerror(error),
                 error == ELOOP ? " (it is a symbolic link; remove it)" : "");
    }
    const LockHolder holder = read_holder(fd);
    if (!holder.host.empty() && holder.host != host) {
      ::close(fd);
      ZERO_THROW(zero::InvalidArgument, "output_dir '", output_dir.string(), "' is locked by ", holder.describe(),
                 " (", path_.string(), "); whether that run is still alive cannot be told from host ", host,
                 ". If no run writes into this folder any more, remove the lock: rm ", path_.string());
    }
    const bool locked = ::flock(fd, LOCK_EX | LOCK_NB) == 0;
    const int lock_error = errno;
    if (!locked && lock_error == EWOULDBLOCK) {
      ::close(fd);
      ZERO_THROW(zero::InvalidArgument, "output_dir '", output_dir.string(), "' is in use by another run: ",
                 holder.describe(), " holds ", path_.string(),
                 ". Two runs in one folder would replace each other's checkpoints and metrics: wait for it to "
                 "finish, or choose another --output_dir");
    }
    // No flock on this file system (ENOLCK, EOPNOTSUPP): the pid decides.
    if (!locked && holder.pid > 0 && (::kill(static_cast<pid_t>(holder.pid), 0) == 0 || errno == EPERM)) {
      ::close(fd);
      ZERO_THROW(zero::InvalidArgument, "output_dir '", output_dir.string(), "' is in use by another run: ",
                 holder.describe(), " holds ", path_.string(), " and that process is alive. Wait for it to "
                 "finish, or choose another --output_dir");
    }
    if (!same_file(fd, path_)) {  // released and taken again meanwhile
      ::close(fd);
      continue;
    }
    std::printf("output_dir: %s was left by %s, which no longer runs (killed, or the node failed); taking it over\n",
                path_.c_str(), holder.describe().c_str());
    fd_ = fd;
    write_holder(fd_, path_);
    return;
  }
  ZERO_THROW(zero::IoError, "output_dir: could not take ", path_.string(),
             ": other runs kept taking and releasing it; start one run at a time");
}

OutputDirLock::~OutputDirLock() {
  if (fd_ < 0) return;
  // Removed while still locked: a run that opened it meanwhile sees that the
  // name no longer leads to its file and starts over.
  if (same_file(fd_, path_)) ::unlink(path_.c_str());
  ::close(fd_);
}

namespace {

std::string step_list(const std::vector<zero::io::CheckpointFolder>& folders) {
  std::string out;
  for (std::size_t i = 0; i < folders.size() && i < 4; ++i)
    out += (i ? ", " : "") + folders[i].path.filename().string();
  if (folders.size() > 4) out += ", ... " + folders.back().path.filename().string();
  return out;
}

std::size_t line_count(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::size_t lines = 0;
  char buffer[1 << 16];
  while (in.read(buffer, sizeof buffer) || in.gcount() > 0) {
    for (std::streamsize i = 0; i < in.gcount(); ++i) lines += buffer[i] == '\n';
    if (!in) break;
  }
  return lines;
}

/// What output_dir holds of an earlier run.
struct EarlierRun {
  zero::io::CheckpointScan checkpoints;
  fs::path metrics;
  std::size_t metrics_lines = 0;
  std::vector<fs::path> tensorboard_events;

  bool any() const {
    return !checkpoints.complete.empty() || !checkpoints.incomplete.empty() || metrics_lines > 0;
  }

  std::string describe() const {
    std::vector<std::string> parts;
    if (!checkpoints.complete.empty())
      parts.push_back(std::to_string(checkpoints.complete.size()) + " checkpoint(s) (" +
                      step_list(checkpoints.complete) + ")");
    if (!checkpoints.incomplete.empty())
      parts.push_back(std::to_string(checkpoints.incomplete.size()) + " incomplete checkpoint(s) without " +
                      std::string(zero::io::kManifestName) + " (" + step_list(checkpoints.incomplete) + ")");
    if (!checkpoints.interrupted.empty())
      parts.push_back(std::to_string(checkpoints.interrupted.size()) + " interrupted save(s) (" +
                      step_list(checkpoints.interrupted) + ")");
    if (metrics_lines > 0) parts.push_back("metrics.jsonl (" + std::to_string(metrics_lines) + " steps logged)");
    if (!tensorboard_events.empty())
      parts.push_back(std::to_string(tensorboard_events.size()) + " TensorBoard event file(s)");
    std::string out;
    for (std::size_t i = 0; i < parts.size(); ++i) out += (i == 0 ? "" : i + 1 == parts.size() ? " and " : ", ") + parts[i];
    return out;
  }
};

EarlierRun find_earlier_run(const fs::path& dir) {
  EarlierRun run;
  const fs::path root = dir / "checkpoints";
  std::error_code ec;
  const fs::file_status root_status = fs::symlink_status(root, ec);
  if (fs::is_symlink(root_status))
    ZERO_THROW(zero::InvalidArgument, "output_dir: ", root.string(), " is a symbolic link (to ",
               fs::read_symlink(root, ec).string(), "): checkpoints are written, rotated and deleted there, so it "
               "must be a real folder inside output_dir (to keep checkpoints on another disk, put output_dir there)");
  if (fs::exists(root_status) && !fs::is_directory(root_status))
    ZERO_THROW(zero::InvalidArgument, "output_dir: ", root.string(), " is not a folder");
  run.checkpoints = zero::io::scan_checkpoints(root);  // refuses step folders that are links
  run.metrics = dir / "metrics.jsonl";
  if (fs::is_regular_file(fs::symlink_status(run.metrics, ec))) run.metrics_lines = line_count(run.metrics);
  for (fs::directory_iterator it(dir / "tensorboard", ec), end; !ec && it != end; it.increment(ec))
    if (it->path().filename().string().rfind("events.out.tfevents.", 0) == 0 &&
        fs::is_regular_file(fs::symlink_status(it->path(), ec)))
      run.tensorboard_events.push_back(it->path());
  return run;
}

/// --overwrite: the earlier run's files go before this run writes any.
void remove_earlier_run(const fs::path& dir, const EarlierRun& run) {
  std::printf("--overwrite: removing the earlier run in %s: %s; unet/, unet_ema/ and loss.svg are replaced at the "
              "end of this run\n",
              dir.c_str(), run.describe().c_str());
  for (const auto* list : {&run.checkpoints.complete, &run.checkpoints.incomplete, &run.checkpoints.interrupted})
    for (const zero::io::CheckpointFolder& folder : *list) zero::io::remove_checkpoint(folder.path);
  std::error_code ec;
  if (run.metrics_lines > 0) fs::remove(run.metrics, ec);
  for (const fs::path& events : run.tensorboard_events) fs::remove(events, ec);
  std::fflush(stdout);
}

bool lies_within(const fs::path& path, const fs::path& dir) {
  std::error_code ec;
  const fs::path p = fs::weakly_canonical(fs::absolute(path), ec), d = fs::weakly_canonical(fs::absolute(dir), ec);
  const auto [in_dir, in_path] = std::mismatch(d.begin(), d.end(), p.begin(), p.end());
  (void)in_path;
  return in_dir == d.end();
}

/// Fresh runs, resumes and --overwrite against what the folder holds.
void check_earlier_run(const TrainConfig& c, const fs::path& dir) {
  const EarlierRun run = find_earlier_run(dir);
  if (c.resume.empty()) {
    if (!run.any()) return;
    if (!c.overwrite)
      ZERO_THROW(zero::InvalidArgument, "output_dir '", dir.string(), "' holds an earlier run: ", run.describe(),
                 ". A new run there would overwrite and rotate away its checkpoints and truncate its metrics. Resume "
                 "it with --resume latest, choose another --output_dir, or pass --overwrite to remove it and start "
                 "afresh");
    remove_earlier_run(dir, run);
    return;
  }
  if (c.resume == "latest") {
    // Something to resume, or nothing at all (maybe_resume starts fresh and says so).
    if (!run.checkpoints.complete.empty() || run.checkpoints.incomplete.empty()) return;
    if (!c.overwrite)
      ZERO_THROW(zero::InvalidArgument, "--resume latest: ", (dir / "checkpoints").string(),
                 " holds only incomplete checkpoints (", step_list(run.checkpoints.incomplete), ": no ",
                 zero::io::kManifestName, ", saves that did not finish), nothing to resume from. Pass --overwrite to "
                 "remove them and start afresh, or --resume a complete checkpoint folder");
    remove_earlier_run(dir, run);
    return;
  }
  if (!c.overwrite || !run.any()) return;
  if (lies_within(c.resume, dir))
    ZERO_THROW(zero::InvalidArgument, "--overwrite with --resume ", c.resume, ": the checkpoint to resume from lies in "
               "output_dir '", dir.string(), "', whose earlier run --overwrite removes. Leave out --overwrite to "
               "continue in this folder, or resume into another --output_dir");
  remove_earlier_run(dir, run);
}

}  // namespace

std::unique_ptr<OutputDirLock> claim_output_dir(const TrainConfig& c, zero::MpiCommunicator& host) {
  std::unique_ptr<OutputDirLock> lock;
  if (host.rank() == 0) {
    const fs::path dir = c.output_dir;
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) ZERO_THROW(zero::IoError, "output_dir '", dir.string(), "': cannot create it: ", ec.message());
    if (!fs::is_directory(dir, ec)) ZERO_THROW(zero::IoError, "output_dir '", dir.string(), "' is not a folder");
    lock = std::make_unique<OutputDirLock>(dir);
    check_earlier_run(c, dir);
    std::fflush(stdout);
  }
  host.barrier();
  return lock;
}

}  // namespace sdxl
