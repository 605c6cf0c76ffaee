// Multi-head attention's core for the UNet (declared in unet.hpp).
#include <torch/torch.h>
#include <torch/version.h>

#include <cmath>

#include "unet.hpp"

namespace sdxl {

using torch::Tensor;

Tensor multi_head_attention(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t heads, bool upcast) {
  const std::int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1), inner = q.size(2);
  const std::int64_t head_dim = inner / heads;
  const auto in_dtype = q.scalar_type();
  const bool to_float = upcast && (in_dtype == torch::kHalf || in_dtype == torch::kBFloat16);
  auto split = [&](const Tensor& t, std::int64_t n) {
    Tensor s = t.view({batch, n, heads, head_dim}).transpose(1, 2);  // [B, H, N, D]
    return to_float ? s.to(torch::kFloat32) : s;
  };
  Tensor qh = split(q, nq), kh = split(k, nk), vh = split(v, nk);
#if TORCH_VERSION_MAJOR >= 2
  // Fused kernels (flash / memory-efficient) on GPU; default scale is 1/sqrt(D).
  Tensor out = at::scaled_dot_product_attention(qh, kh, vh);
#else
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  Tensor scores = torch::matmul(qh, kh.transpose(-1, -2)) * scale;
  Tensor out = torch::matmul(torch::softmax(scores, -1), vh);
#endif
  out = out.transpose(1, 2).reshape({batch, nq, inner});
  return to_float ? out.to(in_dtype) : out;
}

}  // namespace sdxl
