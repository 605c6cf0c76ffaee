#include "profile_trace.hpp"

#include <torch/csrc/autograd/profiler_kineto.h>

#include <set>

namespace sdxl {

namespace {
namespace kineto = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;
}  // namespace

void start_profile_trace() {
  const ProfilerConfig config(ProfilerState::KINETO);
  const std::set<ActivityType> activities{ActivityType::CPU, ActivityType::CUDA};
  kineto::prepareProfiler(config, activities);
  kineto::enableProfiler(config, activities);
}

void save_profile_trace(const std::string& path) { kineto::disableProfiler()->save(path); }

}  // namespace sdxl
