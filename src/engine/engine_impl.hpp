// Engine::Impl: the engine's buffers and per-step bookkeeping, shared by the
// files of src/engine that implement Engine (engine.cpp: parameters and
// gathers; reductions.cpp: the gradient path; step.cpp: the optimizer step;
// engine_state.cpp: checkpoints and inspection) and by the updaters.
// Internal to src/engine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <vector>

#include "buffer_pool.hpp"
#include "host_gradient_worker.hpp"
#include "updater.hpp"
#include "zero/engine/engine.hpp"
#include "zero/engine/stage_plan.hpp"

namespace zero {

using detail::Category;
using detail::kBuffers;
using detail::kEma;
using detail::kGrads;
using detail::kMaster;
using detail::kParams;
using detail::kState;

struct Engine::Impl {
  Impl(Communicator& c, Communicator* replicas, Backend& b, const FlatLayout& l, const FlatLayout& frozen,
       const EngineOptions& o);
  ~Impl();

  Communicator& comm;            // the shard group (the world without hybrid sharding)
  Communicator* replica_comm;    // hybrid sharding: the ranks holding the same shard; else null
  /// Host seconds blocked in wait_for_collective (Engine::comm_wait_seconds).
  double comm_wait_seconds = 0;
  /// work.wait(), its host time added to comm_wait_seconds; while a CUDA
  /// graph is captured, work.detach() (the caller orders on the device).
  void wait_for_collective(Work& work);
  // ---------------------------------------------------------------- CUDA graphs (graph_capture.cpp)
  bool capturing = false;
  bool captured = false;
  bool prepared_for_capture = false;  // prepare_graph_replay() ran, nothing since

  std::vector<char> captured_accumulator;  // accumulator_has_data as the captured micro-step left it
  Backend& backend;
  const FlatLayout& layout;         // trainable parameters
  const FlatLayout& frozen_layout;  // frozen ones (no bucket when none)
  const EngineOptions& options;
  const StagePlan plan;
  const int rank, world;
  const DType pdt, gdt;
  const DType sdt;  // the optimizer state's dtype (OptimizerOptions::state_dtype)
  const std::size_t p_size, g_size, s_size;
  detail::BufferPool pool;

  // ---------------------------------------------------------------- persistent buffers
  std::byte* params_full = nullptr;  // stages 0-2
  std::byte* param_shard = nullptr;  // stage 3 (pinned host memory with offload.params)
  float* master = nullptr;           // full at stage 0, else a shard; null when params are fp32 on the device
  std::byte* state0 = nullptr;       // the optimizer's state, in sdt (fp32 or bf16), laid out like master
  std::byte* state1 = nullptr;
  float* ema = nullptr;              // like master, when EMA is on
  bool ema_initialized = false;
  std::byte* grads_full = nullptr;   // plan.full_grads
  std::byte* grad_shard = nullptr;   // plan.grad_shard_on_device()
  // Frozen parameters: model-dtype values only, never updated, never reduced.
  std::byte* frozen_full = nullptr;   // plan.params_full: all of them on every rank
  std::byte* frozen_shard = nullptr;  // stage 3: this rank's slices (pinned host memory with offload.params)
  std::vector<std::byte*> frozen_unit_buffer;  // stage 3: gathered per unit, beside unit_buffer
  std::vector<WorkPtr> frozen_unit_work;
  bool has_frozen() const { return !frozen_layout.buckets().empty(); }
  /// How master, state and EMA are updated (on the device, offloaded, delayed).
  std::unique_ptr<detail::Updater> updater;

  // ---------------------------------------------------------------- parameter groups
  /// A run of one group's elements: [begin, begin + count) of a slice.
  struct Segment {
    std::size_t begin = 0, count = 0;
    int group = 0;
  };
  /// This rank's slice of bucket b cut into runs of one group (a parameter's
  /// run reaches to the next parameter, its padding included): one segment
  /// per slice without groups. full_segments: the same over the whole buffer
  /// (stage 0 updates everything).
  std::vector<std::vector<Segment>> segments;
  std::vector<Segment> full_segments;
  /// The segments of elements [lo, hi) of the full buffer, relative to lo.
  std::vector<Segment> segments_of(std::size_t lo, std::size_t hi) const;

