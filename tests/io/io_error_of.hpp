// Test helper shared by the io tests.
#pragma once

#include <doctest/doctest.h>

#include <exception>
#include <string>

#include "zero/core/error.hpp"

namespace zero::testing {

// The message of the IoError `fn` throws; fails the test when it throws
// anything else or nothing.
template <typename Fn>
std::string io_error_of(Fn&& fn) {
  try {
    fn();
  } catch (const zero::IoError& e) {
    return e.what();
  } catch (const std::exception& e) {
    FAIL("expected zero::IoError, got another exception: " << e.what());
  }
  FAIL("expected zero::IoError, nothing was thrown");
  return {};
}

}  // namespace zero::testing
