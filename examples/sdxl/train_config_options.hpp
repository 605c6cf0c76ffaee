// The trainer's option table: every scalar option of TrainConfig with its
// TOML table and key, help text and command-line name. The TOML reader,
// the command line, --help and to_toml() all walk this one table
// (train_config.cpp); the pattern lists and [[optimizer.groups]] are not in
// it (they are not scalars). Internal to the trainer's configuration.
#pragma once

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "train_config.hpp"

namespace sdxl::detail {

using Field = std::variant<std::string*, std::int64_t*, double*, bool*>;

struct Option {
  const char* table;
  const char* key;
  Field field;
  const char* help;
  const char* flag = nullptr;  // the command-line name when not the key ([lora] rank is --lora_rank)
  bool integer_as_text = false;  // a text option that also takes a TOML integer (as its digits)
  std::string command_line() const { return std::string("--") + (flag != nullptr ? flag : key); }
};

/// The options of `c`, each pointing at its field, in the order of the TOML
/// tables ([model], [lora], [data], ... [device]).
std::vector<Option> options_of(TrainConfig& c);

}  // namespace sdxl::detail