  // ---------------------------------------------------------------- gradient path (reductions.cpp)
  struct Pending {
    std::size_t bucket;
    WorkPtr work;
    void* scratch = nullptr;  // reduced values still to be added to the accumulator (or copied down)
    std::size_t scratch_bytes = 0;
  };
  // Gradient downloads (plan.streams_grads_to_host): the event of each
  // bucket's copy to host memory. The device block it reads goes back to the
  // pool at once (stream-ordered: its next user waits on the device), and the
  // host worker's jobs on the slice wait for the copy on the worker's thread,
  // so backward's thread never waits for a copy. complete_all waits for them
  // (download_events_waited: how many it has); finish_host_work releases them
  // once the worker is done with them.
  std::vector<char> param_ready;
  std::vector<std::size_t> bucket_ready_count;
  std::vector<char> accumulator_has_data;  // this step
  std::vector<std::byte*> bucket_buffer;   // transient per-bucket gradient buffers
  std::deque<Pending> pending;
  std::vector<Event> download_events;
  std::size_t download_events_waited = 0;
  int micro_step = 0;  // micro-steps finished in this step; 0 again after step()
  /// How the model puts gradients into grad_data (Engine::set_gradient_writes).
  Engine::GradientWrites gradient_writes = Engine::GradientWrites::add;
  /// write_when_clear with a full gradient buffer: its slots are written, not
  /// added to, where clear, and never zeroed (the bucket buffers of the other
  /// stages are still added into).
  bool writes_full_grads() const {
    return gradient_writes == Engine::GradientWrites::write_when_clear && plan.full_grads;
  }
  /// The full buffer holds one micro-step's local gradient only: each is
  /// reduced out of it into the shard accumulator (stages 0-1 on several ranks
  /// without reduce_only_at_boundary).
  bool reduces_full_grads_each_micro_step() const {
    return plan.full_grads && plan.shard_accumulator && !plan.reduce_only_at_boundary;
  }
  /// A slot of the full buffer holds nothing to add to: the first micro-step
  /// of a step, or every micro-step where each is reduced out of it.
  bool full_grads_clear_each_micro_step() const { return micro_step == 0 || reduces_full_grads_each_micro_step(); }
  // plan.streams_grads_to_host: the host's work on the streamed gradients
  // on a thread of its own: with accumulates_on_host the additions of staged
  // slices into the host gradient shard (per bucket the ticket of the last
  // one that reads its staging slice, 0: none in flight), and each bucket's
  // statistics once its gradient of the step is whole (bucket_stats, valid
  // where bucket_stats_queued, after finish_host_work).
  std::unique_ptr<detail::HostGradientWorker> host_worker;
  std::vector<std::uint64_t> staging_add;
  std::vector<GradStats> bucket_stats;
  std::vector<char> bucket_stats_queued;

  void issue_reduce(std::size_t b);
  void complete(Pending& entry);
  /// Every reduction and download done; the compute stream ordered after them.
  void complete_all();
  /// Every host job done (host_worker): the host gradient shard is whole,
  /// and the queued statistics are in bucket_stats.
  void finish_host_work();
  /// The engine's copies between host and device memory (offload), counted
  /// for StepResult::host_to_device_bytes / device_to_host_bytes.
  void copy_to_device(void* device, const void* host, std::size_t bytes, Stream stream) {
    backend.copy(device, host, bytes, stream);
    bytes_to_device += bytes;
  }
  void copy_to_host(void* host, const void* device, std::size_t bytes, Stream stream) {
    backend.copy(host, device, bytes, stream);
    bytes_to_host += bytes;
  }
  std::uint64_t bytes_to_device = 0, bytes_to_host = 0;  // since the last step() returned
  detail::BufferPool::Calls pool_calls_at_step;  // the pool's calls when the last step() returned
  /// Waits for and releases download_events (the worker is idle or gone).
  void release_download_events();
  /// Zeroes the gradient buffers for the next step.
  void reset_gradients();

  // ---------------------------------------------------------------- parameter gathers (engine.cpp)
  // Stages 1-2: the all-gather of each bucket's updated slices after a step,
  // left in flight so that it overlaps the next forward; waited for per
  // bucket on first use or before anything else touches the parameters.
  std::vector<WorkPtr> param_gathers;
  // Stage 3: gathered unit buffers, their reference counts and gathers in flight.
  std::vector<std::byte*> unit_buffer;
  std::vector<int> unit_refs;
  std::vector<WorkPtr> unit_work;
  /// Stage 3: an event recorded on the comm stream after a unit's gathers
  /// (trainable and frozen) were issued. The compute stream waits on it,
  /// not on the comm stream's tail, which holds the prefetches of the units
  /// after it (offloaded: their uploads as well).
  std::vector<Event> unit_ready;
  /// Stage 3 on a device communicator: a unit's gather is ordered before its
  /// use on the device (order_after), so the host does not wait for it when
  /// the unit is entered. Waiting there drained the queue of launched kernels
  /// at every unit, and launch-bound micro-steps (small batches) and
  /// offloaded parameters' uploads paid for it. The host still waits for each
  /// gather (its errors, the communicator's timeout: a failed peer must not
  /// leave this rank hanging) kGathersAheadOfHost units later, when it has
  /// normally long completed, and for all of them at the end of a micro-step.
  static constexpr std::size_t kGathersAheadOfHost = 2;
  std::deque<WorkPtr> gathers_to_check;
  /// A host communicator's gather is waited for at once (the host computes
  /// with its result next); a device one's joins gathers_to_check.
  void check_gather_later(WorkPtr work);
  void check_gathers();
  /// Stage 3: gives back the buffers of units prefetched but never gathered
  /// (their values predate what the caller is about to change).
  void drop_unused_prefetches();

