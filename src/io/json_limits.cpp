// check_json_limits: a SAX pass that counts values and depth and stops at the
// first limit exceeded, so the refusal itself costs no memory.
#include "zero/io/json_limits.hpp"

#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "error_text.hpp"
#include "zero/core/error.hpp"

namespace zero::io {
namespace {

using Json = nlohmann::json;

class LimitCounter {
 public:
  using string_t = Json::string_t;
  explicit LimitCounter(const JsonLimits& limits) : limits_(limits) {}

  bool null() { return value(); }
  bool boolean(bool) { return value(); }
  bool number_integer(Json::number_integer_t) { return value(); }
  bool number_unsigned(Json::number_unsigned_t) { return value(); }
  bool number_float(Json::number_float_t, const string_t&) { return value(); }
  bool string(string_t&) { return value(); }
  bool binary(Json::binary_t&) { return value(); }
  bool start_object(std::size_t) { return open(); }
  bool start_array(std::size_t) { return open(); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool key(string_t&) { return true; }
  bool parse_error(std::size_t, const std::string&, const Json::exception& e) {
    syntax_error = e.what();
    return false;
  }

  std::optional<std::string> over_limit;
  std::optional<std::string> syntax_error;

 private:
  bool value() {
    if (++values_ <= limits_.max_values) return true;
    over_limit = "more than " + std::to_string(limits_.max_values) + " JSON values";
    return false;
  }
  bool open() {
    if (++depth_ > limits_.max_depth) {
      over_limit = "arrays or objects nested more than " + std::to_string(limits_.max_depth) + " deep";
      return false;
    }
    return value();
  }
  bool close() {
    --depth_;
    return true;
  }

  const JsonLimits& limits_;
  std::size_t values_ = 0;
  std::size_t depth_ = 0;
};

}  // namespace

void check_json_limits(std::string_view text, const JsonLimits& limits, std::string_view what) {
  if (text.size() > limits.max_bytes)
    ZERO_THROW(IoError, what, ": ", text.size(), " bytes exceed the limit of ", limits.max_bytes,
               " bytes; expected a smaller file (is it the right one?)");
  LimitCounter counter(limits);
  const bool parsed = Json::sax_parse(text.data(), text.data() + text.size(), &counter);
  if (counter.over_limit)
    ZERO_THROW(IoError, what, ": holds ", *counter.over_limit, ", over the limit for this kind of file");
  if (!parsed || counter.syntax_error)
    ZERO_THROW(IoError, what, ": not valid JSON: ",
               detail::printable_error_text(counter.syntax_error.value_or("rejected by the parser")));
}

}  // namespace zero::io
