// Engine state: checkpoints (save_state, load_state, load_state_resharded)
// and the collective inspection of parameters and optimizer state. The shard
// file's format (one safetensors file per rank, "zero.engine" metadata) is
// defined here, with its reader for tools (engine_state.hpp).
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <optional>

#include "../io/json_reader.hpp"
#include "engine_impl.hpp"
#include "zero/engine/engine_state.hpp"
#include "zero/io/safetensors.hpp"

namespace zero {

// ---------------------------------------------------------------- inspection

namespace {
std::vector<std::vector<float>> split_params(const FlatLayout& layout, const std::vector<float>& full) {
  std::vector<std::vector<float>> out(layout.params().size());
  for (std::size_t p = 0; p < out.size(); ++p) {
    const ParamSlot& slot = layout.slots()[p];
    out[p].assign(full.begin() + static_cast<std::ptrdiff_t>(slot.offset),
                  full.begin() + static_cast<std::ptrdiff_t>(slot.offset + slot.numel));
  }
  return out;
}
}  // namespace

std::vector<std::vector<float>> Engine::gather_master_params() {
  Impl& m = *impl_;
  return in_engine_order(gather_fp32_slices([&m](std::size_t b) -> const float* { return m.master_slice(b); }));
}

std::vector<std::vector<float>> Engine::gather_ema_params() {
  Impl& m = *impl_;
  ZERO_CHECK(m.ema != nullptr, "gather_ema_params: EMA is off (EngineOptions.ema_decay is 0)");
  if (!m.ema_initialized) return gather_master_params();  // no step yet: the average is the weights
  return in_engine_order(
      gather_fp32_slices([&m](std::size_t b) -> const float* { return m.optimizer_slice(m.ema, b); }));
}

void Engine::visit_params(Weights which, const ParamVisitor& visit) {
  Impl& m = *impl_;
  ZERO_CHECK(which == Weights::master || m.ema != nullptr, "visit_params: EMA is off (EngineOptions.ema_decay is 0)");
  m.settle_for_reading();
  Backend& be = m.backend;
  be.synchronize(be.compute_stream());
  // Engine index of each parameter of either layout.
  std::vector<std::size_t> trained_param(layout_.params().size()), frozen_param(frozen_layout_.params().size());
  for (std::size_t p = 0; p < params_.size(); ++p)
    (params_[p].frozen ? frozen_param : trained_param)[index_in_layout_[p]] = p;
  // Before the first step the average is the weights (gather_ema_params).
  const bool ema = which == Weights::ema && m.ema_initialized;
  // Each bucket of `layout` into one bucket-sized buffer (or read in place
  // from `full`), then its parameters handed out.
  auto visit_layout = [&](const FlatLayout& layout, const std::vector<std::size_t>& engine_param, DType dtype,
                          const std::byte* full, const std::function<WorkPtr(std::size_t, void*)>& gather) {
    const std::size_t element = size_of(dtype);
    std::size_t largest = 0;
    for (const Bucket& bucket : layout.buckets()) largest = std::max(largest, bucket.padded * element);
    std::byte* buffer = full != nullptr || largest == 0 ? nullptr : static_cast<std::byte*>(be.allocate(largest));
    try {
      for (std::size_t b = 0; b < layout.buckets().size(); ++b) {
        const Bucket& bucket = layout.buckets()[b];
        const std::byte* values = full != nullptr ? full + bucket.offset * element : buffer;
        if (full == nullptr) {
          gather(b, buffer)->wait();
          be.synchronize(be.comm_stream());
        }
        for (std::size_t t = bucket.first_param; t < bucket.first_param + bucket.param_count; ++t) {
          const ParamSlot& slot = layout.slots()[t];
          visit(engine_param[t], values + (slot.offset - bucket.offset) * element, dtype, slot.numel);
        }
      }
    } catch (...) {
      if (buffer) be.deallocate(buffer, largest);
      throw;
    }
    if (buffer) be.deallocate(buffer, largest);
  };
  visit_layout(layout_, trained_param, DType::fp32, nullptr, [&](std::size_t b, void* buffer) {
    const float* own = ema ? m.optimizer_slice(m.ema, b) : m.master_slice(b);
    return m.gather_bucket(b, buffer, DType::fp32, own, m.plan.optimizer_on_host);
  });
  visit_layout(frozen_layout_, frozen_param, m.pdt, m.frozen_full, [&](std::size_t b, void* buffer) {
    const std::byte* own = m.frozen_shard + frozen_layout_.buckets()[b].shard_offset * m.p_size;
    return m.gather_bucket_of(frozen_layout_, b, buffer, m.pdt, own, m.plan.params_on_host);
  });
}

std::vector<std::vector<float>> Engine::gather_optimizer_state(int slot) {
  Impl& m = *impl_;
  float* base = slot == 0 ? m.state0 : slot == 1 ? m.state1 : nullptr;
  ZERO_CHECK(base != nullptr, "gather_optimizer_state: the optimizer has no state tensor ", slot);
  std::vector<std::vector<float>> trainable =
      gather_fp32_slices([&m, base](std::size_t b) -> const float* { return m.optimizer_slice(base, b); });
  std::vector<std::vector<float>> out(params_.size());
  for (std::size_t p = 0; p < params_.size(); ++p)
    if (!params_[p].frozen) out[p] = std::move(trainable[index_in_layout_[p]]);
  return out;
}

std::vector<std::vector<float>> Engine::in_engine_order(std::vector<std::vector<float>> trainable) {
  if (frozen_layout_.buckets().empty()) return trainable;  // the layout's order is the engine's
  std::vector<std::vector<float>> frozen = gather_frozen_params();
  std::vector<std::vector<float>> out(params_.size());
  for (std::size_t p = 0; p < params_.size(); ++p)
    out[p] = std::move(params_[p].frozen ? frozen[index_in_layout_[p]] : trainable[index_in_layout_[p]]);
  return out;
}

std::vector<std::vector<float>> Engine::gather_fp32_slices(const std::function<const float*(std::size_t)>& slice) {
  Impl& m = *impl_;
  m.settle_for_reading();
  Backend& be = m.backend;
  const std::vector<Bucket>& buckets = layout_.buckets();
  std::vector<float> host(layout_.padded_numel());
  std::size_t largest = 0;
  for (const Bucket& bucket : buckets) largest = std::max(largest, bucket.padded);
  if (largest == 0) return split_params(layout_, host);
  be.synchronize(be.compute_stream());
  // One bucket at a time through one bucket-sized device buffer: exports and
  // validation images read the weights mid-run, beside the training state,
  // and must not need a full fp32 copy of the model on the device.
  float* gathered = static_cast<float*>(be.allocate(largest * 4));
  try {
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      m.gather_bucket(b, gathered, DType::fp32, slice(b), m.plan.optimizer_on_host)->wait();
      be.synchronize(be.comm_stream());
      be.copy_to_host(host.data() + buckets[b].offset, gathered, buckets[b].padded * 4);
    }
  } catch (...) {
    be.deallocate(gathered, largest * 4);
    throw;
  }
  be.deallocate(gathered, largest * 4);
  return split_params(layout_, host);
}

