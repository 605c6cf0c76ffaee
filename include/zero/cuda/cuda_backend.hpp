// CudaBackend: the engine's Backend on one GPU. Buffers are cudaMalloc'd,
// kernels are zero::gpu's fused ones, collectives run on a non-blocking comm
// stream of its own, ordered against the compute stream by events.
#pragma once

#include <memory>

#include "zero/engine/backend.hpp"

namespace zero {

/// A Backend on `device` (made current by this call). compute_stream is the
/// stream the model's kernels run on (the caller's current stream, e.g.
/// LibTorch's); null means the legacy default stream. The backend never
/// synchronizes the whole device: synchronize() and grad_stats() wait for one
/// stream only.
std::unique_ptr<Backend> make_cuda_backend(int device, Stream compute_stream = nullptr);

}  // namespace zero
