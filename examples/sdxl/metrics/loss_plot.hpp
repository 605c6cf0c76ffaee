// A self-contained SVG chart of the training loss (raw loss as a thin line,
// its exponential moving average as a thick one), so a run leaves a picture
// of its loss that any browser opens, with no plotting stack on the machine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>

namespace sdxl::metrics {

struct LossPlotOptions {
  std::string title = "Training loss";
  std::string x_label = "step";
  std::string y_label = "loss";
  /// Logarithmic loss axis; losses <= 0 cannot be drawn there and are skipped.
  bool log_y = false;
  /// Ema smoothing of the thick line, in [0, 1). Diffusion losses are noisy
  /// from step to step, hence a long average by default.
  double ema_smoothing = 0.95;
  int width = 960;   ///< pixels, at least 200
  int height = 540;  ///< pixels, at least 150
  /// Points per line at most (at least 4). A longer run is drawn from the
  /// minimum and maximum of each of max_points/2 consecutive buckets, which
  /// keeps loss spikes visible while the file stays small.
  std::size_t max_points = 4000;
};

/// What a chart shows, returned alongside it.
struct LossPlotSummary {
  std::size_t points = 0;                ///< input points
  std::size_t plotted = 0;               ///< points with a drawable loss
  std::size_t skipped_non_finite = 0;    ///< NaN or infinite losses
  std::size_t skipped_non_positive = 0;  ///< losses <= 0 on a log axis
  std::size_t polyline_points = 0;       ///< points of each line after decimation
};

/// The SVG document. steps[i] is the step of losses[i]; steps are expected to
/// increase. Skipped points are counted in a note under the title; no
/// drawable point gives a chart with its axes and "no data".
/// Throws zero::InvalidArgument for spans of different lengths or bad options.
std::string render_loss_svg(std::span<const std::int64_t> steps, std::span<const double> losses,
                            const LossPlotOptions& options = {}, LossPlotSummary* summary = nullptr);

/// Writes render_loss_svg() to `path` atomically (zero::io::AtomicFileWriter),
/// so a viewer that reloads the chart during training never sees half of it.
LossPlotSummary write_loss_svg(const std::filesystem::path& path, std::span<const std::int64_t> steps,
                               std::span<const double> losses, const LossPlotOptions& options = {});

}  // namespace sdxl::metrics
