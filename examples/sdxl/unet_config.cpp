#include "unet_config.hpp"

#include <cmath>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "unet_param_count.hpp"
#include "zero/core/error.hpp"
#include "zero/io/json_limits.hpp"

namespace sdxl {

using nlohmann::json;

std::string_view name_of(UnitGranularity units) { return units == UnitGranularity::layers ? "layers" : "blocks"; }

UnitGranularity unit_granularity_from(std::string_view name, std::string_view what) {
  if (name == "layers") return UnitGranularity::layers;
  if (name == "blocks") return UnitGranularity::blocks;
  ZERO_THROW(zero::InvalidArgument, what, " must be \"layers\" (one ZeRO unit per ResNet block, transformer layer and "
             "resampler) or \"blocks\" (one per down, mid and up block), got \"", name, "\"");
}

std::string_view name_of(DownBlockType type) {
  return type == DownBlockType::kDown ? "DownBlock2D" : "CrossAttnDownBlock2D";
}
std::string_view name_of(UpBlockType type) {
  return type == UpBlockType::kUp ? "UpBlock2D" : "CrossAttnUpBlock2D";
}

UNetConfig UNetConfig::sdxl_base() {
  UNetConfig c;
  c.sample_size = {128};
  c.in_channels = 4;
  c.out_channels = 4;
  c.flip_sin_to_cos = true;
  c.freq_shift = 0;
  c.down_block_types = {DownBlockType::kDown, DownBlockType::kCrossAttnDown, DownBlockType::kCrossAttnDown};
  c.has_mid_block = true;
  c.up_block_types = {UpBlockType::kCrossAttnUp, UpBlockType::kCrossAttnUp, UpBlockType::kUp};
  c.block_out_channels = {320, 640, 1280};
  c.layers_per_block = {2, 2, 2};
  c.norm_num_groups = 32;
  c.norm_eps = 1e-5;
  c.cross_attention_dim = {2048, 2048, 2048};
  c.transformer_layers_per_block = {1, 2, 10};
  c.attention_head_dim = {5, 10, 20};
  c.use_linear_projection = true;
  c.upcast_attention = false;
  c.addition_embed_text_time = true;
  c.addition_time_embed_dim = 256;
  c.projection_class_embeddings_input_dim = 2816;
  return c;
}

// ---------------------------------------------------------------- parsing helpers
namespace {

std::string describe(const json& value) { return value.dump(); }

std::int64_t as_int(const json& value, std::string_view key) {
  if (value.is_number_integer()) return value.get<std::int64_t>();
  // JSON writers sometimes emit 2.0 for 2; accept exact integers only.
  if (value.is_number_float()) {
    double d = value.get<double>();
    if (std::floor(d) == d && std::abs(d) < 9e15) return static_cast<std::int64_t>(d);
  }
  ZERO_THROW(zero::InvalidArgument, "UNet config key '", key, "': expected an integer, got ", describe(value));
}

double as_number(const json& value, std::string_view key) {
  ZERO_CHECK(value.is_number(), "UNet config key '", key, "': expected a number, got ", describe(value));
  return value.get<double>();
}

bool as_bool(const json& value, std::string_view key, bool if_null) {
  if (value.is_null()) return if_null;
  ZERO_CHECK(value.is_boolean(), "UNet config key '", key, "': expected true or false, got ", describe(value));
  return value.get<bool>();
}

std::string as_string(const json& value, std::string_view key) {
  ZERO_CHECK(value.is_string(), "UNet config key '", key, "': expected a string, got ", describe(value));
  return value.get<std::string>();
}

std::vector<std::string> as_string_list(const json& value, std::string_view key) {
  ZERO_CHECK(value.is_array(), "UNet config key '", key, "': expected a list of strings, got ", describe(value));
  ZERO_CHECK(value.size() <= static_cast<std::size_t>(UNetLimits::kMaxLevels), "UNet config key '", key, "': has ",
             value.size(), " entries, more than the ", UNetLimits::kMaxLevels, " levels this UNet supports (kMaxLevels)");
  std::vector<std::string> out;
  for (const json& item : value) out.push_back(as_string(item, key));
  return out;
}

// diffusers lets most per-level settings be one int (used at every level) or a list.
std::vector<std::int64_t> as_int_or_list(const json& value, std::string_view key, std::size_t levels) {
  if (value.is_array()) {
    ZERO_CHECK(value.size() == levels, "UNet config key '", key, "': has ", value.size(), " entries but there are ",
               levels, " down blocks");
    std::vector<std::int64_t> out;
    for (const json& item : value) {
      ZERO_CHECK(!item.is_array(), "UNet config key '", key,
                 "': nested lists (asymmetric UNets) are not supported, got ", describe(value));
      out.push_back(as_int(item, key));
    }
    ZERO_CHECK(out.size() == levels, "UNet config key '", key, "': has ", out.size(), " entries but there are ",
               levels, " down blocks");
    return out;
  }
  return std::vector<std::int64_t>(levels, as_int(value, key));
}

[[noreturn]] void unsupported(std::string_view key, const json& value, std::string_view supported) {
  ZERO_THROW(zero::InvalidArgument, "UNet config key '", key, "' = ", describe(value),
             " is not supported by this UNet (supported: ", supported, ")");
}

void require_null(std::string_view key, const json& value) {
  if (!value.is_null()) unsupported(key, value, "null");
}

void require_false(std::string_view key, const json& value) {
  if (value.is_null() || (value.is_boolean() && !value.get<bool>())) return;
  if (value.is_array()) {
    bool all_false = true;
    for (const json& item : value) all_false = all_false && item.is_boolean() && !item.get<bool>();
    if (all_false) return;
  }
  unsupported(key, value, "false");
}

void require_number(std::string_view key, const json& value, double expected) {
  if (value.is_number() && value.get<double>() == expected) return;
  unsupported(key, value, json(expected).dump());
}

void require_string(std::string_view key, const json& value, std::initializer_list<std::string_view> allowed) {
  if (value.is_string()) {
    for (std::string_view s : allowed)
      if (value.get<std::string>() == s) return;
  }
  std::string list;
  for (std::string_view s : allowed) list += (list.empty() ? "\"" : ", \"") + std::string(s) + "\"";
  unsupported(key, value, list);
}

// ---------------------------------------------------------------- from_json in steps

// diffusers' config keys and their values: the document's, else the default.
using Settings = std::map<std::string, json>;

json parse_config_document(std::string_view json_text) {
  // Bounded before the document is built: its tree costs far more memory than its text.
  try {
    zero::io::check_json_limits(json_text,
                                {.max_bytes = UNetLimits::kMaxConfigBytes,
                                 .max_values = UNetLimits::kMaxConfigJsonValues,
                                 .max_depth = UNetLimits::kMaxConfigJsonDepth},
                                "UNet config");
  } catch (const zero::IoError& e) {
    ZERO_THROW(zero::InvalidArgument, e.message());  // a config is the caller's input, as every key's check
  }
  json doc;
  try {
    doc = json::parse(json_text.begin(), json_text.end());
  } catch (const json::exception& e) {
    ZERO_THROW(zero::InvalidArgument, "UNet config is not valid JSON: ", e.what());
  }
  ZERO_CHECK(doc.is_object(), "UNet config must be a JSON object, got ", doc.type_name());

  if (auto it = doc.find("_class_name"); it != doc.end()) {
    ZERO_CHECK(it->is_string() && it->get<std::string>() == "UNet2DConditionModel",
               "UNet config key '_class_name' = ", describe(*it), ": only UNet2DConditionModel is supported");
  }
  return doc;
}

// Every key the model knows, with diffusers' default where the key is absent.
// Keys whose only supported value is the default are checked, then dropped.
Settings diffusers_defaults() {
  return {
      {"sample_size", nullptr},
      {"in_channels", 4},
      {"out_channels", 4},
      {"center_input_sample", false},
      {"flip_sin_to_cos", true},
      {"freq_shift", 0},
      {"down_block_types", {"CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"}},
      {"mid_block_type", "UNetMidBlock2DCrossAttn"},
      {"up_block_types", {"UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"}},
      {"only_cross_attention", false},
      {"block_out_channels", {320, 640, 1280, 1280}},
      {"layers_per_block", 2},
      {"downsample_padding", 1},
      {"mid_block_scale_factor", 1},
      {"dropout", 0.0},
      {"act_fn", "silu"},
      {"norm_num_groups", 32},
      {"norm_eps", 1e-5},
      {"cross_attention_dim", 1280},
      {"transformer_layers_per_block", 1},
      {"reverse_transformer_layers_per_block", nullptr},
      {"encoder_hid_dim", nullptr},
      {"encoder_hid_dim_type", nullptr},
      {"attention_head_dim", 8},
      {"num_attention_heads", nullptr},
      {"dual_cross_attention", false},
      {"use_linear_projection", false},
      {"class_embed_type", nullptr},
      {"addition_embed_type", nullptr},
      {"addition_time_embed_dim", nullptr},
      {"num_class_embeds", nullptr},
      {"upcast_attention", false},
      {"resnet_time_scale_shift", "default"},
      {"resnet_skip_time_act", false},
      {"resnet_out_scale_factor", 1.0},
      {"time_embedding_type", "positional"},
      {"time_embedding_dim", nullptr},
      {"time_embedding_act_fn", nullptr},
      {"timestep_post_act", nullptr},
      {"time_cond_proj_dim", nullptr},
      {"conv_in_kernel", 3},
      {"conv_out_kernel", 3},
      {"projection_class_embeddings_input_dim", nullptr},
      {"attention_type", "default"},
      {"class_embeddings_concat", false},
      {"mid_block_only_cross_attention", nullptr},
      {"cross_attention_norm", nullptr},
      {"addition_embed_type_num_heads", 64},
  };
}

// The defaults, overridden by the document's keys; a key the model does not know is an error.
Settings settings_of(const json& doc) {
  const Settings defaults = diffusers_defaults();
  Settings v = defaults;
  for (auto it = doc.begin(); it != doc.end(); ++it) {
    if (!it.key().empty() && it.key()[0] == '_') continue;  // _class_name, _diffusers_version, _name_or_path
    ZERO_CHECK(defaults.count(it.key()) != 0, "UNet config key '", it.key(),
               "' is unknown to this UNet2DConditionModel implementation");
    v[it.key()] = it.value();
  }
  return v;
}

// Settings this model only implements at their default.
void require_defaults(Settings& v) {
  require_false("only_cross_attention", v["only_cross_attention"]);
  require_number("downsample_padding", v["downsample_padding"], 1);
  require_number("dropout", v["dropout"], 0.0);  // dropout would need RNG replay under recompute
  require_string("act_fn", v["act_fn"], {"silu", "swish"});
  require_null("reverse_transformer_layers_per_block", v["reverse_transformer_layers_per_block"]);
  require_null("encoder_hid_dim", v["encoder_hid_dim"]);
  require_null("encoder_hid_dim_type", v["encoder_hid_dim_type"]);
  require_false("dual_cross_attention", v["dual_cross_attention"]);
  require_null("class_embed_type", v["class_embed_type"]);
  require_null("num_class_embeds", v["num_class_embeds"]);
  require_string("resnet_time_scale_shift", v["resnet_time_scale_shift"], {"default"});
  require_false("resnet_skip_time_act", v["resnet_skip_time_act"]);
  // resnet_out_scale_factor only reaches ResnetDownsampleBlock2D-style blocks in
  // diffusers; the blocks implemented here ignore it there too. Still, it must be a number.
  as_number(v["resnet_out_scale_factor"], "resnet_out_scale_factor");
  require_string("time_embedding_type", v["time_embedding_type"], {"positional"});
  require_null("time_embedding_act_fn", v["time_embedding_act_fn"]);
  require_null("timestep_post_act", v["timestep_post_act"]);
  require_null("time_cond_proj_dim", v["time_cond_proj_dim"]);
  require_string("attention_type", v["attention_type"], {"default"});
  require_false("class_embeddings_concat", v["class_embeddings_concat"]);
  require_false("mid_block_only_cross_attention", v["mid_block_only_cross_attention"]);
  require_null("cross_attention_norm", v["cross_attention_norm"]);
  as_int(v["addition_embed_type_num_heads"], "addition_embed_type_num_heads");  // used by "text" only
}

// The sample size, the channels in and out, and the timestep embedding's flip and shift.
void read_input_settings(Settings& v, UNetConfig& c) {
  if (const json& s = v["sample_size"]; !s.is_null()) {
    if (s.is_array()) {
      ZERO_CHECK(s.size() == 2, "UNet config key 'sample_size': expected an int or [height, width], got a list of ",
                 s.size());
      for (const json& d : s) c.sample_size.push_back(as_int(d, "sample_size"));
      ZERO_CHECK(c.sample_size.size() == 2, "UNet config key 'sample_size': expected an int or [height, width]");
    } else {
      c.sample_size = {as_int(s, "sample_size")};
    }
  }
  c.in_channels = as_int(v["in_channels"], "in_channels");
  c.out_channels = as_int(v["out_channels"], "out_channels");
  c.center_input_sample = as_bool(v["center_input_sample"], "center_input_sample", false);
  c.flip_sin_to_cos = as_bool(v["flip_sin_to_cos"], "flip_sin_to_cos", true);
  c.freq_shift = as_number(v["freq_shift"], "freq_shift");
}

void read_block_types(Settings& v, UNetConfig& c) {
  for (std::string name : as_string_list(v["down_block_types"], "down_block_types")) {
    // diffusers strips this prefix before dispatching on the block name.
    if (name.rfind("UNetRes", 0) == 0) name = name.substr(7);
    if (name == "DownBlock2D") {
      c.down_block_types.push_back(DownBlockType::kDown);
    } else if (name == "CrossAttnDownBlock2D") {
      c.down_block_types.push_back(DownBlockType::kCrossAttnDown);
    } else {
      unsupported("down_block_types", name, "\"DownBlock2D\", \"CrossAttnDownBlock2D\"");
    }
  }
  for (std::string name : as_string_list(v["up_block_types"], "up_block_types")) {
    if (name.rfind("UNetRes", 0) == 0) name = name.substr(7);
    if (name == "UpBlock2D") {
      c.up_block_types.push_back(UpBlockType::kUp);
    } else if (name == "CrossAttnUpBlock2D") {
      c.up_block_types.push_back(UpBlockType::kCrossAttnUp);
    } else {
      unsupported("up_block_types", name, "\"UpBlock2D\", \"CrossAttnUpBlock2D\"");
    }
  }
  if (const json& m = v["mid_block_type"]; m.is_null()) {
    c.has_mid_block = false;
  } else {
    require_string("mid_block_type", m, {"UNetMidBlock2DCrossAttn"});
    c.has_mid_block = true;
  }
}

// The per-level lists, one entry per down block.
void read_level_settings(Settings& v, UNetConfig& c) {
  const std::size_t levels = c.down_block_types.size();
  ZERO_CHECK(levels > 0, "UNet config key 'down_block_types': must not be empty");
  ZERO_CHECK(v["block_out_channels"].is_array(), "UNet config key 'block_out_channels': expected a list");
  c.block_out_channels = as_int_or_list(v["block_out_channels"], "block_out_channels", levels);
  c.layers_per_block = as_int_or_list(v["layers_per_block"], "layers_per_block", levels);
  c.mid_block_scale_factor = as_number(v["mid_block_scale_factor"], "mid_block_scale_factor");
  ZERO_CHECK(!v["norm_num_groups"].is_null(), "UNet config key 'norm_num_groups' = null is not supported "
             "(supported: an integer)");
  c.norm_num_groups = as_int(v["norm_num_groups"], "norm_num_groups");
  c.norm_eps = as_number(v["norm_eps"], "norm_eps");
  c.cross_attention_dim = as_int_or_list(v["cross_attention_dim"], "cross_attention_dim", levels);
  c.transformer_layers_per_block =
      as_int_or_list(v["transformer_layers_per_block"], "transformer_layers_per_block", levels);
  c.attention_head_dim = as_int_or_list(v["attention_head_dim"], "attention_head_dim", levels);
  if (!v["num_attention_heads"].is_null())
    c.num_attention_heads = as_int_or_list(v["num_attention_heads"], "num_attention_heads", levels);
  c.use_linear_projection = as_bool(v["use_linear_projection"], "use_linear_projection", false);
  // SDXL's published config has "upcast_attention": null, which diffusers treats as false.
  c.upcast_attention = as_bool(v["upcast_attention"], "upcast_attention", false);
}

void read_embedding_settings(Settings& v, UNetConfig& c) {
  if (const json& a = v["addition_embed_type"]; !a.is_null()) {
    require_string("addition_embed_type", a, {"text_time"});
    c.addition_embed_text_time = true;
    ZERO_CHECK(!v["addition_time_embed_dim"].is_null(),
               "UNet config key 'addition_time_embed_dim' must be set when addition_embed_type is \"text_time\"");
    ZERO_CHECK(!v["projection_class_embeddings_input_dim"].is_null(),
               "UNet config key 'projection_class_embeddings_input_dim' must be set when addition_embed_type is "
               "\"text_time\"");
  }
  if (!v["addition_time_embed_dim"].is_null())
    c.addition_time_embed_dim = as_int(v["addition_time_embed_dim"], "addition_time_embed_dim");
  if (!v["projection_class_embeddings_input_dim"].is_null())
    c.projection_class_embeddings_input_dim =
        as_int(v["projection_class_embeddings_input_dim"], "projection_class_embeddings_input_dim");
  if (!v["time_embedding_dim"].is_null()) c.time_embedding_dim = as_int(v["time_embedding_dim"], "time_embedding_dim");
  c.conv_in_kernel = as_int(v["conv_in_kernel"], "conv_in_kernel");
  c.conv_out_kernel = as_int(v["conv_out_kernel"], "conv_out_kernel");
}

}  // namespace

UNetConfig UNetConfig::from_json(std::string_view json_text) {
  Settings v = settings_of(parse_config_document(json_text));
  require_defaults(v);
  UNetConfig c;
  read_input_settings(v, c);
  read_block_types(v, c);
  read_level_settings(v, c);
  read_embedding_settings(v, c);
  c.validate();
  c.check_parameter_count();
  return c;
}

UNetConfig UNetConfig::from_json(std::string_view json_text, const std::string& source) {
  try {
    return from_json(json_text);
  } catch (const zero::InvalidArgument& e) {
    ZERO_THROW(zero::InvalidArgument, source, ": ", e.message());
  }
}

void UNetConfig::validate() const {
  const std::size_t n = down_block_types.size();
  ZERO_CHECK(n > 0, "UNet config: 'down_block_types' must not be empty");
  ZERO_CHECK(up_block_types.size() == n, "UNet config: 'up_block_types' has ", up_block_types.size(),
             " entries but 'down_block_types' has ", n);
  auto check_len = [&](const std::vector<std::int64_t>& list, std::string_view key) {
    ZERO_CHECK(list.size() == n, "UNet config: '", key, "' has ", list.size(), " entries but there are ", n,
               " down blocks");
    for (std::int64_t x : list) ZERO_CHECK(x > 0, "UNet config: '", key, "' entries must be positive, got ", x);
  };
  ZERO_CHECK(n <= static_cast<std::size_t>(UNetLimits::kMaxLevels), "UNet config: 'down_block_types' has ", n,
             " entries, more than the ", UNetLimits::kMaxLevels, " levels this UNet supports (kMaxLevels)");
  check_len(block_out_channels, "block_out_channels");
  check_len(layers_per_block, "layers_per_block");
  check_len(cross_attention_dim, "cross_attention_dim");
  check_len(transformer_layers_per_block, "transformer_layers_per_block");
  check_len(attention_head_dim, "attention_head_dim");
  if (!num_attention_heads.empty()) check_len(num_attention_heads, "num_attention_heads");
  ZERO_CHECK(in_channels > 0 && out_channels > 0, "UNet config: 'in_channels' and 'out_channels' must be positive");
  ZERO_CHECK(norm_num_groups > 0, "UNet config: 'norm_num_groups' must be positive, got ", norm_num_groups);
  ZERO_CHECK(norm_eps > 0, "UNet config: 'norm_eps' must be positive, got ", norm_eps);
  ZERO_CHECK(conv_in_kernel > 0 && conv_in_kernel % 2 == 1, "UNet config: 'conv_in_kernel' must be odd, got ",
             conv_in_kernel);
  ZERO_CHECK(conv_out_kernel > 0 && conv_out_kernel % 2 == 1, "UNet config: 'conv_out_kernel' must be odd, got ",
             conv_out_kernel);
  ZERO_CHECK(time_embedding_dim >= 0, "UNet config: 'time_embedding_dim' must be positive");
  if (addition_embed_text_time) {
    ZERO_CHECK(addition_time_embed_dim > 0, "UNet config: 'addition_time_embed_dim' must be positive for text_time");
    ZERO_CHECK(projection_class_embeddings_input_dim > 0,
               "UNet config: 'projection_class_embeddings_input_dim' must be positive for text_time");
  }
  ZERO_CHECK(sample_size.size() <= 2, "UNet config: 'sample_size' must be an int or [height, width]");
  check_limits();
  // Channel counts that GroupNorm and the head split must divide; checked here
  // so the message names the config key instead of a torch shape error.
  for (std::size_t i = 0; i < n; ++i) {
    const std::int64_t ch = block_out_channels[i];
    ZERO_CHECK(ch % norm_num_groups == 0, "UNet config: block_out_channels[", i, "] = ", ch,
               " is not divisible by norm_num_groups = ", norm_num_groups);
    const std::int64_t heads = heads_of_level(i);
    const bool uses_attention = down_block_types[i] == DownBlockType::kCrossAttnDown ||
                                up_block_types[n - 1 - i] == UpBlockType::kCrossAttnUp ||
                                (has_mid_block && i == n - 1);
    if (uses_attention) {
      ZERO_CHECK(heads > 0 && ch % heads == 0, "UNet config: block_out_channels[", i, "] = ", ch,
                 " is not divisible by the head count ", heads, " (",
                 num_attention_heads.empty() ? "attention_head_dim" : "num_attention_heads", "[", i, "])");
    }
  }
}

void UNetConfig::check_limits() const {
  auto at_most = [](std::int64_t value, std::int64_t limit, std::string_view key, std::string_view limit_name) {
    ZERO_CHECK(value <= limit, "UNet config: '", key, "' = ", value, " exceeds the limit of ", limit, " (",
               limit_name, " in unet_config.hpp)");
  };
  auto list_at_most = [&](const std::vector<std::int64_t>& list, std::int64_t limit, std::string_view key,
                          std::string_view limit_name) {
    for (std::int64_t x : list) at_most(x, limit, key, limit_name);
  };
  using L = UNetLimits;
  list_at_most(sample_size, L::kMaxSampleSize, "sample_size", "kMaxSampleSize");
  at_most(in_channels, L::kMaxChannels, "in_channels", "kMaxChannels");
  at_most(out_channels, L::kMaxChannels, "out_channels", "kMaxChannels");
  list_at_most(block_out_channels, L::kMaxChannels, "block_out_channels", "kMaxChannels");
  list_at_most(cross_attention_dim, L::kMaxChannels, "cross_attention_dim", "kMaxChannels");
  list_at_most(layers_per_block, L::kMaxLayersPerBlock, "layers_per_block", "kMaxLayersPerBlock");
  list_at_most(transformer_layers_per_block, L::kMaxTransformerLayers, "transformer_layers_per_block",
               "kMaxTransformerLayers");
  list_at_most(attention_head_dim, L::kMaxHeads, "attention_head_dim", "kMaxHeads");
  list_at_most(num_attention_heads, L::kMaxHeads, "num_attention_heads", "kMaxHeads");
  at_most(norm_num_groups, L::kMaxChannels, "norm_num_groups", "kMaxChannels");
  at_most(time_embedding_dim, L::kMaxChannels, "time_embedding_dim", "kMaxChannels");
  at_most(addition_time_embed_dim, L::kMaxChannels, "addition_time_embed_dim", "kMaxChannels");
  at_most(projection_class_embeddings_input_dim, L::kMaxChannels, "projection_class_embeddings_input_dim",
          "kMaxChannels");
  at_most(conv_in_kernel, L::kMaxKernel, "conv_in_kernel", "kMaxKernel");
  at_most(conv_out_kernel, L::kMaxKernel, "conv_out_kernel", "kMaxKernel");
  for (std::int64_t s : sample_size) ZERO_CHECK(s > 0, "UNet config: 'sample_size' must be positive, got ", s);
}

void UNetConfig::check_parameter_count() const {
  using L = UNetLimits;
  // Every size within its limit keeps the count below 2^63; the total is what costs memory.
  const std::int64_t parameters = count_parameters(*this);
  ZERO_CHECK(parameters <= L::kMaxParameters, "UNet config: ", parameters, " parameters (",
             static_cast<double>(parameters) * 4 / (1 << 30), " GiB in fp32) exceed the limit of ", L::kMaxParameters,
             " (kMaxParameters in unet_config.hpp); lower block_out_channels, layers_per_block or "
             "transformer_layers_per_block");
}

std::int64_t UNetConfig::heads_of_level(std::size_t level) const {
  return num_attention_heads.empty() ? attention_head_dim.at(level) : num_attention_heads.at(level);
}

LevelSpec UNetConfig::down_level(std::size_t i) const {
  return LevelSpec{block_out_channels.at(i), layers_per_block.at(i), heads_of_level(i),
                   transformer_layers_per_block.at(i), cross_attention_dim.at(i)};
}

LevelSpec UNetConfig::up_level(std::size_t i) const {
  const std::size_t level = num_levels() - 1 - i;
  return LevelSpec{block_out_channels.at(level), layers_per_block.at(level) + 1, heads_of_level(level),
                   transformer_layers_per_block.at(level), cross_attention_dim.at(level)};
}

LevelSpec UNetConfig::mid_level() const {
  const std::size_t last = num_levels() - 1;
  return LevelSpec{block_out_channels.at(last), 1, heads_of_level(last), transformer_layers_per_block.at(last),
                   cross_attention_dim.at(last)};
}

std::string UNetConfig::to_json() const {
  json j;
  j["_class_name"] = "UNet2DConditionModel";
  j["act_fn"] = "silu";
  j["addition_embed_type"] = addition_embed_text_time ? json("text_time") : json(nullptr);
  j["addition_embed_type_num_heads"] = 64;
  j["addition_time_embed_dim"] = addition_time_embed_dim > 0 ? json(addition_time_embed_dim) : json(nullptr);
  j["attention_head_dim"] = attention_head_dim;
  j["block_out_channels"] = block_out_channels;
  j["center_input_sample"] = center_input_sample;
  j["class_embed_type"] = nullptr;
  j["class_embeddings_concat"] = false;
  j["conv_in_kernel"] = conv_in_kernel;
  j["conv_out_kernel"] = conv_out_kernel;
  j["cross_attention_dim"] = cross_attention_dim;
  j["cross_attention_norm"] = nullptr;
  json down = json::array();
  for (DownBlockType t : down_block_types) down.push_back(std::string(name_of(t)));
  j["down_block_types"] = down;
  j["downsample_padding"] = 1;
  j["dropout"] = 0.0;
  j["dual_cross_attention"] = false;
  j["encoder_hid_dim"] = nullptr;
  j["encoder_hid_dim_type"] = nullptr;
  j["flip_sin_to_cos"] = flip_sin_to_cos;
  if (std::floor(freq_shift) == freq_shift) {
    j["freq_shift"] = static_cast<std::int64_t>(freq_shift);
  } else {
    j["freq_shift"] = freq_shift;
  }
  j["in_channels"] = in_channels;
  j["layers_per_block"] = layers_per_block;
  j["mid_block_only_cross_attention"] = nullptr;
  j["mid_block_scale_factor"] = mid_block_scale_factor;
  j["mid_block_type"] = has_mid_block ? json("UNetMidBlock2DCrossAttn") : json(nullptr);
  j["norm_eps"] = norm_eps;
  j["norm_num_groups"] = norm_num_groups;
  j["num_attention_heads"] = num_attention_heads.empty() ? json(nullptr) : json(num_attention_heads);
  j["num_class_embeds"] = nullptr;
  j["only_cross_attention"] = false;
  j["out_channels"] = out_channels;
  j["projection_class_embeddings_input_dim"] =
      projection_class_embeddings_input_dim > 0 ? json(projection_class_embeddings_input_dim) : json(nullptr);
  j["resnet_out_scale_factor"] = 1.0;
  j["resnet_skip_time_act"] = false;
  j["resnet_time_scale_shift"] = "default";
  if (sample_size.empty()) {
    j["sample_size"] = nullptr;
  } else if (sample_size.size() == 1) {
    j["sample_size"] = sample_size[0];
  } else {
    j["sample_size"] = sample_size;
  }
  j["time_cond_proj_dim"] = nullptr;
  j["time_embedding_act_fn"] = nullptr;
  j["time_embedding_dim"] = time_embedding_dim > 0 ? json(time_embedding_dim) : json(nullptr);
  j["time_embedding_type"] = "positional";
  j["timestep_post_act"] = nullptr;
  j["transformer_layers_per_block"] = transformer_layers_per_block;
  json up = json::array();
  for (UpBlockType t : up_block_types) up.push_back(std::string(name_of(t)));
  j["up_block_types"] = up;
  j["upcast_attention"] = upcast_attention;
  j["use_linear_projection"] = use_linear_projection;
  return j.dump(2);
}

}  // namespace sdxl