namespace {
// Model-dtype values of every parameter of `layout` widened to float, from a
// full buffer (stages 0-2) or gathered from the shards (collective).
std::vector<std::vector<float>> gather_model_values(Engine::Impl& m, const FlatLayout& layout, const std::byte* full_buffer,
                                                    const std::byte* shard) {
  Backend& be = m.backend;
  const std::size_t full = layout.padded_numel();
  std::vector<std::byte> raw(full * m.p_size);
  be.synchronize(be.compute_stream());
  if (full_buffer) {
    be.copy_to_host(raw.data(), full_buffer, raw.size());
  } else {
    // Bucket by bucket, as gather_fp32_slices does (no full copy on the device).
    std::size_t largest = 0;
    for (const Bucket& bucket : layout.buckets()) largest = std::max(largest, bucket.padded * m.p_size);
    std::byte* gathered = largest == 0 ? nullptr : static_cast<std::byte*>(be.allocate(largest));
    try {
      for (std::size_t b = 0; b < layout.buckets().size(); ++b) {
        const Bucket& bucket = layout.buckets()[b];
        m.gather_bucket_of(layout, b, gathered, m.pdt, shard + bucket.shard_offset * m.p_size, m.plan.params_on_host)
            ->wait();
        be.synchronize(be.comm_stream());
        be.copy_to_host(raw.data() + bucket.offset * m.p_size, gathered, bucket.padded * m.p_size);
      }
    } catch (...) {
      if (gathered) be.deallocate(gathered, largest);
      throw;
    }
    if (gathered) be.deallocate(gathered, largest);
  }
  std::vector<float> host(full);
  for (std::size_t i = 0; i < full; ++i) host[i] = load_as_float(raw.data(), i, m.pdt);
  return split_params(layout, host);
}
}  // namespace

