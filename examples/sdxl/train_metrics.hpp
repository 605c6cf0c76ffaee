// What rank 0 of the trainer records each step: metrics.jsonl, TensorBoard
// and the progress line (MetricsSinks, record_step), from the measures the
// step loop takes (StepMeasures), and every rank's phase times gathered for
// the load-imbalance columns (gather_phase_times).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>

#include "data/epoch_schedule.hpp"
#include "metrics/jsonl_writer.hpp"        // metrics.jsonl
#include "metrics/progress.hpp"            // the progress line, Ema
#include "metrics/rank_timing.hpp"         // PhaseTimes, RankImbalance
#include "metrics/tensorboard_writer.hpp"
#include "train_config.hpp"
#include "zero/comm/mpi_communicator.hpp"
#include "zero/engine/engine.hpp"          // StepResult

namespace sdxl {

using Clock = std::chrono::steady_clock;

inline double seconds_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

/// Rank 0's outputs (the other ranks hold none): metrics.jsonl, cut back to
/// the resumed step so that a resumed run rewrites the steps after its
/// checkpoint, TensorBoard with a session start, and the progress line.
struct MetricsSinks {
  MetricsSinks(const TrainConfig& cfg, std::int64_t resumed_step, const zero::MpiCommunicator& host_comm);

  std::optional<metrics::JsonlWriter> jsonl;
  std::optional<metrics::TensorBoardWriter> tensorboard;
  metrics::ProgressLine progress;
  metrics::Ema loss_ema{0.9};
  bool tty = false;
};

/// One step as rank 0 records it; losses and memory are over all ranks.
struct StepMeasures {
  std::int64_t done = 0;  // steps done, 1-based as logged
  double loss = 0, lr = 0, images_per_s = 0;
  double mem_max_bytes = 0, mem_min_bytes = 0;
  std::int64_t captions_dropped = 0;  // over all ranks and micro-steps
  zero::StepResult result;
  Clock::time_point step_start, step_call;
  double step_call_seconds = 0;
  double step_seconds = 0;  // the whole step's wall time (rank 0's)
  metrics::RankImbalance imbalance;  // this step's phases over all ranks
};

/// Where the run stands, for the records: its length, the step it resumed
/// from, when this process started stepping, its epochs, the engine's count
/// of skipped steps.
struct RunPosition {
  std::int64_t total_steps = 0;
  std::int64_t start_step = 0;
  const data::EpochSchedule& epochs;
  Clock::time_point start;
  std::int64_t steps_skipped = 0;
};

/// metrics.jsonl, TensorBoard, and the progress line every log_every steps
/// (and at the last step). Rank 0 only.
void record_step(const TrainConfig& cfg, MetricsSinks& sinks, const RunPosition& run, const StepMeasures& m);

/// Every rank's phase times of this step, in one all-gather of three floats
/// per rank over the host communicator (metrics/rank_timing.hpp).
metrics::RankImbalance gather_phase_times(zero::MpiCommunicator& host_comm, const metrics::PhaseTimes& mine);

}  // namespace sdxl
