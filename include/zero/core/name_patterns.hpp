// Parameter names matched against shell-style patterns ("down_blocks.0.*",
// "*.bias", "*norm*"): how a trainer says which parameters form a group, are
// frozen, or skip weight decay. '*' matches any run of characters, dots
// included; '?' one character; [...] a set (POSIX fnmatch without flags).
#pragma once

#include <fnmatch.h>

#include <cstddef>
#include <string>
#include <vector>

#include "zero/core/error.hpp"

namespace zero {

inline bool name_matches(const std::string& pattern, const std::string& name) {
  return fnmatch(pattern.c_str(), name.c_str(), 0) == 0;
}

/// A named set of patterns (a parameter group, say).
struct NamedPatterns {
  std::string name;
  std::vector<std::string> patterns;
};

/// For each name, 1 + the index of the one set with a pattern that matches it,
/// or 0 where none does. Throws zero::InvalidArgument, prefixed with `what`
/// (e.g. "[[optimizer.groups]]"), for a pattern that matches no name (a typo
/// would otherwise silently do nothing) and for a name that two sets match
/// (naming both sets and the name).
inline std::vector<int> assign_by_patterns(const std::vector<std::string>& names, const std::vector<NamedPatterns>& sets,
                                           const std::string& what) {
  std::vector<int> out(names.size(), 0);
  for (std::size_t s = 0; s < sets.size(); ++s) {
    for (const std::string& pattern : sets[s].patterns) {
      bool used = false;
      for (std::size_t i = 0; i < names.size(); ++i) {
        if (!name_matches(pattern, names[i])) continue;
        used = true;
        const int mine = static_cast<int>(s) + 1;
        if (out[i] != 0 && out[i] != mine)
          ZERO_THROW(InvalidArgument, what, ": parameter '", names[i], "' is in two groups, '",
                     sets[static_cast<std::size_t>(out[i] - 1)].name, "' and '", sets[s].name, "'");
        out[i] = mine;
      }
      ZERO_CHECK(used, what, ": pattern '", pattern, "' of '", sets[s].name, "' matches no parameter");
    }
  }
  return out;
}

}  // namespace zero
