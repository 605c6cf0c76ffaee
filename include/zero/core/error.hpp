// zero::Error family and the ZERO_CHECK_* macros: one error vocabulary for the
// whole library. Every error carries the rank that raised it (when known) and
// the file:line of the check, so a message from rank 5 of 64 says so.
#pragma once

#include <atomic>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace zero {

namespace detail {
// The process's rank for error messages; set once a communicator exists.
// -1 means "not known yet" (single process or before bootstrap).
inline std::atomic<int>& process_rank_slot() {
  static std::atomic<int> rank{-1};
  return rank;
}
}  // namespace detail

inline void set_process_rank(int rank) { detail::process_rank_slot().store(rank); }
inline int process_rank() { return detail::process_rank_slot().load(); }

/// Debug mode (environment ZERO_DEBUG set to anything but "" or "0"): error
/// messages name the source file and line that raised them, and top-level
/// handlers print LibTorch's C++ frames. Off, users see what went wrong and
/// what to change, not where in zero's sources it was noticed.
inline bool debug_mode() {
  static const bool on = [] {
    const char* value = std::getenv("ZERO_DEBUG");
    return value != nullptr && *value != '\0' && std::string_view(value) != "0";
  }();
  return on;
}

/// Base of every exception zero throws. what() reads "[zero rank R] message",
/// and "[zero rank R] file:line: message" in debug mode (file() and line()
/// always hold the location).
class Error : public std::runtime_error {
 public:
  Error(std::string message, const char* file, int line)
      : std::runtime_error(format(message, file, line)),
        message_(std::move(message)),
        file_(file ? file : ""),
        line_(line),
        rank_(process_rank()) {}

  /// The message without the rank and location prefix.
  const std::string& message() const noexcept { return message_; }
  const std::string& file() const noexcept { return file_; }
  int line() const noexcept { return line_; }
  int rank() const noexcept { return rank_; }
  /// "src/io/safetensors_reader.cpp:42": the file from the project's top
  /// folders on (not the builder's home) and the line.
  std::string location() const { return location_of(file_.c_str(), line_); }

 private:
  static std::string location_of(const char* file, int line) {
    std::string_view path(file ? file : "");
    for (std::string_view top : {"include/zero/", "src/", "tests/", "examples/", "bench/", "tools/"}) {
      if (auto pos = path.rfind(top); pos != std::string_view::npos) {
        path = path.substr(pos);
        break;
      }
    }
    return std::string(path) + ":" + std::to_string(line);
  }

  static std::string format(const std::string& message, const char* file, int line) {
    std::ostringstream out;
    out << "[zero";
    if (int r = process_rank(); r >= 0) out << " rank " << r;
    out << "] ";
    if (file && debug_mode()) out << location_of(file, line) << ": ";
    out << message;
    return out.str();
  }

  std::string message_;
  std::string file_;
  int line_;
  int rank_;
};

/// A caller passed something invalid: options, sizes, dtypes, names.
class InvalidArgument : public Error {
  using Error::Error;
};
/// An internal invariant broke: a bug in zero, not in the caller's input.
class InternalError : public Error {
  using Error::Error;
};
/// A collective failed or timed out; the communicator should be recreated.
class CommError : public Error {
  using Error::Error;
};
/// Reading or writing files failed, or a file's content is malformed.
class IoError : public Error {
  using Error::Error;
};
/// A CUDA runtime, cuBLAS or NCCL call failed.
class DeviceError : public Error {
  using Error::Error;
};
/// An allocation could not be satisfied (host or device).
class OutOfMemory : public Error {
  using Error::Error;
};

namespace detail {
template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}
}  // namespace detail

}  // namespace zero

/// Throws ExceptionType with the streamed message parts.
#define ZERO_THROW(ExceptionType, ...) \
  throw ExceptionType(::zero::detail::concat(__VA_ARGS__), __FILE__, __LINE__)

/// Validation of caller input: throws zero::InvalidArgument when cond is false.
#define ZERO_CHECK(cond, ...)                                   \
  do {                                                          \
    if (!(cond)) ZERO_THROW(::zero::InvalidArgument, __VA_ARGS__); \
  } while (0)

/// Like ZERO_CHECK but prints both operands, as gloo's ENFORCE_EQ does.
#define ZERO_CHECK_EQ(a, b, ...)                                                      \
  do {                                                                                \
    const auto& zero_lhs_ = (a);                                                      \
    const auto& zero_rhs_ = (b);                                                      \
    if (!(zero_lhs_ == zero_rhs_))                                                    \
      ZERO_THROW(::zero::InvalidArgument, #a " == " #b " failed (", zero_lhs_, " vs ", \
                 zero_rhs_, "): ", __VA_ARGS__);                                      \
  } while (0)

/// Internal invariants (bugs in zero itself).
#define ZERO_ASSERT(cond, ...)                                                              \
  do {                                                                                      \
    if (!(cond)) ZERO_THROW(::zero::InternalError, "invariant " #cond " broken: ", __VA_ARGS__); \
  } while (0)
