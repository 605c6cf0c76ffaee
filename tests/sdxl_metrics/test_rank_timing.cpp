#include "rank_timing.hpp"

#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "progress.hpp"
#include "zero/core/error.hpp"

using namespace sdxl::metrics;

namespace {

std::vector<float> gather(const std::vector<PhaseTimes>& ranks) {
  std::vector<float> out(ranks.size() * kPhaseValues);
  for (std::size_t r = 0; r < ranks.size(); ++r) pack(ranks[r], out.data() + r * kPhaseValues);
  return out;
}

}  // namespace

TEST_CASE("summarize_ranks: min and max per phase, the slowest rank by its own work") {
  // Rank 2 computes longest; the others wait for it, so their
  // forward+backward is short and their wait long.
  const RankImbalance r = summarize_ranks(gather({{0.50, 0.40, 0.10}, {0.55, 0.35, 0.10}, {0.90, 0.01, 0.12}}));
  CHECK(r.ranks == 3);
  CHECK(r.slowest_rank == 2);
  CHECK(r.fwd_bwd.min == doctest::Approx(0.50));
  CHECK(r.fwd_bwd.max == doctest::Approx(0.90));
  CHECK(r.comm_wait.min == doctest::Approx(0.01));
  CHECK(r.comm_wait.max == doctest::Approx(0.40));
  CHECK(r.optimizer.min == doctest::Approx(0.10));
  CHECK(r.optimizer.max == doctest::Approx(0.12));

  // The optimizer counts too: rank 0's update is the long one.
  CHECK(summarize_ranks(gather({{0.5, 0.0, 0.9}, {0.6, 0.0, 0.1}})).slowest_rank == 0);
  // Equal ranks: the lowest.
  CHECK(summarize_ranks(gather({{0.5, 0.1, 0.1}, {0.5, 0.1, 0.1}})).slowest_rank == 0);

  const auto scalars = imbalance_scalars(r);
  CHECK(scalars.size() == 7);
  CHECK(scalars.at("imbalance/slowest_rank") == 2.0);
  CHECK(scalars.at("imbalance/comm_wait_max_s") == doctest::Approx(0.40));

  CHECK_THROWS_AS(summarize_ranks({}), zero::InvalidArgument);
  CHECK_THROWS_AS(summarize_ranks({1.0f, 2.0f}), zero::InvalidArgument);
}

TEST_CASE("format_imbalance and the progress line") {
  const RankImbalance two = summarize_ranks(gather({{0.5, 0.3, 0.1}, {0.8, 0.0, 0.1}}));
  CHECK(format_imbalance(two) == "fwd+bwd 0.500-0.800 s, wait 0.000-0.300 s, opt 0.100-0.100 s, slowest rank 1");
  const RankImbalance one = summarize_ranks(gather({{0.5, 0.0, 0.1}}));
  CHECK(format_imbalance(one) == "fwd+bwd 0.500 s, wait 0.000 s, opt 0.100 s");

  Progress p;
  p.step = 3;
  p.total_steps = 10;
  p.loss = 0.5;
  const std::string without = format_progress(p, 1.0);
  CHECK(without.find("fwd+bwd") == std::string::npos);
  p.imbalance = two;
  const std::string with = format_progress(p, 1.0);
  CHECK(with.find(" | fwd+bwd 0.500-0.800 s, wait 0.000-0.300 s, opt 0.100-0.100 s, slowest rank 1 | ETA ") !=
        std::string::npos);
}
