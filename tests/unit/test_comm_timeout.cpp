// ZERO_COMM_TIMEOUT_S: the communicator's default timeout from the
// environment. Out-of-range values (inf, nan, 1e300, below a millisecond)
// are refused with a message naming the variable, the value and the range,
// before any conversion to an integer could overflow.
#include <doctest/doctest.h>

#include <cstdlib>
#include <optional>
#include <string>

#include "zero/comm/mpi_communicator.hpp"

using namespace zero;

namespace {

// Sets the variable for one scope and restores what was there before.
class ScopedTimeoutEnv {
 public:
  explicit ScopedTimeoutEnv(const char* value) {
    if (const char* old = std::getenv(kName)) saved_ = old;
    ::setenv(kName, value, 1);
  }
  ~ScopedTimeoutEnv() {
    if (saved_) ::setenv(kName, saved_->c_str(), 1);
    else ::unsetenv(kName);
  }

 private:
  static constexpr const char* kName = "ZERO_COMM_TIMEOUT_S";
  std::optional<std::string> saved_;
};

std::string refusal_of(const char* value) {
  ScopedTimeoutEnv env(value);
  try {
    (void)MpiCommunicator::default_timeout();
  } catch (const InvalidArgument& e) {
    return e.message();
  }
  return "";
}

}  // namespace

TEST_CASE("ZERO_COMM_TIMEOUT_S: sane values in seconds become milliseconds") {
  {
    ScopedTimeoutEnv env("2.5");
    CHECK(MpiCommunicator::default_timeout().count() == 2500);
  }
  {
    ScopedTimeoutEnv env("0.001");
    CHECK(MpiCommunicator::default_timeout().count() == 1);
  }
  {
    ScopedTimeoutEnv env("1e6");
    CHECK(MpiCommunicator::default_timeout().count() == 1000000000);
  }
}

TEST_CASE("ZERO_COMM_TIMEOUT_S: out of range or not a number is refused, naming the variable and the range") {
  for (const char* value : {"inf", "-inf", "1e300", "1e400", "0.0001", "0", "nan", "abc", "-1", "", "60s", "1e6.5"}) {
    CAPTURE(value);
    const std::string message = refusal_of(value);
    REQUIRE(!message.empty());
    CHECK(message.find("ZERO_COMM_TIMEOUT_S='" + std::string(value) + "'") != std::string::npos);
    CHECK(message.find("finite number of seconds in [0.001, 1e6]") != std::string::npos);
  }
}
