#include "train_config.hpp"

#include "train_config_options.hpp"
#include "train_config_toml.hpp"

#include <CLI/CLI.hpp>

#include <array>
#include <cmath>
#include <sstream>
#include <utility>
#include <variant>

#include "zero/core/error.hpp"

namespace sdxl {

using detail::check_config_bounds;
using detail::Field;
using detail::Option;
using detail::options_of;
using detail::parse_toml;
using detail::read_config_text;
using detail::unshield;

namespace {

std::string show(const Field& field) {
  return std::visit(
      [](auto* p) -> std::string {
        std::ostringstream out;
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, std::string>) out << detail::toml_string(*p);
        else if constexpr (std::is_same_v<T, bool>) out << (*p ? "true" : "false");
        else out << *p;
        return out.str();
      },
      field);
}

void set_from_toml(const Option& o, const toml::node& node, const std::string& origin) {
  const std::string where = origin + ": [" + o.table + "] " + o.key;
  std::visit(
      [&](auto* p) {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, std::string>) {
          if (o.integer_as_text && node.is_integer()) {
            *p = std::to_string(*node.value<std::int64_t>());
            return;
          }
          auto v = node.value<std::string>();
          ZERO_CHECK(node.is_string() && v, where, ": expected a string, got ", node.type());
          *p = unshield(*v);
        } else if constexpr (std::is_same_v<T, bool>) {
          ZERO_CHECK(node.is_boolean(), where, ": expected true or false, got ", node.type());
          *p = *node.value<bool>();
        } else if constexpr (std::is_same_v<T, std::int64_t>) {
          ZERO_CHECK(node.is_integer(), where, ": expected an integer, got ", node.type());
          *p = *node.value<std::int64_t>();
        } else {
          ZERO_CHECK(node.is_number(), where, ": expected a number, got ", node.type());
          *p = *node.value<double>();
        }
      },
      o.field);
}

void set_from_text(const Option& o, const std::string& text) {
  const std::string where = o.command_line();
  std::visit(
      [&](auto* p) {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, std::string>) {
          *p = text;
        } else if constexpr (std::is_same_v<T, bool>) {
          // A bare --overwrite (no value) means true.
          if (text.empty() || text == "true" || text == "1" || text == "on") *p = true;
          else if (text == "false" || text == "0" || text == "off") *p = false;
          else ZERO_THROW(zero::InvalidArgument, where, ": expected true or false, got '", text, "'");
        } else {
          std::size_t used = 0;
          T value{};
          try {
            if constexpr (std::is_same_v<T, std::int64_t>) value = std::stoll(text, &used);
            else value = std::stod(text, &used);
          } catch (const std::exception&) {
            used = 0;
          }
          ZERO_CHECK(used == text.size() && !text.empty(), where, ": expected ",
                     std::is_same_v<T, std::int64_t> ? "an integer" : "a number", ", got '", text, "'");
          *p = value;
        }
      },
      o.field);
}

std::vector<std::string> string_list(const toml::node& node, const std::string& where) {
  const toml::array* array = node.as_array();
  ZERO_CHECK(array != nullptr, where, ": expected an array of strings (glob patterns), got ", node.type());
  std::vector<std::string> out;
  for (const toml::node& item : *array) {
    auto text = item.value<std::string>();
    ZERO_CHECK(item.is_string() && text && !text->empty(), where, ": expected non-empty strings, got ", item.type());
    out.push_back(unshield(*text));
  }
  return out;
}

/// [[optimizer.groups]]: each a table of params (patterns), lr_scale and
/// weight_decay (optional), name (optional).
std::vector<TrainConfig::OptimizerGroup> optimizer_groups_of(const toml::node& node, const std::string& origin) {
  const toml::array* array = node.as_array();
  ZERO_CHECK(array != nullptr && array->is_array_of_tables(), origin,
             ": optimizer.groups must be an array of tables ([[optimizer.groups]]), got ", node.type());
  std::vector<TrainConfig::OptimizerGroup> out;
  for (std::size_t i = 0; i < array->size(); ++i) {
    const std::string where = origin + ": [[optimizer.groups]] #" + std::to_string(i + 1);
    TrainConfig::OptimizerGroup group;
    group.name = "group " + std::to_string(i + 1);
    for (const auto& [key_node, value] : *array->get(i)->as_table()) {
      const std::string key(key_node.str());
      if (key == "params") {
        group.params = string_list(value, where + " params");
      } else if (key == "name") {
        auto text = value.value<std::string>();
        ZERO_CHECK(value.is_string() && text && !text->empty(), where, " name: expected a non-empty string");
        group.name = unshield(*text);
      } else if (key == "lr_scale" || key == "weight_decay") {
        ZERO_CHECK(value.is_number(), where, " ", key, ": expected a number, got ", value.type());
        const double x = *value.value<double>();
        ZERO_CHECK(std::isfinite(x) && x >= 0, where, " ", key, ": must be finite and >= 0, got ", x);
        if (key == "lr_scale") group.lr_scale = x;
        else group.weight_decay = x;
      } else {
        ZERO_THROW(zero::InvalidArgument, where, ": unknown key '", key,
                   "' (expected params, lr_scale, weight_decay, name)");
      }
    }
    ZERO_CHECK(!group.params.empty(), where, ": params is missing or empty (glob patterns of parameter names)");
    out.push_back(std::move(group));
  }
  return out;
}

