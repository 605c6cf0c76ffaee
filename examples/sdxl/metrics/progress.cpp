#include "progress.hpp"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>

#include "zero/core/error.hpp"

namespace sdxl::metrics {
namespace {

__attribute__((format(printf, 1, 2))) std::string printf_string(const char* format, ...) {
  char buffer[128];
  va_list args;
  va_start(args, format);
  int n = std::vsnprintf(buffer, sizeof(buffer), format, args);
  va_end(args);
  if (n < 0) return {};
  if (static_cast<std::size_t>(n) < sizeof(buffer)) return std::string(buffer, n);
  std::string text(static_cast<std::size_t>(n) + 1, '\0');
  va_start(args, format);
  std::vsnprintf(text.data(), text.size(), format, args);
  va_end(args);
  text.resize(static_cast<std::size_t>(n));
  return text;
}

constexpr double kMiB = 1024.0 * 1024.0;
constexpr double kGiB = 1024.0 * kMiB;
constexpr int kDefaultBar = 10;
constexpr int kMinBar = 5;
constexpr int kMaxBar = 40;

}  // namespace

// ---------------------------------------------------------------- Ema

Ema::Ema(double smoothing) : smoothing_(smoothing) {
  ZERO_CHECK(smoothing >= 0.0 && smoothing < 1.0, "Ema smoothing must be in [0, 1), got ",
             smoothing);
}

double Ema::update(double x) {
  if (std::isfinite(x)) {
    biased_ = smoothing_ * biased_ + (1.0 - smoothing_) * x;
    weight_ = smoothing_ * weight_ + (1.0 - smoothing_);
    ++count_;
  }
  return value();
}

double Ema::value() const noexcept {
  return count_ == 0 ? std::numeric_limits<double>::quiet_NaN() : biased_ / weight_;
}

void Ema::reset() noexcept {
  biased_ = 0.0;
  weight_ = 0.0;
  count_ = 0;
}

// ---------------------------------------------------------------- formatting

std::string format_duration(double seconds) {
  // Past ~30 years an ETA means "never"; it also keeps the cast below defined.
  if (!std::isfinite(seconds) || seconds < 0.0 || seconds >= 1e9) return "--:--:--";
  const auto total = static_cast<long long>(seconds);
  return printf_string("%02lld:%02lld:%02lld", total / 3600, total / 60 % 60, total % 60);
}

std::string format_progress(const Progress& p, std::optional<double> eta_s, int width) {
  const bool known_total = p.total_steps > 0;
  std::string head = known_total ? printf_string("step %lld/%lld", static_cast<long long>(p.step),
                                                 static_cast<long long>(p.total_steps))
                                 : printf_string("step %lld", static_cast<long long>(p.step));
  double fraction = 0.0;
  std::string percent;
  if (known_total) {
    fraction = std::clamp(static_cast<double>(p.step) / static_cast<double>(p.total_steps), 0.0, 1.0);
    percent = printf_string(" %d%%", static_cast<int>(std::floor(fraction * 100.0)));
  }

  // 0.0/0.0 is a NaN with the sign bit set on x86, which printf shows as
  // "-nan"; a diverged loss reads the same whichever NaN it is.
  std::string tail = std::isfinite(p.epoch) ? printf_string(" | epoch %.2f", p.epoch) : std::string();
  tail += std::isnan(p.loss) ? std::string(" | loss nan") : printf_string(" | loss %.4f", p.loss);
  if (std::isfinite(p.loss_ema)) tail += printf_string(" (ema %.4f)", p.loss_ema);
  if (std::isfinite(p.lr)) tail += printf_string(" | lr %.2e", p.lr);
  if (std::isfinite(p.images_per_s)) tail += printf_string(" | %.2f img/s", p.images_per_s);
  if (p.mem_max_bytes > 0 || p.mem_min_bytes > 0) {
    // GiB for a GPU's tens of GiB; below 1 GiB (a small model on CPU ranks)
    // MiB, which GiB with one decimal would show as 0.0.
    const bool gib = static_cast<double>(p.mem_max_bytes) >= kGiB;
    const double unit = gib ? kGiB : kMiB;
    tail += printf_string(" | mem %.1f/%.1f %s max/min", static_cast<double>(p.mem_max_bytes) / unit,
                          static_cast<double>(p.mem_min_bytes) / unit, gib ? "GiB" : "MiB");
  }
  if (p.imbalance) tail += " | " + format_imbalance(*p.imbalance);
  if (known_total) tail += " | ETA " + format_duration(eta_s.value_or(-1.0));

  int bar_length = 0;
  if (known_total) {
    if (width <= 0) {
      bar_length = kDefaultBar;
    } else {
      const int fixed = static_cast<int>(head.size() + percent.size() + tail.size()) + 3;  // " [" "]"
      bar_length = std::min(width - fixed, kMaxBar);
      if (bar_length < kMinBar) bar_length = 0;
    }
  }
  std::string line = head;
  if (bar_length > 0) {
    const int filled = static_cast<int>(std::floor(fraction * bar_length));
    line += " [";
    line.append(static_cast<std::size_t>(filled), '#');
    line.append(static_cast<std::size_t>(bar_length - filled), '.');
    line += "]";
  }
  line += percent;
  line += tail;
  if (width > 0 && line.size() > static_cast<std::size_t>(width))
    line.resize(static_cast<std::size_t>(width));
  return line;
}

// ---------------------------------------------------------------- ProgressLine

ProgressLine::ProgressLine(double rate_smoothing) : rate_(rate_smoothing) {}

std::string ProgressLine::render(const Progress& p, int width) {
  if (last_step_ && p.step < *last_step_) {  // restarted: old timings say nothing
    rate_.reset();
    last_step_.reset();
  }
  if (!last_step_) {
    if (p.step > p.start_step && p.elapsed_s > 0.0)
      rate_.update(static_cast<double>(p.step - p.start_step) / p.elapsed_s);
    last_step_ = p.step;
    last_elapsed_s_ = p.elapsed_s;
  } else if (p.step > *last_step_ && p.elapsed_s > last_elapsed_s_) {
    rate_.update(static_cast<double>(p.step - *last_step_) / (p.elapsed_s - last_elapsed_s_));
    last_step_ = p.step;
    last_elapsed_s_ = p.elapsed_s;
  }
  // A step that advanced with no measurable time keeps the previous sample,
  // so the next call measures both steps over their combined time.

  eta_s_.reset();
  if (p.total_steps > 0) {
    if (p.step >= p.total_steps)
      eta_s_ = 0.0;
    else if (auto rate = steps_per_s(); rate && *rate > 0.0)
      eta_s_ = static_cast<double>(p.total_steps - p.step) / *rate;
  }
  return format_progress(p, eta_s_, width);
}

std::optional<double> ProgressLine::steps_per_s() const {
  if (rate_.empty()) return std::nullopt;
  return rate_.value();
}

// ---------------------------------------------------------------- terminal

bool is_tty(std::FILE* stream) {
  if (!stream) return false;
  const int fd = ::fileno(stream);
  return fd >= 0 && ::isatty(fd) == 1;
}

int terminal_width(std::FILE* stream, int fallback) {
  if (!is_tty(stream)) return fallback;
  winsize size{};
  if (::ioctl(::fileno(stream), TIOCGWINSZ, &size) != 0 || size.ws_col == 0) return fallback;
  return size.ws_col;
}

}  // namespace sdxl::metrics
