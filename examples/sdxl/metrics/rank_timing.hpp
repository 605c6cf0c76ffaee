// Load imbalance across ranks: each rank's split of a step into
// forward+backward, waiting for collectives and the optimizer, gathered once
// per logged step, summarized as min/max over ranks and the slowest rank.
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <vector>

namespace sdxl::metrics {

/// One rank's step, in seconds of host wall time. Waits for the engine's
/// collectives are taken out of the other two, so that a fast rank that waits
/// for a slow one shows a short forward+backward and a long wait, and the
/// slow rank the opposite.
struct PhaseTimes {
  double fwd_bwd_s = 0;    ///< the batch, forward and backward, without comm_wait_s's part
  double comm_wait_s = 0;  ///< blocked in the engine's collectives (Engine::comm_wait_seconds)
  double optimizer_s = 0;  ///< step() without comm_wait_s's part
  /// The rank's own work: what the other ranks wait for.
  double busy_s() const { return fwd_bwd_s + optimizer_s; }
};

struct Spread {
  double min = 0, max = 0;
};

struct RankImbalance {
  Spread fwd_bwd, comm_wait, optimizer;
  int slowest_rank = 0;  ///< the largest busy_s(); the lowest rank among equals
  int ranks = 0;
};

/// The values PhaseTimes::pack writes, per rank, for one all-gather.
inline constexpr std::size_t kPhaseValues = 3;
/// The three times as floats, in the order summarize_ranks reads them.
void pack(const PhaseTimes& times, float* out);

/// Summarizes `gathered`: kPhaseValues floats per rank, in rank order (what an
/// all-gather of pack()'s output holds). Throws zero::InvalidArgument when
/// the size is not a positive multiple of kPhaseValues.
RankImbalance summarize_ranks(const std::vector<float>& gathered);

/// The metrics.jsonl / TensorBoard scalars: "imbalance/fwd_bwd_min_s",
/// "..._max_s" (likewise comm_wait and optimizer) and "imbalance/slowest_rank".
std::map<std::string, double> imbalance_scalars(const RankImbalance& imbalance);

/// The progress line's part: "fwd+bwd 1.20-1.45 s, wait 0.01-0.25 s, opt
/// 0.10-0.11 s, slowest rank 1" (min-max over ranks); one rank: "fwd+bwd 1.20
/// s, wait 0.00 s, opt 0.10 s".
std::string format_imbalance(const RankImbalance& imbalance);

}  // namespace sdxl::metrics
