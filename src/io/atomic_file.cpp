#include "zero/io/atomic_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <utility>

#include "zero/core/error.hpp"

namespace zero::io {
namespace {

std::string errno_text(int error) { return std::strerror(error); }

std::filesystem::path directory_of(const std::filesystem::path& target) {
  std::filesystem::path dir = target.parent_path();
  return dir.empty() ? std::filesystem::path(".") : dir;
}

// Unique enough across processes (pid) and within one (random + counter);
// O_EXCL catches the remaining collisions, which the caller retries.
std::string temp_suffix() {
  static thread_local std::mt19937_64 engine([] {
    std::random_device device;
    std::seed_seq seed{device(), device(), static_cast<unsigned>(::getpid()),
                       static_cast<unsigned>(
                           std::chrono::steady_clock::now().time_since_epoch().count())};
    return std::mt19937_64(seed);
  }());
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, ".tmp.%ld.%016llx", static_cast<long>(::getpid()),
                static_cast<unsigned long long>(engine()));
  return buffer;
}

// ZERO_FAULT_KILL_DURING_WRITE / ZERO_FAULT_STOP_DURING_WRITE =
// <substring>[:<nth>] (see the header): parsed once; a malformed value is
// reported and ignored rather than thrown, since a test hook must not change
// how a correct program fails.
struct WriteFault {
  const char* variable = nullptr;
  int signal = SIGKILL;
  std::string substring;
  long nth = 1;
  std::atomic<long> matched{0};
};

WriteFault* parse_write_fault(const char* variable, int signal) {
  const char* text = std::getenv(variable);
  if (text == nullptr || *text == '\0') return nullptr;
  std::string value = text;
  long nth = 1;
  if (const auto colon = value.rfind(':'); colon != std::string::npos) {
    char* end = nullptr;
    nth = std::strtol(value.c_str() + colon + 1, &end, 10);
    if (end == value.c_str() + colon + 1 || *end != '\0' || nth < 1) {
      std::fprintf(stderr, "[zero] ignoring %s='%s': expected <substring>[:<nth>], nth >= 1\n", variable, text);
      return nullptr;
    }
    value.resize(colon);
  }
  auto* fault = new WriteFault;  // lives until exit: the hook may fire at any time
  fault->variable = variable;
  fault->signal = signal;
  fault->substring = value;
  fault->nth = nth;
  return fault;
}

WriteFault* write_fault() {
  static WriteFault* const fault = [] {
    WriteFault* kill = parse_write_fault("ZERO_FAULT_KILL_DURING_WRITE", SIGKILL);
    return kill != nullptr ? kill : parse_write_fault("ZERO_FAULT_STOP_DURING_WRITE", SIGSTOP);
  }();
  return fault;
}

}  // namespace

AtomicFileWriter::AtomicFileWriter(std::filesystem::path target) : target_(std::move(target)) {
  ZERO_CHECK(!target_.empty() && target_.has_filename(),
             "AtomicFileWriter: target path '", target_.string(), "' does not name a file");
  const std::filesystem::path dir = directory_of(target_);
  const std::string name = target_.filename().string();
  // A handful of attempts: EEXIST means another writer drew the same suffix.
  for (int attempt = 0; attempt < 16; ++attempt) {
    std::filesystem::path candidate = dir / ("." + name + temp_suffix());
    // 0666 lets the umask decide, as for any newly created file.
    int fd = ::open(candidate.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd >= 0) {
      fd_ = fd;
      temp_ = std::move(candidate);
      return;
    }
    if (errno == EINTR || errno == EEXIST) continue;
    const int error = errno;
    ZERO_THROW(IoError, "cannot create a temporary file in directory '", dir.string(),
               "' to write '", target_.string(), "': ", errno_text(error));
  }
  ZERO_THROW(IoError, "cannot create a temporary file in directory '", dir.string(),
             "' to write '", target_.string(), "': every candidate name already exists");
}

AtomicFileWriter::~AtomicFileWriter() { discard(); }

AtomicFileWriter::AtomicFileWriter(AtomicFileWriter&& other) noexcept
    : target_(std::move(other.target_)),
      temp_(std::exchange(other.temp_, {})),
      fd_(std::exchange(other.fd_, -1)),
      bytes_written_(other.bytes_written_),
      committed_(other.committed_),
      failed_(other.failed_) {}

