#include "buffer_pool.hpp"

#include <algorithm>

namespace zero::detail {

BufferPool::~BufferPool() {
  for (auto& [bytes, blocks] : free_blocks_)
    for (void* p : blocks) backend_.deallocate(p, bytes);
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
    p = static_cast<std::byte*>(blocks.back());
    blocks.pop_back();
    reused = static_cast<std::ptrdiff_t>(bytes);
    count(kBuffers, -reused);
  } else {
    p = static_cast<std::byte*>(backend_.allocate(bytes));
  }
  backend_.fill_zero(p, bytes, stream);
  count(c, static_cast<std::ptrdiff_t>(bytes));
  count_transient(c, static_cast<std::ptrdiff_t>(bytes), -reused);
  return p;
}

void BufferPool::give_back(Category c, void* p, std::size_t bytes) {
  count(c, -static_cast<std::ptrdiff_t>(bytes));
  if (cached_ + bytes > cache_limit_) {
    count_transient(c, -static_cast<std::ptrdiff_t>(bytes), 0);
    // The device path orders frees after the work queued on these streams.
    backend_.synchronize(backend_.comm_stream());
    backend_.synchronize(backend_.compute_stream());
    backend_.deallocate(p, bytes);
    return;
  }
  count(kBuffers, static_cast<std::ptrdiff_t>(bytes));
  free_blocks_[bytes].push_back(p);
  count_transient(c, -static_cast<std::ptrdiff_t>(bytes), static_cast<std::ptrdiff_t>(bytes));
}

}  // namespace zero::detail
