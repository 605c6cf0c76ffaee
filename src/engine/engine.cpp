// Engine: construction, parameters and their gathers, and the optimizer step.
// Stage 3's unit gathers and schedule are in unit_gathers.cpp, the gradient
// path in reductions.cpp, the updaters in *_updater.cpp, checkpoints and
// inspection in engine_state.cpp.
#include "zero/engine/engine.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <limits>
#include <utility>

#include "engine_impl.hpp"

namespace zero {

// ---------------------------------------------------------------- Impl

namespace {
std::size_t largest_bucket_of(const FlatLayout& layout) {
  std::size_t largest = 0;
  for (const Bucket& b : layout.buckets()) largest = std::max(largest, b.padded);
  return largest;
}
// The transient blocks' sizes at their largest: a stage-3 unit, a bucket's
// gradients, a shard's reduction scratch.
std::map<detail::Category, std::vector<std::size_t>> block_sizes_of(const FlatLayout& layout, const EngineOptions& o) {
  std::size_t largest_shard = 0;
  for (const Bucket& b : layout.buckets()) largest_shard = std::max(largest_shard, b.shard_size);
  const std::size_t largest = largest_bucket_of(layout);
  const std::size_t g = size_of(o.effective_grad_dtype());
  return {{detail::kParams, {largest * size_of(o.param_dtype)}}, {detail::kBuffers, {largest * g, largest_shard * g}}};
}
std::size_t cache_limit_of(const FlatLayout& layout, const EngineOptions& o) {
  const std::size_t widest = std::max(size_of(o.param_dtype), size_of(o.effective_grad_dtype()));
  return o.buckets.cache_bytes.value_or(2 * largest_bucket_of(layout) * widest);
}
}  // namespace

Engine::Impl::Impl(Communicator& c, Communicator* replicas, Backend& b, const FlatLayout& l,
                   const FlatLayout& frozen, const EngineOptions& o)
    : comm(c),
      replica_comm(replicas),
      backend(b),
      layout(l),
      frozen_layout(frozen),
      options(o),
      plan(StagePlan::of(o, c.size())),
      rank(c.rank()),
      world(c.size()),
      pdt(o.param_dtype),
      gdt(o.effective_grad_dtype()),
      sdt(o.optimizer.state_dtype),
      p_size(size_of(pdt)),
      g_size(size_of(gdt)),
      s_size(size_of(sdt)),
      pool(b, cache_limit_of(l, o), /*keep_working_set=*/!o.buckets.cache_bytes.has_value(), block_sizes_of(l, o)) {
  // Persistent buffers, where the plan puts them (memory_model.cpp counts the same).
  const std::size_t full = layout.padded_numel(), shard = layout.shard_numel();
  if (plan.params_full) params_full = pool.allocate(kParams, full * p_size);
  else if (plan.params_on_host) param_shard = pool.allocate_host(kParams, shard * p_size);
  else param_shard = pool.allocate(kParams, shard * p_size);
  const std::size_t optimizer_bytes = plan.optimizer_elements(full) * 4;
  auto allocate_state = [&](Category c, bool on_host) {
    return on_host ? pool.allocate_host<float>(c, optimizer_bytes) : pool.allocate<float>(c, optimizer_bytes);
  };
  if (plan.has_master) master = allocate_state(kMaster, plan.optimizer_on_host);
  const std::size_t state_bytes = plan.optimizer_elements(full) * s_size;
  auto allocate_slot = [&] {
    return plan.optimizer_on_host ? pool.allocate_host(kState, state_bytes) : pool.allocate(kState, state_bytes);
  };
  if (plan.state_slots >= 1) state0 = allocate_slot();
  if (plan.state_slots >= 2) state1 = allocate_slot();
  if (plan.ema) ema = allocate_state(kEma, plan.ema_on_host);
  if (plan.full_grads) grads_full = pool.allocate(kGrads, full * g_size);
  if (plan.grad_shard_on_device()) grad_shard = pool.allocate(kGrads, shard * g_size);
  // Frozen parameters: their model-dtype values where the trainable ones
  // live (full, or a shard gathered per unit), and nothing else.
  const std::size_t frozen_full_numel = frozen_layout.padded_numel(), frozen_shard_numel = frozen_layout.shard_numel();
  if (has_frozen()) {
    if (plan.params_full) frozen_full = pool.allocate(kParams, frozen_full_numel * p_size);
    else if (plan.params_on_host) frozen_shard = pool.allocate_host(kParams, frozen_shard_numel * p_size);
    else frozen_shard = pool.allocate(kParams, frozen_shard_numel * p_size);
  }
  frozen_unit_buffer.assign(frozen_layout.buckets().size(), nullptr);
  frozen_unit_work.resize(frozen_layout.buckets().size());
  updater = detail::make_updater(*this);
  if (plan.streams_grads_to_host) {
    const OffloadOptions& offload = options.offload;
    host_worker = std::make_unique<detail::HostGradientWorker>(
        backend, gdt, offload.gradient_worker_threads > 0 ? offload.gradient_worker_threads : offload.update_threads);
    staging_add.assign(layout.buckets().size(), 0);
    bucket_stats.assign(layout.buckets().size(), GradStats{});
    bucket_stats_queued.assign(layout.buckets().size(), 0);
  }

  const std::size_t buckets = layout.buckets().size();
  param_ready.assign(layout.params().size(), 0);
  bucket_ready_count.assign(buckets, 0);
  accumulator_has_data.assign(buckets, 0);
  bucket_buffer.assign(buckets, nullptr);
  unit_buffer.assign(buckets, nullptr);
  unit_refs.assign(buckets, 0);
  unit_work.resize(buckets);
  unit_ready.assign(buckets, nullptr);
  param_gathers.resize(buckets);
  for (std::size_t b = 0; b < buckets; ++b)
    segments.push_back(segments_of(own_offset(b), own_offset(b) + layout.buckets()[b].shard_size));
  full_segments = segments_of(0, layout.padded_numel());
}

std::vector<Engine::Impl::Segment> Engine::Impl::segments_of(std::size_t lo, std::size_t hi) const {
  std::vector<Segment> out;
  // Buckets are in offset order: start at the first that ends after lo
  // (one bucket per call for a slice: linear in the buckets overall).
  const auto& buckets = layout.buckets();
  auto first = std::partition_point(buckets.begin(), buckets.end(),
                                    [lo](const Bucket& b) { return b.offset + b.padded <= lo; });
  for (auto it = first; it != buckets.end() && it->offset < hi; ++it) {
    const Bucket& bucket = *it;
    const std::size_t bucket_end = bucket.offset + bucket.padded;
    for (std::size_t p = bucket.first_param; p < bucket.first_param + bucket.param_count; ++p) {
      // Parameter p's run: from its offset to the next parameter's (the
      // padding between them is zero and stays zero under every group).
      const std::size_t start = p == bucket.first_param ? bucket.offset : layout.slots()[p].offset;
      const std::size_t end =
          p + 1 < bucket.first_param + bucket.param_count ? layout.slots()[p + 1].offset : bucket_end;
      const std::size_t a = std::max(start, lo), z = std::min(end, hi);
      if (a >= z) continue;
      const int group = layout.params()[p].group;
      if (!out.empty() && out.back().group == group && out.back().begin + out.back().count == a - lo)
        out.back().count += z - a;
      else
        out.push_back({a - lo, z - a, group});
    }
  }
  return out;
}

Engine::Impl::~Impl() {
  host_worker.reset();  // stops its jobs before the host shards they read and write go
  updater.reset();  // joins a delayed update before the state it writes goes
  pending.clear();  // Work destructors wait
  param_gathers.clear();
  unit_work.clear();
  frozen_unit_work.clear();
  for (Event& ready : unit_ready) backend.release_event(std::exchange(ready, nullptr));
  for (std::size_t u = 0; u < frozen_unit_buffer.size(); ++u)
    pool.free(frozen_unit_buffer[u], frozen_layout.buckets()[u].padded * p_size);
  pool.free(frozen_full, frozen_layout.padded_numel() * p_size);
  if (plan.params_on_host) pool.free_host(frozen_shard, frozen_layout.shard_numel() * p_size);
  else pool.free(frozen_shard, frozen_layout.shard_numel() * p_size);
  for (std::size_t b = 0; b < bucket_buffer.size(); ++b) pool.free(bucket_buffer[b], layout.buckets()[b].padded * g_size);
  for (std::size_t u = 0; u < unit_buffer.size(); ++u) pool.free(unit_buffer[u], layout.buckets()[u].padded * p_size);
  release_download_events();  // the worker is gone (above)
  const std::size_t full = layout.padded_numel(), shard = layout.shard_numel();
  pool.free(params_full, full * p_size);
  if (plan.params_on_host) pool.free_host(param_shard, shard * p_size);
  else pool.free(param_shard, shard * p_size);
  const std::size_t optimizer_bytes = plan.optimizer_elements(full) * 4;
  for (float* state : {master, ema}) {
    if (state_on_host(state)) pool.free_host(state, optimizer_bytes);
    else pool.free(state, optimizer_bytes);
  }
  const std::size_t state_bytes = plan.optimizer_elements(full) * s_size;
  for (std::byte* state : {state0, state1}) {
    if (plan.optimizer_on_host) pool.free_host(state, state_bytes);
    else pool.free(state, state_bytes);
  }
  pool.free(grads_full, full * g_size);
  pool.free(grad_shard, shard * g_size);
}

void Engine::Impl::order_after(Stream waiter, Stream producer) {
  Event done = backend.record_event(producer);
  backend.stream_wait(waiter, done);
  backend.release_event(done);
}

WorkPtr Engine::Impl::gather_bucket(std::size_t b, void* dest, DType dtype, const void* own, bool own_on_host) {
  return gather_bucket_of(layout, b, dest, dtype, own, own_on_host);
}

WorkPtr Engine::Impl::gather_bucket_of(const FlatLayout& of, std::size_t b, void* dest, DType dtype, const void* own,
                                       bool own_on_host) {
  const Bucket& bucket = of.buckets()[b];
  const std::size_t element = size_of(dtype);
  std::byte* place = static_cast<std::byte*>(dest) + static_cast<std::size_t>(rank) * bucket.shard_size * element;
  if (own_on_host) {  // host memory: up into this rank's place, then gathered in place
    copy_to_device(place, own, bucket.shard_size * element, backend.comm_stream());
    own = place;
  }
  return comm.all_gather(own, dest, bucket.shard_size, dtype, backend.comm_stream());
}

std::vector<WorkPtr> Engine::Impl::gather_buckets(void* full, DType dtype,
                                                  const std::function<const void*(std::size_t)>& own,
                                                  bool own_on_host) {
  return gather_buckets_of(layout, full, dtype, own, own_on_host);
}

std::vector<WorkPtr> Engine::Impl::gather_buckets_of(const FlatLayout& of, void* full, DType dtype,
                                                     const std::function<const void*(std::size_t)>& own,
                                                     bool own_on_host) {
  std::vector<WorkPtr> works;
  const std::size_t element = size_of(dtype);
  for (std::size_t b = 0; b < of.buckets().size(); ++b)
    works.push_back(gather_bucket_of(of, b, static_cast<std::byte*>(full) + of.buckets()[b].offset * element, dtype,
                                     own(b), own_on_host));
  return works;
}

void Engine::Impl::wait_for_collective(Work& work) {
  // In a CUDA graph capture every caller orders what follows on the device
  // (the comm stream, or order_after): the host must not wait.
  if (capturing) return work.detach();
  const auto start = std::chrono::steady_clock::now();
  work.wait();
  comm_wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void Engine::Impl::check_gather_later(WorkPtr work) {
  if (comm.memory_kind() == MemoryKind::host || capturing) {
    wait_for_collective(*work);  // while capturing: detached, ordered on the device
    return;
  }
  gathers_to_check.push_back(std::move(work));
  while (gathers_to_check.size() > kGathersAheadOfHost) {
    wait_for_collective(*gathers_to_check.front());
    gathers_to_check.pop_front();
  }
}

void Engine::Impl::check_gathers() {
  for (; !gathers_to_check.empty(); gathers_to_check.pop_front()) wait_for_collective(*gathers_to_check.front());
}

void Engine::Impl::finish_param_gather(std::size_t b) {
  if (!param_gathers[b]) return;
  wait_for_collective(*param_gathers[b]);
  param_gathers[b].reset();
  // The host waited for this bucket's gather: the compute stream's work from
  // here on runs after it. Waiting on the comm stream's tail instead held the
  // first forward kernel back until every bucket's gather (offloaded: every
  // upload) was done. A capture cannot wait on the host: it waits on the device.
  if (capturing) order_after(backend.compute_stream(), backend.comm_stream());
}

void Engine::Impl::finish_param_gathers() {
  for (std::size_t b = 0; b < param_gathers.size(); ++b) finish_param_gather(b);
  // Stage 3's unit gathers too: with offload_params they read the host shard
  // that the CPU update writes, and every caller is about to touch the state.
  check_gathers();
  drop_unused_prefetches();
}

void Engine::Impl::settle() {
  updater->settle();
  finish_param_gathers();
}

void Engine::Impl::settle_for_reading() {
  updater->settle_for_reading();
  finish_param_gathers();
}

void Engine::Impl::state_to_host(void* host_dst, const void* state, std::size_t bytes) {
  if (state_on_host(state)) backend.host_copy(host_dst, state, bytes);
  else backend.copy_to_host(host_dst, state, bytes);
}

void Engine::Impl::state_from_host(void* state, const void* host_src, std::size_t bytes) {
  if (state_on_host(state)) backend.host_copy(state, host_src, bytes);
  else backend.copy_from_host(state, host_src, bytes);
}

// ---------------------------------------------------------------- construction

namespace {
// The ranks a layout is sharded over: the shard group with hybrid sharding.
int shard_world_size(const EngineOptions& options, const Communicator& comm) {
  if (options.shard_group_size <= 0) return comm.size();
  check_shard_group_size(options.shard_group_size, comm.size());
  return options.shard_group_size;
}

LayoutOptions layout_options(const EngineOptions& options, const Communicator& comm) {
  return {.world_size = shard_world_size(options, comm),
          .alignment = options.buckets.alignment_elements,
          .bucket_elements = std::max<std::size_t>(1, options.buckets.bytes / size_of(options.param_dtype))};
}

// Consecutive parameters packed into buckets of about options.buckets.bytes
// (frozen ones counted in: a bucket is a unit of both kinds).
std::vector<std::vector<ParamSpec>> auto_units(std::vector<ParamSpec> params, const LayoutOptions& options) {
  std::vector<std::vector<ParamSpec>> units;
  std::size_t next = 0;
  for (std::size_t count : FlatLayout::bucket_sizes(params, options)) {
    units.emplace_back(std::make_move_iterator(params.begin() + static_cast<std::ptrdiff_t>(next)),
                       std::make_move_iterator(params.begin() + static_cast<std::ptrdiff_t>(next + count)));
    next += count;
  }
  return units;
}
}  // namespace

struct Engine::Units {
  std::vector<ParamSpec> params;  // in the order given
  std::vector<std::size_t> index_in_layout, unit_of;
  std::vector<std::vector<std::size_t>> unit_params;
  FlatLayout trainable, frozen;

  // Each unit's trainable parameters go to one layout, its frozen ones to
  // another (one bucket per unit in each). Without frozen parameters the
  // trainable layout is exactly today's and the frozen one has no bucket.
  Units(std::vector<std::vector<ParamSpec>> units, const LayoutOptions& options) {
    std::vector<std::vector<ParamSpec>> trainable_units(units.size()), frozen_units(units.size());
    bool any_frozen = false;
    for (std::size_t u = 0; u < units.size(); ++u) {
      ZERO_CHECK(!units[u].empty(), "parameter group ", u, " is empty");
      unit_params.emplace_back();
      for (ParamSpec& p : units[u]) {
        auto& into = p.frozen ? frozen_units[u] : trainable_units[u];
        any_frozen = any_frozen || p.frozen;
        unit_params.back().push_back(params.size());
        unit_of.push_back(u);
        index_in_layout.push_back(p.frozen ? frozen_count() + frozen_units[u].size()
                                           : trainable_count() + trainable_units[u].size());
        into.push_back(p);
        params.push_back(std::move(p));
      }
      trainable_total += trainable_units[u].size();
      frozen_total += frozen_units[u].size();
    }
    trainable = FlatLayout::build_grouped(trainable_units, options, any_frozen);
    if (any_frozen) frozen = FlatLayout::build_grouped(frozen_units, options, true);
  }

 private:
  std::size_t trainable_total = 0, frozen_total = 0;
  std::size_t trainable_count() const { return trainable_total; }
  std::size_t frozen_count() const { return frozen_total; }
};

Engine::Engine(std::vector<ParamSpec> params, const EngineOptions& options, Communicator& comm,
               Backend& backend)
    : Engine(Units(auto_units(std::move(params), layout_options(options, comm)), layout_options(options, comm)),
             options, comm, backend) {}

Engine::Engine(std::vector<std::vector<ParamSpec>> groups, const EngineOptions& options,
               Communicator& comm, Backend& backend)
    : Engine(Units(std::move(groups), layout_options(options, comm)), options, comm, backend) {}

Engine::Engine(Units units, const EngineOptions& options, Communicator& comm, Backend& backend)
    : options_(options),
      params_(std::move(units.params)),
      index_in_layout_(std::move(units.index_in_layout)),
      unit_of_(std::move(units.unit_of)),
      unit_params_(std::move(units.unit_params)),
      layout_(std::move(units.trainable)),
      frozen_layout_(std::move(units.frozen)),
      lr_(options.optimizer.lr),
      scaler_(options.effective_loss_scaling() ? options.loss_scaler : LossScalerOptions{.dynamic = false, .initial_scale = 1.0}) {
  options_.validate();
  const int shard_size = shard_world_size(options_, comm);
  ZERO_CHECK(comm.memory_kind() == backend.memory_kind(), "communicator '", comm.backend_name(),
             "' works on ", comm.memory_kind() == MemoryKind::host ? "host" : "device",
             " memory but backend '", backend.name(), "' allocates ",
             backend.memory_kind() == MemoryKind::host ? "host" : "device", " memory");
  // Every rank must build the same layout; a mismatch would silently pair
  // different parameters in the collectives.
  // (Over the whole world, before any split: a rank with another shard
  // group size would split differently and wait forever.)
  std::array<double, 5> mine = {static_cast<double>(layout_.padded_numel()),
                                static_cast<double>(params_.size()),
                                static_cast<double>(options_.stage),
                                static_cast<double>(frozen_layout_.padded_numel()),
                                static_cast<double>(shard_size)};
  std::array<double, 5> low = mine, high = mine;
  comm.all_reduce_host_f64(low.data(), 5, ReduceOp::min);
  comm.all_reduce_host_f64(high.data(), 5, ReduceOp::max);
  ZERO_CHECK(low == high, "ranks disagree on the model: this rank has ", params_.size(),
             " parameters (", layout_.padded_numel(), " padded trainable and ", frozen_layout_.padded_numel(),
             " frozen elements, stage ", options_.stage, ", shard groups of ", shard_size, "), others between ",
             low[1], " and ", high[1], " parameters (", low[0], " to ", high[0], " trainable and ", low[3], " to ",
             high[3], " frozen elements, stage ", low[2], " to ", high[2], ", shard groups of ", low[4], " to ",
             high[4], ")");
  Communicator& shards = shard_comm(comm);
  rank_ = shards.rank();
  world_ = shards.size();
  for (const ParamSpec& p : layout_.params())
    ZERO_CHECK(p.group >= 0 && static_cast<std::size_t>(p.group) < options_.group_count(), "parameter '", p.name,
               "' is in group ", p.group, " but EngineOptions.param_groups has ", options_.group_count(),
               options_.param_groups.empty() ? " (none given: every parameter is in group 0)" : "");
  impl_ = std::make_unique<Impl>(shards, hybrid_.replica.get(), backend, layout_, frozen_layout_, options_);
}

Communicator& Engine::shard_comm(Communicator& world) {
  if (options_.shard_group_size <= 0 || options_.shard_group_size == world.size()) return world;
  hybrid_ = world.split_hybrid(options_.shard_group_size);
  replica_ = hybrid_.replica->rank();
  replicas_ = hybrid_.replica->size();
  return *hybrid_.shard;
}

// Impl refers to the layouts and options_: it must go before they do.
Engine::~Engine() { impl_.reset(); }

const StagePlan& Engine::plan() const { return impl_->plan; }

// ---------------------------------------------------------------- parameters

namespace {
// The part of a parameter inside rank's slice of its bucket, in full-buffer
// coordinates: [lo, hi), empty when lo >= hi.
struct OwnPart {
  std::size_t own = 0, lo = 0, hi = 0;
};
OwnPart own_part(const FlatLayout& layout, const ParamSlot& slot, int rank) {
  const Bucket& bucket = layout.buckets()[slot.bucket];
  const std::size_t own = bucket.offset + static_cast<std::size_t>(rank) * bucket.shard_size;
  return {own, std::max(slot.offset, own), std::min(slot.offset + slot.numel, own + bucket.shard_size)};
}
}  // namespace

void Engine::set_param(std::size_t param, const float* host_values) {
  ZERO_CHECK(param < params_.size(), "set_param: parameter index ", param, " of ", params_.size());
  Impl& m = *impl_;
  m.settle();
  const bool is_frozen = params_[param].frozen;
  const FlatLayout& where = is_frozen ? frozen_layout_ : layout_;
  const ParamSlot& slot = where.slots()[index_in_layout_[param]];
  ZERO_CHECK(host_values != nullptr || slot.numel == 0, "set_param('", params_[param].name, "'): null values");
  std::vector<std::byte> rounded(slot.numel * m.p_size);
  for (std::size_t i = 0; i < slot.numel; ++i) store_from_float(rounded.data(), i, m.pdt, host_values[i]);
  const Bucket& bucket = where.buckets()[slot.bucket];
  const auto [own, lo, hi] = own_part(where, slot, rank_);
  std::byte* full = is_frozen ? m.frozen_full : m.params_full;
  std::byte* shard = is_frozen ? m.frozen_shard : m.param_shard;
  if (m.plan.params_full) {
    m.backend.copy_from_host(full + slot.offset * m.p_size, rounded.data(), rounded.size());
  } else if (lo < hi) {
    std::byte* out = shard + (bucket.shard_offset + lo - own) * m.p_size;
    const std::byte* in = rounded.data() + (lo - slot.offset) * m.p_size;
    if (m.plan.params_on_host) m.backend.host_copy(out, in, (hi - lo) * m.p_size);
    else m.backend.copy_from_host(out, in, (hi - lo) * m.p_size);
  }
  if (!m.master || is_frozen) return;
  if (m.plan.optimizer_full) {
    m.backend.copy_from_host(m.master + slot.offset, host_values, slot.numel * 4);
  } else if (lo < hi) {
    m.state_from_host(m.master + bucket.shard_offset + (lo - own), host_values + (lo - slot.offset), (hi - lo) * 4);
  }
}

const void* Engine::param_data(std::size_t param) const {
  ZERO_CHECK(param < params_.size(), "param_data: parameter index ", param, " of ", params_.size());
  Impl& m = *impl_;
  const bool is_frozen = params_[param].frozen;
  const FlatLayout& where = is_frozen ? frozen_layout_ : layout_;
  const ParamSlot& slot = where.slots()[index_in_layout_[param]];
  if (m.plan.params_full) {
    if (is_frozen) return m.frozen_full + slot.offset * m.p_size;  // never re-gathered
    m.finish_param_gather(slot.bucket);
    return m.params_full + slot.offset * m.p_size;
  }
  ZERO_CHECK(m.unit_refs[slot.bucket] > 0, "param_data('", params_[param].name, "'): its unit ", slot.bucket,
             " is not gathered (stage 3: call gather_unit first)");
  const std::byte* unit;
  if (m.plan.units_in_place)
    unit = (is_frozen ? m.frozen_shard : m.param_shard) + where.buckets()[slot.bucket].shard_offset * m.p_size;
  else
    unit = is_frozen ? m.frozen_unit_buffer[slot.bucket] : m.unit_buffer[slot.bucket];
  return unit + (slot.offset - where.buckets()[slot.bucket].offset) * m.p_size;
}

// ---------------------------------------------------------------- optimizer

StepResult Engine::step() {
  Impl& m = *impl_;
  ZERO_CHECK(m.micro_step == options_.accumulation_steps, "step() after ", m.micro_step,
             " micro-steps; accumulation_steps is ", options_.accumulation_steps,
             " (call finish_micro_step() after each)");
  m.finish_param_gathers();  // the optimizer is about to write the parameters
  m.prepared_for_capture = false;  // what a capture must follow is queued from here on
  StepResult result;

  // 1. Global statistics of the reduced gradients, each rank over the slices
  // it owns, summed in rank order: the same bits at every stage.
  const GradStats local = local_grad_stats(result);
  std::array<double, 2> global = {local.sum_squares, local.nonfinite ? 1.0 : 0.0};
  {
    const auto start = std::chrono::steady_clock::now();
    m.comm.all_reduce_host_f64(global.data(), 2, ReduceOp::sum);
    m.comm_wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  const bool nonfinite = global[1] > 0 || !std::isfinite(global[0]);

  // 2. The loss scale and the skip decision. The reduced gradient is the
  // rank average of the sum over micro-steps of (loss scale x gradient); the
  // optimizer wants the plain mean.
  const double divisor = scaler_.scale() * options_.accumulation_steps;
  const bool proceed = scaler_.update(nonfinite) && !nonfinite;
  // Blocks beyond the cache's limit go back here, not at the end: cudaFree
  // waits for the whole device, and here both streams are idle (the
  // statistics were read) before the update queues its uploads.
  m.pool.trim();
  m.updater->finish_previous(result);
  if (m.host_worker) {
    result.host_add_wait_seconds = m.host_worker->take_wait_seconds();
  }
  result.loss_scale = scaler_.scale();
  result.grad_norm = nonfinite ? std::numeric_limits<double>::infinity() : std::sqrt(global[0]) / divisor;

  // 3. The update (and the gathers that bring the parameters back).
  if (proceed) {
    consecutive_nonfinite_ = 0;
    if (options_.max_grad_norm > 0 && result.grad_norm > options_.max_grad_norm)
      result.clip_coefficient = options_.max_grad_norm / (result.grad_norm + 1e-6);
    ++step_;
    detail::UpdateArgs args{.groups = {}, .ema_decay = options_.ema.decay_at(step_), .step = step_};
    for (std::size_t g = 0; g < options_.group_count(); ++g) {
      const OptimizerOptions group = options_.group_optimizer(g);
      args.groups.push_back(
          {group, make_step_scalars(group, step_, lr_ * options_.group_lr_scale(g), result.clip_coefficient / divisor)});
    }
    m.updater->apply(args, result);
  } else {
    ++skipped_total_;
    ++consecutive_nonfinite_;
  }
  result.applied = proceed;
  result.step = step_;

  m.reset_gradients();
  m.micro_step = 0;
  result.host_to_device_bytes = std::exchange(m.bytes_to_device, 0);
  result.device_to_host_bytes = std::exchange(m.bytes_to_host, 0);
  const detail::BufferPool::Calls calls = m.pool.calls();
  result.block_allocations = calls.allocations - m.pool_calls_at_step.allocations;
  result.block_frees = calls.frees - m.pool_calls_at_step.frees;
  result.block_waits = calls.waits - m.pool_calls_at_step.waits;
  m.pool_calls_at_step = calls;
  if (!proceed && options_.max_consecutive_nonfinite > 0 &&
      consecutive_nonfinite_ >= options_.max_consecutive_nonfinite) {
    ZERO_THROW(Error, consecutive_nonfinite_, " steps in a row had non-finite gradients (limit ",
               options_.max_consecutive_nonfinite, "); stopping. Master weights are untouched since step ",
               step_, ". Lower the learning rate or check the data.");
  }
  return result;
}

GradStats Engine::local_grad_stats(StepResult& result) {
  Impl& m = *impl_;
  const auto& buckets = layout_.buckets();
  if (m.plan.streams_grads_to_host) {  // the gradients are in host memory: summed there, the same way
    // Each bucket's were summed on the host worker as its gradient of the
    // step landed, beside backward (the last finish_micro_step waited for
    // them; reset_gradients clears the flags); here they are added in bucket
    // order, as the whole shard's would be.
    // With the statistics summed on the device, they come back in one copy.
    const auto start = std::chrono::steady_clock::now();
    if (m.plan.grad_stats_on_device_before_download)
      m.backend.read_grad_stats(m.bucket_stats.data(), buckets.size(), m.backend.comm_stream());
    GradStats local;
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      ZERO_ASSERT(m.bucket_stats_queued[b], "bucket ", b, "'s gradient statistics were not queued this step");
      const GradStats part = m.bucket_stats[b];
      local.sum_squares += part.sum_squares;
      local.nonfinite = local.nonfinite || part.nonfinite;
    }
    result.cpu_grad_stats_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return local;
  }
  std::vector<Backend::Span> spans(buckets.size());
  for (std::size_t b = 0; b < buckets.size(); ++b) spans[b] = {m.reduced_grad(b), buckets[b].shard_size};
  return m.backend.grad_stats(spans.data(), spans.size(), m.gdt, m.backend.compute_stream());
}

int Engine::micro_step() const { return impl_->micro_step; }

// ---------------------------------------------------------------- memory

MemoryByCategory Engine::memory() const {
  const detail::BufferPool& p = impl_->pool;
  const std::size_t replica_workspace = impl_->replica_comm ? impl_->replica_comm->workspace_bytes() : 0;
  return {p.current(kParams), p.current(kGrads),   p.current(kMaster),
          p.current(kState),  p.current(kEma),     p.current(kBuffers) + impl_->comm.workspace_bytes() + replica_workspace};
}

double Engine::comm_wait_seconds() const { return impl_->comm_wait_seconds; }

MemoryByCategory Engine::peak_memory() const {
  const detail::BufferPool& p = impl_->pool;
  const std::size_t replica_workspace = impl_->replica_comm ? impl_->replica_comm->peak_workspace_bytes() : 0;
  return {p.peak(kParams), p.peak(kGrads), p.peak(kMaster),
          p.peak(kState),  p.peak(kEma),   p.peak(kBuffers) + impl_->comm.peak_workspace_bytes() + replica_workspace};
}

MemoryByCategory Engine::host_memory() const {
  const detail::BufferPool& p = impl_->pool;
  return {p.host_current(kParams), p.host_current(kGrads), p.host_current(kMaster),
          p.host_current(kState),  p.host_current(kEma),   p.host_current(kBuffers)};
}

int Engine::steps_before_steady() const { return impl_->updater->steps_before_steady(); }

TransientMemory Engine::transient_memory() const {
  const detail::TransientUse now = impl_->pool.transient_now(), peak = impl_->pool.transient_peak();
  return {.gathered_units_at_peak = peak.gathered_units,
          .bucket_buffers_at_peak = peak.bucket_buffers,
          .cached_blocks_at_peak = peak.cached_blocks,
          .now = now.total()};
}

MemoryByCategory Engine::predicted_model_state() const {
  return model_state_bytes(impl_->plan, layout_.padded_numel(), frozen_layout_.padded_numel());
}

MemoryByCategory Engine::predicted_host_state() const {
  return host_model_state_bytes(impl_->plan, layout_.padded_numel(), frozen_layout_.padded_numel());
}

std::size_t Engine::trainable_index(std::size_t param, const char* what) const {
  ZERO_CHECK(param < params_.size(), what, ": parameter index ", param, " of ", params_.size());
  ZERO_CHECK(!params_[param].frozen, what, "('", params_[param].name, "'): the parameter is frozen (no gradient)");
  return index_in_layout_[param];
}

}  // namespace zero
