#include "progress.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <string>

#include "zero/core/error.hpp"

using namespace sdxl::metrics;

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

Progress example() {
  Progress p;
  p.step = 120;
  p.total_steps = 1000;
  p.loss = 0.1234;
  p.loss_ema = 0.1301;
  p.lr = 1e-5;
  p.images_per_s = 3.21;
  p.mem_max_bytes = static_cast<std::uint64_t>(21.3 * kGiB);
  p.mem_min_bytes = static_cast<std::uint64_t>(20.9 * kGiB);
  p.elapsed_s = 100.0;
  return p;
}

}  // namespace

TEST_CASE("Ema: bias-corrected, starts at the first value, ignores non-finite input") {
  Ema ema(0.5);
  CHECK(ema.empty());
  CHECK(std::isnan(ema.value()));
  CHECK(ema.update(1.0) == doctest::Approx(1.0));
  // (0.5 * 1 + 1 * 3) / (0.5 + 1)
  CHECK(ema.update(3.0) == doctest::Approx(3.5 / 1.5));
  CHECK(ema.update(kNaN) == doctest::Approx(3.5 / 1.5));
  CHECK(ema.update(std::numeric_limits<double>::infinity()) == doctest::Approx(3.5 / 1.5));
  CHECK(ema.count() == 2);
  ema.reset();
  CHECK(ema.empty());

  Ema constant(0.99);
  for (int i = 0; i < 1000; ++i) constant.update(0.25);
  CHECK(constant.value() == doctest::Approx(0.25).epsilon(1e-12));

  Ema follow(0.0);
  follow.update(5.0);
  CHECK(follow.update(-2.0) == -2.0);

  CHECK_THROWS_AS(Ema(1.0), zero::InvalidArgument);
  CHECK_THROWS_AS(Ema(-0.1), zero::InvalidArgument);
}

TEST_CASE("format_duration") {
  CHECK(format_duration(0) == "00:00:00");
  CHECK(format_duration(2710.9) == "00:45:10");
  CHECK(format_duration(86399) == "23:59:59");
  CHECK(format_duration(360000) == "100:00:00");
  CHECK(format_duration(-1) == "--:--:--");
  CHECK(format_duration(kNaN) == "--:--:--");
  CHECK(format_duration(std::numeric_limits<double>::infinity()) == "--:--:--");
}

TEST_CASE("format_progress: memory below 1 GiB (CPU ranks) in MiB, not 0.0 GiB") {
  Progress small = example();
  small.mem_max_bytes = 37u << 20;
  small.mem_min_bytes = (35u << 20) + (1u << 19);
  const std::string line = format_progress(small, 10.0);
  CHECK(line.find("mem 37.0/35.5 MiB max/min") != std::string::npos);
  CHECK(line.find("GiB") == std::string::npos);
}

TEST_CASE("format_progress: the documented line") {
  CHECK(format_progress(example(), 2710.0) ==
        "step 120/1000 [#.........] 12% | loss 0.1234 (ema 0.1301) | lr 1.00e-05 | 3.21 img/s | "
        "mem 21.3/20.9 GiB max/min | ETA 00:45:10");
  Progress with_epoch = example();
  with_epoch.epoch = 2.4;
  CHECK(format_progress(with_epoch, 2710.0) ==
        "step 120/1000 [#.........] 12% | epoch 2.40 | loss 0.1234 (ema 0.1301) | lr 1.00e-05 | 3.21 img/s | "
        "mem 21.3/20.9 GiB max/min | ETA 00:45:10");
  Progress done = example();
  done.step = 1000;
  CHECK(format_progress(done, 0.0).rfind("step 1000/1000 [##########] 100% |", 0) == 0);
  Progress beyond = example();
  beyond.step = 1200;
  CHECK(format_progress(beyond, 0.0).find("[##########] 100%") != std::string::npos);
}

