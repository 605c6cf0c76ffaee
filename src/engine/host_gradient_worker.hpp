// The host's work on streamed gradients (plan.streams_grads_to_host), on a
// thread of their own, beside the rest of backward. Internal to src/engine.
//
// - Additions (plan.accumulates_on_host): after the first micro-step of a
//   step each bucket's reduced slice lands in a staging shard and is added
//   into the host gradient shard.
// - Statistics: once a bucket's gradient of the step is whole in host memory
//   (its download landed, and its last addition ran), its sum of squares and
//   non-finite flag; step() only adds the buckets' results in bucket order.
// Done on the thread that drives the device, each job (a bucket's shard, tens
// of millions of elements) would hold back the kernel launches of the rest
// of backward, and the statistics of the whole shard would stand between
// backward and the update (0.13 s of step() for SDXL on the H200 host). The
// engine waits for a bucket's last addition before the next download
// overwrites its staging slice, and for all jobs before anything reads the
// host gradients (the step). Jobs run in the order queued, so the sums and
// the statistics are the same bits as on the driving thread.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>

#include "zero/engine/backend.hpp"

namespace zero::detail {

/// The OpenMP team of a host thread that works beside the device
/// (OffloadOptions::update_threads): `requested`, or with 0 OpenMP's default
/// less one, left to the thread that launches the kernels. Call it on the
/// thread that runs the team.
int host_team_threads(int requested);

class HostGradientWorker {
 public:
  /// threads: the worker's OpenMP team (host_team_threads).
  HostGradientWorker(Backend& backend, DType dtype, int threads = 0);
  /// Drops what is still queued (its buffers are about to go) after the
  /// job under way, and joins the thread.
  ~HostGradientWorker();
  HostGradientWorker(const HostGradientWorker&) = delete;
  HostGradientWorker& operator=(const HostGradientWorker&) = delete;

  /// Queues dst += src over `count` elements; returns its ticket. Both
  /// buffers must stay until wait(ticket) (or wait_all) has returned. With
  /// `after` (a backend event: the copy that brings src down), the worker
  /// waits for it first, so the thread that queues never waits for a copy;
  /// the event must stay until then (the caller releases it after wait_all).
  std::uint64_t add(void* dst, const void* src, std::size_t count, Event after = nullptr);
  /// Queues *out = Backend::host_grad_stats(data, count) behind everything
  /// queued before; returns its ticket. data, out and after as for add().
  std::uint64_t stats(const void* data, std::size_t count, GradStats* out, Event after = nullptr);
  /// Blocks until the job with `ticket` and every one queued before it are
  /// done; rethrows what a job threw. Ticket 0: nothing to wait for.
  void wait(std::uint64_t ticket);
  void wait_all();
  /// Host seconds spent blocked in wait / wait_all since the last call
  /// (each step reports its own).
  double take_wait_seconds() { return std::exchange(wait_seconds_, 0.0); }

 private:
  struct Job {
    void* dst;  // an addition's destination; nullptr: statistics of src into stats
    const void* src;
    std::size_t count;
    GradStats* stats;
    Event after;  // waited for before the job; null: nothing
  };
  std::uint64_t queue(const Job& job);
  void run();

  Backend& backend_;
  const DType dtype_;
  const int threads_;
  std::mutex mutex_;
  std::condition_variable queued_cv_, done_cv_;
  std::deque<Job> jobs_;
  std::uint64_t queued_ = 0, done_ = 0;  // tickets are 1, 2, ...
  bool stop_ = false;
  std::exception_ptr error_;
  double wait_seconds_ = 0;
  std::thread thread_;  // last: started once the rest is ready
};

}  // namespace zero::detail
