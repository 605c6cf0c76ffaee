// Comparisons shared by the sdxl kernel tests (test_geglu.cpp,
// test_group_norm_nhwc.cpp, test_fused_linear.cpp). Include after LibTorch.
#pragma once

#include <torch/torch.h>

// The same shape, dtype and bits (both defined: an undefined gradient never
// equals anything).
inline bool bitwise_equal(const torch::Tensor& a, const torch::Tensor& b) {
  return a.defined() && b.defined() && a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() &&
         torch::equal(a.cpu(), b.cpu());
}

// Largest |a - ref| relative to max |ref|, in float64.
inline double relative_error(const torch::Tensor& a, const torch::Tensor& ref) {
  const torch::Tensor x = a.detach().cpu().to(torch::kFloat64), y = ref.detach().cpu().to(torch::kFloat64);
  return ((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item<double>();
}
