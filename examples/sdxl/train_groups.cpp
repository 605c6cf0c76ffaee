#include "train_groups.hpp"

#include <cstdio>
#include <map>
#include <utility>

#include "zero/core/name_patterns.hpp"

namespace sdxl {

ParamGrouping group_parameters(const TrainConfig& cfg, const std::vector<std::string>& names) {
  ParamGrouping out;
  out.group_of.assign(names.size(), 0);
  if (cfg.optimizer_groups.empty() && cfg.no_weight_decay.empty()) return out;
  std::vector<zero::NamedPatterns> sets;
  for (const TrainConfig::OptimizerGroup& g : cfg.optimizer_groups) sets.push_back({g.name, g.params});
  const std::vector<int> table = zero::assign_by_patterns(names, sets, "[[optimizer.groups]]");
  std::vector<int> no_decay(names.size(), 0);
  if (!cfg.no_weight_decay.empty())
    no_decay = zero::assign_by_patterns(names, {{"no_weight_decay", cfg.no_weight_decay}}, "[optimizer] no_weight_decay");

  // One engine group per (table, decay) pair in use, in order of first use.
  std::map<std::pair<int, bool>, int> index;
  for (std::size_t i = 0; i < names.size(); ++i) {
    const std::pair<int, bool> key{table[i], no_decay[i] != 0};
    auto [it, added] = index.try_emplace(key, static_cast<int>(out.groups.size()));
    if (added) {
      zero::ParamGroupOptions group;
      if (key.first == 0) {
        group.name = "default";
      } else {
        const TrainConfig::OptimizerGroup& g = cfg.optimizer_groups[static_cast<std::size_t>(key.first - 1)];
        group.name = g.name;
        group.lr_scale = g.lr_scale;
        group.weight_decay = g.weight_decay;
      }
      if (key.second) {
        group.name += " (no weight decay)";
        group.weight_decay = 0.0;
      }
      out.groups.push_back(group);
    }
    out.group_of[i] = it->second;
  }
  return out;
}

std::string describe_grouping(const ParamGrouping& grouping, const zero::OptimizerOptions& base,
                              const std::vector<std::int64_t>& numels) {
  if (grouping.groups.empty()) return "parameter groups: one (every parameter with the [optimizer] values)\n";
  std::string text = "parameter groups: " + std::to_string(grouping.groups.size()) + "\n";
  for (std::size_t g = 0; g < grouping.groups.size(); ++g) {
    std::size_t tensors = 0;
    std::int64_t elements = 0;
    for (std::size_t i = 0; i < grouping.group_of.size(); ++i) {
      if (static_cast<std::size_t>(grouping.group_of[i]) != g) continue;
      ++tensors;
      elements += numels[i];
    }
    const zero::OptimizerOptions o = grouping.groups[g].resolve(base);
    char line[256];
    std::snprintf(line, sizeof line, "  %-36s %6zu tensors %14lld elements  lr x%g  weight decay %g\n",
                  grouping.groups[g].name.c_str(), tensors, static_cast<long long>(elements), grouping.groups[g].lr_scale,
                  o.weight_decay);
    text += line;
  }
  return text;
}

}  // namespace sdxl
