// The trainer's parameter groups: [optimizer] no_weight_decay and
// [[optimizer.groups]] turned into the engine's groups
// (EngineOptions::param_groups) and each parameter's group.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "train_config.hpp"
#include "zero/engine/options.hpp"

namespace sdxl {

struct ParamGrouping {
  /// The engine's groups; empty when the config asks for none (one group).
  std::vector<zero::ParamGroupOptions> groups;
  /// Each parameter's group, in the order of the names given.
  std::vector<int> group_of;
};

/// Every [[optimizer.groups]] table is a group (the parameters its patterns
/// match); the others form the default group. A parameter matching
/// no_weight_decay goes to its group's twin without weight decay. Groups
/// that end up empty are left out. Throws zero::InvalidArgument for a
/// pattern that matches nothing and for a parameter in two groups, naming
/// them.
ParamGrouping group_parameters(const TrainConfig& cfg, const std::vector<std::string>& names);

/// "parameter groups (3): default: 1,234 tensors, 5.6M elements, lr x1, weight decay 0.01; ..." one line a group.
std::string describe_grouping(const ParamGrouping& grouping, const zero::OptimizerOptions& base,
                              const std::vector<std::int64_t>& numels);

}  // namespace sdxl
