// The host gradient accumulation's additions (plan.accumulates_on_host), on a
// thread of their own. Internal to src/engine.
//
// After the first micro-step of a step each bucket's reduced slice lands in a
// staging shard and is added into the host gradient shard. Done on the thread
// that drives the device, each addition (a bucket's shard, tens of millions
// of elements) would hold back the kernel launches of the rest of backward;
// queued here, it runs beside them. The engine waits for a bucket's last
// addition before the next download overwrites its staging slice, and for all
// of them before anything reads the host gradients (the step). The additions
// of one bucket run in the order they were queued, so the sums are the same
// bits as on the driving thread.
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

class HostAdder {
 public:
  HostAdder(Backend& backend, DType dtype);
  /// Drops what is still queued (its buffers are about to go) after the
  /// addition under way, and joins the thread.
  ~HostAdder();
  HostAdder(const HostAdder&) = delete;
  HostAdder& operator=(const HostAdder&) = delete;

  /// Queues dst += src over `count` elements; returns its ticket. Both
  /// buffers must stay until wait(ticket) (or wait_all) has returned.
  std::uint64_t add(void* dst, const void* src, std::size_t count);
  /// Blocks until the addition with `ticket` and every one queued before it
  /// are done; rethrows what an addition threw. Ticket 0: nothing to wait for.
  void wait(std::uint64_t ticket);
  void wait_all();
  /// Host seconds spent blocked in wait / wait_all since the last call
  /// (each step reports its own).
  double take_wait_seconds() { return std::exchange(wait_seconds_, 0.0); }

 private:
  struct Job {
    void* dst;
    const void* src;
    std::size_t count;
  };
  void run();

  Backend& backend_;
  const DType dtype_;
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
