#include "diffusion.hpp"

#include <cmath>

#include "zero/core/error.hpp"

namespace sdxl {

Prediction parse_prediction(const std::string& text) {
  if (text == "epsilon") return Prediction::epsilon;
  if (text == "v_prediction") return Prediction::v_prediction;
  ZERO_THROW(zero::InvalidArgument, "prediction: '", text, "' is not epsilon or v_prediction");
}

NoiseSchedule::NoiseSchedule(int steps, double beta_start, double beta_end) : steps_(steps) {
  ZERO_CHECK(steps >= 2, "noise schedule needs >= 2 steps, got ", steps);
  ZERO_CHECK(0 < beta_start && beta_start < beta_end && beta_end < 1, "noise schedule: need 0 < beta_start < beta_end < 1");
  const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  torch::Tensor betas = torch::linspace(std::sqrt(beta_start), std::sqrt(beta_end), steps, f64).square();
  alphas_cumprod_ = torch::cumprod(1.0 - betas, 0);
}

torch::Tensor NoiseSchedule::per_sample(const torch::Tensor& values, const torch::Tensor& timesteps,
                                        const torch::Tensor& like) const {
  torch::Tensor t = timesteps.to(torch::kCPU, torch::kLong);
  ZERO_CHECK(t.dim() == 1 && t.size(0) == like.size(0), "timesteps must be [B] with B = ", like.size(0));
  ZERO_CHECK(t.numel() == 0 || (t.min().item<long>() >= 0 && t.max().item<long>() < steps_),
             "timesteps must be in [0, ", steps_, ")");
  std::vector<std::int64_t> shape(static_cast<std::size_t>(like.dim()), 1);
  shape[0] = like.size(0);
  return values.index_select(0, t).to(like.device(), like.scalar_type()).view(shape);
}

torch::Tensor NoiseSchedule::add_noise(const torch::Tensor& x0, const torch::Tensor& noise,
                                       const torch::Tensor& timesteps) const {
  // Coefficients in float64, rounded once to the data's dtype (as diffusers).
  return per_sample(alphas_cumprod_.sqrt(), timesteps, x0) * x0 +
         per_sample((1.0 - alphas_cumprod_).sqrt(), timesteps, x0) * noise;
}

torch::Tensor NoiseSchedule::target(Prediction prediction, const torch::Tensor& x0, const torch::Tensor& noise,
                                    const torch::Tensor& timesteps) const {
  if (prediction == Prediction::epsilon) return noise;
  return per_sample(alphas_cumprod_.sqrt(), timesteps, x0) * noise -
         per_sample((1.0 - alphas_cumprod_).sqrt(), timesteps, x0) * x0;
}

torch::Tensor NoiseSchedule::snr(const torch::Tensor& timesteps) const {
  torch::Tensor values = alphas_cumprod_ / (1.0 - alphas_cumprod_);
  return values.index_select(0, timesteps.to(torch::kCPU, torch::kLong)).to(timesteps.device(), torch::kFloat32);
}

torch::Tensor NoiseSchedule::min_snr_weights(Prediction prediction, const torch::Tensor& timesteps, double gamma) const {
  ZERO_CHECK(gamma > 0, "min_snr_gamma must be > 0 here, got ", gamma);
  torch::Tensor s = snr(timesteps);
  torch::Tensor clipped = torch::clamp_max(s, gamma);
  return prediction == Prediction::epsilon ? clipped / s : clipped / (s + 1);
}

torch::Tensor sample_noise(const torch::Tensor& like, double offset, torch::Generator& generator) {
  torch::Tensor noise = torch::randn(like.sizes(), generator, like.options().dtype(torch::kFloat32));
  if (offset > 0) {
    std::vector<std::int64_t> shape = {like.size(0), like.size(1)};
    for (int i = 2; i < like.dim(); ++i) shape.push_back(1);
    noise = noise + offset * torch::randn(shape, generator, noise.options());
  }
  return noise.to(like.scalar_type());
}

torch::Tensor diffusion_loss(const torch::Tensor& prediction, const torch::Tensor& target, const torch::Tensor& weights) {
  torch::Tensor error = (prediction.to(torch::kFloat32) - target.to(torch::kFloat32)).square();
  torch::Tensor per_sample = error.flatten(1).mean(1);
  if (weights.defined()) per_sample = per_sample * weights.to(per_sample.device(), torch::kFloat32);
  return per_sample.mean();
}

double learning_rate(const std::string& schedule, double peak, long step, long warmup, long total) {
  if (warmup > 0 && step < warmup) return peak * static_cast<double>(step + 1) / static_cast<double>(warmup);
  const double span = static_cast<double>(std::max(1L, total - warmup));
  const double progress = std::min(1.0, static_cast<double>(step - warmup) / span);
  if (schedule == "constant") return peak;
  if (schedule == "linear") return peak * (1.0 - progress);
  if (schedule == "cosine") return peak * 0.5 * (1.0 + std::cos(M_PI * progress));
  ZERO_THROW(zero::InvalidArgument, "lr_schedule: '", schedule, "' is not constant, linear or cosine");
}

}  // namespace sdxl