std::vector<std::vector<float>> Engine::gather_model_params() {
  Impl& m = *impl_;
  m.settle();
  return in_engine_order(gather_model_values(m, layout_, m.params_full, m.param_shard));
}

std::vector<std::vector<float>> Engine::gather_frozen_params() {
  Impl& m = *impl_;
  m.settle_for_reading();  // frozen values never change: nothing to send up first
  return gather_model_values(m, frozen_layout_, m.frozen_full, m.frozen_shard);
}


// ---------------------------------------------------------------- checkpoints
// (kept with the engine: it needs the buffers' placement at every stage)


namespace {

constexpr const char* kShardFormat = "zero.engine.shard";
constexpr int kShardVersion = 1;

nlohmann::json param_json(const ParamSpec& p) {
  nlohmann::json entry = {{"name", p.name}, {"numel", p.numel}};
  // The shape, where the model gave one, lets a consolidated file carry real
  // tensor shapes. Files from before it have name and numel only.
  if (!p.shape.empty()) entry["shape"] = p.shape;
  // The parameter group, where not 0 (files from before groups have none).
  if (p.group != 0) entry["group"] = p.group;
  return entry;
}

nlohmann::json layout_json(const FlatLayout& layout) {
  nlohmann::json params = nlohmann::json::array(), groups = nlohmann::json::array();
  for (const ParamSpec& p : layout.params()) params.push_back(param_json(p));
  for (const Bucket& b : layout.buckets()) groups.push_back(b.param_count);
  return {{"world_size", layout.world_size()}, {"alignment", layout.alignment()},
          {"padded_numel", layout.padded_numel()}, {"params", params}, {"bucket_param_counts", groups}};
}

// Rank's shard of `now`, filled from the old ranks' shards (`sources`, in
// rank order) of the same parameters placed as `old`, in any units and order:
// parameter p of `now` is parameter old_index[p] of `old`. Padding is zero.
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

// Frozen parameters are saved once: each rank its slices of the frozen
// layout (whatever the stage), widened to fp32 (exact for every model dtype).
std::vector<float> own_frozen_values(Engine::Impl& m) {
  const FlatLayout& l = m.frozen_layout;
  Backend& be = m.backend;
  std::vector<std::byte> raw(l.shard_numel() * m.p_size);
  for (std::size_t b = 0; b < l.buckets().size(); ++b) {
    const Bucket& bucket = l.buckets()[b];
    std::byte* dst = raw.data() + bucket.shard_offset * m.p_size;
    const std::size_t bytes = bucket.shard_size * m.p_size;
    if (m.frozen_full)
      be.copy_to_host(dst, m.frozen_full + (bucket.offset + static_cast<std::size_t>(m.rank) * bucket.shard_size) * m.p_size, bytes);
    else if (m.plan.params_on_host)
      be.host_copy(dst, m.frozen_shard + bucket.shard_offset * m.p_size, bytes);
    else
      be.copy_to_host(dst, m.frozen_shard + bucket.shard_offset * m.p_size, bytes);
  }
  std::vector<float> out(l.shard_numel());
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = load_as_float(raw.data(), i, m.pdt);
  return out;
}

// The inverse: this rank's slices back into its shard, or into the full
// buffer and then gathered from every rank (stages 0-2). Collective.
void restore_frozen(Engine::Impl& m, const std::vector<float>& values) {
  const FlatLayout& l = m.frozen_layout;
  Backend& be = m.backend;
  std::vector<std::byte> raw(values.size() * m.p_size);
  for (std::size_t i = 0; i < values.size(); ++i) store_from_float(raw.data(), i, m.pdt, values[i]);
  auto own_in_full = [&](std::size_t b) {
    const Bucket& bucket = l.buckets()[b];
    return m.frozen_full + (bucket.offset + static_cast<std::size_t>(m.rank) * bucket.shard_size) * m.p_size;
  };
  for (std::size_t b = 0; b < l.buckets().size(); ++b) {
    const Bucket& bucket = l.buckets()[b];
    const std::byte* src = raw.data() + bucket.shard_offset * m.p_size;
    const std::size_t bytes = bucket.shard_size * m.p_size;
    if (m.frozen_full) be.copy_from_host(own_in_full(b), src, bytes);
    else if (m.plan.params_on_host) be.host_copy(m.frozen_shard + bucket.shard_offset * m.p_size, src, bytes);
    else be.copy_from_host(m.frozen_shard + bucket.shard_offset * m.p_size, src, bytes);
  }
  if (!m.frozen_full) return;
  be.synchronize(be.compute_stream());
  auto own = [&](std::size_t b) -> const void* { return own_in_full(b); };
  for (auto& w : m.gather_buckets_of(l, m.frozen_full, m.pdt, own, false)) w->wait();
  be.synchronize(be.comm_stream());
}

}  // namespace

