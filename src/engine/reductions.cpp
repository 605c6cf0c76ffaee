// The gradient path: a bucket whose gradients are complete is
// reduce-scattered (averaged over ranks) on the comm stream into where the
// StagePlan says reduced gradients live: in place in the full buffer, into
// the sharded accumulator (through scratch after the first micro-step), or
// into scratch that is copied down to the host (streamed offload; with
// accumulation on the host, the micro-steps after the first into staging,
// which the CPU adds into the host gradient shard once the copy has landed).
#include "engine_impl.hpp"

#include <algorithm>
#include <utility>

namespace zero {

void Engine::Impl::issue_reduce(std::size_t b) {
  const Bucket& bucket = layout.buckets()[b];
  const std::byte* input = plan.full_grads ? grads_full + bucket.offset * g_size : bucket_buffer[b];
  ZERO_ASSERT(input != nullptr || bucket.padded == 0, "bucket ", b, " has no gradient buffer");
  Pending entry{b, nullptr};
  void* destination;
  if (plan.reduces_in_place()) {
    destination = grads_full + own_offset(b) * g_size;
  } else if (plan.streams_grads_to_host && world == 1 && !replica_comm) {
    // One rank: the average is the gradient itself, copied down straight
    // from the bucket buffer in complete() (no scratch, no collective).
    destination = nullptr;
  } else if (plan.streams_grads_to_host || accumulator_has_data[b]) {
    // No device shard (reduced into scratch, copied down in complete()), or
    // a later micro-step (reduced into scratch, added to the accumulator).
    entry.scratch_bytes = bucket.shard_size * g_size;
    entry.scratch = pool.acquire(kBuffers, entry.scratch_bytes, backend.comm_stream());
    destination = entry.scratch;
  } else {
    destination = grad_shard + bucket.shard_offset * g_size;
    accumulator_has_data[b] = 1;
  }
  // The gradients were written on the compute stream.
  order_after(backend.comm_stream(), backend.compute_stream());
  if (destination) {
    entry.work = comm.reduce_scatter(input, destination, bucket.shard_size, gdt, ReduceOp::avg, backend.comm_stream());
    if (replica_comm) {
      // Hybrid sharding: the group's average of this shard, averaged across
      // the replicas that hold the same shard. Device communicators order the
      // two on the stream; a host one must finish the first before the second reads it.
      if (comm.memory_kind() == MemoryKind::host) wait_for_collective(*entry.work);
      entry.work = replica_comm->all_reduce(destination, bucket.shard_size, gdt, ReduceOp::avg, backend.comm_stream());
    }
  }
  pending.push_back(std::move(entry));
  // The step's last backward reads this bucket's parameters no more: the
  // delayed update may send its new ones up now.
  if (micro_step + 1 == options.accumulation_steps) updater->on_bucket_released(b);
  // Bound the memory of reductions in flight (their input buffers and the
  // communicator's scratch): complete the oldest beyond the limit.
  while (pending.size() > static_cast<std::size_t>(options.buckets.max_reductions_in_flight)) {
    complete(pending.front());
    pending.pop_front();
  }
}

void Engine::Impl::complete(Pending& entry) {
  if (entry.work) wait_for_collective(*entry.work);
  const Bucket& bucket = layout.buckets()[entry.bucket];
  if (plan.streams_grads_to_host) {
    // The reduced slice goes down now, overlapping the rest of backward.
    const bool add_from_staging = plan.accumulates_on_host && micro_step > 0;
    const bool last_of_step = micro_step + 1 == options.accumulation_steps;
    std::byte* scratch = static_cast<std::byte*>(entry.scratch);
    std::size_t scratch_bytes = entry.scratch_bytes;
    const void* reduced = entry.scratch;
    if (!entry.scratch && plan.reduces_in_place()) {
      reduced = reduced_grad(entry.bucket);
    } else if (!entry.scratch && plan.full_grads) {  // one rank, stage 1: the slice of the full buffer
      reduced = grads_full + bucket.offset * g_size;
    } else if (!entry.scratch) {  // one rank: the bucket buffer itself
      scratch = bucket_buffer[entry.bucket];
      scratch_bytes = bucket.padded * g_size;
      bucket_buffer[entry.bucket] = nullptr;
      reduced = scratch;
    }
    const std::size_t at = bucket.shard_offset * g_size;
    std::byte* host = (add_from_staging ? updater->host_gradient_staging() : updater->host_gradients()) + at;
    // The last micro-step's addition must have read this staging slice.
    if (add_from_staging) host_worker->wait(std::exchange(staging_add[entry.bucket], 0));
    copy_to_host(host, reduced, bucket.shard_size * g_size, backend.comm_stream());
    const Event copied = backend.record_event(backend.comm_stream());
    download_events.push_back(copied);
    // Summed on the device while it goes down (after the copy's event, which
    // the host worker waits for), before the scratch is given back.
    const bool stats_on_device = last_of_step && plan.grad_stats_on_device_before_download;
    if (stats_on_device) {
      backend.queue_grad_stats({reduced, bucket.shard_size}, gdt, entry.bucket, backend.comm_stream());
      bucket_stats_queued[entry.bucket] = 1;
    }
    // Its next user waits on the device for the copy, not this thread.
    if (scratch) pool.give_back(kBuffers, scratch, scratch_bytes, backend.comm_stream());
    entry.scratch = nullptr;
    // The worker waits for the copy, then adds the staged slice into the
    // host shard (accumulating on the host) and, at the step's last
    // micro-step, sums the bucket's whole gradient of the step.
    if (add_from_staging)
      staging_add[entry.bucket] =
          host_worker->add(updater->host_gradients() + at, updater->host_gradient_staging() + at, bucket.shard_size,
                           copied);
    if (last_of_step && !stats_on_device) {
      host_worker->stats(updater->host_gradients() + at, bucket.shard_size, &bucket_stats[entry.bucket], copied);
      bucket_stats_queued[entry.bucket] = 1;
    }
  }
  if (entry.scratch) {
    backend.accumulate(grad_shard + bucket.shard_offset * g_size, entry.scratch, gdt, bucket.shard_size,
                       backend.comm_stream());
    pool.give_back(kBuffers, entry.scratch, entry.scratch_bytes, backend.comm_stream());
  }
  if (!plan.full_grads && bucket_buffer[entry.bucket]) {
    pool.give_back(kBuffers, bucket_buffer[entry.bucket], bucket.padded * g_size, backend.comm_stream());
    bucket_buffer[entry.bucket] = nullptr;
  }
}

void Engine::Impl::complete_all() {
  while (!pending.empty()) {
    complete(pending.front());
    pending.pop_front();
  }
  // The micro-step's gradients are in host memory when it ends.
  for (; download_events_waited < download_events.size(); ++download_events_waited)
    backend.wait_event(download_events[download_events_waited]);
  order_after(backend.compute_stream(), backend.comm_stream());
}

void Engine::Impl::finish_host_work() {
  if (!host_worker) return;
  host_worker->wait_all();
  std::fill(staging_add.begin(), staging_add.end(), 0);
  release_download_events();
}

void Engine::Impl::release_download_events() {
  // Only once no worker job can still be waiting for one of them.
  for (Event e : download_events) {
    backend.wait_event(e);
    backend.release_event(e);
  }
  download_events.clear();
  download_events_waited = 0;
}

void Engine::Impl::reset_gradients() {
  const Stream compute = backend.compute_stream();
  // Written, not added to, where clear: nothing to zero (padding was zeroed
  // at allocation, and reductions keep it zero).
  if (grads_full && !writes_full_grads()) backend.fill_zero(grads_full, layout.padded_numel() * g_size, compute);
  // The shard accumulator is written only on the comm stream (reductions,
  // accumulation), where a delayed update's download of it is queued too:
  // zeroed there, after what the compute stream read of it (statistics, the
  // on-device update), so the next forward need not wait for that download.
  if (grad_shard) {
    order_after(backend.comm_stream(), compute);
    backend.fill_zero(grad_shard, layout.shard_numel() * g_size, backend.comm_stream());
  }
  std::fill(accumulator_has_data.begin(), accumulator_has_data.end(), 0);
  std::fill(bucket_stats_queued.begin(), bucket_stats_queued.end(), 0);
}

// ---------------------------------------------------------------- Engine: gradients

void* Engine::grad_data(std::size_t param) { return trainable_grad_data(trainable_index(param, "grad_data")); }

void Engine::grad_ready(std::size_t param) { trainable_grad_ready(trainable_index(param, "grad_ready")); }

void Engine::set_gradient_writes(GradientWrites writes) {
  Impl& m = *impl_;
  ZERO_CHECK(m.micro_step == 0 && std::none_of(m.param_ready.begin(), m.param_ready.end(), [](char r) { return r != 0; }),
             "set_gradient_writes: only between steps (micro-step ", m.micro_step, " has begun)");
  const bool was_writing = m.writes_full_grads();
  m.gradient_writes = writes;
  // Back to adding: the buffer's dead contents must be zeros again.
  if (was_writing && !m.writes_full_grads())
    m.backend.fill_zero(m.grads_full, layout_.padded_numel() * m.g_size, m.backend.compute_stream());
}

Engine::GradientWrites Engine::gradient_writes() const { return impl_->gradient_writes; }

bool Engine::grad_slot_is_clear(std::size_t param) const {
  const Impl& m = *impl_;
  const std::size_t t = trainable_index(param, "grad_slot_is_clear");
  return m.writes_full_grads() && !m.param_ready[t] && m.full_grads_clear_each_micro_step();
}

// Below, `param` indexes layout_ (the trainable parameters).
void* Engine::trainable_grad_data(std::size_t param) {
  Impl& m = *impl_;
  const ParamSlot& slot = layout_.slots()[param];
  ZERO_CHECK(!m.param_ready[param], "grad_data('", layout_.params()[param].name,
             "'): its gradient was already declared ready in this micro-step");
  ZERO_CHECK(m.micro_step < options_.accumulation_steps, "grad_data: all ", options_.accumulation_steps,
             " micro-steps of this step are done; call step() first");
  if (m.plan.full_grads) return m.grads_full + slot.offset * m.g_size;
  const Bucket& bucket = layout_.buckets()[slot.bucket];
  if (!m.bucket_buffer[slot.bucket])
    m.bucket_buffer[slot.bucket] = m.pool.acquire(kBuffers, bucket.padded * m.g_size, m.backend.compute_stream());
  return m.bucket_buffer[slot.bucket] + (slot.offset - bucket.offset) * m.g_size;
}

void Engine::trainable_grad_ready(std::size_t param) {
  Impl& m = *impl_;
  ZERO_CHECK(!m.param_ready[param], "grad_ready('", layout_.params()[param].name,
             "') called twice in one micro-step");
  ZERO_CHECK(m.micro_step < options_.accumulation_steps, "grad_ready: all ", options_.accumulation_steps,
             " micro-steps of this step are done; call step() first");
  const std::size_t b = layout_.slots()[param].bucket;
  if (!m.plan.full_grads && !m.bucket_buffer[b]) trainable_grad_data(param);  // an unused parameter: zero gradient
  m.param_ready[param] = 1;
  if (++m.bucket_ready_count[b] < layout_.buckets()[b].param_count) return;
  const bool last_micro_step = m.micro_step + 1 == options_.accumulation_steps;
  if (m.plan.reduce_only_at_boundary && !last_micro_step) return;
  m.issue_reduce(b);
}

void Engine::finish_micro_step() {
  Impl& m = *impl_;
  ZERO_CHECK(m.micro_step < options_.accumulation_steps, "finish_micro_step: all ",
             options_.accumulation_steps, " micro-steps of this step are done; call step() first");
  for (std::size_t p = 0; p < m.param_ready.size(); ++p) {
    if (m.param_ready[p]) continue;
    // No gradient: with a buffer that is not zeroed, zero the slot here.
    if (m.writes_full_grads() && m.full_grads_clear_each_micro_step()) {
      const ParamSlot& slot = layout_.slots()[p];
      m.backend.fill_zero(m.grads_full + slot.offset * m.g_size, layout_.params()[p].numel * m.g_size,
                          m.backend.compute_stream());
    }
    trainable_grad_ready(p);
  }
  // A unit whose parameters are all frozen has an empty trainable bucket (all
  // padding): reduced like the others, so that every path finds every bucket's
  // (zero) gradient where it looks.
  const bool last_micro_step = m.micro_step + 1 == options_.accumulation_steps;
  for (std::size_t b = 0; b < layout_.buckets().size(); ++b) {
    if (layout_.buckets()[b].param_count != 0 || (m.plan.reduce_only_at_boundary && !last_micro_step)) continue;
    if (!m.plan.full_grads)
      m.bucket_buffer[b] = m.pool.acquire(kBuffers, layout_.buckets()[b].padded * m.g_size, m.backend.compute_stream());
    m.issue_reduce(b);
  }
  m.complete_all();
  m.check_gathers();  // stage 3's gathers of this micro-step, checked before it counts as done
  if (last_micro_step) {
    m.finish_host_work();  // the step reads the host gradients (and their statistics) next
    m.updater->on_backward_done();
  }
  // Reducing every micro-step out of a full buffer (stages 0-1): it held only
  // this micro-step's local gradient, now in the accumulator.
  if (m.reduces_full_grads_each_micro_step() && !m.writes_full_grads())
    m.backend.fill_zero(m.grads_full, layout_.padded_numel() * m.g_size, m.backend.compute_stream());
  std::fill(m.param_ready.begin(), m.param_ready.end(), 0);
  std::fill(m.bucket_ready_count.begin(), m.bucket_ready_count.end(), 0);
  ++m.micro_step;
}

}  // namespace zero