void apply_toml(TrainConfig& config, const toml::table& root, const std::string& origin) {
  auto options = options_of(config);
  for (const auto& [table_key, table_node] : root) {
    const std::string table(table_key.str());
    const toml::table* entries = table_node.as_table();
    ZERO_CHECK(entries != nullptr, origin, ": top-level key '", table,
               "' must be a table ([model], [lora], [data], [train], [optimizer], [zero], [output], [validation], [device])");
    for (const auto& [key_node, value] : *entries) {
      const std::string key(key_node.str());
      if (table == "model" && key == "freeze") {
        config.freeze = string_list(value, origin + ": [model] freeze");
        continue;
      }
      if (table == "lora" && key == "targets") {
        config.lora_targets = string_list(value, origin + ": [lora] targets");
        continue;
      }
      if (table == "optimizer" && key == "no_weight_decay") {
        config.no_weight_decay = string_list(value, origin + ": [optimizer] no_weight_decay");
        continue;
      }
      if (table == "validation" && key == "prompts") {
        config.validation_prompts = string_list(value, origin + ": [validation] prompts");
        continue;
      }
      if (table == "optimizer" && key == "groups") {
        config.optimizer_groups = optimizer_groups_of(value, origin);
        continue;
      }
      const Option* match = nullptr;
      for (const Option& o : options)
        if (table == o.table && key == o.key) match = &o;
      if (!match) {
        std::string hint;
        for (const Option& o : options)
          if (key == o.key) hint = std::string(" (it belongs in [") + o.table + "])";
        if (key == "freeze") hint = " (it belongs in [model])";
        if (key == "targets") hint = " (it belongs in [lora])";
        if (key == "no_weight_decay" || key == "groups") hint = " (it belongs in [optimizer])";
        if (key == "prompts") hint = " (it belongs in [validation])";
        ZERO_THROW(zero::InvalidArgument, origin, ": unknown key '", table, ".", key, "'", hint);
      }
      set_from_toml(*match, value, origin);
    }
  }
}

// Given epochs alone (in the file or on the command line), the run is as
// long as they say: the default of steps does not apply. Both given is an
// error of validate(), naming both.
void length_from_epochs(TrainConfig& config, bool steps_given) {
  if (config.epochs > 0 && !steps_given) config.steps = 0;
}

bool file_sets(const toml::table& root, const char* path) { return root.at_path(path).node() != nullptr; }

}  // namespace

std::string TrainConfig::to_toml() const {
  TrainConfig copy = *this;
  std::ostringstream out;
  std::string table;
  // The pattern lists are not in the option table (they are not scalars):
  // each goes at the end of its table.
  auto close_table = [&] {
    if (table == "model" && !freeze.empty()) out << "freeze = " << pattern_list(freeze) << "\n";
    if (table == "lora") out << "targets = " << pattern_list(lora_targets) << "\n";
    if (table == "optimizer" && !no_weight_decay.empty())
      out << "no_weight_decay = " << pattern_list(no_weight_decay) << "\n";
    if (table == "validation" && !validation_prompts.empty())
      out << "prompts = " << pattern_list(validation_prompts) << "\n";
  };
  for (const Option& o : options_of(copy)) {
    if (table != o.table) {
      close_table();
      table = o.table;
      out << (out.tellp() > 0 ? "\n" : "") << "[" << table << "]\n";
    }
    out << o.key << " = " << show(o.field) << "\n";
  }
  close_table();
  for (const OptimizerGroup& g : optimizer_groups) {
    out << "\n[[optimizer.groups]]\nname = " << detail::toml_string(g.name) << "\nparams = " << pattern_list(g.params)
        << "\nlr_scale = " << g.lr_scale << "\n";
    if (g.weight_decay) out << "weight_decay = " << *g.weight_decay << "\n";
  }
  return out.str();
}

std::string pattern_list(const std::vector<std::string>& patterns) {
  // toml++'s own array layout, its strings escaped (detail::toml_string).
  if (patterns.empty()) return "[]";
  std::string text = "[ ";
  for (std::size_t i = 0; i < patterns.size(); ++i) text += (i ? ", " : "") + detail::toml_string(patterns[i]);
  return text + " ]";
}