AtomicFileWriter& AtomicFileWriter::operator=(AtomicFileWriter&& other) noexcept {
  if (this != &other) {
    discard();
    target_ = std::move(other.target_);
    temp_ = std::exchange(other.temp_, {});
    fd_ = std::exchange(other.fd_, -1);
    bytes_written_ = other.bytes_written_;
    committed_ = other.committed_;
    failed_ = other.failed_;
  }
  return *this;
}

void AtomicFileWriter::discard() noexcept {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
  if (!committed_ && !temp_.empty()) {
    ::unlink(temp_.c_str());
    temp_.clear();
  }
}

void AtomicFileWriter::write(const void* data, std::size_t size) {
  ZERO_CHECK(fd_ >= 0 && !committed_ && !failed_, "AtomicFileWriter: write to '",
             target_.string(), "' after commit, after a failure or after a move");
  const char* cursor = static_cast<const char*>(data);
  std::size_t left = size;
  while (left > 0) {
    const ssize_t n = ::write(fd_, cursor, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      // write() returning 0 for a non-empty regular-file write has no errno;
      // treat it as "no space" rather than spin.
      const int error = n < 0 ? errno : ENOSPC;
      failed_ = true;
      ZERO_THROW(IoError, "cannot write '", target_.string(), "' (temporary file '",
                 temp_.string(), "', ", bytes_written_, " bytes written so far): ",
                 errno_text(error));
    }
    cursor += n;
    left -= static_cast<std::size_t>(n);
    bytes_written_ += static_cast<std::size_t>(n);
  }
}

void AtomicFileWriter::commit() {
  ZERO_CHECK(fd_ >= 0 && !committed_ && !failed_, "AtomicFileWriter: commit of '",
             target_.string(), "' twice, after a failure or after a move");
  if (WriteFault* fault = write_fault();
      fault != nullptr && target_.string().find(fault->substring) != std::string::npos &&
      ++fault->matched == fault->nth) {
    std::fprintf(stderr, "[zero] %s: %s process %ld while writing '%s' (%zu of %zu bytes in '%s')\n",
                 fault->variable, fault->signal == SIGKILL ? "killing" : "stopping", static_cast<long>(::getpid()),
                 target_.c_str(), fault->signal == SIGKILL ? bytes_written_ / 2 : bytes_written_, bytes_written_,
                 temp_.c_str());
    std::fflush(stderr);
    // Killed: what a process dying halfway leaves. Stopped: the data stays
    // whole, so that a process continued with SIGCONT commits a correct file.
    if (fault->signal == SIGKILL && ::ftruncate(fd_, static_cast<off_t>(bytes_written_ / 2)) != 0)
      std::perror("[zero] ftruncate");
    ::kill(::getpid(), fault->signal);
  }
  int rc;
  do {
    rc = ::fsync(fd_);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    const int error = errno;
    failed_ = true;
    ZERO_THROW(IoError, "cannot fsync temporary file '", temp_.string(), "' for '",
               target_.string(), "': ", errno_text(error));
  }
  // close() can report deferred write errors (NFS); it is not retried on EINTR
  // because Linux releases the descriptor either way.
  const int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0 && errno != EINTR) {
    const int error = errno;
    failed_ = true;
    ZERO_THROW(IoError, "cannot close temporary file '", temp_.string(), "' for '",
               target_.string(), "': ", errno_text(error));
  }
  if (::rename(temp_.c_str(), target_.c_str()) != 0) {
    const int error = errno;
    failed_ = true;
    ZERO_THROW(IoError, "cannot rename temporary file '", temp_.string(), "' to '",
               target_.string(), "': ", errno_text(error));
  }
  committed_ = true;
  temp_.clear();
  fsync_directory(directory_of(target_));
}

void write_file_atomically(const std::filesystem::path& target, std::span<const std::byte> bytes) {
  AtomicFileWriter writer(target);
  writer.write(bytes.data(), bytes.size());
  writer.commit();
}

void fsync_directory(const std::filesystem::path& directory) {
  const int fd = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    const int error = errno;
    ZERO_THROW(IoError, "cannot open directory '", directory.string(), "' to fsync it: ",
               errno_text(error));
  }
  int rc;
  do {
    rc = ::fsync(fd);
  } while (rc != 0 && errno == EINTR);
  const int error = errno;
  ::close(fd);
  // Some file systems (e.g. certain FUSE or network mounts) cannot fsync a
  // directory and say EINVAL; there is nothing more durable to ask them for.
  if (rc != 0 && error != EINVAL) {
    ZERO_THROW(IoError, "cannot fsync directory '", directory.string(), "': ",
               errno_text(error));
  }
}

}  // namespace zero::io
