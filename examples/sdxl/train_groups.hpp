// Which parameters the trainer trains and how: [model] freeze (parameters
// that keep their starting values), and [optimizer] no_weight_decay and
// [[optimizer.groups]] turned into the engine's groups
// (EngineOptions::param_groups) and each trained parameter's group.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "train_config.hpp"
#include "zero/engine/options.hpp"

namespace sdxl {

/// For each name, whether a [model] freeze pattern matches it. Throws
/// zero::InvalidArgument for a pattern that matches no parameter (a typo
/// would otherwise train what was meant to stay fixed) and when every
/// parameter is frozen (nothing to train).
std::vector<bool> frozen_parameters(const TrainConfig& cfg, const std::vector<std::string>& names);

/// "frozen ([model] freeze = [ 'down_blocks.*' ]): 136 of 428 tensors, 552032 of 1976516 elements (27.9%);
/// trained: 292 tensors, 1424484 elements", one line; "frozen: none (...)" without a freeze.
std::string describe_freeze(const TrainConfig& cfg, const std::vector<bool>& frozen,
                            const std::vector<std::int64_t>& numels);

struct ParamGrouping {
  /// The engine's groups; empty when the config asks for none (one group).
  std::vector<zero::ParamGroupOptions> groups;
  /// Each parameter's group, in the order of the names given; kNotTrained
  /// for a frozen one.
  std::vector<int> group_of;
  static constexpr int kNotTrained = -1;
};

/// Every [[optimizer.groups]] table is a group (the trained parameters its
/// patterns match); the other trained parameters form the default group. A
/// parameter matching no_weight_decay goes to its group's twin without
/// weight decay. Frozen parameters (`frozen`, one per name) are in no group.
/// Groups that end up empty are left out. Throws zero::InvalidArgument for a
/// pattern that matches nothing or only frozen parameters, and for a
/// parameter in two groups, naming them.
ParamGrouping group_parameters(const TrainConfig& cfg, const std::vector<std::string>& names,
                               const std::vector<bool>& frozen);

/// "parameter groups (3): default: 1,234 tensors, 5.6M elements, lr x1, weight decay 0.01; ..." one line a group.
std::string describe_grouping(const ParamGrouping& grouping, const zero::OptimizerOptions& base,
                              const std::vector<std::int64_t>& numels);

}  // namespace sdxl
