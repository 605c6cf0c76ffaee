// Noise schedulers for sampling, numerically equal to Hugging Face diffusers'
// EulerDiscreteScheduler (SDXL's default) and DPMSolverMultistepScheduler
// (DPM++ 2M, with or without Karras sigmas), configured from a pipeline's
// scheduler/scheduler_config.json.
//
// "Equal" means the same float32 operations in the same order: the training
// schedule and the per-step coefficients are computed with LibTorch's float32
// ops where diffusers uses torch, and with the float64/float32 arithmetic
// NumPy performs where diffusers uses NumPy (set_timesteps), so timesteps and
// sigmas agree with diffusers' to float32 rounding (tests/sdxl/test_sampling.cpp).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>

namespace sdxl {

/// Which sampler to build. The noise schedule (betas, training steps,
/// prediction type, timestep spacing) always comes from the pipeline's
/// scheduler config, whatever class that config names, as diffusers'
/// `SchedulerClass.from_config(pipe.scheduler.config, ...)` does.
enum class Sampler {
  kEuler,          // "euler": EulerDiscreteScheduler
  kDpmpp2m,        // "dpmpp_2m": DPMSolverMultistepScheduler, dpmsolver++, solver_order 2
  kDpmpp2mKarras,  // "dpmpp_2m_karras": the same with use_karras_sigmas = true
};

/// "euler", "dpmpp_2m" or "dpmpp_2m_karras"; zero::InvalidArgument naming
/// `what` (e.g. "--sampler") and the supported names otherwise.
Sampler parse_sampler(std::string_view name, std::string_view what);
std::string_view name_of(Sampler sampler);

enum class BetaSchedule { kLinear, kScaledLinear };
enum class PredictionType { kEpsilon, kVPrediction };
enum class TimestepSpacing { kLinspace, kLeading, kTrailing };

/// The scheduler_config.json keys the implemented schedulers use, after
/// validation (every other value of a key the chosen class reads is refused
/// by parse_scheduler_config, naming the key and the supported values).
struct SchedulerConfig {
  Sampler sampler = Sampler::kEuler;
  std::int64_t num_train_timesteps = 1000;
  double beta_start = 0.0001;
  double beta_end = 0.02;
  BetaSchedule beta_schedule = BetaSchedule::kLinear;
  PredictionType prediction_type = PredictionType::kEpsilon;
  TimestepSpacing timestep_spacing = TimestepSpacing::kLinspace;
  std::int64_t steps_offset = 0;
  bool use_karras_sigmas = false;
};

/// Limits on the scheduler's inputs (a config file is small; a step count is
/// a user's number).
struct SchedulerLimits {
  static constexpr std::size_t kMaxConfigBytes = 1 << 16;
  static constexpr std::int64_t kMaxTrainTimesteps = 100000;
};

/// Parses scheduler_config.json text for `sampler`'s scheduler class. Keys
/// that class does not read (another class's leftovers, such as SDXL's
/// "skip_prk_steps") are ignored, as diffusers does; absent keys take that
/// class's defaults in diffusers. `sampler` then overrides what its name
/// fixes (dpmpp_*: algorithm_type dpmsolver++, solver_order 2; *_karras:
/// use_karras_sigmas). NaN/Infinity tokens (Python's json writes them, e.g.
/// "lambda_min_clipped": -Infinity) are accepted. zero::InvalidArgument names
/// `what` (the file), the key and the supported values.
SchedulerConfig parse_scheduler_config(std::string_view json_text, Sampler sampler, std::string_view what);

/// Reads `path`: a scheduler_config.json file, or a diffusers pipeline folder
/// (then its scheduler/scheduler_config.json). zero::IoError when unreadable.
SchedulerConfig read_scheduler_config(const std::filesystem::path& path, Sampler sampler);

/// A scheduler as the SDXL pipeline drives it: set_timesteps(n), then for
/// i = 0..n-1: scale_model_input(x, i) before the model, step(out, i, x)
/// after it (steps strictly in order: multistep solvers keep history).
/// Schedule tensors live on the CPU; sample tensors may be on any device.
class Scheduler {
 public:
  explicit Scheduler(SchedulerConfig config);
  virtual ~Scheduler() = default;
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  /// Computes the inference timesteps and sigmas for `steps` >= 1 and
  /// resets the step state. zero::InvalidArgument for steps < 1 or more
  /// than num_train_timesteps.
  virtual void set_timesteps(std::int64_t steps) = 0;
  /// [N] on the CPU: float32 for Euler, int64 for DPM-Solver (as diffusers).
  const torch::Tensor& timesteps() const { return timesteps_; }
  /// [N + 1] float32 on the CPU; the last is 0.
  const torch::Tensor& sigmas() const { return sigmas_; }
  std::int64_t num_steps() const { return timesteps_.defined() ? timesteps_.size(0) : 0; }
  /// The factor the initial unit-variance noise is multiplied by (0-dim float32).
  virtual torch::Tensor init_noise_sigma() const = 0;
  /// The model input at step `index` (Euler divides by sqrt(sigma^2 + 1)).
  virtual torch::Tensor scale_model_input(const torch::Tensor& sample, std::int64_t index) const = 0;
  /// The sample at step index + 1 from the model's output at step `index`.
  virtual torch::Tensor step(const torch::Tensor& model_output, std::int64_t index, const torch::Tensor& sample) = 0;

  const SchedulerConfig& config() const { return config_; }
  /// sqrt((1 - alphas_cumprod) / alphas_cumprod) over the training steps, float32 [T].
  const torch::Tensor& training_sigmas() const { return training_sigmas_; }

 protected:
  void check_steps(std::int64_t steps) const;
  void check_index(std::int64_t index, const char* call) const;

  SchedulerConfig config_;
  torch::Tensor alphas_cumprod_;    // float32 [T]
  torch::Tensor training_sigmas_;   // float32 [T]
  torch::Tensor timesteps_;
  torch::Tensor sigmas_;
};

/// The scheduler `config.sampler` names.
std::unique_ptr<Scheduler> make_scheduler(const SchedulerConfig& config);

}  // namespace sdxl
