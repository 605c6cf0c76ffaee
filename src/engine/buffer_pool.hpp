// The engine's memory: persistent buffers, transient blocks reused by size,
// and the accounting by category that memory(), peak_memory() and the
// planner read. Internal to src/engine.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

#include "zero/engine/backend.hpp"
#include "zero/engine/memory_model.hpp"

namespace zero::detail {

enum Category { kParams, kGrads, kMaster, kState, kEma, kBuffers, kCategories };

/// Transient device blocks at the moment their total was highest.
struct TransientUse {
  std::size_t gathered_units = 0;  // stage-3 unit buffers (category params)
  std::size_t bucket_buffers = 0;  // gradient buckets and scratch in use
  std::size_t cached_blocks = 0;   // free blocks kept for reuse
  std::size_t total() const { return gathered_units + bucket_buffers + cached_blocks; }
};

class BufferPool {
 public:
  /// cache_limit: free transient bytes kept for reuse at most; with
  /// keep_working_set, every block given back is kept until trim() at the
  /// step's end goes back to the limit, except that a request no free block
  /// holds, where a new block would take the pool past its peak in use, first
  /// frees the (smaller) free blocks. A free mid-step waits for both streams;
  /// the planner replays the same pool, so its peak includes what this holds.
  /// block_sizes:
  /// the sizes of the blocks the schedules ask for at their largest (a unit,
  /// a bucket's gradients, a shard's scratch). A new block is made as large
  /// as the smallest of them that holds the request, where that is at most
  /// twice the request and the cache can hold one, so that one block serves
  /// most requests of its kind. Buckets
  /// and units come in many sizes: blocks kept by exact size missed, and each
  /// miss meant a cudaMalloc and, with the cache full, a free that waits for
  /// the device, a host sync per bucket or unit. Empty: exact sizes.
  BufferPool(Backend& backend, std::size_t cache_limit, bool keep_working_set = false,
             std::map<Category, std::vector<std::size_t>> block_sizes = {});
  ~BufferPool();
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  /// Persistent backend memory, zeroed; null for 0 bytes.
  template <typename T = std::byte>
  T* allocate(Category c, std::size_t bytes) {
    return static_cast<T*>(allocate_bytes(c, bytes));
  }
  /// Persistent pinned host memory, zeroed; null for 0 bytes.
  template <typename T = std::byte>
  T* allocate_host(Category c, std::size_t bytes) {
    return static_cast<T*>(allocate_host_bytes(c, bytes));
  }
  void free(void* p, std::size_t bytes);
  void free_host(void* p, std::size_t bytes);

  /// A transient block of at least `bytes`, its first `bytes` zeroed on
  /// `stream`. The smallest free block that holds it is reused, whatever its
  /// size (that holds nothing more; a new block would), `stream` first
  /// waiting for its last use. Counted at the block's capacity.
  std::byte* acquire(Category c, std::size_t bytes, Stream stream);
  /// Returns a transient block whose last use was queued on `last_use`: kept
  /// for reuse (counted as buffers) while the cache is under its limit or
  /// the pool keeps its working set, freed otherwise. The next acquire waits on the device for that last
  /// use, not the host: a stream-ordered pool, which a CUDA graph capture needs.
  void give_back(Category c, void* p, std::size_t bytes, Stream last_use);

  /// Frees cached blocks beyond the cache's limit (after one wait for both
  /// streams, where there are any): the working set kept within a step goes
  /// back to the limit between steps. No-op while capturing.
  void trim();

  /// A CUDA graph capture: until end_capture() nothing is freed (that would
  /// wait on the host) and the blocks the capture uses are noted; then those
  /// are kept for the graph's replays, out of reach of later acquires.
  void begin_capture();
  void end_capture();
  bool capturing() const { return capturing_; }

  std::size_t current(Category c) const { return current_[c]; }
  std::size_t peak(Category c) const { return peak_[c]; }
  std::size_t host_current(Category c) const { return host_current_[c]; }
  TransientUse transient_now() const { return {transient_units_, transient_buffers_, cached_ + graph_bytes_}; }
  TransientUse transient_peak() const { return transient_peak_; }
  /// Backend calls for transient blocks so far: allocations, frees, and
  /// host waits for a stream before frees.
  struct Calls {
    std::uint64_t allocations = 0, frees = 0, waits = 0;
  };
  Calls calls() const { return calls_; }

 private:
  void* allocate_bytes(Category c, std::size_t bytes);
  void* allocate_host_bytes(Category c, std::size_t bytes);
  void count(Category c, std::ptrdiff_t delta);
  void count_transient(Category c, std::ptrdiff_t live, std::ptrdiff_t cached);

  Backend& backend_;
  std::size_t cache_limit_ = 0;
  bool keep_working_set_ = false;
  std::size_t peak_in_use_ = 0;  // the most transient bytes in use at once
  void free_blocks_smaller_than(std::size_t bytes);  // after one wait for both streams
  std::map<Category, std::vector<std::size_t>> block_sizes_;  // each ascending
  std::size_t block_size_for(Category c, std::size_t bytes) const;
  std::map<void*, std::size_t> capacity_;  // transient blocks in use: their capacity
  std::array<std::size_t, kCategories> current_{}, peak_{}, host_current_{}, host_peak_{};
  struct FreeBlock {
    void* p = nullptr;
    Event last_use = nullptr;  // recorded after the block's last use; null once waited for
  };
  std::map<std::size_t, std::vector<FreeBlock>> free_blocks_;  // reusable transient blocks by capacity
  void free_cached(const FreeBlock& block, std::size_t bytes);  // its last use waited for by the caller
  bool capturing_ = false;
  std::map<void*, std::size_t> captured_;     // blocks acquired during the capture
  std::vector<std::pair<void*, std::size_t>> graph_blocks_;  // kept for a captured graph
  std::size_t graph_bytes_ = 0;
  std::size_t cached_ = 0;
  std::size_t transient_units_ = 0, transient_buffers_ = 0;
  TransientUse transient_peak_;
  Calls calls_;
  void wait_for_streams();  // before a free: every stream of the backend, counted
  void deallocate_block(void* p, std::size_t bytes);  // a transient block, counted
};

}  // namespace zero::detail