  void finish_param_gather(std::size_t b);
  void finish_param_gathers();
  /// Before anything reads or writes the state outside step(): a delayed
  /// update completed and uploaded, the parameter gathers done.
  void settle();
  /// Before the state is only read (Updater::settle_for_reading), the parameter gathers done.
  void settle_for_reading();

  // ---------------------------------------------------------------- shared pieces
  /// Makes `waiter` wait for the work queued on `producer` so far (an event,
  /// recorded and released), without blocking the host.
  void order_after(Stream waiter, Stream producer);
  /// All-gathers every rank's slice of bucket b into `dest` (the bucket's
  /// padded length, dtype elements) on the comm stream: in place from this
  /// rank's place in dest, or, when `own_on_host`, after copying `own` up into it.
  WorkPtr gather_bucket(std::size_t b, void* dest, DType dtype, const void* own, bool own_on_host);
  /// The same for bucket b of another layout (the frozen one).
  WorkPtr gather_bucket_of(const FlatLayout& of, std::size_t b, void* dest, DType dtype, const void* own,
                           bool own_on_host);
  /// gather_bucket for every bucket of a full buffer (`full` + bucket offsets),
  /// this rank's slice of bucket b at own(b).
  std::vector<WorkPtr> gather_buckets(void* full, DType dtype, const std::function<const void*(std::size_t)>& own,
                                      bool own_on_host);
  std::vector<WorkPtr> gather_buckets_of(const FlatLayout& of, void* full, DType dtype,
                                         const std::function<const void*(std::size_t)>& own, bool own_on_host);

  // ---------------------------------------------------------------- addresses
  /// This rank's slice of bucket b, in full-buffer coordinates.
  std::size_t own_offset(std::size_t b) const {
    const Bucket& bucket = layout.buckets()[b];
    return bucket.offset + static_cast<std::size_t>(rank) * bucket.shard_size;
  }
  /// The reduced (averaged) gradient of this rank's slice of bucket b.
  std::byte* reduced_grad(std::size_t b) const {
    if (plan.reduces_in_place()) return grads_full + own_offset(b) * g_size;
    return grad_shard + layout.buckets()[b].shard_offset * g_size;
  }
  /// This rank's slice of bucket b in an fp32 buffer laid out like the
  /// optimizer state: full at stage 0, a shard otherwise.
  float* optimizer_slice(float* base, std::size_t b) const { return base + optimizer_offset(b); }
  /// Where this rank's slice of bucket b starts, in elements, in a buffer laid
  /// out like the optimizer state (full at stage 0, a shard otherwise).
  std::size_t optimizer_offset(std::size_t b) const {
    return plan.optimizer_full ? own_offset(b) : layout.buckets()[b].shard_offset;
  }
  /// This rank's slice of bucket b of an optimizer state buffer (sdt).
  std::byte* state_slice(std::byte* base, std::size_t b) const { return base + optimizer_offset(b) * s_size; }
  /// The fp32 master values of this rank's slice of bucket b (the parameters
  /// themselves when they are fp32 on the device).
  float* master_slice(std::size_t b) const {
    if (master) return optimizer_slice(master, b);
    if (plan.gathers_units) return reinterpret_cast<float*>(param_shard) + layout.buckets()[b].shard_offset;
    return reinterpret_cast<float*>(params_full) + own_offset(b);
  }
  /// This rank's model-dtype slice of bucket b where the optimizer writes it.
  std::byte* own_params(std::size_t b) const {
    if (plan.gathers_units) return param_shard + layout.buckets()[b].shard_offset * p_size;
    return params_full + own_offset(b) * p_size;
  }
  /// Whether the fp32 state at `state` (in the master, the optimizer state or
  /// the EMA) lives in host memory: offloaded, and for the EMA not kept on
  /// the device (offload.ema_on_device).
  bool state_on_host(const void* state) const {
    const std::less<const void*> before;
    const bool in_ema = ema != nullptr && !before(state, ema) &&
                        before(state, ema + plan.optimizer_elements(layout.padded_numel()));
    return in_ema ? plan.ema_on_host : plan.optimizer_on_host;
  }
  // fp32 state slices to and from host memory: a plain copy when the state
  // lives there, a device transfer otherwise.
  void state_to_host(void* host_dst, const void* state, std::size_t bytes);
  void state_from_host(void* state, const void* host_src, std::size_t bytes);
};

}  // namespace zero
