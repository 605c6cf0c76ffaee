#include "rank_timing.hpp"

#include <algorithm>
#include <cstdio>

#include "zero/core/error.hpp"

namespace sdxl::metrics {
namespace {

Spread spread_of(const std::vector<float>& gathered, std::size_t field) {
  Spread s{gathered[field], gathered[field]};
  for (std::size_t i = field; i < gathered.size(); i += kPhaseValues) {
    s.min = std::min(s.min, static_cast<double>(gathered[i]));
    s.max = std::max(s.max, static_cast<double>(gathered[i]));
  }
  return s;
}

std::string range(const char* name, const Spread& s, bool one_rank) {
  char buffer[96];
  if (one_rank)
    std::snprintf(buffer, sizeof(buffer), "%s %.3f s", name, s.max);
  else
    std::snprintf(buffer, sizeof(buffer), "%s %.3f-%.3f s", name, s.min, s.max);
  return buffer;
}

}  // namespace

void pack(const PhaseTimes& times, float* out) {
  out[0] = static_cast<float>(times.fwd_bwd_s);
  out[1] = static_cast<float>(times.comm_wait_s);
  out[2] = static_cast<float>(times.optimizer_s);
}

RankImbalance summarize_ranks(const std::vector<float>& gathered) {
  ZERO_CHECK(!gathered.empty() && gathered.size() % kPhaseValues == 0, "summarize_ranks: ", gathered.size(),
             " values, expected a positive multiple of ", kPhaseValues);
  RankImbalance r;
  r.ranks = static_cast<int>(gathered.size() / kPhaseValues);
  r.fwd_bwd = spread_of(gathered, 0);
  r.comm_wait = spread_of(gathered, 1);
  r.optimizer = spread_of(gathered, 2);
  double slowest_busy = -1;
  for (int rank = 0; rank < r.ranks; ++rank) {
    const float* t = gathered.data() + static_cast<std::size_t>(rank) * kPhaseValues;
    const double busy = static_cast<double>(t[0]) + static_cast<double>(t[2]);
    if (busy > slowest_busy) {
      slowest_busy = busy;
      r.slowest_rank = rank;
    }
  }
  return r;
}

std::map<std::string, double> imbalance_scalars(const RankImbalance& r) {
  return {{"imbalance/fwd_bwd_min_s", r.fwd_bwd.min},     {"imbalance/fwd_bwd_max_s", r.fwd_bwd.max},
          {"imbalance/comm_wait_min_s", r.comm_wait.min}, {"imbalance/comm_wait_max_s", r.comm_wait.max},
          {"imbalance/optimizer_min_s", r.optimizer.min}, {"imbalance/optimizer_max_s", r.optimizer.max},
          {"imbalance/slowest_rank", static_cast<double>(r.slowest_rank)}};
}

std::string format_imbalance(const RankImbalance& r) {
  const bool one = r.ranks <= 1;
  std::string text = range("fwd+bwd", r.fwd_bwd, one) + ", " + range("wait", r.comm_wait, one) + ", " +
                     range("opt", r.optimizer, one);
  if (!one) text += ", slowest rank " + std::to_string(r.slowest_rank);
  return text;
}

}  // namespace sdxl::metrics
