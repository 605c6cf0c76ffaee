// LibTorch's errors as users should see them: one line, LibTorch's message
// without its C++ frames (c10::Error::what_without_backtrace; the frames
// only in debug mode, ZERO_DEBUG=1), and an allocation failure as
// zero::OutOfMemory saying what was being done, how much was asked for and
// which option to change.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <new>
#include <optional>
#include <string>
#include <string_view>

#include "zero/core/error.hpp"

namespace sdxl {

/// LibTorch's message: the first line without frames, or all of what() in debug mode.
inline std::string torch_error_text(const c10::Error& error) {
  if (zero::debug_mode()) return error.what();
  std::string_view text = error.what_without_backtrace();
  // "[enforce fail at alloc_cpu.cpp:75] err == 0. " names LibTorch's source and condition, not the problem.
  if (text.rfind("[enforce fail at ", 0) == 0) {
    if (const auto end = text.find("] "); end != std::string_view::npos) text.remove_prefix(end + 2);
  }
  if (const auto allocator = text.find("DefaultCPUAllocator: "); allocator != std::string_view::npos)
    text.remove_prefix(allocator);
  return std::string(text.substr(0, text.find('\n')));
}

/// Whether LibTorch failed to allocate (host or device).
inline bool is_allocation_failure(const c10::Error& error) {
  if (dynamic_cast<const c10::OutOfMemoryError*>(&error) != nullptr) return true;
  const std::string_view text = error.what_without_backtrace();
  for (std::string_view says : {"not enough memory", "can't allocate memory", "out of memory"})
    if (text.find(says) != std::string_view::npos) return true;
  return false;
}

/// Runs body(). A LibTorch allocation failure or std::bad_alloc becomes
/// zero::OutOfMemory "<doing>: out of memory (<LibTorch's words>); <advice>";
/// any other LibTorch error zero::Error "<doing>: <LibTorch's message>".
template <typename Body>
decltype(auto) with_torch_errors(const std::string& doing, const std::string& advice, Body&& body) {
  try {
    return body();
  } catch (const c10::Error& error) {
    if (is_allocation_failure(error))
      ZERO_THROW(zero::OutOfMemory, doing, ": out of memory (", torch_error_text(error), "); ", advice);
    ZERO_THROW(zero::Error, doing, ": ", torch_error_text(error));
  } catch (const std::bad_alloc&) {
    ZERO_THROW(zero::OutOfMemory, doing, ": out of host memory (an allocation failed); ", advice);
  }
}

/// For zero::run_or_abort: a LibTorch error that escaped every phase, in one
/// line (nothing for other exceptions, which run_or_abort describes itself).
inline std::optional<std::string> describe_torch_failure(const std::exception& failure) {
  const auto* error = dynamic_cast<const c10::Error*>(&failure);
  if (error == nullptr) return std::nullopt;
  return (is_allocation_failure(*error) ? "out of memory (" + torch_error_text(*error) + ")"
                                        : "LibTorch: " + torch_error_text(*error));
}

}  // namespace sdxl
