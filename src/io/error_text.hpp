// Text of a JSON parser's error for our own messages: nlohmann's "[json.exception...] "
// prefix dropped, and bytes that are not printable ASCII escaped as \xNN, so that a
// hostile file cannot put control characters into logs.
#pragma once

#include <cstdio>
#include <string>
#include <string_view>

namespace zero::io::detail {

inline std::string printable_error_text(std::string_view what, std::size_t max_chars = std::string_view::npos) {
  if (!what.empty() && what.front() == '[') {
    if (const auto end = what.find("] "); end != std::string_view::npos) what.remove_prefix(end + 2);
  }
  what = what.substr(0, max_chars);
  std::string out;
  out.reserve(what.size());
  for (const char c : what) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte >= 0x20 && byte < 0x7f) {
      out += c;
    } else {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\x%02x", byte);
      out += escaped;
    }
  }
  return out;
}

/// At most 80 bytes of a text for a message, cut on a UTF-8 character boundary.
inline std::string brief_text(std::string_view text) {
  constexpr std::size_t kLimit = 80;
  if (text.size() <= kLimit) return std::string(text);
  std::size_t cut = kLimit;
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xc0u) == 0x80u) --cut;
  return std::string(text.substr(0, cut)) + "...";
}

}  // namespace zero::io::detail
