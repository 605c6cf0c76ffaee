#include "buffer_pool.hpp"

#include <algorithm>

#include "zero/core/error.hpp"

namespace zero::detail {

BufferPool::~BufferPool() {
  for (auto& [bytes, blocks] : free_blocks_)
    for (FreeBlock& b : blocks) {
      backend_.release_event(b.last_use);
      backend_.deallocate(b.p, bytes);
    }
  for (auto& [p, bytes] : graph_blocks_) backend_.deallocate(p, bytes);
}

void BufferPool::count(Category c, std::ptrdiff_t delta) {
  current_[c] = static_cast<std::size_t>(static_cast<std::ptrdiff_t>(current_[c]) + delta);
  peak_[c] = std::max(peak_[c], current_[c]);
}

void BufferPool::count_transient(Category c, std::ptrdiff_t live, std::ptrdiff_t cached) {
  std::size_t& in_use = c == kParams ? transient_units_ : transient_buffers_;
  in_use = static_cast<std::size_t>(static_cast<std::ptrdiff_t>(in_use) + live);
  cached_ = static_cast<std::size_t>(static_cast<std::ptrdiff_t>(cached_) + cached);
  if (transient_now().total() > transient_peak_.total()) transient_peak_ = transient_now();
}

void* BufferPool::allocate_bytes(Category c, std::size_t bytes) {
  if (bytes == 0) return nullptr;
  void* p = backend_.allocate(bytes);
  backend_.fill_zero(p, bytes, backend_.compute_stream());
  count(c, static_cast<std::ptrdiff_t>(bytes));
  return p;
}

void* BufferPool::allocate_host_bytes(Category c, std::size_t bytes) {
  if (bytes == 0) return nullptr;
  void* p = backend_.allocate_host(bytes);
  backend_.host_fill_zero(p, bytes);
  host_current_[c] += bytes;
  host_peak_[c] = std::max(host_peak_[c], host_current_[c]);
  return p;
}

void BufferPool::free(void* p, std::size_t bytes) {
  if (p) backend_.deallocate(p, bytes);
}

void BufferPool::free_host(void* p, std::size_t bytes) {
  if (p) backend_.deallocate_host(p, bytes);
}

std::byte* BufferPool::acquire(Category c, std::size_t bytes, Stream stream) {
  auto& blocks = free_blocks_[bytes];
  std::byte* p;
  std::ptrdiff_t reused = 0;
  if (!blocks.empty()) {
    const FreeBlock block = blocks.back();
    blocks.pop_back();
    p = static_cast<std::byte*>(block.p);
    if (block.last_use) {
      backend_.stream_wait(stream, block.last_use);
      backend_.release_event(block.last_use);
    }
    reused = static_cast<std::ptrdiff_t>(bytes);
    count(kBuffers, -reused);
  } else {
    p = static_cast<std::byte*>(backend_.allocate(bytes));
  }
  if (capturing_) captured_[p] = bytes;
  backend_.fill_zero(p, bytes, stream);
  count(c, static_cast<std::ptrdiff_t>(bytes));
  count_transient(c, static_cast<std::ptrdiff_t>(bytes), -reused);
  return p;
}

void BufferPool::give_back(Category c, void* p, std::size_t bytes, Stream last_use) {
  count(c, -static_cast<std::ptrdiff_t>(bytes));
  if (cached_ + bytes > cache_limit_ && !capturing_) {
    count_transient(c, -static_cast<std::ptrdiff_t>(bytes), 0);
    // The device path orders frees after the work queued on these streams.
    backend_.synchronize(backend_.comm_stream());
    backend_.synchronize(backend_.compute_stream());
    backend_.deallocate(p, bytes);
    return;
  }
  count(kBuffers, static_cast<std::ptrdiff_t>(bytes));
  free_blocks_[bytes].push_back({p, backend_.record_event(last_use)});
  count_transient(c, -static_cast<std::ptrdiff_t>(bytes), static_cast<std::ptrdiff_t>(bytes));
}

void BufferPool::begin_capture() {
  capturing_ = true;
  captured_.clear();
  // A capture cannot wait for work outside it. The caller has ordered that
  // work before the capture's start (Engine::prepare_graph_replay joins the
  // comm stream into the compute stream), so the last uses are behind us.
  for (auto& [bytes, blocks] : free_blocks_)
    for (FreeBlock& b : blocks) {
      backend_.release_event(b.last_use);
      b.last_use = nullptr;
    }
}

void BufferPool::end_capture() {
  capturing_ = false;
  // Every block the capture used is free again (the micro-step gave them
  // back): take them out of the cache for good. Their events were recorded
  // in the capture, so they mean nothing outside it.
  for (auto& [bytes, blocks] : free_blocks_) {
    std::erase_if(blocks, [&, size = bytes](FreeBlock& b) {
      if (!captured_.contains(b.p)) return false;
      backend_.release_event(b.last_use);
      graph_blocks_.emplace_back(b.p, size);
      graph_bytes_ += size;
      cached_ -= size;  // still held (counted as buffers), no longer a cache to draw from
      captured_.erase(b.p);
      return true;
    });
  }
  ZERO_CHECK(captured_.empty(), captured_.size(), " transient block(s) acquired during the CUDA graph capture are "
             "still in use at its end (a stage-3 unit not released, or a reduction not completed): the graph's "
             "replays would write them");
}

}  // namespace zero::detail