TEST_CASE("format_progress: unknown fields") {
  Progress p;
  p.step = 5;
  p.loss = kNaN;
  CHECK(format_progress(p, std::nullopt) == "step 5 | loss nan");
  p.loss = -kNaN;
  CHECK(format_progress(p, std::nullopt) == "step 5 | loss nan");
  p.loss = kNaN;
  p.total_steps = 10;
  CHECK(format_progress(p, std::nullopt) == "step 5/10 [#####.....] 50% | loss nan | ETA --:--:--");
}

TEST_CASE("format_progress: the bar fits the terminal width") {
  const Progress p = example();
  const std::string plain = format_progress(p, 2710.0);
  const std::size_t without_bar = plain.size() - 10;  // the default bar is 10 characters

  // Room for a 25-character bar: the line fills the width exactly.
  const int width = static_cast<int>(without_bar) + 25;
  const std::string fitted = format_progress(p, 2710.0, width);
  CHECK(fitted.size() == static_cast<std::size_t>(width));
  CHECK(fitted.find("[###" + std::string(22, '.') + "]") != std::string::npos);  // 12% of 25

  // A wide terminal: the bar stops at 40.
  const std::string wide = format_progress(p, 2710.0, 300);
  CHECK(wide.size() == without_bar + 40);

  // Too narrow for a bar: none, and the line is cut so a '\r' rewrite never wraps.
  const std::string narrow = format_progress(p, 2710.0, 60);
  CHECK(narrow.size() == 60);
  CHECK(narrow.find('[') == std::string::npos);
  CHECK(narrow.rfind("step 120/1000 12% | loss 0.1234", 0) == 0);
}

TEST_CASE("ProgressLine: ETA from the smoothed step rate") {
  ProgressLine line(0.8);
  Progress p;
  p.total_steps = 100;
  p.loss = 0.5;
  CHECK(line.render(p).find("ETA --:--:--") != std::string::npos);
  CHECK_FALSE(line.steps_per_s().has_value());

  p.step = 10;
  p.elapsed_s = 10.0;  // 1 step/s
  CHECK(line.render(p).find("ETA 00:01:30") != std::string::npos);
  REQUIRE(line.eta_s().has_value());
  CHECK(*line.eta_s() == doctest::Approx(90.0));

  p.step = 20;
  p.elapsed_s = 15.0;  // 2 steps/s since the last call
  line.render(p);
  const double rate = (0.8 * 1.0 + 1.0 * 2.0) / 1.8;
  CHECK(*line.steps_per_s() == doctest::Approx(rate));
  CHECK(*line.eta_s() == doctest::Approx(80.0 / rate));

  // A redraw of the same step changes nothing.
  p.elapsed_s = 30.0;
  line.render(p);
  CHECK(*line.steps_per_s() == doctest::Approx(rate));

  p.step = 100;
  p.elapsed_s = 60.0;
  CHECK(line.render(p).find("100% |") != std::string::npos);
  CHECK(*line.eta_s() == 0.0);

  // Steps going backwards: a restart, the estimate starts over.
  p.step = 3;
  p.elapsed_s = 1.0;
  line.render(p);
  CHECK(*line.steps_per_s() == doctest::Approx(3.0));
}

TEST_CASE("ProgressLine: a resumed run measures from its start step") {
  ProgressLine line;
  Progress p;
  p.total_steps = 1000;
  p.start_step = 500;
  p.step = 510;
  p.elapsed_s = 5.0;
  CHECK(line.render(p).find("ETA 00:04:05") != std::string::npos);  // 490 steps at 2/s
}

TEST_CASE("is_tty and terminal_width off a terminal") {
  CHECK_FALSE(is_tty(nullptr));
  std::FILE* file = std::tmpfile();
  REQUIRE(file != nullptr);
  CHECK_FALSE(is_tty(file));
  CHECK(terminal_width(file, 77) == 77);
  std::fclose(file);
}
