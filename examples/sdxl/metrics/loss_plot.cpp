#include "loss_plot.hpp"

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <vector>

#include "progress.hpp"
#include "zero/core/error.hpp"
#include "zero/io/atomic_file.hpp"

namespace sdxl::metrics {
namespace {

struct Point {
  double x;
  double y;
};

__attribute__((format(printf, 2, 3))) void append_printf(std::string& out, const char* format, ...) {
  char buffer[256];
  va_list args;
  va_start(args, format);
  int n = std::vsnprintf(buffer, sizeof(buffer), format, args);
  va_end(args);
  if (n < 0) return;
  if (static_cast<std::size_t>(n) < sizeof(buffer)) {
    out.append(buffer, static_cast<std::size_t>(n));
    return;
  }
  std::string text(static_cast<std::size_t>(n) + 1, '\0');
  va_start(args, format);
  std::vsnprintf(text.data(), text.size(), format, args);
  va_end(args);
  out.append(text.data(), static_cast<std::size_t>(n));
}

std::string xml_escape(std::string_view text) {
  std::string escaped;
  for (char c : text) {
    switch (c) {
      case '&': escaped += "&amp;"; break;
      case '<': escaped += "&lt;"; break;
      case '>': escaped += "&gt;"; break;
      case '"': escaped += "&quot;"; break;
      case '\'': escaped += "&apos;"; break;
      default:
        // Control characters other than tab/newline are not allowed in XML 1.0.
        if (static_cast<unsigned char>(c) >= 0x20 || c == '\t' || c == '\n') escaped += c;
    }
  }
  return escaped;
}

// Keeps the first and last point and, per bucket of consecutive points, the
// lowest and the highest in their original order: the envelope a full
// resolution plot would show at this width, spikes included.
std::vector<Point> decimate(const std::vector<Point>& points, std::size_t max_points) {
  if (points.size() <= max_points) return points;
  const std::size_t buckets = (max_points - 2) / 2;
  std::vector<std::size_t> indices;
  indices.reserve(max_points);
  indices.push_back(0);
  for (std::size_t b = 0; b < buckets; ++b) {
    const std::size_t begin = b * points.size() / buckets;
    const std::size_t end = (b + 1) * points.size() / buckets;
    std::size_t low = begin;
    std::size_t high = begin;
    for (std::size_t i = begin; i < end; ++i) {
      if (points[i].y < points[low].y) low = i;
      if (points[i].y > points[high].y) high = i;
    }
    indices.push_back(std::min(low, high));
    indices.push_back(std::max(low, high));
  }
  indices.push_back(points.size() - 1);
  indices.erase(std::unique(indices.begin(), indices.end()), indices.end());
  std::vector<Point> kept;
  kept.reserve(indices.size());
  for (std::size_t i : indices) kept.push_back(points[i]);
  return kept;
}

// A "nice" tick spacing (1, 2 or 5 times a power of ten) giving about
// `target` intervals over `range`.
double nice_step(double range, int target) {
  const double raw = range / target;
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  const double fraction = raw / magnitude;
  const double nice = fraction < 1.5 ? 1.0 : fraction < 3.5 ? 2.0 : fraction < 7.5 ? 5.0 : 10.0;
  return nice * magnitude;
}

// Enough decimals to tell ticks `step` apart, no more.
std::string tick_label(double value, double step) {
  std::string label;
  const int decimals = std::clamp(static_cast<int>(-std::floor(std::log10(step) + 1e-9)), 0, 12);
  if (std::abs(value) < step * 1e-6) value = 0.0;  // no "-0.00"
  append_printf(label, "%.*f", decimals, value);
  return label;
}

struct Axis {
  double lo;
  double hi;
  std::vector<double> ticks;  // in axis units (log10 of the loss on a log axis)
  std::vector<std::string> labels;
};

Axis linear_axis(double lo, double hi, int target_ticks) {
  if (hi <= lo) {  // one value: give it some room around
    const double pad = lo == 0.0 ? 1.0 : std::abs(lo) * 0.1;
    lo -= pad;
    hi += pad;
  }
  const double step = nice_step(hi - lo, target_ticks);
  Axis axis{std::floor(lo / step) * step, std::ceil(hi / step) * step, {}, {}};
  // Counted, not accumulated: at magnitudes where `step` is below the
  // spacing of doubles, t += step would never reach hi.
  const auto intervals = static_cast<int>(std::min(std::round((axis.hi - axis.lo) / step), 50.0));
  for (int i = 0; i <= intervals; ++i) {
    const double t = axis.lo + i * step;
    axis.ticks.push_back(t);
    axis.labels.push_back(tick_label(t, step));
  }
  return axis;
}

// Decades on a log axis, with 2x and 5x ticks when few decades are shown.
Axis log_axis(double lo_value, double hi_value) {
  double lo = std::floor(std::log10(lo_value));
  double hi = std::ceil(std::log10(hi_value));
  if (hi <= lo) hi = lo + 1.0;
  Axis axis{lo, hi, {}, {}};
  const bool fine = hi - lo <= 2.0;
  for (double decade = lo; decade <= hi; decade += 1.0) {
    for (double mantissa : {1.0, 2.0, 5.0}) {
      if (mantissa != 1.0 && (!fine || decade == hi)) continue;
      const double value = mantissa * std::pow(10.0, decade);
      std::string label;
      append_printf(label, "%g", value);
      axis.ticks.push_back(std::log10(value));
      axis.labels.push_back(label);
    }
  }
  return axis;
}

void append_polyline(std::string& svg, const char* css_class, const char* color, double stroke_width,
                     const std::vector<Point>& points) {
  append_printf(svg, "<polyline class=\"%s\" fill=\"none\" stroke=\"%s\" stroke-width=\"%.1f\" "
                "stroke-linejoin=\"round\" points=\"", css_class, color, stroke_width);
  for (std::size_t i = 0; i < points.size(); ++i)
    append_printf(svg, "%s%.1f,%.1f", i ? " " : "", points[i].x, points[i].y);
  svg += "\"/>\n";
}

}  // namespace

std::string render_loss_svg(std::span<const std::int64_t> steps, std::span<const double> losses,
                            const LossPlotOptions& options, LossPlotSummary* summary_out) {
  ZERO_CHECK(steps.size() == losses.size(), "render_loss_svg: ", steps.size(), " steps but ",
             losses.size(), " losses");
  ZERO_CHECK(options.width >= 200 && options.height >= 150,
             "render_loss_svg: the chart must be at least 200x150 pixels, got ", options.width,
             "x", options.height);
  ZERO_CHECK(options.max_points >= 4, "render_loss_svg: max_points must be at least 4, got ",
             options.max_points);
  Ema ema(options.ema_smoothing);  // validates the smoothing

  // ---- the drawable points, in data units (log10 of the loss on a log axis)
  LossPlotSummary summary;
  summary.points = losses.size();
  std::vector<Point> raw;
  std::vector<Point> smooth;
  raw.reserve(losses.size());
  smooth.reserve(losses.size());
  for (std::size_t i = 0; i < losses.size(); ++i) {
    const double loss = losses[i];
    if (!std::isfinite(loss)) {
      ++summary.skipped_non_finite;
      continue;
    }
    if (options.log_y && loss <= 0.0) {
      ++summary.skipped_non_positive;
      continue;
    }
    const double average = ema.update(loss);
    const double x = static_cast<double>(steps[i]);
    raw.push_back({x, options.log_y ? std::log10(loss) : loss});
    smooth.push_back({x, options.log_y ? std::log10(average) : average});
  }
  summary.plotted = raw.size();

  // ---- layout
  const double width = options.width;
  const double height = options.height;
  const double left = 80, right = 24, top = 56, bottom = 56;
  const double plot_w = width - left - right;
  const double plot_h = height - top - bottom;

  Axis x_axis{0.0, 1.0, {}, {}};
  Axis y_axis{0.0, 1.0, {}, {}};
  if (!raw.empty()) {
    auto [x_min, x_max] = std::minmax_element(raw.begin(), raw.end(),
                                              [](const Point& a, const Point& b) { return a.x < b.x; });
    auto [y_min, y_max] = std::minmax_element(raw.begin(), raw.end(),
                                              [](const Point& a, const Point& b) { return a.y < b.y; });
    x_axis = linear_axis(x_min->x, x_max->x, 8);
    y_axis = options.log_y ? log_axis(std::pow(10.0, y_min->y), std::pow(10.0, y_max->y))
                           : linear_axis(y_min->y, y_max->y, 6);
  } else {
    x_axis = linear_axis(0.0, 1.0, 4);
    y_axis = options.log_y ? log_axis(0.1, 1.0) : linear_axis(0.0, 1.0, 4);
  }
  auto to_px = [&](Point p) {
    return Point{left + (p.x - x_axis.lo) / (x_axis.hi - x_axis.lo) * plot_w,
                 top + plot_h - (p.y - y_axis.lo) / (y_axis.hi - y_axis.lo) * plot_h};
  };

  // ---- document
  std::string svg;
  svg += "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  append_printf(svg,
                "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
                "viewBox=\"0 0 %d %d\" font-family=\"sans-serif\" font-size=\"12\">\n",
                options.width, options.height, options.width, options.height);
  append_printf(svg, "<rect width=\"%d\" height=\"%d\" fill=\"white\"/>\n", options.width,
                options.height);
  append_printf(svg, "<text class=\"title\" x=\"%.1f\" y=\"24\" text-anchor=\"middle\" "
                "font-size=\"16\" font-weight=\"bold\">%s</text>\n",
                width / 2, xml_escape(options.title).c_str());

