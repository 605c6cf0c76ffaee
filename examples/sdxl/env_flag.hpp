// Switches for A/B runs, read from the environment (the bench/gpu scripts
// set them): each turns a measured default off, and is on when set to "1".
#pragma once

#include <cstdlib>
#include <string_view>

inline bool env_flag(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && std::string_view(value) == "1";
}