std::optional<std::vector<std::string>> saved_freeze(const std::string& config_toml) {
  toml::table root;
  try {
    check_config_bounds(config_toml, "saved configuration");
    root = parse_toml(config_toml, "saved configuration");
  } catch (const toml::parse_error&) {
    return std::nullopt;
  } catch (const zero::InvalidArgument&) {
    return std::nullopt;
  }
  const toml::node* node = root.at_path("model.freeze").node();
  if (node == nullptr) return std::vector<std::string>{};
  try {
    return string_list(*node, "saved [model] freeze");
  } catch (const zero::InvalidArgument&) {
    return std::nullopt;
  }
}

TrainConfig train_config_from_toml(const std::string& text, const std::string& origin) {
  TrainConfig config;
  toml::table root;
  check_config_bounds(text, origin);
  root = parse_toml(text, origin);
  apply_toml(config, root, origin);
  length_from_epochs(config, file_sets(root, "train.steps"));
  config.validate();
  return config;
}

bool parse_train_config(int argc, char** argv, TrainConfig& config) {
  CLI::App app{"Full fine-tuning of the SDXL UNet on zero.\n  mpirun -np N train --config file.toml [--key value ...]"};
  std::string config_path;
  app.add_option("--config", config_path, "TOML configuration file; --key value options override it");
  TrainConfig defaults;
  auto default_options = options_of(defaults);
  std::vector<std::string> overrides(default_options.size());
  std::vector<CLI::Option*> handles;
  for (std::size_t i = 0; i < default_options.size(); ++i) {
    const Option& o = default_options[i];
    const bool is_bool = std::holds_alternative<bool*>(o.field);
    handles.push_back(app.add_option(o.command_line(), overrides[i],
                                     std::string(o.help) + " [" + o.table + "] (default: " + show(o.field) + ")")
                          ->type_name(std::holds_alternative<std::string*>(o.field) ? "TEXT"
                                      : is_bool                                      ? "[BOOL]"
                                      : std::holds_alternative<double*>(o.field)     ? "NUMBER"
                                                                                      : "INT"));
    if (is_bool) handles.back()->expected(0, 1);  // --flag alone is --flag true
  }
  // The lists on the command line: one value per flag, the flag repeated
  // for several; the values given replace the file's list, and --flag ""
  // alone empties it (--freeze "" freezes nothing).
  struct ListFlag {
    const char* flag;
    const char* type_name;
    std::string help;
    std::vector<std::string> TrainConfig::*list;
    std::vector<std::string> values;
    CLI::Option* option = nullptr;
  };
  std::array<ListFlag, 3> list_flags{{
      {"--freeze", "PATTERN",
       "glob pattern of parameters to freeze (diffusers names; repeat for several); replaces [model] freeze; --freeze "
       "\"\" freezes none [model] (default: [])",
       &TrainConfig::freeze},
      {"--lora_target", "PATTERN",
       "glob pattern of Linear layers to adapt (repeat for several); replaces [lora] targets [lora] (default: " +
           pattern_list(defaults.lora_targets) + ")",
       &TrainConfig::lora_targets},
      {"--validation_prompt", "TEXT",
       "a validation prompt (repeat for several); replaces [validation] prompts [validation] (default: []: the "
       "dataset's cached validation prompts)",
       &TrainConfig::validation_prompts},
  }};
  for (ListFlag& f : list_flags) f.option = app.add_option(f.flag, f.values, f.help)->type_name(f.type_name);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::printf("%s", app.help().c_str());
    return false;
  } catch (const CLI::ParseError& e) {
    ZERO_THROW(zero::InvalidArgument, "command line: ", e.what(), " (see --help)");
  }
  config = TrainConfig{};
  bool steps_given = false;
  if (!config_path.empty()) {
    const std::string text = read_config_text(config_path);
    check_config_bounds(text, config_path);
    toml::table root;
    root = parse_toml(text, config_path);
    apply_toml(config, root, config_path);
    steps_given = file_sets(root, "train.steps");
  }
  auto options = options_of(config);
  for (std::size_t i = 0; i < options.size(); ++i)
    if (handles[i]->count() > 0) {
      set_from_text(options[i], overrides[i]);
      config.command_line_keys.push_back(options[i].key);
      if (std::string(options[i].table) == "train" && std::string(options[i].key) == "steps") steps_given = true;
    }
  length_from_epochs(config, steps_given);
  for (const ListFlag& f : list_flags) {
    if (f.option->count() == 0) continue;
    std::vector<std::string>& list = config.*f.list;
    list.clear();
    for (const std::string& value : f.values)
      if (!value.empty()) list.push_back(value);
  }
  config.validate();
  return true;
}

}  // namespace sdxl
