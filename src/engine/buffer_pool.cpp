#include "buffer_pool.hpp"

#include <algorithm>

#include "zero/core/error.hpp"

namespace zero::detail {

BufferPool::BufferPool(Backend& backend, std::size_t cache_limit, bool keep_working_set,
                       std::map<Category, std::vector<std::size_t>> block_sizes)
    : backend_(backend),
      cache_limit_(cache_limit),
      keep_working_set_(keep_working_set),
      block_sizes_(std::move(block_sizes)) {
  for (auto& [category, sizes] : block_sizes_) std::sort(sizes.begin(), sizes.end());
}

std::size_t BufferPool::block_size_for(Category c, std::size_t bytes) const {
  const auto kind = block_sizes_.find(c);
  if (kind == block_sizes_.end()) return bytes;
  const std::vector<std::size_t>& sizes = kind->second;
  // At most twice the request: a unit or bucket far below the largest keeps
  // its own size rather than hold a large block.
  const auto size = std::lower_bound(sizes.begin(), sizes.end(), bytes);
  if (size == sizes.end() || *size > 2 * bytes) return bytes;
  // A block the cache could not keep would only be freed larger.
  const bool cacheable = *size <= cache_limit_ || keep_working_set_;
  return cacheable ? *size : bytes;
}

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
  peak_in_use_ = std::max(peak_in_use_, transient_units_ + transient_buffers_);
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
  std::byte* p;
  std::size_t capacity = bytes;
  std::ptrdiff_t reused = 0;
  const std::size_t block = block_size_for(c, bytes);
  // The smallest free block that holds the request, whatever its size:
  // reusing a block the pool already holds adds nothing to what it holds, a
  // new block would. (Reusing only blocks no larger than a new one, SDXL's
  // units of many sizes missed the cache ~800 times a step at stage 3.)
  auto fit = free_blocks_.lower_bound(bytes);
  while (fit != free_blocks_.end() && fit->second.empty()) ++fit;
  if (fit != free_blocks_.end()) {
    capacity = fit->first;
    const FreeBlock block = fit->second.back();
    fit->second.pop_back();
    p = static_cast<std::byte*>(block.p);
    if (block.last_use) {
      backend_.stream_wait(stream, block.last_use);
      backend_.release_event(block.last_use);
    }
    reused = static_cast<std::ptrdiff_t>(capacity);
    cached_ -= capacity;
    count(kBuffers, -reused);
  } else {
    capacity = block;
    // A miss: the free blocks are all smaller than the request. Where a new
    // block would take what the pool holds past its peak in use, the free
    // blocks this request cannot use go first (one wait for both streams),
    // so that holding never runs ahead of use by more than one block.
    const std::size_t holding = transient_units_ + transient_buffers_ + cached_;
    if (keep_working_set_ && !capturing_ && cached_ > 0 && holding + capacity > peak_in_use_)
      free_blocks_smaller_than(bytes);
    p = static_cast<std::byte*>(backend_.allocate(capacity));
    ++calls_.allocations;
  }
  capacity_[p] = capacity;
  if (capturing_) captured_[p] = capacity;
  backend_.fill_zero(p, bytes, stream);
  count(c, static_cast<std::ptrdiff_t>(capacity));
  count_transient(c, static_cast<std::ptrdiff_t>(capacity), 0);
  return p;
}

void BufferPool::give_back(Category c, void* p, std::size_t bytes, Stream last_use) {
  const auto held = capacity_.find(p);
  ZERO_CHECK(held != capacity_.end(), "BufferPool::give_back: a block (", bytes, " bytes) this pool did not hand out");
  ZERO_CHECK(bytes <= held->second, "BufferPool::give_back: ", bytes, " bytes for a block of ", held->second);
  bytes = held->second;
  capacity_.erase(held);
  count(c, -static_cast<std::ptrdiff_t>(bytes));
  // Kept: within the cache's limit, or, keeping the working set, until
  // trim() at the step's end. A free here waits for both streams, which
  // drains the device's queue of launched work in the middle of the passes;
  // a rule that freed once the pool held more than its peak in use freed
  // after every cache miss (SDXL at stage 3: ~800 a step on the H100).
  const bool keep = keep_working_set_ || cached_ + bytes <= cache_limit_;
  if (!keep && !capturing_) {
    count_transient(c, -static_cast<std::ptrdiff_t>(bytes), 0);
    // The device path orders frees after the work queued on these streams.
    wait_for_streams();
    deallocate_block(p, bytes);
    return;
  }
  count(kBuffers, static_cast<std::ptrdiff_t>(bytes));
  free_blocks_[bytes].push_back({p, backend_.record_event(last_use)});
  count_transient(c, -static_cast<std::ptrdiff_t>(bytes), static_cast<std::ptrdiff_t>(bytes));
}

void BufferPool::wait_for_streams() {
  if (backend_.transfer_stream() != backend_.comm_stream()) backend_.synchronize(backend_.transfer_stream());
  backend_.synchronize(backend_.comm_stream());
  backend_.synchronize(backend_.compute_stream());
  ++calls_.waits;
}

void BufferPool::deallocate_block(void* p, std::size_t bytes) {
  backend_.deallocate(p, bytes);
  ++calls_.frees;
}

void BufferPool::free_cached(const FreeBlock& block, std::size_t bytes) {
  backend_.release_event(block.last_use);
  deallocate_block(block.p, bytes);
  count(kBuffers, -static_cast<std::ptrdiff_t>(bytes));
  count_transient(kBuffers, 0, -static_cast<std::ptrdiff_t>(bytes));
}

void BufferPool::free_blocks_smaller_than(std::size_t bytes) {
  wait_for_streams();
  for (auto size = free_blocks_.begin(); size != free_blocks_.end() && size->first < bytes; ++size) {
    for (const FreeBlock& block : size->second) free_cached(block, size->first);
    size->second.clear();
  }
}

void BufferPool::trim() {
  if (capturing_ || cached_ <= cache_limit_) return;
  wait_for_streams();
  // Largest first, each kept while it fits what is left of the limit: the
  // cache stays as full as the limit allows (the next step draws on it).
  std::size_t budget = cache_limit_;
  for (auto size = free_blocks_.rbegin(); size != free_blocks_.rend(); ++size) {
    auto& blocks = size->second;
    std::erase_if(blocks, [&, bytes = size->first](const FreeBlock& block) {
      if (bytes <= budget) {
        budget -= bytes;
        return false;
      }
      free_cached(block, bytes);
      return true;
    });
  }
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