void Engine::save_state(const std::string& path, const std::vector<std::pair<std::string, std::string>>& metadata) {
  Impl& m = *impl_;
  Backend& be = m.backend;
  ZERO_CHECK(micro_step_ == 0, "save_state: in the middle of a step (", micro_step_,
             " micro-steps done); save between steps");
  m.settle();
  be.synchronize(be.compute_stream());
  const std::size_t shard = layout_.shard_numel();
  auto collect = [&](auto slice_of) {
    std::vector<float> host(shard);
    for (std::size_t b = 0; b < layout_.buckets().size(); ++b)
      m.state_to_host(host.data() + layout_.buckets()[b].shard_offset, slice_of(b), layout_.buckets()[b].shard_size * 4);
    return host;
  };
  std::vector<std::pair<std::string, std::vector<float>>> tensors;
  tensors.emplace_back("master", collect([&](std::size_t b) { return m.master_slice(b); }));
  if (m.state0) tensors.emplace_back("state0", collect([&](std::size_t b) { return m.optimizer_slice(m.state0, b); }));
  if (m.state1) tensors.emplace_back("state1", collect([&](std::size_t b) { return m.optimizer_slice(m.state1, b); }));
  if (m.ema && m.ema_initialized)
    tensors.emplace_back("ema", collect([&](std::size_t b) { return m.optimizer_slice(m.ema, b); }));
  if (m.has_frozen()) tensors.emplace_back("frozen", own_frozen_values(m));
  std::vector<io::TensorView> views;
  for (auto& [name, data] : tensors)
    views.push_back({name, io::TensorDType::F32, {static_cast<std::int64_t>(data.size())}, data.data()});

  nlohmann::json state = {{"format", kShardFormat},
                          {"version", kShardVersion},
                          {"rank", rank_},
                          {"stage", options_.stage},
                          {"param_dtype", std::string(name_of(options_.param_dtype))},
                          {"optimizer", std::string(name_of(options_.optimizer.kind))},
                          {"state_slots", options_.optimizer.state_slots()},
                          {"step", step_},
                          {"skipped_total", skipped_total_},
                          {"consecutive_nonfinite", consecutive_nonfinite_},
                          {"loss_scale", scaler_.scale()},
                          {"loss_scale_good_steps", scaler_.good_steps()},
                          {"loss_scale_hysteresis_left", scaler_.hysteresis_left()},
                          {"loss_scale_skipped", scaler_.skipped_steps()},
                          {"layout", layout_json(layout_)}};
  if (m.has_frozen()) state["frozen_layout"] = layout_json(frozen_layout_);
  if (!options_.param_groups.empty()) {
    // The groups' hyperparameters, for the record (the assignment is in the
    // layout; a resumed run may change the values, not the assignment).
    nlohmann::json groups = nlohmann::json::array();
    for (std::size_t g = 0; g < options_.param_groups.size(); ++g) {
      const OptimizerOptions o = options_.group_optimizer(g);
      groups.push_back({{"name", options_.param_groups[g].name},
                        {"lr_scale", options_.param_groups[g].lr_scale},
                        {"weight_decay", o.weight_decay},
                        {"beta1", o.beta1},
                        {"beta2", o.beta2},
                        {"eps", o.eps},
                        {"momentum", o.momentum}});
    }
    state["param_groups"] = groups;
  }
  std::map<std::string, std::string> meta(metadata.begin(), metadata.end());
  meta["zero.engine"] = state.dump();
  io::write_safetensors(path, views, meta);
}