  std::string note;
  if (summary.skipped_non_finite)
    append_printf(note, "%zu non-finite point%s skipped", summary.skipped_non_finite,
                  summary.skipped_non_finite == 1 ? "" : "s");
  if (summary.skipped_non_positive)
    append_printf(note, "%s%zu non-positive point%s skipped (log scale)", note.empty() ? "" : "; ",
                  summary.skipped_non_positive, summary.skipped_non_positive == 1 ? "" : "s");
  if (!note.empty())
    append_printf(svg, "<text class=\"note\" x=\"%.1f\" y=\"42\" text-anchor=\"middle\" "
                  "fill=\"#b22222\">%s</text>\n", width / 2, xml_escape(note).c_str());

  // Grid and ticks.
  svg += "<g class=\"grid\" stroke=\"#e6e6e6\" stroke-width=\"1\">\n";
  for (double t : x_axis.ticks) {
    const double x = to_px({t, y_axis.lo}).x;
    append_printf(svg, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\"/>\n", x, top, x, top + plot_h);
  }
  for (double t : y_axis.ticks) {
    const double y = to_px({x_axis.lo, t}).y;
    append_printf(svg, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\"/>\n", left, y, left + plot_w, y);
  }
  svg += "</g>\n";

  svg += "<g class=\"x-ticks\" text-anchor=\"middle\">\n";
  for (std::size_t i = 0; i < x_axis.ticks.size(); ++i) {
    const double x = to_px({x_axis.ticks[i], y_axis.lo}).x;
    append_printf(svg, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"black\"/>\n", x,
                  top + plot_h, x, top + plot_h + 5);
    append_printf(svg, "<text x=\"%.1f\" y=\"%.1f\">%s</text>\n", x, top + plot_h + 18,
                  xml_escape(x_axis.labels[i]).c_str());
  }
  svg += "</g>\n";
  svg += "<g class=\"y-ticks\" text-anchor=\"end\">\n";
  for (std::size_t i = 0; i < y_axis.ticks.size(); ++i) {
    const double y = to_px({x_axis.lo, y_axis.ticks[i]}).y;
    append_printf(svg, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"black\"/>\n",
                  left - 5, y, left, y);
    append_printf(svg, "<text x=\"%.1f\" y=\"%.1f\">%s</text>\n", left - 8, y + 4,
                  xml_escape(y_axis.labels[i]).c_str());
  }
  svg += "</g>\n";

