// [device] deterministic: only kernels whose results do not depend on
// scheduling, so that a run repeats bit for bit and a CUDA graph's replay
// equals the eager step it captured. By default LibTorch lets cuDNN pick
// algorithms that accumulate with atomics (convolution weight gradients,
// attention's dQ), whose summation order changes from run to run.
#pragma once

#include <ATen/Context.h>

#include <cstdlib>

namespace sdxl {

/// Call before the first matmul on the GPU: cuBLAS reads
/// CUBLAS_WORKSPACE_CONFIG when it creates its handles, and a fixed
/// workspace configuration is what makes its split reductions repeatable
/// (LibTorch stops a matmul under deterministic algorithms without it). A
/// value the user set is kept. Strict mode (not warn-only): an operation
/// without a deterministic kernel stops the run naming itself, rather than
/// breaking reproducibility quietly. The cuDNN autotuner is turned off by the
/// caller (its timing-based choice could differ between runs). `on_gpu`:
/// the cuBLAS setting is made only where cuBLAS runs.
inline void use_deterministic_algorithms(bool on, bool on_gpu) {
  if (!on) return;
  if (on_gpu) setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
  at::globalContext().setDeterministicCuDNN(true);
  at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
}

}  // namespace sdxl
