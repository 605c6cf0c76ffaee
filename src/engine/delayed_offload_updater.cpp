// DelayedOffloadUpdater: ZeRO-Offload's delayed parameter update. step()
// still decides at once (statistics, clipping, loss scale, skip); the CPU
// update then runs on a background thread while the next forward and
// backward run on the device, and is joined, and its parameters sent up, at
// the next step() (or before anything reads or writes the state).
//
// What the background update reads and writes is never what the device
// touches meanwhile:
//   - gradients: with one micro-step (or accumulating on the host), two host
//     shards: backward streams into one while the update reads the other.
//     With several micro-steps accumulated on the device, start() queues
//     their download into the one host shard (the last update was joined
//     before), and the update waits for each bucket's copy to land.
//   - parameters: two staging copies (the update writes one while the other
//     may still be going up) or, with offload_params, two host parameter
//     shards: the gathers read Impl::param_shard, the update writes the
//     other, and the two are swapped when the update is joined.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <utility>

#include "updaters.hpp"

namespace zero::detail {

DelayedOffloadUpdater::DelayedOffloadUpdater(Engine::Impl& engine) : OffloadUpdater(engine) {
  const std::size_t shard = m_.layout.shard_numel();
  // Streamed gradients need a second shard for the next backward; with
  // several micro-steps they go down only at step(), after the join: one
  // pinned shard serves both.
  if (m_.plan.streams_grads_to_host) grad_host_spare_ = m_.pool.allocate_host(kBuffers, shard * m_.g_size);
  // Zeroed like param_shard: the update rewrites every trained slice, and the
  // all-padding slices stay zero in both.
  if (m_.plan.params_on_host) {
    params_spare_ = m_.pool.allocate_host(kBuffers, shard * m_.p_size);
  } else if (!m_.plan.uploads_master) {  // sending the master up, the update writes no copy
    copies_[0] = copy_host_;
    copies_[1] = m_.pool.allocate_host(kBuffers, shard * m_.p_size);
  }
  const std::size_t buckets = m_.layout.buckets().size();
  grad_downloaded_.assign(buckets, nullptr);
  // Stages 1-2 gather each bucket at step(): a slice sent up earlier only
  // changes when it arrives. (Offloaded parameters never go up; stage 3's
  // units are gathered from the shard as the forward needs them.)
  sends_during_backward_ =
      m_.options.offload.upload_during_backward && m_.plan.gathers_params_after_step && !m_.plan.params_on_host;
  released_.assign(buckets, 0);
  params_up_.assign(buckets, 0);
  up_event_.assign(buckets, nullptr);
  ema_up_.assign(buckets, 0);
}

DelayedOffloadUpdater::~DelayedOffloadUpdater() {
  if (thread_.joinable()) thread_.join();  // its error, if any, has no one left to go to
  release_downloads();  // (master_sent_: ~OffloadUpdater, after the copies it waits for)
  for (Event& e : sent_before_update_) m_.backend.release_event(std::exchange(e, nullptr));
  for (Event& e : up_event_) m_.backend.release_event(std::exchange(e, nullptr));
  if (backward_staging_) {
    try {
      m_.backend.synchronize(m_.backend.transfer_stream());
      m_.pool.give_back(kBuffers, reinterpret_cast<std::byte*>(backward_staging_), master_piece_ * 4,
                        m_.backend.transfer_stream());
    } catch (...) {
      // A failed device: the pool's own destruction frees what it can.
    }
  }

  for (Event& e : copy_uploaded_)
    if (e) {
      m_.backend.wait_event(e);
      m_.backend.release_event(e);
    }
  const std::size_t shard = m_.layout.shard_numel();
  m_.pool.free_host(grad_host_spare_, shard * m_.g_size);
  m_.pool.free_host(copies_[1], shard * m_.p_size);
  m_.pool.free_host(params_spare_, shard * m_.p_size);
}

void DelayedOffloadUpdater::finish_previous(StepResult& result) {
  // The last step's update (run while this step's forward and backward were
  // on the device) is done before anything else touches the state, and its
  // parameters go up whether or not this step applies.
  const bool was_running = thread_.joinable();
  result.cpu_update_wait_seconds = join();
  if (was_running) result.cpu_update_seconds = update_seconds_;
  result.buckets_up_during_backward = std::exchange(up_during_backward_, 0);
  upload();
}

void DelayedOffloadUpdater::apply(const UpdateArgs& args, StepResult& result) {
  if (args.step <= m_.options.offload.delayed_update_warmup_steps) {
    OffloadUpdater::apply(args, result);  // the warm-up updates synchronously
    return;
  }
  join_ema();  // a warm-up step's EMA reads the master this update writes
  start(args);  // joined and uploaded at the next step()
}

void DelayedOffloadUpdater::settle() {
  join_ema();
  join();
  upload();
}

void DelayedOffloadUpdater::settle_for_reading() {
  join_ema();
  join();
  // The EMA on the device is read exact: the finished update's master goes
  // up for it now, and again with the parameters at the next step() (or
  // during the next backward).
  for (std::size_t b = 0; b < m_.layout.buckets().size(); ++b) {
    if (!ema_owed(b)) continue;
    send_master(b, pending_ema_decay_, MasterUse::ema_only);
    ema_up_[b] = 1;
  }
}

void DelayedOffloadUpdater::on_bucket_released(std::size_t b) {
  if (!sends_during_backward_ || !upload_pending_ || m_.capturing) return;
  // The staging block is taken at the first release of the first backward
  // with an update pending (a rule of the step sequence, not of timing: the
  // planner's replay takes it too) and kept from then on. Given back at the
  // end of each backward, it was one more block in backward's working set
  // than the pool keeps between steps: 5 more blocks made and freed a step
  // (a cudaFree waits for the device) on an H100, +0.1 s a step.
  if (m_.plan.uploads_master && !backward_staging_)
    backward_staging_ = reinterpret_cast<float*>(
        m_.pool.acquire(kBuffers, master_piece_ * 4, m_.backend.transfer_stream()));
  released_[b] = 1;
  send_released();
}

void DelayedOffloadUpdater::on_backward_done() {
  if (!sends_during_backward_ || !upload_pending_ || m_.capturing) return;
  send_released();  // what the CPU finished since the last release
}

void DelayedOffloadUpdater::send_released() {
  Backend& be = m_.backend;
  const Stream transfer = be.transfer_stream();
  const auto& buckets = m_.layout.buckets();
  // The update finishes buckets in order; what it has written is visible
  // here after this load (release on its side).
  const std::size_t done = std::min(buckets_updated_.load(std::memory_order_acquire), buckets.size());
  bool ordered = false;
  for (std::size_t b = 0; b < done; ++b) {
    if (!released_[b] || params_up_[b]) continue;
    // After every kernel backward has queued so far: those that read the
    // released buckets' parameters included.
    if (!ordered) m_.order_after(transfer, be.compute_stream());
    ordered = true;
    if (m_.plan.uploads_master) {
      send_master(b, ema_owed(b) ? pending_ema_decay_ : 0, MasterUse::params, transfer, backward_staging_);
      ema_up_[b] = 1;
    } else {
      const Bucket& bucket = buckets[b];
      m_.copy_to_device(m_.own_params(b), copies_[update_copy_] + bucket.shard_offset * m_.p_size,
                        bucket.shard_size * m_.p_size, transfer);
    }
    // The bucket's gather at step() waits for this copy alone, not for the
    // transfer stream's tail (the buckets sent after it).
    up_event_[b] = be.record_event(transfer);
    params_up_[b] = 1;
    ++up_during_backward_;
  }
}

void DelayedOffloadUpdater::download_accumulated(std::byte* grads) {
  Backend& be = m_.backend;
  const auto& buckets = m_.layout.buckets();
  const Stream transfer = be.comm_stream();
  // The statistics were read on the compute stream; the accumulator was
  // last written on the comm stream, where the copies queue behind it.
  m_.order_after(transfer, be.compute_stream());
  for (std::size_t b = 0; b < buckets.size(); ++b) {
    m_.copy_to_host(grads + buckets[b].shard_offset * m_.g_size, m_.reduced_grad(b),
                    buckets[b].shard_size * m_.g_size, transfer);
    grad_downloaded_[b] = be.record_event(transfer);
  }
  // reset_gradients zeroes the shard accumulator on the comm stream, behind
  // these copies, so the next forward does not wait for them. Reduced in
  // place (stage 1, reducing at the boundary), the gradients live in the
  // full buffer that backward writes on the compute stream: that waits.
  if (m_.plan.reduces_in_place()) m_.order_after(be.compute_stream(), transfer);
}

void DelayedOffloadUpdater::release_downloads() {
  for (Event& e : grad_downloaded_) {
    m_.backend.release_event(e);
    e = nullptr;
  }
}

void DelayedOffloadUpdater::start(const UpdateArgs& args) {
  ZERO_ASSERT(!thread_.joinable(), "a delayed update is already running");
  // The shard this step's backward streamed into (the next one streams into
  // the other), or the one the accumulated gradients now go down into.
  std::byte* grads = grad_host_;
  if (m_.plan.streams_grads_to_host) std::swap(grad_host_, grad_host_spare_);
  else download_accumulated(grads);
  std::byte* copy = nullptr;  // plan.uploads_master: none, the device rounds the master
  if (m_.plan.uploads_master) {
    initialize_ema();  // on the device, from the master before this update writes it
  } else if (m_.plan.params_on_host) {
    // The spare shard is the one this step's gathers read (swapped out at
    // the join): they are done (the statistics waited for the reductions
    // queued after them), which the event makes certain before it is rewritten.
    Event gathered = m_.backend.record_event(m_.backend.comm_stream());
    m_.backend.wait_event(gathered);
    m_.backend.release_event(gathered);
    copy = params_spare_;
  } else {
    update_copy_ ^= 1;
    if (copy_uploaded_[update_copy_]) {  // queued a step ago: normally long done
      m_.backend.wait_event(copy_uploaded_[update_copy_]);
      m_.backend.release_event(copy_uploaded_[update_copy_]);
      copy_uploaded_[update_copy_] = nullptr;
    }
    copy = copies_[update_copy_];
  }
  // The average starts at the weights before the first update: copied on
  // the background thread too, before that update writes the master.
  const bool first_ema = m_.ema && !m_.ema_initialized;
  m_.ema_initialized = m_.ema_initialized || first_ema;
  upload_pending_ = true;
  pending_ema_decay_ = m_.plan.uploads_master && m_.ema ? args.ema_decay : 0;
  error_ = nullptr;
  std::fill(released_.begin(), released_.end(), 0);
  std::fill(params_up_.begin(), params_up_.end(), 0);
  std::fill(ema_up_.begin(), ema_up_.end(), 0);
  buckets_updated_.store(0, std::memory_order_relaxed);
  // The thread waits for the copies queued so far; this update's own sends
  // collect in master_sent_ from now on.
  ZERO_ASSERT(sent_before_update_.empty(), "the last update's copy events were not released");
  sent_before_update_ = std::exchange(master_sent_, std::vector<Event>(m_.layout.buckets().size(), nullptr));
  // The thread keeps its own copy of the arguments (the optimizer options
  // outlive it: they are the engine's) and of the download events (released
  // at the join, on this thread).
  // And of the events of the master's last copies up (uploads_master): a
  // slice is rewritten only once its copy is done.
  thread_ = std::thread([this, args, grads, copy, first_ema, downloaded = grad_downloaded_, sent = sent_before_update_] {
    const auto start = std::chrono::steady_clock::now();
    try {
      omp_set_num_threads(host_team_threads(m_.options.offload.update_threads));
      if (first_ema) m_.backend.host_copy(m_.ema, m_.master, m_.layout.shard_numel() * 4);
      for (std::size_t b = 0; b < m_.layout.buckets().size(); ++b) {
        if (downloaded[b]) m_.backend.wait_event(downloaded[b]);  // bucket b's gradients have landed
        if (sent[b]) m_.backend.wait_event(sent[b]);              // its master slice went up
        update_bucket(b, args, grads, copy, true);  // the EMA from cache, right behind each slice
        buckets_updated_.store(b + 1, std::memory_order_release);  // may go up during backward
      }
    } catch (...) {
      error_ = std::current_exception();
    }
    update_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  });
}

double DelayedOffloadUpdater::join() {
  if (!thread_.joinable()) return 0;
  const auto start = std::chrono::steady_clock::now();
  thread_.join();
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  release_downloads();
  for (Event& e : sent_before_update_) m_.backend.release_event(e);  // the thread waited for each
  sent_before_update_.clear();
  if (error_) {
    upload_pending_ = false;
    std::rethrow_exception(std::exchange(error_, nullptr));
  }
  return waited;
}

void DelayedOffloadUpdater::upload() {
  if (!upload_pending_) return;
  ZERO_ASSERT(!thread_.joinable(), "upload before the delayed update was joined");
  if (m_.plan.params_on_host) {
    // The gathers from now on read the updated shard; the old one is the
    // next update's to write.
    std::swap(m_.param_shard, params_spare_);
    upload_pending_ = false;
    return;
  }
  Backend& be = m_.backend;
  const auto& buckets = m_.layout.buckets();
  // The device may still be running backward, which reads the parameters.
  m_.order_after(be.comm_stream(), be.compute_stream());
  for (std::size_t b = 0; b < buckets.size(); ++b) {
    if (params_up_[b]) {
      // Sent during backward: gathered (and the copy buffer's event, below,
      // recorded) after it arrived.
      be.stream_wait(be.comm_stream(), up_event_[b]);
      be.release_event(std::exchange(up_event_[b], nullptr));
      if (m_.plan.gathers_params_after_step)
        m_.param_gathers[b] =
            m_.gather_bucket(b, m_.params_full + buckets[b].offset * m_.p_size, m_.pdt, m_.own_params(b), false);
    } else if (m_.plan.uploads_master) {
      send_master(b, ema_owed(b) ? pending_ema_decay_ : 0, MasterUse::params_and_gather);
    } else {
      upload_bucket(b, copies_[update_copy_]);
    }
  }
  if (!m_.plan.uploads_master) copy_uploaded_[update_copy_] = be.record_event(be.comm_stream());
  pending_ema_decay_ = 0;
  std::fill(params_up_.begin(), params_up_.end(), 0);
  finish_uploads();
  upload_pending_ = false;
}

}  // namespace zero::detail
