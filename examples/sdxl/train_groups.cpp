#include "train_groups.hpp"

#include <algorithm>
#include <cstdio>
#include <map>
#include <utility>

#include "zero/core/name_patterns.hpp"

namespace sdxl {

std::vector<bool> frozen_parameters(const TrainConfig& cfg, const std::vector<std::string>& names) {
  std::vector<bool> frozen(names.size(), false);
  for (const std::string& pattern : cfg.freeze) {
    bool used = false;
    for (std::size_t i = 0; i < names.size(); ++i) {
      if (!zero::name_matches(pattern, names[i])) continue;
      frozen[i] = true;
      used = true;
    }
    ZERO_CHECK(used, "[model] freeze: pattern '", pattern, "' matches no parameter (glob patterns on the diffusers "
               "parameter names, e.g. \"down_blocks.0.*\"; '*' matches dots too)");
  }
  const auto trained = static_cast<std::size_t>(std::count(frozen.begin(), frozen.end(), false));
  ZERO_CHECK(trained > 0, "[model] freeze = ", pattern_list(cfg.freeze), " freezes all ", names.size(),
             " parameters: nothing to train");
  return frozen;
}

std::string describe_freeze(const TrainConfig& cfg, const std::vector<bool>& frozen,
                            const std::vector<std::int64_t>& numels) {
  std::size_t tensors = 0;
  std::int64_t elements = 0, total = 0;
  for (std::size_t i = 0; i < frozen.size(); ++i) {
    total += numels[i];
    if (!frozen[i]) continue;
    ++tensors;
    elements += numels[i];
  }
  if (tensors == 0) return "frozen: none (every parameter is trained; [model] freeze is empty)\n";
  char line[320];
  std::snprintf(line, sizeof line,
                "frozen ([model] freeze = %s): %zu of %zu tensors, %lld of %lld elements (%.1f%%); trained: %zu "
                "tensors, %lld elements\n",
                pattern_list(cfg.freeze).c_str(), tensors, frozen.size(), static_cast<long long>(elements),
                static_cast<long long>(total), 100.0 * static_cast<double>(elements) / static_cast<double>(total),
                frozen.size() - tensors, static_cast<long long>(total - elements));
  return line;
}

namespace {

// A group or no_weight_decay pattern that matches only frozen parameters
// would change nothing: most likely the freeze or the pattern is not what
// was meant, so it is refused like a pattern that matches nothing.
void check_matches_trained(const TrainConfig& cfg, const std::vector<std::string>& names,
                           const std::vector<bool>& frozen, const std::vector<std::string>& patterns,
                           const std::string& what) {
  for (const std::string& pattern : patterns) {
    bool trained = false;
    for (std::size_t i = 0; i < names.size() && !trained; ++i)
      trained = !frozen[i] && zero::name_matches(pattern, names[i]);
    ZERO_CHECK(trained, what, ": pattern '", pattern, "' matches only frozen parameters ([model] freeze = ",
               pattern_list(cfg.freeze), "): it would apply to no trained parameter");
  }
}

}  // namespace

ParamGrouping group_parameters(const TrainConfig& cfg, const std::vector<std::string>& names,
                               const std::vector<bool>& frozen) {
  ParamGrouping out;
  out.group_of.assign(names.size(), 0);
  for (std::size_t i = 0; i < names.size(); ++i)
    if (frozen[i]) out.group_of[i] = ParamGrouping::kNotTrained;
  if (cfg.optimizer_groups.empty() && cfg.no_weight_decay.empty()) return out;
  std::vector<zero::NamedPatterns> sets;
  for (const TrainConfig::OptimizerGroup& g : cfg.optimizer_groups) sets.push_back({g.name, g.params});
  const std::vector<int> table = zero::assign_by_patterns(names, sets, "[[optimizer.groups]]");
  for (const TrainConfig::OptimizerGroup& g : cfg.optimizer_groups)
    check_matches_trained(cfg, names, frozen, g.params, "[[optimizer.groups]] '" + g.name + "'");
  std::vector<int> no_decay(names.size(), 0);
  if (!cfg.no_weight_decay.empty()) {
    no_decay = zero::assign_by_patterns(names, {{"no_weight_decay", cfg.no_weight_decay}}, "[optimizer] no_weight_decay");
    check_matches_trained(cfg, names, frozen, cfg.no_weight_decay, "[optimizer] no_weight_decay");
  }

  // One engine group per (table, decay) pair in use, in order of first use.
  std::map<std::pair<int, bool>, int> index;
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (frozen[i]) continue;
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
  if (grouping.groups.empty()) return "parameter groups: one (every trained parameter with the [optimizer] values)\n";
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