namespace {

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

// Both layouts of a shard as save_state placed them: the trainable one and,
// where the shard has frozen parameters, the frozen one (else no bucket).
struct SavedLayouts {
  FlatLayout trainable, frozen;
  bool has_frozen = false;
};

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

// Where this run's parameters are in a checkpoint: its layouts, and for each
// parameter (of either kind) the index of the same one in the checkpoint's.
struct SavedPlacement {
  SavedLayouts old;
  std::vector<std::size_t> old_index, old_frozen_index;
  bool same = false;  // placed exactly as here: load_state's own file alone will do
};

// The checkpoint must hold the same parameters (names, sizes, shapes, groups,
// the same ones frozen); their order, units, alignment and world size may differ.
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

const float* shard_tensor(const io::SafeTensorsFile& file, const std::string& path, const char* name, std::size_t count) {
  const io::TensorInfo* info = file.find(name);
  if (!info) return nullptr;
  if (info->dtype != io::TensorDType::F32 || info->shape != std::vector<std::int64_t>{static_cast<std::int64_t>(count)})
    ZERO_THROW(IoError, "checkpoint shard '", path, "': tensor '", name, "' should be F32 [", count, "]");
  return reinterpret_cast<const float*>(file.data(*info).data());
}

}  // namespace

void Engine::load_state(const std::string& path) {
  const io::SafeTensorsFile file = io::SafeTensorsFile::open(path);
  const nlohmann::json state = shard_metadata(file, path);
  const SavedPlacement saved = match_saved(state, layout_, frozen_layout_, path);
  if (saved.old.trainable.world_size() != world_)
    ZERO_THROW(IoError, "checkpoint shard '", path, "' was written by ", saved.old.trainable.world_size(),
               " ranks; this run has ", world_, ": resume with load_state_resharded and every rank's file");
  if (state.value("rank", -1) != rank_)
    ZERO_THROW(IoError, "checkpoint shard '", path, "': rank is ", state.value("rank", -1), ", this run has ", rank_);
  if (!saved.same)
    ZERO_THROW(IoError, "checkpoint shard '", path, "' holds this run's parameters in other units, another order "
               "or another alignment, so this rank's elements lie in other ranks' files: resume with "
               "load_state_resharded and every rank's file (saved_layout_matches tells the two apart)");
  const std::size_t shard = layout_.shard_numel();
  std::array<const float*, 4> tensors = {shard_tensor(file, path, "master", shard), shard_tensor(file, path, "state0", shard),
                                         shard_tensor(file, path, "state1", shard), shard_tensor(file, path, "ema", shard)};
  std::vector<float> frozen;
  if (impl_->has_frozen()) {
    const float* values = shard_tensor(file, path, "frozen", frozen_layout_.shard_numel());
    if (!values) ZERO_THROW(IoError, "checkpoint shard '", path, "': tensor 'frozen' is missing");
    frozen.assign(values, values + frozen_layout_.shard_numel());
  }
  restore_state(tensors, frozen, state.dump(), path);
}

