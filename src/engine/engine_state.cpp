// Engine state: checkpoints (save_state, load_state, load_state_resharded,
// restore_state), kept with the engine: they need the buffers' placement at
// every stage. The shard file's format and the matching of a saved
// placement to this run's are in shard_format.{hpp,cpp}; the collective
// inspection of the weights in engine_inspection.cpp.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <functional>
#include <map>

#include "engine_impl.hpp"
#include "shard_format.hpp"
#include "zero/io/safetensors.hpp"

namespace zero {

using detail::kShardFormat;
using detail::kShardVersion;
using detail::layout_json;
using detail::match_saved;
using detail::reshard;
using detail::SavedPlacement;
using detail::shard_metadata;
using detail::shard_tensor;

namespace {

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
  ZERO_CHECK(m.micro_step == 0, "save_state: in the middle of a step (", m.micro_step,
             " micro-steps done); save between steps");
  m.settle();
  be.synchronize(be.compute_stream());
  be.synchronize(be.comm_stream());  // offload.ema_on_device: the EMA is updated there
  const std::size_t shard = layout_.shard_numel();
  auto collect = [&](auto slice_of) {
    std::vector<float> host(shard);
    for (std::size_t b = 0; b < layout_.buckets().size(); ++b)
      m.state_to_host(host.data() + layout_.buckets()[b].shard_offset, slice_of(b), layout_.buckets()[b].shard_size * 4);
    return host;
  };
  // The optimizer state is written as fp32 whatever its dtype in memory (bf16
  // widens exactly): the file format stays one, and a run may resume with
  // the other state dtype.
  auto collect_state = [&](std::byte* base) {
    if (m.sdt == DType::fp32) return collect([&](std::size_t b) { return m.state_slice(base, b); });
    std::vector<std::byte> raw(shard * m.s_size);
    for (std::size_t b = 0; b < layout_.buckets().size(); ++b)
      m.state_to_host(raw.data() + layout_.buckets()[b].shard_offset * m.s_size, m.state_slice(base, b),
                      layout_.buckets()[b].shard_size * m.s_size);
    std::vector<float> host(shard);
    cpu_convert(raw.data(), m.sdt, host.data(), DType::fp32, shard);
    return host;
  };
  std::vector<std::pair<std::string, std::vector<float>>> tensors;
  tensors.emplace_back("master", collect([&](std::size_t b) { return m.master_slice(b); }));
  if (m.state0) tensors.emplace_back("state0", collect_state(m.state0));
  if (m.state1) tensors.emplace_back("state1", collect_state(m.state1));
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
  // host: fp32 values of this rank's shard, stored as `dtype` (the optimizer
  // state's may be bf16: rounded to nearest, exact for values it wrote).
  auto restore_as = [&](DType dtype, const float* host, const std::function<void*(std::size_t)>& slice,
                        void* full_base) {
    const std::size_t size = size_of(dtype);
    std::vector<std::byte> narrowed;
    const std::byte* source = reinterpret_cast<const std::byte*>(host);
    if (dtype != DType::fp32) {
      narrowed.resize(layout_.shard_numel() * size);
      cpu_convert(host, DType::fp32, narrowed.data(), dtype, layout_.shard_numel());
      source = narrowed.data();
    }
    for (std::size_t b = 0; b < buckets.size(); ++b)
      m.state_from_host(slice(b), source + buckets[b].shard_offset * size, buckets[b].shard_size * size);
    if (m.plan.optimizer_full && full_base) {
      auto own = [&](std::size_t b) -> const void* {
        return static_cast<const std::byte*>(full_base) + m.own_offset(b) * size;
      };
      for (auto& w : m.gather_buckets(full_base, dtype, own, false)) w->wait();
      be.synchronize(be.comm_stream());
    }
  };
  auto restore = [&](const float* host, const std::function<float*(std::size_t)>& slice, float* full_base) {
    restore_as(DType::fp32, host, slice, full_base);
  };
  auto restore_state_slot = [&](const float* host, std::byte* base) {
    restore_as(m.sdt, host, [&](std::size_t b) -> void* { return m.state_slice(base, b); }, base);
  };
  const bool fp32 = m.pdt == DType::fp32;
  restore(master, [&](std::size_t b) { return m.master_slice(b); },
          fp32 && !m.master ? (m.plan.optimizer_full ? reinterpret_cast<float*>(m.params_full) : nullptr) : m.master);
  if (m.state0) restore_state_slot(state0, m.state0);
  if (m.state1) restore_state_slot(state1, m.state1);
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

}  // namespace zero
