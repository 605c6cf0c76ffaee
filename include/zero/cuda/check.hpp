// ZERO_CHECK_CUDA / ZERO_CHECK_NCCL: every CUDA runtime and NCCL call in zero
// goes through these, so that a failure names the call, its file:line and the
// library's own error string, and surfaces as zero::DeviceError.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string>

#include "zero/core/error.hpp"

/// Throws zero::DeviceError when a CUDA runtime call does not return cudaSuccess.
#define ZERO_CHECK_CUDA(call)                                                                  \
  do {                                                                                         \
    const cudaError_t zero_cuda_status_ = (call);                                              \
    if (zero_cuda_status_ != cudaSuccess)                                                      \
      ZERO_THROW(::zero::DeviceError, #call " failed: ", cudaGetErrorName(zero_cuda_status_), \
                 " (", cudaGetErrorString(zero_cuda_status_), ")");                            \
  } while (0)

/// After a kernel launch: a bad launch configuration (and any earlier
/// asynchronous fault) is reported by cudaGetLastError, not by the launch.
#define ZERO_CHECK_LAUNCH() ZERO_CHECK_CUDA(cudaGetLastError())

/// Throws zero::DeviceError when an NCCL call returns neither ncclSuccess nor
/// ncclInProgress (the latter is success for non-blocking communicators).
#define ZERO_CHECK_NCCL(call)                                                                  \
  do {                                                                                         \
    const ncclResult_t zero_nccl_status_ = (call);                                             \
    if (zero_nccl_status_ != ncclSuccess && zero_nccl_status_ != ncclInProgress)               \
      ZERO_THROW(::zero::DeviceError, #call " failed: ", ncclGetErrorString(zero_nccl_status_), \
                 " (ncclResult_t ", static_cast<int>(zero_nccl_status_), ")",                 \
                 ::zero::detail::nccl_last_error_suffix());                                    \
  } while (0)

namespace zero::detail {
/// NCCL's description of its last failure, prefixed for a message; "" when none.
inline std::string nccl_last_error_suffix() {
  const char* last = ncclGetLastError(nullptr);
  if (last == nullptr || *last == '\0') return {};
  return std::string(": ") + last;
}
}  // namespace zero::detail
