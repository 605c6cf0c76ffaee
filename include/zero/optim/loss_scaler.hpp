// Dynamic loss scaling for fp16 training: the loss is multiplied by `scale`
// before backward so small gradients survive fp16; an overflow anywhere (agreed
// across ranks by the engine) skips the step and backs the scale off.
#pragma once

#include <cmath>
#include <cstdint>

#include "zero/core/error.hpp"

namespace zero {

struct LossScalerOptions {
  bool dynamic = true;
  double initial_scale = 65536.0;  // 2^16, as PyTorch's GradScaler
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  /// Steps without overflow before the scale grows.
  int growth_interval = 2000;
  /// Overflows tolerated before the scale backs off (DeepSpeed's hysteresis);
  /// every overflow still skips its step.
  int hysteresis = 2;
  double min_scale = 1.0;
  double max_scale = 16777216.0;  // 2^24

  void validate() const {
    ZERO_CHECK(initial_scale > 0 && std::isfinite(initial_scale),
               "loss_scale.initial_scale must be finite and > 0, got ", initial_scale);
    ZERO_CHECK(growth_factor >= 1, "loss_scale.growth_factor must be >= 1, got ", growth_factor);
    ZERO_CHECK(backoff_factor > 0 && backoff_factor < 1,
               "loss_scale.backoff_factor must be in (0, 1), got ", backoff_factor);
    ZERO_CHECK(growth_interval >= 1, "loss_scale.growth_interval must be >= 1, got ", growth_interval);
    ZERO_CHECK(hysteresis >= 1, "loss_scale.hysteresis must be >= 1, got ", hysteresis);
    ZERO_CHECK(min_scale > 0 && min_scale <= initial_scale && initial_scale <= max_scale,
               "loss_scale: need 0 < min_scale <= initial_scale <= max_scale");
  }
};

class DynamicLossScaler {
 public:
  explicit DynamicLossScaler(LossScalerOptions options = {}) : options_(options) {
    options_.validate();
    scale_ = options_.initial_scale;
    hysteresis_left_ = options_.hysteresis;
  }

  double scale() const { return scale_; }

  /// Records the outcome of one step (found_overflow must already agree across
  /// ranks). Returns true when the optimizer step may be taken.
  bool update(bool found_overflow) {
    if (found_overflow) {
      ++skipped_;
      good_steps_ = 0;
      if (options_.dynamic && --hysteresis_left_ <= 0) {
        scale_ = std::max(options_.min_scale, scale_ * options_.backoff_factor);
        hysteresis_left_ = options_.hysteresis;
      }
      return false;
    }
    if (options_.dynamic && ++good_steps_ >= options_.growth_interval) {
      scale_ = std::min(options_.max_scale, scale_ * options_.growth_factor);
      good_steps_ = 0;
      hysteresis_left_ = options_.hysteresis;
    }
    return true;
  }

  std::int64_t skipped_steps() const { return skipped_; }
  int good_steps() const { return good_steps_; }
  int hysteresis_left() const { return hysteresis_left_; }

  /// For checkpoints: restores the full state.
  void restore(double scale, int good_steps, int hysteresis_left, std::int64_t skipped) {
    ZERO_CHECK(scale > 0 && std::isfinite(scale), "loss scale must be finite and > 0, got ", scale);
    scale_ = scale;
    good_steps_ = good_steps;
    hysteresis_left_ = hysteresis_left;
    skipped_ = skipped;
  }

 private:
  LossScalerOptions options_;
  double scale_ = 1;
  int good_steps_ = 0;
  int hysteresis_left_ = 1;
  std::int64_t skipped_ = 0;
};

}  // namespace zero
