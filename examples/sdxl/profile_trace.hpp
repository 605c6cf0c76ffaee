// A Kineto trace (chrome://tracing JSON) of CPU and CUDA activity, as
// unet_bench --profile and the trainer's [device] profile_step write it;
// bench/gpu/kernel_summary.py sums one by kernel family.
#pragma once

#include <string>

namespace sdxl {

/// Starts recording CPU and CUDA activity. The caller synchronises the
/// device first if the trace should start with an idle GPU.
void start_profile_trace();

/// Stops recording and writes the trace to `path`. Synchronise the device
/// first, or kernels still running are missing from the trace.
void save_profile_trace(const std::string& path);

}  // namespace sdxl
