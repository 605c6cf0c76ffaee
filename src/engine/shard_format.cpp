// The checkpoint shard file's format (shard_format.hpp): its metadata
// written and read back, saved layouts rebuilt and matched to this run's, and
// read_saved_shard for tools (zero/engine/engine_state.hpp).
#include "shard_format.hpp"

#include <algorithm>
#include <limits>
#include <map>
#include <optional>

#include "../io/json_reader.hpp"
#include "zero/core/error.hpp"
#include "zero/engine/engine_state.hpp"

namespace zero {
namespace detail {

namespace {

nlohmann::json param_json(const ParamSpec& p) {
  nlohmann::json entry = {{"name", p.name}, {"numel", p.numel}};
  // The shape, where the model gave one, lets a consolidated file carry real
  // tensor shapes. Files from before it have name and numel only.
  if (!p.shape.empty()) entry["shape"] = p.shape;
  // The parameter group, where not 0 (files from before groups have none).
  if (p.group != 0) entry["group"] = p.group;
  return entry;
}

}  // namespace

nlohmann::json layout_json(const FlatLayout& layout) {
  nlohmann::json params = nlohmann::json::array(), groups = nlohmann::json::array();
  for (const ParamSpec& p : layout.params()) params.push_back(param_json(p));
  for (const Bucket& b : layout.buckets()) groups.push_back(b.param_count);
  return {{"world_size", layout.world_size()}, {"alignment", layout.alignment()},
          {"padded_numel", layout.padded_numel()}, {"params", params}, {"bucket_param_counts", groups}};
}

nlohmann::json shard_metadata(const io::SafeTensorsFile& file, const std::string& path) {
  auto it = file.metadata().find("zero.engine");
  if (it == file.metadata().end())
    ZERO_THROW(IoError, "checkpoint shard '", path, "': no 'zero.engine' metadata (not written by Engine::save_state)");
  try {
    return nlohmann::json::parse(it->second);
  } catch (const std::exception& e) {
    ZERO_THROW(IoError, "checkpoint shard '", path, "': 'zero.engine' metadata is not JSON: ", e.what());
  }
}

namespace {

// An integer in [lo, hi] under `key`, or the reader's error naming it.
std::int64_t integer(const io::detail::JsonReader& in, const char* key, std::int64_t lo, std::int64_t hi) {
  const nlohmann::json* v = in.find(key);
  if (!v || !v->is_number_integer()) in.fail(key, "an integer");
  if (const auto x = io::detail::integer_in(*v, lo, hi)) return *x;
  in.fail(key, "an integer in range");
}

// A layout recorded by save_state, rebuilt and checked against its padded size.
FlatLayout saved_layout(const io::detail::JsonReader& layout, const std::string& path, int world_size,
                        bool allow_empty_buckets) {
  using io::detail::JsonReader;
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  const auto alignment = static_cast<std::size_t>(integer(layout, "alignment", 1, 1 << 30));
  const auto padded = static_cast<std::size_t>(integer(layout, "padded_numel", 0, kMax));
  const nlohmann::json& params_json = layout.array("params");
  const nlohmann::json& counts_json = layout.array("bucket_param_counts");
  std::vector<ParamSpec> params;
  for (const nlohmann::json& p : params_json) {
    const JsonReader param = layout.nested(p, "params[]");
    ParamSpec spec{param.string("name"), static_cast<std::size_t>(integer(param, "numel", 0, std::int64_t{1} << 50)),
                   {}};
    if (const nlohmann::json* shape = param.find("shape")) {
      if (!shape->is_array()) param.fail("shape", "an array of integers >= 0");
      for (const nlohmann::json& d : *shape) {
        if (!d.is_number_integer() || d.get<std::int64_t>() < 0) param.fail("shape", "an array of integers >= 0");
        spec.shape.push_back(d.get<std::int64_t>());
      }
    }
    if (param.find("group")) spec.group = static_cast<int>(integer(param, "group", 0, 1 << 20));
    params.push_back(std::move(spec));
  }
  const std::size_t least = allow_empty_buckets ? 0 : 1;
  std::vector<std::vector<ParamSpec>> groups;
  std::size_t next = 0;
  for (const nlohmann::json& c : counts_json) {
    if (!c.is_number_unsigned() || c.get<std::size_t>() < least || c.get<std::size_t>() > params.size() - next)
      layout.fail("bucket_param_counts", allow_empty_buckets ? "counts >= 0 that add up to the number of parameters"
                                                             : "counts >= 1 that add up to the number of parameters");
    const std::size_t n = c.get<std::size_t>();
    groups.emplace_back(params.begin() + static_cast<std::ptrdiff_t>(next),
                        params.begin() + static_cast<std::ptrdiff_t>(next + n));
    next += n;
  }
  if (next != params.size()) layout.fail("bucket_param_counts", "counts that add up to the number of parameters");
  FlatLayout out;
  try {
    out = FlatLayout::build_grouped(groups, {.world_size = world_size, .alignment = alignment}, allow_empty_buckets);
  } catch (const InvalidArgument& e) {
    ZERO_THROW(IoError, "checkpoint shard '", path, "': its layout does not rebuild: ", e.message());
  }
  if (out.padded_numel() != padded)
    ZERO_THROW(IoError, "checkpoint shard '", path, "': its layout rebuilds to ", out.padded_numel(),
               " padded elements, the file says ", padded);
  return out;
}

SavedLayouts saved_layouts(const io::detail::JsonReader& root, const std::string& path) {
  const io::detail::JsonReader layout = root.object("layout");
  const int world_size = static_cast<int>(integer(layout, "world_size", 1, 1 << 20));
  SavedLayouts out;
  // Units all of one kind leave an empty bucket in the other kind's layout.
  out.has_frozen = root.find("frozen_layout") != nullptr;
  out.trainable = saved_layout(layout, path, world_size, out.has_frozen);
  if (out.has_frozen) {
    const io::detail::JsonReader frozen = root.object("frozen_layout");
    if (integer(frozen, "world_size", 1, 1 << 20) != world_size) frozen.fail("world_size", "layout.world_size");
    out.frozen = saved_layout(frozen, path, world_size, true);
    if (out.frozen.buckets().size() != out.trainable.buckets().size())
      frozen.fail("bucket_param_counts", "one count per unit, as many as layout.bucket_param_counts");
  }
  return out;
}

// The same parameter: name, numel and group; the shape only where both sides
// recorded one (files written before shapes were recorded still load). Another
// group would mean other hyperparameters.
bool same_param(const ParamSpec& a, const ParamSpec& b) {
  return a.name == b.name && a.numel == b.numel && a.group == b.group &&
         (a.shape.empty() || b.shape.empty() || a.shape == b.shape);
}

// For each parameter of `ours`, its index in `theirs` (one kind of a
// checkpoint's parameters, trainable or frozen; `their_other` and
// `our_other` the other kind). The same list in the same order maps by
// position (names need not be unique then); any other order or units map by
// name. Throws IoError naming the file and the first parameter that differs.
std::vector<std::size_t> match_params(const FlatLayout& theirs, const FlatLayout& ours, const FlatLayout& their_other,
                                      const FlatLayout& our_other, bool frozen, const std::string& path) {
  const std::vector<ParamSpec>& t = theirs.params();
  const std::vector<ParamSpec>& o = ours.params();
  std::vector<std::size_t> index(o.size());
  for (std::size_t i = 0; i < o.size(); ++i) index[i] = i;
  if (t.size() == o.size() && std::equal(t.begin(), t.end(), o.begin(), same_param)) return index;

  auto refuse = [&](const std::string& detail) {
    ZERO_THROW(IoError, "checkpoint shard '", path, "' belongs to another model: ", detail,
               frozen ? " (among the frozen parameters)" : "");
  };
  auto by_name = [](const std::vector<ParamSpec>& params) {
    std::map<std::string, std::size_t> names;
    for (std::size_t i = 0; i < params.size(); ++i)
      if (!names.emplace(params[i].name, i).second) return std::optional<std::map<std::string, std::size_t>>();
    return std::optional(std::move(names));
  };
  const auto their_names = by_name(t), our_names = by_name(o);
  if (!their_names || !our_names) {
    // Names that repeat cannot be matched by name: position decides, as it did before.
    if (t.size() != o.size())
      refuse(std::to_string(t.size()) + " parameters in the checkpoint, " + std::to_string(o.size()) + " here");
    for (std::size_t i = 0; i < o.size(); ++i)
      if (!same_param(t[i], o[i]))
        refuse("parameter " + std::to_string(i) + " is " + param_json(t[i]).dump() + " in the checkpoint, " +
               param_json(o[i]).dump() + " here (names repeat, so parameters are matched by position)");
  }
  auto holds = [](const FlatLayout& layout, const std::string& name) {
    return std::any_of(layout.params().begin(), layout.params().end(),
                       [&](const ParamSpec& p) { return p.name == name; });
  };
  const char* here_kind = frozen ? "frozen" : "trained";
  const char* other_kind = frozen ? "trained" : "frozen";
  const std::string refreeze = " (a resumed run must freeze the same parameters as the run that saved)";
  // The first of the checkpoint's parameters that this run lacks, to name beside ours.
  std::string theirs_only;
  for (const ParamSpec& p : t)
    if (!our_names->contains(p.name) && !holds(our_other, p.name)) {
      theirs_only = p.name;
      break;
    }
  for (std::size_t i = 0; i < o.size(); ++i) {
    const auto it = their_names->find(o[i].name);
    if (it == their_names->end()) {
      if (holds(their_other, o[i].name))
        refuse("parameter '" + o[i].name + "' is " + other_kind + " in the checkpoint, " + here_kind + " here" +
               refreeze);
      refuse("parameter " + std::to_string(i) + " ('" + o[i].name + "') is not in the checkpoint" +
             (theirs_only.empty() ? std::string() : "; the checkpoint's '" + theirs_only + "' is not here"));
    }
    if (!same_param(t[it->second], o[i]))
      refuse("parameter " + std::to_string(i) + " is " + param_json(t[it->second]).dump() + " in the checkpoint, " +
             param_json(o[i]).dump() + " here");
    index[i] = it->second;
  }
  if (t.size() != o.size()) {  // every one of ours is there: the checkpoint has more
    for (const ParamSpec& p : t)
      if (!our_names->contains(p.name)) {
        if (holds(our_other, p.name))
          refuse("parameter '" + p.name + "' is " + here_kind + " in the checkpoint, " + other_kind + " here" +
                 refreeze);
        break;
      }
    refuse(std::to_string(t.size()) + " parameters in the checkpoint, " + std::to_string(o.size()) +
           " here; the checkpoint's '" + theirs_only + "' is not here");
  }
  return index;
}

// Whether `old` (with `old_index` from match_params) places every element
// where `now` does: then each rank's own file holds exactly its shard.
bool same_placement(const FlatLayout& old, const FlatLayout& now, const std::vector<std::size_t>& old_index) {
  if (old.world_size() != now.world_size() || old.buckets().size() != now.buckets().size() ||
      old.slots().size() != now.slots().size())
    return false;
  for (std::size_t p = 0; p < now.slots().size(); ++p) {
    const ParamSlot &a = old.slots()[p], &b = now.slots()[p];
    if (old_index[p] != p || a.bucket != b.bucket || a.offset != b.offset || a.numel != b.numel) return false;
  }
  for (std::size_t b = 0; b < now.buckets().size(); ++b) {
    const Bucket &x = old.buckets()[b], &y = now.buckets()[b];
    if (x.offset != y.offset || x.padded != y.padded || x.shard_size != y.shard_size ||
        x.shard_offset != y.shard_offset || x.first_param != y.first_param || x.param_count != y.param_count)
      return false;
  }
  return true;
}

}  // namespace

SavedPlacement match_saved(const nlohmann::json& state, const FlatLayout& here, const FlatLayout& here_frozen,
                           const std::string& path) {
  auto expect = [&](const char* key, const nlohmann::json& want) {
    if (!state.contains(key) || state[key] != want)
      ZERO_THROW(IoError, "checkpoint shard '", path, "': ", key, " is ",
                 state.contains(key) ? state[key].dump() : std::string("missing"), ", this run has ", want.dump());
  };
  expect("format", kShardFormat);
  expect("version", kShardVersion);
  if (!state.contains("layout") || !state["layout"].is_object())
    ZERO_THROW(IoError, "checkpoint shard '", path, "': no layout in its metadata");
  const bool theirs = state.contains("frozen_layout"), ours = !here_frozen.buckets().empty();
  if (theirs != ours)
    ZERO_THROW(IoError, "checkpoint shard '", path, "' belongs to another model: ",
               theirs ? "the checkpoint has frozen parameters, this run none"
                      : "this run has frozen parameters, the checkpoint none",
               " (a resumed run must freeze the same parameters as the run that saved)");
  const std::string origin = "checkpoint shard '" + path + "': 'zero.engine' metadata ";
  const io::detail::JsonReader root(origin, state, "", io::detail::JsonReader::Found::omitted);
  SavedPlacement out;
  out.old = saved_layouts(root, path);
  out.old_index = match_params(out.old.trainable, here, out.old.frozen, here_frozen, false, path);
  out.same = same_placement(out.old.trainable, here, out.old_index);
  if (ours) {
    out.old_frozen_index = match_params(out.old.frozen, here_frozen, out.old.trainable, here, true, path);
    out.same = out.same && same_placement(out.old.frozen, here_frozen, out.old_frozen_index);
  }
  return out;
}

std::vector<float> reshard(const FlatLayout& now, const FlatLayout& old, const std::vector<std::size_t>& old_index,
                           int rank, const std::vector<const float*>& sources) {
  std::vector<float> out(now.shard_numel(), 0.0f);
  for (std::size_t b = 0; b < now.buckets().size(); ++b) {
    const Bucket& nb = now.buckets()[b];
    const std::size_t lo = nb.offset + static_cast<std::size_t>(rank) * nb.shard_size, hi = lo + nb.shard_size;
    for (std::size_t p = nb.first_param; p < nb.first_param + nb.param_count; ++p) {
      const ParamSlot& ns = now.slots()[p];
      const std::size_t a = std::max(lo, ns.offset), c = std::min(hi, ns.offset + ns.numel);
      if (a >= c) continue;
      // Elements [a, c) of the new full buffer, i.e. [a - ns.offset, c - ns.offset) of parameter p,
      // from whichever old shards hold them.
      float* dest = out.data() + nb.shard_offset + (a - lo);
      for_each_shard_run(old, old_index[p], a - ns.offset, c - a,
                         [&](int owner, std::size_t index, std::size_t element, std::size_t run) {
                           std::copy_n(sources[static_cast<std::size_t>(owner)] + index, run,
                                       dest + (element - (a - ns.offset)));
                         });
    }
  }
  return out;
}

const float* shard_tensor(const io::SafeTensorsFile& file, const std::string& path, const char* name, std::size_t count) {
  const io::TensorInfo* info = file.find(name);
  if (!info) return nullptr;
  if (info->dtype != io::TensorDType::F32 || info->shape != std::vector<std::int64_t>{static_cast<std::int64_t>(count)})
    ZERO_THROW(IoError, "checkpoint shard '", path, "': tensor '", name, "' should be F32 [", count, "]");
  return reinterpret_cast<const float*>(file.data(*info).data());
}

}  // namespace detail

// ---------------------------------------------------------------- saved shards (for tools)

SavedShard read_saved_shard(const io::SafeTensorsFile& file) {
  using namespace detail;
  using io::detail::JsonReader;
  const std::string path = file.path().string();
  const nlohmann::json state = shard_metadata(file, path);
  const std::string origin = "checkpoint shard '" + path + "': 'zero.engine' metadata ";
  const JsonReader root(origin, state, "", JsonReader::Found::omitted);
  if (!state.is_object()) root.fail("(root)", "an object");
  if (state.value("format", nlohmann::json()) != kShardFormat) root.fail("format", "\"zero.engine.shard\"");
  if (state.value("version", nlohmann::json()) != kShardVersion) root.fail("version", "1");
  SavedShard out;
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  out.rank = static_cast<int>(integer(root, "rank", 0, 1 << 20));
  out.stage = static_cast<int>(integer(root, "stage", 0, 3));
  out.step = integer(root, "step", 0, kMax);
  if (root.find("skipped_total") != nullptr) out.skipped_steps = integer(root, "skipped_total", 0, kMax);
  out.param_dtype = root.string("param_dtype");
  out.optimizer = root.string("optimizer");
  out.state_slots = static_cast<int>(integer(root, "state_slots", 0, 2));
  const nlohmann::json& loss_scale = root.get("loss_scale", "a number");
  if (!loss_scale.is_number()) root.fail("loss_scale", "a number");
  out.loss_scale = loss_scale.get<double>();
  const JsonReader layout = root.object("layout");
  out.world_size = static_cast<int>(integer(layout, "world_size", 1, 1 << 20));
  if (out.rank >= out.world_size) root.fail("rank", "below layout.world_size");
  SavedLayouts layouts = saved_layouts(root, path);
  out.layout = std::move(layouts.trainable);
  out.frozen_layout = std::move(layouts.frozen);
  const bool has_frozen = layouts.has_frozen;
  out.layout_text = layout_json(out.layout).dump();  // rebuilt, not echoed: bounded depth
  if (has_frozen) out.layout_text += layout_json(out.frozen_layout).dump();
  return out;
}

}  // namespace zero
