#include "train_config_toml.hpp"

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <utility>

#include "zero/core/error.hpp"

namespace sdxl::detail {

namespace {

// ---------------------------------------------------------------- bounds before parsing

// toml++ builds a node of about 90 bytes per value: a small file of a long
// array would cost gigabytes before any key is checked. A configuration is a
// few KB; these bounds refuse other files before a node is built.
constexpr std::size_t kMaxConfigBytes = 1 << 20;
constexpr std::size_t kMaxConfigValues = 10'000;

// The values of a TOML text, over-counted (each '=', ',' and '[' outside
// strings and comments is one): the bound needs no parse.
std::size_t count_toml_values(std::string_view text) {
  std::size_t values = 0;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '#') {
      while (i < text.size() && text[i] != '\n') ++i;
    } else if (c == '"' || c == '\'') {
      const bool multiline = text.substr(i, 3) == std::string(3, c);
      const std::string_view close = multiline ? text.substr(i, 3) : text.substr(i, 1);
      i += close.size();
      while (i < text.size() && text.substr(i, close.size()) != close) {
        if (c == '"' && text[i] == '\\') ++i;  // an escape: the next character is part of the string
        else if (!multiline && text[i] == '\n') break;
        ++i;
      }
      i += close.size() - 1;
    } else if (c == '=' || c == ',' || c == '[') {
      ++values;
    }
  }
  return values;
}

}  // namespace

void check_config_bounds(std::string_view text, const std::string& origin) {
  ZERO_CHECK(text.size() <= kMaxConfigBytes, origin, ": ", text.size(), " bytes, over the limit of ", kMaxConfigBytes,
             " for a configuration (kMaxConfigBytes; a training configuration is a few KB): is it the right file?");
  const std::size_t values = count_toml_values(text);
  ZERO_CHECK(values <= kMaxConfigValues, origin, ": about ", values, " values (keys and list entries), over the limit "
             "of ", kMaxConfigValues, " for a configuration (kMaxConfigValues)");
}

namespace {

// toml++ 3.3 (the Debian package) tests code points outside strings, and
// after a line-ending backslash in a multi-line string, with a whitespace
// table whose lookup is undefined behaviour (it reaches TOML_UNREACHABLE) for
// three ranges of code points (upstream marzer/tomlplusplus issues 190 and
// 295; found by tests/fuzz/fuzz_train_config). toml++ is therefore given a
// text in which those code points are moved into private-use ranges, which the
// table handles, and every string read from it is moved back. A configuration
// that holds the private-use code points themselves is refused.
struct ShieldedRange {
  char32_t first, last, moved_to;
};
constexpr ShieldedRange kShieldedRanges[] = {
    {0x00A1, 0x0499, 0xF0A1}, {0x2C5E, 0x3057, 0xE000}, {0xFB26, 0xFEFE, 0xE400}};

// The code point of a well-formed 2- or 3-byte UTF-8 sequence at text[i] (and its length), else 0.
std::pair<char32_t, std::size_t> decode_utf8(std::string_view text, std::size_t i) {
  auto cont = [&](std::size_t k) { return k < text.size() && (static_cast<unsigned char>(text[k]) & 0xC0) == 0x80; };
  const auto b0 = static_cast<unsigned char>(text[i]);
  if ((b0 & 0xE0) == 0xC0 && cont(i + 1))
    return {(char32_t(b0 & 0x1F) << 6) | (static_cast<unsigned char>(text[i + 1]) & 0x3F), 2};
  if ((b0 & 0xF0) == 0xE0 && cont(i + 1) && cont(i + 2))
    return {(char32_t(b0 & 0x0F) << 12) | (char32_t(static_cast<unsigned char>(text[i + 1]) & 0x3F) << 6) |
                (static_cast<unsigned char>(text[i + 2]) & 0x3F),
            3};
  return {0, 1};
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
  } else {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
  }
  out += static_cast<char>(0x80 | (cp & 0x3F));
}

std::string shield_for_tomlpp(std::string_view text, const std::string& origin) {
  std::string out;
  out.reserve(text.size() + text.size() / 2);
  std::size_t line = 1;
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '\n') ++line;
    const auto [cp, length] = decode_utf8(text, i);
    bool moved = false;
    for (const ShieldedRange& r : kShieldedRanges) {
      ZERO_CHECK(length == 1 || cp < r.moved_to || cp > r.moved_to + (r.last - r.first), origin, ":", line,
                 ": private-use character (code point ", static_cast<std::uint32_t>(cp),
                 ") is not accepted in a configuration");
      if (length > 1 && cp >= r.first && cp <= r.last) {
        append_utf8(out, cp - r.first + r.moved_to);
        moved = true;
      }
    }
    if (moved) {
      i += length - 1;
      continue;
    }
    out += text[i];
  }
  return out;
}

}  // namespace

// The inverse of shield_for_tomlpp, for strings read from the parsed table.
std::string unshield(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (std::size_t i = 0; i < text.size(); ++i) {
    const auto [cp, length] = decode_utf8(text, i);
    bool moved = false;
    for (const ShieldedRange& r : kShieldedRanges)
      if (length == 3 && cp >= r.moved_to && cp <= r.moved_to + (r.last - r.first)) {
        append_utf8(out, cp - r.moved_to + r.first);
        moved = true;
      }
    if (moved) {
      i += length - 1;
      continue;
    }
    out += text[i];
  }
  return out;
}

toml::table parse_toml(std::string_view text, const std::string& origin) {
  const std::string shielded = shield_for_tomlpp(text, origin);
  try {
    return toml::parse(shielded, origin);
  } catch (const toml::parse_error& e) {
    ZERO_THROW(zero::InvalidArgument, origin, ":", e.source().begin.line, ":", e.source().begin.column, ": ",
               unshield(e.description()));
  }
}

std::string read_config_text(const std::string& path) {
  std::error_code error;
  const std::uintmax_t bytes = std::filesystem::file_size(path, error);
  ZERO_CHECK(!error, "--config ", path, ": cannot read: ", error.message());
  ZERO_CHECK(bytes <= kMaxConfigBytes, path, ": ", bytes, " bytes, over the limit of ", kMaxConfigBytes,
             " for a configuration (kMaxConfigBytes; a training configuration is a few KB): is it the right file?");
  std::ifstream in(path, std::ios::binary);
  ZERO_CHECK(in.good(), "--config ", path, ": cannot open");
  std::string text(static_cast<std::size_t>(bytes), '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  ZERO_CHECK(in.gcount() == static_cast<std::streamsize>(text.size()), "--config ", path, ": cannot read all of its ",
             bytes, " bytes");
  return text;
}

std::string toml_string(std::string_view text) {
  std::string out = "\"";
  for (const char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\t': out += "\\t"; break;
      case '\n': out += "\\n"; break;
      case '\f': out += "\\f"; break;
      case '\r': out += "\\r"; break;
      default:
        if (c < 0x20 || c == 0x7f) {
          char escaped[8];
          std::snprintf(escaped, sizeof escaped, "\\u%04X", static_cast<unsigned>(c));
          out += escaped;
        } else {
          out += ch;  // UTF-8 passes as it is
        }
    }
  }
  return out + "\"";
}

}  // namespace sdxl::detail