bool Engine::saved_layout_matches(const std::string& path) const {
  const io::SafeTensorsFile file = io::SafeTensorsFile::open(path);
  return match_saved(shard_metadata(file, path), layout_, frozen_layout_, path).same;
}

void Engine::load_state_resharded(const std::vector<std::string>& paths) {
  ZERO_CHECK(!paths.empty(), "load_state_resharded: no checkpoint files");
  std::vector<io::SafeTensorsFile> files;
  for (const std::string& path : paths) files.push_back(io::SafeTensorsFile::open(path));
  const nlohmann::json first = shard_metadata(files[0], paths[0]);
  const int old_world = first.contains("layout") && first["layout"].is_object()
                            ? first["layout"].value("world_size", -1) : -1;
  ZERO_CHECK(old_world == static_cast<int>(paths.size()), "load_state_resharded: the checkpoint was written by ",
             old_world, " ranks but ", paths.size(), " files were given (", paths[0], ")");
  // The old placement of the same parameters (any units and order), once:
  // every file must record the same one.
  const SavedPlacement saved = match_saved(first, layout_, frozen_layout_, paths[0]);
  for (std::size_t r = 0; r < files.size(); ++r) {
    const nlohmann::json state = r == 0 ? first : shard_metadata(files[r], paths[r]);
    if (state.value("rank", -1) != static_cast<int>(r))
      ZERO_THROW(IoError, "checkpoint shard '", paths[r], "': rank is ", state.value("rank", -1), ", expected ", r,
                 " (files must be given in rank order)");
    if (state.value("format", nlohmann::json()) != first["format"] ||
        state.value("version", nlohmann::json()) != first["version"] ||
        state.value("layout", nlohmann::json()) != first["layout"] ||
        state.value("frozen_layout", nlohmann::json()) != first.value("frozen_layout", nlohmann::json()) ||
        state.value("step", -1) != first.value("step", -1))
      ZERO_THROW(IoError, "checkpoint shard '", paths[r], "' does not belong with '", paths[0],
                 "' (another layout or step)");
  }

  // This rank's new slices, filled from whichever old ranks held those elements.
  const FlatLayout& old = saved.old.trainable;
  const char* names[4] = {"master", "state0", "state1", "ema"};
  std::array<std::vector<float>, 4> hosts;
  std::array<const float*, 4> pointers{};
  for (int k = 0; k < 4; ++k) {
    std::vector<const float*> sources;
    for (std::size_t r = 0; r < files.size(); ++r)
      sources.push_back(shard_tensor(files[r], paths[r], names[k], old.shard_numel()));
    if (std::find(sources.begin(), sources.end(), nullptr) != sources.end()) continue;  // absent in this checkpoint
    hosts[k] = reshard(layout_, old, saved.old_index, rank_, sources);
    pointers[k] = hosts[k].data();
  }
  std::vector<float> frozen;
  if (!frozen_layout_.buckets().empty()) {
    const FlatLayout& old_frozen = saved.old.frozen;
    std::vector<const float*> sources;
    for (std::size_t r = 0; r < files.size(); ++r) {
      sources.push_back(shard_tensor(files[r], paths[r], "frozen", old_frozen.shard_numel()));
      if (!sources.back()) ZERO_THROW(IoError, "checkpoint shard '", paths[r], "': tensor 'frozen' is missing");
    }
    frozen = reshard(frozen_layout_, old_frozen, saved.old_frozen_index, rank_, sources);
  }
  restore_state(pointers, frozen, first.dump(), paths[0]);
}