  // Axes and their labels.
  append_printf(svg, "<rect class=\"frame\" x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" "
                "fill=\"none\" stroke=\"black\"/>\n", left, top, plot_w, plot_h);
  append_printf(svg, "<text class=\"x-label\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%s</text>\n",
                left + plot_w / 2, height - 14, xml_escape(options.x_label).c_str());
  const std::string y_label =
      options.log_y ? options.y_label + " (log scale)" : options.y_label;
  append_printf(svg, "<text class=\"y-label\" x=\"18\" y=\"%.1f\" text-anchor=\"middle\" "
                "transform=\"rotate(-90 18 %.1f)\">%s</text>\n",
                top + plot_h / 2, top + plot_h / 2, xml_escape(y_label).c_str());

  // The data, clipped to the plot area.
  append_printf(svg, "<clipPath id=\"plot-area\"><rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" "
                "height=\"%.1f\"/></clipPath>\n", left, top, plot_w, plot_h);
  if (raw.empty()) {
    append_printf(svg, "<text class=\"no-data\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\" "
                  "fill=\"#808080\">no data</text>\n", left + plot_w / 2, top + plot_h / 2);
  } else {
    std::vector<Point> raw_px = decimate(raw, options.max_points);
    std::vector<Point> smooth_px = decimate(smooth, options.max_points);
    for (Point& p : raw_px) p = to_px(p);
    for (Point& p : smooth_px) p = to_px(p);
    summary.polyline_points = raw_px.size();
    svg += "<g clip-path=\"url(#plot-area)\">\n";
    append_polyline(svg, "loss", "#9ecae1", 1.0, raw_px);
    append_polyline(svg, "ema", "#08519c", 2.5, smooth_px);
    // A one-point polyline draws nothing; mark the point itself.
    if (raw_px.size() == 1)
      append_printf(svg, "<circle class=\"point\" cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"#08519c\"/>\n",
                    raw_px[0].x, raw_px[0].y);
    svg += "</g>\n";
  }

  // Legend, top right inside the plot.
  const double lx = left + plot_w - 150;
  const double ly = top + 16;
  svg += "<g class=\"legend\">\n";
  append_printf(svg, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#9ecae1\" "
                "stroke-width=\"1\"/>\n", lx, ly, lx + 24, ly);
  append_printf(svg, "<text x=\"%.1f\" y=\"%.1f\">loss</text>\n", lx + 30, ly + 4);
  append_printf(svg, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#08519c\" "
                "stroke-width=\"2.5\"/>\n", lx, ly + 18, lx + 24, ly + 18);
  append_printf(svg, "<text x=\"%.1f\" y=\"%.1f\">EMA (%g)</text>\n", lx + 30, ly + 22,
                options.ema_smoothing);
  svg += "</g>\n";
  svg += "</svg>\n";

  if (summary_out) *summary_out = summary;
  return svg;
}

LossPlotSummary write_loss_svg(const std::filesystem::path& path, std::span<const std::int64_t> steps,
                               std::span<const double> losses, const LossPlotOptions& options) {
  LossPlotSummary summary;
  const std::string svg = render_loss_svg(steps, losses, options, &summary);
  zero::io::write_file_atomically(path, std::as_bytes(std::span<const char>(svg)));
  return summary;
}

}  // namespace sdxl::metrics
