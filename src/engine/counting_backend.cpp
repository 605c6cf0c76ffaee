#include "zero/engine/counting_backend.hpp"

#include <algorithm>

namespace zero {

void* CountingBackend::next_address(std::size_t bytes) {
  // 256-byte aligned, each block at its own address (the engine keys its
  // cache of free blocks by size and compares pointers).
  const std::uintptr_t at = next_;
  next_ += (std::max<std::size_t>(bytes, 1) + 255) / 256 * 256;
  return reinterpret_cast<void*>(at);
}

void* CountingBackend::allocate(std::size_t bytes) {
  ++allocations_;
  device_ += bytes;
  device_peak_ = std::max(device_peak_, device_);
  return next_address(bytes);
}

void CountingBackend::deallocate(void*, std::size_t bytes) {
  device_ -= bytes;
  ++deallocations_;
}

void* CountingBackend::allocate_host(std::size_t bytes) {
  host_ += bytes;
  return next_address(bytes);
}

void CountingBackend::deallocate_host(void*, std::size_t bytes) { host_ -= bytes; }

void CountingBackend::copy_to_host(void*, const void*, std::size_t) {
  ZERO_THROW(InvalidArgument, "CountingBackend holds no data: nothing can be read back (it is for planning)");
}

}  // namespace zero