void Engine::restore_state(const std::array<const float*, 4>& tensors, const std::vector<float>& frozen_shard,
                           const std::string& state_json, const std::string& path) {
  Impl& m = *impl_;
  m.settle();
  m.backend.synchronize(m.backend.comm_stream());  // uploads out of the host copies are done
  Backend& be = m.backend;
  const nlohmann::json state = nlohmann::json::parse(state_json);
  if (state.value("optimizer", std::string()) != name_of(options_.optimizer.kind) ||
      state.value("state_slots", -1) != options_.optimizer.state_slots())
    ZERO_THROW(IoError, "checkpoint shard '", path, "': optimizer is ", state.value("optimizer", nlohmann::json()).dump(),
               " with ", state.value("state_slots", -1), " state tensors, this run has \"",
               name_of(options_.optimizer.kind), "\" with ", options_.optimizer.state_slots());
  const auto [master, state0, state1, ema] = tensors;
  if (!master) ZERO_THROW(IoError, "checkpoint shard '", path, "': tensor 'master' is missing");
  if ((m.state0 && !state0) || (m.state1 && !state1))
    ZERO_THROW(IoError, "checkpoint shard '", path, "': optimizer state tensors are missing");
  be.synchronize(be.compute_stream());
  const auto& buckets = layout_.buckets();
  // Own slices first; stage 0 then gathers every rank's slices into its full buffers.
  auto restore = [&](const float* host, const std::function<float*(std::size_t)>& slice, float* full_base) {
    for (std::size_t b = 0; b < buckets.size(); ++b)
      m.state_from_host(slice(b), host + buckets[b].shard_offset, buckets[b].shard_size * 4);
    if (m.plan.optimizer_full && full_base) {
      auto own = [&](std::size_t b) -> const void* { return full_base + m.own_offset(b); };
      for (auto& w : m.gather_buckets(full_base, DType::fp32, own, false)) w->wait();
      be.synchronize(be.comm_stream());
    }
  };
  const bool fp32 = m.pdt == DType::fp32;
  restore(master, [&](std::size_t b) { return m.master_slice(b); },
          fp32 && !m.master ? (m.plan.optimizer_full ? reinterpret_cast<float*>(m.params_full) : nullptr) : m.master);
  if (m.state0) restore(state0, [&](std::size_t b) { return m.optimizer_slice(m.state0, b); }, m.state0);
  if (m.state1) restore(state1, [&](std::size_t b) { return m.optimizer_slice(m.state1, b); }, m.state1);
  if (m.ema && ema) {
    restore(ema, [&](std::size_t b) { return m.optimizer_slice(m.ema, b); }, m.ema);
    m.ema_initialized = true;
  }
  // The model copy is the master rounded, as after every step; stages 0-2
  // then gather every rank's slices (stage 0 with fp32 parameters restored
  // them whole above).
  m.updater->parameters_from_master();
  if (m.has_frozen()) restore_frozen(m, frozen_shard);
  if (m.plan.params_full && !(fp32 && m.plan.optimizer_full)) {
    be.synchronize(be.compute_stream());
    auto own = [&m](std::size_t b) -> const void* { return m.own_params(b); };
    for (auto& w : m.gather_buckets(m.params_full, m.pdt, own, false)) w->wait();
    be.synchronize(be.comm_stream());
  }
  step_ = state.value("step", std::int64_t{0});
  skipped_total_ = state.value("skipped_total", std::int64_t{0});
  consecutive_nonfinite_ = state.value("consecutive_nonfinite", 0);
  scaler_.restore(state.value("loss_scale", 1.0), state.value("loss_scale_good_steps", 0),
                  state.value("loss_scale_hysteresis_left", 1), state.value("loss_scale_skipped", std::int64_t{0}));
}


// ---------------------------------------------------------------- saved shards (for tools)

SavedShard read_saved_shard(const io::SafeTensorsFile& file) {
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
