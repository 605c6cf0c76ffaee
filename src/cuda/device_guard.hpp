// DeviceGuard: makes a device current for a scope and restores the caller's
// after, so that an object bound to GPU 1 can be used from code on GPU 0.
#pragma once

#include <cuda_runtime_api.h>

#include "zero/cuda/check.hpp"

namespace zero::detail {

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    ZERO_CHECK_CUDA(cudaGetDevice(&previous_));
    switched_ = previous_ != device;
    if (switched_) ZERO_CHECK_CUDA(cudaSetDevice(device));
  }
  ~DeviceGuard() {
    if (switched_) (void)cudaSetDevice(previous_);  // best effort: destructors must not throw
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

}  // namespace zero::detail
