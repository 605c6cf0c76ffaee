// The rank-0 progress line and the exponential moving average behind its
// smoothed loss and ETA:
//   step 120/1000 [#.........] 12% | epoch 2.40 | loss 0.1234 (ema 0.1301) |
//   lr 1.00e-05 | 3.21 img/s | mem 21.3/20.9 GiB max/min | fwd+bwd 0.910-1.204 s,
//   wait 0.012-0.301 s, opt 0.100-0.104 s, slowest rank 3 | ETA 00:45:10
#pragma once

#include <cstdint>
#include <cstdio>
#include <limits>
#include <optional>
#include <string>

#include "rank_timing.hpp"

namespace sdxl::metrics {

/// Exponential moving average with bias correction: after n updates the value
/// is sum(s^(n-i) x_i) / sum(s^(n-i)), so the first value is x_1 itself
/// instead of being pulled toward zero (TensorBoard smooths curves the same
/// way). Non-finite inputs are ignored: one NaN loss must not turn the
/// smoothed loss into NaN for the rest of the run.
class Ema {
 public:
  /// `smoothing` is the weight of the history, in [0, 1); 0 follows the
  /// input exactly. Throws zero::InvalidArgument outside that range.
  explicit Ema(double smoothing = 0.9);

  /// Adds `x` (unless it is NaN or infinite) and returns value().
  double update(double x);
  /// NaN before the first finite update.
  double value() const noexcept;
  bool empty() const noexcept { return count_ == 0; }
  /// Finite inputs taken so far.
  std::int64_t count() const noexcept { return count_; }
  double smoothing() const noexcept { return smoothing_; }
  void reset() noexcept;

 private:
  double smoothing_;
  double biased_ = 0.0;
  double weight_ = 0.0;  // 1 - smoothing^count, the bias correction
  std::int64_t count_ = 0;
};

/// What the progress line shows. NaN (or 0 bytes) means "not known" and the
/// field is left out, except loss, which shows "nan" (a diverged run).
struct Progress {
  std::int64_t step = 0;         ///< optimizer steps completed
  std::int64_t total_steps = 0;  ///< 0: unknown, no bar and no ETA
  std::int64_t start_step = 0;   ///< the step this run started (resumed) at
  double epoch = std::numeric_limits<double>::quiet_NaN();  ///< epochs done, with the fraction of the current one
  double loss = std::numeric_limits<double>::quiet_NaN();
  double loss_ema = std::numeric_limits<double>::quiet_NaN();
  double lr = std::numeric_limits<double>::quiet_NaN();
  double images_per_s = std::numeric_limits<double>::quiet_NaN();
  std::uint64_t mem_max_bytes = 0;  ///< peak memory of the fullest rank
  std::uint64_t mem_min_bytes = 0;  ///< peak memory of the emptiest rank
  double elapsed_s = 0.0;           ///< seconds since this run started
  /// The step's phases, min-max over ranks (format_imbalance); empty: left out.
  std::optional<RankImbalance> imbalance;
};

/// "HH:MM:SS" (hours grow past 99 rather than wrap); "--:--:--" for a
/// negative, NaN or infinite duration.
std::string format_duration(double seconds);

/// The line for `progress` with the given ETA (empty: "--:--:--").
/// `width` <= 0 draws a 10-character bar and never shortens the line. A
/// positive width is the terminal's: the bar grows or shrinks (to 40 at most)
/// so that the line fills it, is dropped below 5 characters, and the line is
/// cut at `width` so that a '\r' rewrite never wraps onto a second row.
std::string format_progress(const Progress& progress, std::optional<double> eta_s, int width = 0);

/// Renders successive progress lines of one run, estimating the ETA from the
/// step rate between calls, smoothed by an Ema so that a slow checkpoint step
/// does not make the ETA jump.
class ProgressLine {
 public:
  /// `rate_smoothing`: the Ema smoothing of the steps-per-second estimate.
  explicit ProgressLine(double rate_smoothing = 0.8);

  /// Updates the rate from the steps done since the previous call (the first
  /// call uses step - start_step over elapsed_s) and formats the line.
  /// Calling it again for the same step (a TTY redraw) leaves the rate as is;
  /// a step that goes backwards (a restart) starts the estimate over.
  std::string render(const Progress& progress, int width = 0);

  /// Smoothed steps per second; empty until a rate could be measured.
  std::optional<double> steps_per_s() const;
  /// Seconds left at the smoothed rate, as of the last render().
  std::optional<double> eta_s() const noexcept { return eta_s_; }

 private:
  Ema rate_;
  std::optional<std::int64_t> last_step_;
  double last_elapsed_s_ = 0.0;
  std::optional<double> eta_s_;
};

/// Whether `stream` is a terminal: the trainer then rewrites one line with
/// '\r', and prints one line per log interval otherwise (files, pipes, CI).
bool is_tty(std::FILE* stream);

/// The terminal's width in columns, or `fallback` when `stream` is not a
/// terminal or the width is unknown.
int terminal_width(std::FILE* stream, int fallback = 120);

}  // namespace sdxl::metrics
