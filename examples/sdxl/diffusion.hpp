// DDPM training math for SDXL: the scaled-linear noise schedule (beta 0.00085
// to 0.012 over 1000 steps), forward noising, epsilon and v-prediction
// targets, min-SNR-gamma loss weights and noise offset.
#pragma once

#include <torch/torch.h>

#include <string>

namespace sdxl {

enum class Prediction { epsilon, v_prediction };
Prediction parse_prediction(const std::string& text);

class NoiseSchedule {
 public:
  /// SDXL's: scaled_linear betas from beta_start to beta_end (squares of a
  /// linear ramp of their square roots), float64, `steps` entries.
  explicit NoiseSchedule(int steps = 1000, double beta_start = 0.00085, double beta_end = 0.012);

  int steps() const { return steps_; }
  /// alpha-bar_t for each timestep (float64, CPU).
  const torch::Tensor& alphas_cumprod() const { return alphas_cumprod_; }

  /// x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) noise, per sample's t.
  torch::Tensor add_noise(const torch::Tensor& x0, const torch::Tensor& noise, const torch::Tensor& timesteps) const;
  /// The regression target: noise (epsilon) or v = sqrt(abar) noise - sqrt(1-abar) x0.
  torch::Tensor target(Prediction prediction, const torch::Tensor& x0, const torch::Tensor& noise,
                       const torch::Tensor& timesteps) const;
  /// SNR(t) = abar / (1 - abar), float32 [B] on timesteps' device.
  torch::Tensor snr(const torch::Tensor& timesteps) const;
  /// Min-SNR-gamma weights (Hang et al., 2023): min(SNR, gamma) / SNR for
  /// epsilon, min(SNR, gamma) / (SNR + 1) for v-prediction; [B].
  torch::Tensor min_snr_weights(Prediction prediction, const torch::Tensor& timesteps, double gamma) const;

 private:
  /// coefficient [B] broadcast to x's rank, on x's device and dtype.
  torch::Tensor per_sample(const torch::Tensor& values, const torch::Tensor& timesteps, const torch::Tensor& like) const;
  int steps_;
  torch::Tensor alphas_cumprod_;
};

/// Noise with offset: randn + offset * randn(B, C, 1, 1) (Guttenberg, 2023),
/// which lets the model learn overall brightness. offset 0 gives plain noise.
torch::Tensor sample_noise(const torch::Tensor& like, double offset, torch::Generator& generator);

/// Mean-squared error per sample, optionally weighted: mean over all but
/// the batch dimension, times weights[B], then the mean over the batch.
torch::Tensor diffusion_loss(const torch::Tensor& prediction, const torch::Tensor& target,
                             const torch::Tensor& weights = {});

/// Learning rate at `step` (0-based): linear warm-up to `peak`, then
/// constant, linear decay to 0, or cosine decay to 0 at `total`.
double learning_rate(const std::string& schedule, double peak, long step, long warmup, long total);

}  // namespace sdxl
