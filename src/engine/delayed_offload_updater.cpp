// DelayedOffloadUpdater: ZeRO-Offload's delayed parameter update. step()
// still decides at once (statistics, clipping, loss scale, skip); the CPU
// update then runs on a background thread while the next forward and
// backward run on the device, and is joined, and its parameters sent up, at
// the next step() (or before anything reads or writes the state).
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <utility>

#include "updaters.hpp"

namespace zero::detail {

DelayedOffloadUpdater::DelayedOffloadUpdater(Engine::Impl& engine) : OffloadUpdater(engine) {
  const std::size_t shard = m_.layout.shard_numel();
  copies_[0] = copy_host_;
  grad_host_spare_ = m_.pool.allocate_host(kBuffers, shard * m_.g_size);
  copies_[1] = m_.pool.allocate_host(kBuffers, shard * m_.p_size);
}

DelayedOffloadUpdater::~DelayedOffloadUpdater() {
  if (thread_.joinable()) thread_.join();  // its error, if any, has no one left to go to
  for (Event& e : copy_uploaded_)
    if (e) {
      m_.backend.wait_event(e);
      m_.backend.release_event(e);
    }
  const std::size_t shard = m_.layout.shard_numel();
  m_.pool.free_host(grad_host_spare_, shard * m_.g_size);
  m_.pool.free_host(copies_[1], shard * m_.p_size);
}

void DelayedOffloadUpdater::finish_previous(StepResult& result) {
  // The last step's update (run while this step's forward and backward were
  // on the device) is done before anything else touches the state, and its
  // parameters go up whether or not this step applies.
  const bool was_running = thread_.joinable();
  result.cpu_update_wait_seconds = join();
  if (was_running) result.cpu_update_seconds = update_seconds_;
  upload();
}

void DelayedOffloadUpdater::apply(const UpdateArgs& args, StepResult& result) {
  if (args.step <= m_.options.offload.delayed_update_warmup_steps) {
    OffloadUpdater::apply(args, result);  // the warm-up updates synchronously
    return;
  }
  initialize_ema();
  start(args);  // joined and uploaded at the next step()
}

void DelayedOffloadUpdater::settle() {
  join();
  upload();
}

void DelayedOffloadUpdater::start(const UpdateArgs& args) {
  ZERO_ASSERT(!thread_.joinable(), "a delayed update is already running");
  std::swap(grad_host_, grad_host_spare_);
  const std::byte* grads = grad_host_spare_;
  update_copy_ ^= 1;
  if (copy_uploaded_[update_copy_]) {  // queued a step ago: normally long done
    m_.backend.wait_event(copy_uploaded_[update_copy_]);
    m_.backend.release_event(copy_uploaded_[update_copy_]);
    copy_uploaded_[update_copy_] = nullptr;
  }
  std::byte* copy = copies_[update_copy_];
  upload_pending_ = true;
  error_ = nullptr;
  // The thread keeps its own copy of the arguments (the optimizer options
  // outlive it: they are the engine's).
  thread_ = std::thread([this, args, grads, copy] {
    const auto start = std::chrono::steady_clock::now();
    try {
      // Leave a core to the thread that drives the device meanwhile.
      omp_set_num_threads(std::max(1, omp_get_max_threads() - 1));
      for (std::size_t b = 0; b < m_.layout.buckets().size(); ++b) update_bucket(b, args, grads, copy);
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
  if (error_) {
    upload_pending_ = false;
    std::rethrow_exception(std::exchange(error_, nullptr));
  }
  return waited;
}

void DelayedOffloadUpdater::upload() {
  if (!upload_pending_) return;
  ZERO_ASSERT(!thread_.joinable(), "upload before the delayed update was joined");
  // The device may still be running backward, which reads the parameters.
  m_.order_after(m_.backend.comm_stream(), m_.backend.compute_stream());
  for (std::size_t b = 0; b < m_.layout.buckets().size(); ++b) upload_bucket(b, copies_[update_copy_]);
  copy_uploaded_[update_copy_] = m_.backend.record_event(m_.backend.comm_stream());
  finish_uploads();
  upload_pending_ = false;
}

}  // namespace zero::detail
