// HostGradientWorker: see host_gradient_worker.hpp.
#include "host_gradient_worker.hpp"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <utility>

namespace zero::detail {

int host_team_threads(int requested) { return requested > 0 ? requested : std::max(1, omp_get_max_threads() - 1); }

HostGradientWorker::HostGradientWorker(Backend& backend, DType dtype, int threads)
    : backend_(backend), dtype_(dtype), threads_(threads), thread_([this] { run(); }) {}

HostGradientWorker::~HostGradientWorker() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
    jobs_.clear();
  }
  queued_cv_.notify_all();
  thread_.join();
}

std::uint64_t HostGradientWorker::add(void* dst, const void* src, std::size_t count, Event after) {
  return queue({dst, src, count, nullptr, after});
}

std::uint64_t HostGradientWorker::stats(const void* data, std::size_t count, GradStats* out, Event after) {
  return queue({nullptr, data, count, out, after});
}

std::uint64_t HostGradientWorker::queue(const Job& job) {
  std::uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    jobs_.push_back(job);
    ticket = ++queued_;
  }
  queued_cv_.notify_one();
  return ticket;
}

void HostGradientWorker::wait(std::uint64_t ticket) {
  const auto start = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(mutex_);
  done_cv_.wait(lock, [&] { return done_ >= ticket || error_; });
  wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (error_) std::rethrow_exception(error_);  // kept: every later wait fails the same way
}

void HostGradientWorker::wait_all() {
  std::uint64_t last;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    last = queued_;
  }
  wait(last);
}

void HostGradientWorker::run() {
  omp_set_num_threads(host_team_threads(threads_));
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    queued_cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
    if (stop_) return;
    const Job job = jobs_.front();
    jobs_.pop_front();
    lock.unlock();
    std::exception_ptr error;
    try {
      if (job.after) backend_.wait_event(job.after);
      if (job.dst) backend_.host_accumulate(job.dst, job.src, dtype_, job.count);
      else *job.stats = backend_.host_grad_stats(job.src, job.count, dtype_);
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    if (error && !error_) error_ = error;
    ++done_;
    done_cv_.notify_all();
  }
}

}  // namespace zero::detail
