#include "zero/io/atomic_file.hpp"

#include <doctest/doctest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <csignal>
#include <string>

#include "io_error_of.hpp"
#include "temp_dir.hpp"
#include "zero/core/error.hpp"
#include "zero/io/safetensors.hpp"

using namespace zero::io;
using zero::io::testing::read_text;
using zero::io::testing::TempDir;
using zero::io::testing::write_text;

namespace {

std::span<const std::byte> as_bytes(const std::string& text) {
  return std::as_bytes(std::span<const char>(text.data(), text.size()));
}

using zero::testing::io_error_of;

// Lowers this process's file size limit for one scope: writes past it fail
// with EFBIG, standing in for a full disk without needing one.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    ::getrlimit(RLIMIT_FSIZE, &saved_);
    old_handler_ = std::signal(SIGXFSZ, SIG_IGN);  // else the kernel kills us
    rlimit lowered = saved_;
    lowered.rlim_cur = bytes;
    ::setrlimit(RLIMIT_FSIZE, &lowered);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &saved_);
    std::signal(SIGXFSZ, old_handler_);
  }

 private:
  rlimit saved_{};
  void (*old_handler_)(int) = nullptr;
};

}  // namespace

TEST_CASE("write_file_atomically creates and replaces, leaving no temporary") {
  TempDir dir;
  const auto target = dir / "state.bin";
  write_file_atomically(target, as_bytes("first"));
  CHECK(read_text(target) == "first");
  write_file_atomically(target, as_bytes("second, longer content"));
  CHECK(read_text(target) == "second, longer content");
  write_file_atomically(target, {});
  CHECK(read_text(target).empty());
  CHECK(dir.entries() == std::vector<std::string>{"state.bin"});
}

TEST_CASE("an uncommitted writer never shows through and cleans up") {
  TempDir dir;
  const auto target = dir / "checkpoint.safetensors";
  write_text(target, "old content");
  std::filesystem::path temp;
  {
    AtomicFileWriter writer(target);
    temp = writer.temp_path();
    CHECK(temp.parent_path() == dir.path());
    const std::string temp_name = temp.filename().string();
    CHECK(temp_name.rfind(".checkpoint.safetensors.tmp." + std::to_string(::getpid()) + ".", 0) == 0);
    writer.write(as_bytes("half of the new"));
    CHECK(std::filesystem::exists(temp));
    CHECK(read_text(target) == "old content");
    CHECK(writer.bytes_written() == 15);
    // destroyed here, as when an exception unwinds a checkpoint save
  }
  CHECK(read_text(target) == "old content");
  CHECK_FALSE(std::filesystem::exists(temp));
  CHECK(dir.entries() == std::vector<std::string>{"checkpoint.safetensors"});
}

TEST_CASE("commit replaces the target; misuse is rejected") {
  TempDir dir;
  const auto target = dir / "x";
  AtomicFileWriter writer(target);
  writer.write("abc", 3);
  writer.write(as_bytes("def"));
  CHECK_FALSE(std::filesystem::exists(target));
  writer.commit();
  CHECK(writer.committed());
  CHECK(writer.temp_path().empty());
  CHECK(read_text(target) == "abcdef");
  CHECK_THROWS_AS(writer.commit(), zero::InvalidArgument);
  CHECK_THROWS_AS(writer.write("x", 1), zero::InvalidArgument);
  CHECK(dir.entries() == std::vector<std::string>{"x"});
  CHECK_THROWS_AS(AtomicFileWriter(dir.path() / ""), zero::InvalidArgument);
}

TEST_CASE("writers are movable") {
  TempDir dir;
  AtomicFileWriter first(dir / "a");
  first.write("1", 1);
  AtomicFileWriter second(std::move(first));
  second.write("2", 1);
  AtomicFileWriter third(dir / "b");
  third = std::move(second);  // discards b's temporary
  third.commit();
  CHECK(read_text(dir / "a") == "12");
  CHECK(dir.entries() == std::vector<std::string>{"a"});
}

TEST_CASE("unwritable directories give IoError naming the directory") {
  TempDir dir;
  // The parent is a regular file: ENOTDIR for root and everyone else.
  write_text(dir / "plain_file", "x");
  const auto under_file = dir / "plain_file" / "out.safetensors";
  const std::string not_dir = io_error_of([&] { write_file_atomically(under_file, as_bytes("x")); });
  CHECK(not_dir.find((dir / "plain_file").string()) != std::string::npos);
  CHECK(not_dir.find("Not a directory") != std::string::npos);

  const std::string missing = io_error_of(
      [&] { write_safetensors(dir / "no_such_dir" / "w.safetensors", {}); });
  CHECK(missing.find((dir / "no_such_dir").string()) != std::string::npos);
  CHECK(missing.find("No such file or directory") != std::string::npos);

  if (::geteuid() == 0) {
    MESSAGE("running as root: permissions are not enforced, read-only directory check skipped");
  } else {
    const auto read_only = dir / "read_only";
    std::filesystem::create_directory(read_only);
    std::filesystem::permissions(read_only, std::filesystem::perms::owner_read |
                                                std::filesystem::perms::owner_exec);
    const std::string denied =
        io_error_of([&] { write_file_atomically(read_only / "f", as_bytes("x")); });
    CHECK(denied.find(read_only.string()) != std::string::npos);
    CHECK(denied.find("Permission denied") != std::string::npos);
  }
}

TEST_CASE("a write failure (file too large, as for a full disk) keeps the old target") {
  TempDir dir;
  const auto target = dir / "big.bin";
  write_text(target, "previous");
  const std::string payload(64 * 1024, 'z');
  std::string message;
  {
    FileSizeLimit limit(4096);
    message = io_error_of([&] { write_file_atomically(target, as_bytes(payload)); });
  }
  CHECK(message.find(target.string()) != std::string::npos);
  CHECK(message.find("File too large") != std::string::npos);
  CHECK(read_text(target) == "previous");
  CHECK(dir.entries() == std::vector<std::string>{"big.bin"});

  // A writer that failed refuses to commit a partial file.
  {
    AtomicFileWriter writer(target);
    {
      FileSizeLimit limit(4096);
      CHECK_THROWS_AS(writer.write(payload.data(), payload.size()), zero::IoError);
    }
    CHECK(writer.bytes_written() == 4096);
    CHECK_THROWS_AS(writer.commit(), zero::InvalidArgument);
  }
  CHECK(read_text(target) == "previous");
  CHECK(dir.entries() == std::vector<std::string>{"big.bin"});
}

TEST_CASE("fsync_directory") {
  TempDir dir;
  fsync_directory(dir.path());
  const std::string missing = io_error_of([&] { fsync_directory(dir / "gone"); });
  CHECK(missing.find((dir / "gone").string()) != std::string::npos);
}
