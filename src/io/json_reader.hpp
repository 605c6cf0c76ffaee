// Typed getters over a JSON object, for the readers of zero's own JSON formats
// (the checkpoint manifest, the engine's shard metadata). Every failure throws
// IoError naming the key by its dotted path ("layout.padded_numel"), what it
// should be and, unless the format's messages leave it out, what was found.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "error_text.hpp"
#include "zero/core/error.hpp"

namespace zero::io::detail {

// What a value is, for "found ..." in messages. Never Json::dump() of a
// container: a hostile file may nest arrays a million deep.
inline std::string describe(const nlohmann::json& value) {
  using Json = nlohmann::json;
  switch (value.type()) {
    case Json::value_t::null: return "null";
    case Json::value_t::boolean: return value.get<bool>() ? "true" : "false";
    case Json::value_t::string: return Json(brief_text(value.get_ref<const std::string&>())).dump();
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned:
    case Json::value_t::number_float: return value.dump();
    case Json::value_t::array: return "an array of " + std::to_string(value.size());
    case Json::value_t::object: return "an object of " + std::to_string(value.size()) + " keys";
    default: return "a " + std::string(value.type_name());
  }
}

/// `value` as an integer in [lo, hi]; nothing for floats, other types and values out of range.
inline std::optional<std::int64_t> integer_in(const nlohmann::json& value, std::int64_t lo, std::int64_t hi) {
  if (value.is_number_integer() && !value.is_number_unsigned()) {
    const auto x = value.get<std::int64_t>();
    if (x >= lo && x <= hi) return x;
  } else if (value.is_number_unsigned()) {
    const auto x = value.get<std::uint64_t>();
    if (hi >= 0 && x <= static_cast<std::uint64_t>(hi) && static_cast<std::int64_t>(x) >= lo)
      return static_cast<std::int64_t>(x);
  }
  return std::nullopt;
}

/// `value` as an unsigned integer in [lo, hi]; nothing for floats, negatives, other types and values out of range.
inline std::optional<std::uint64_t> unsigned_in(const nlohmann::json& value, std::uint64_t lo, std::uint64_t hi) {
  if (value.is_number_unsigned()) {
    const auto x = value.get<std::uint64_t>();
    if (x >= lo && x <= hi) return x;
  } else if (value.is_number_integer()) {
    const auto x = value.get<std::int64_t>();
    if (x >= 0 && static_cast<std::uint64_t>(x) >= lo && static_cast<std::uint64_t>(x) <= hi)
      return static_cast<std::uint64_t>(x);
  }
  return std::nullopt;
}

// Reads the keys of one JSON object. A message reads
//   <origin>key '<prefix><key>' should be <expected>[, found <what>]
// `origin` (e.g. "manifest.json: ") is held by reference: it must outlive the
// reader and every reader made from it.
class JsonReader {
 public:
  using Json = nlohmann::json;
  /// Whether messages end with ", found <what>".
  enum class Found { named, omitted };

  JsonReader(const std::string& origin, const Json& object, std::string prefix = "", Found found = Found::named)
      : origin_(origin), object_(object), prefix_(std::move(prefix)), found_(found) {}

  [[noreturn]] void fail(const std::string& key, std::string_view expected, const std::string& what = {}) const {
    if (found_ == Found::named)
      ZERO_THROW(::zero::IoError, origin_, "key '", prefix_, key, "' should be ", expected, ", found ", what);
    ZERO_THROW(::zero::IoError, origin_, "key '", prefix_, key, "' should be ", expected);
  }

  bool has(const char* key) const { return object_.contains(key); }

  /// The value of `key`, or nullptr when it is missing (or this is not an object).
  const Json* find(const char* key) const {
    auto it = object_.find(key);
    return it == object_.end() ? nullptr : &*it;
  }

  const Json& get(const char* key, std::string_view expected) const {
    const Json* v = find(key);
    if (!v) fail(key, expected, "nothing (the key is missing)");
    return *v;
  }

  std::int64_t integer(const char* key, std::int64_t lo, std::int64_t hi, std::string_view expected) const {
    const Json& v = get(key, expected);
    if (const auto x = integer_in(v, lo, hi)) return *x;
    fail(key, expected, describe(v));
  }

  std::uint64_t unsigned_integer(const char* key, std::uint64_t lo, std::uint64_t hi, std::string_view expected) const {
    const Json& v = get(key, expected);
    if (const auto x = unsigned_in(v, lo, hi)) return *x;
    fail(key, expected, describe(v));
  }

  // A finite number (integers accepted) in [lo, hi]; lo excluded when `open_low`.
  double number(const char* key, double lo, double hi, bool open_low, std::string_view expected) const {
    const Json& v = get(key, expected);
    if (v.is_number()) {
      const double x = v.get<double>();
      if (std::isfinite(x) && (open_low ? x > lo : x >= lo) && x <= hi) return x;
    }
    fail(key, expected, describe(v));
  }

  bool boolean(const char* key) const {
    const Json& v = get(key, "true or false");
    if (!v.is_boolean()) fail(key, "true or false", describe(v));
    return v.get<bool>();
  }

  const std::string& string(const char* key, std::string_view expected = "a string") const {
    const Json& v = get(key, expected);
    if (!v.is_string()) fail(key, expected, describe(v));
    return v.get_ref<const std::string&>();
  }

  const std::string& one_of(const char* key, std::initializer_list<std::string_view> allowed,
                            std::string_view expected) const {
    const std::string& s = string(key, expected);
    if (std::find(allowed.begin(), allowed.end(), s) == allowed.end()) fail(key, expected, describe(get(key, expected)));
    return s;
  }

  const Json& array(const char* key, std::string_view expected = "an array") const {
    const Json& v = get(key, expected);
    if (!v.is_array()) fail(key, expected, describe(v));
    return v;
  }

  JsonReader object(const char* key) const {
    const Json& v = get(key, "an object");
    if (!v.is_object()) fail(key, "an object", describe(v));
    return nested(v, key);
  }

  /// A reader of `value`, a part of this object named `name` in messages ("files[2]").
  JsonReader nested(const Json& value, const std::string& name) const {
    return JsonReader(origin_, value, prefix_ + name + ".", found_);
  }

  const Json& json() const { return object_; }

 private:
  const std::string& origin_;
  const Json& object_;
  std::string prefix_;
  Found found_;
};

}  // namespace zero::io::detail
