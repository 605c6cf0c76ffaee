// Updaters: how a step's update reaches the master weights, optimizer state,
// EMA and model parameters, chosen once at construction from the StagePlan:
//   DeviceUpdater         - the backend's fused kernels, where the state lives
//                           (device, or host memory on the host backend);
//   OffloadUpdater        - state in pinned host memory, updated by the CPU
//                           bucket by bucket while transfers overlap;
//   DelayedOffloadUpdater - the same update on a background thread, beside
//                           the next step's forward and backward.
// Engine::step decides (statistics, loss scale, skip, clip) and hands the
// decision to the updater; the updater also starts the gathers that bring
// the parameters back. Internal to src/engine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "zero/engine/engine.hpp"
#include "zero/optim/optimizer.hpp"

namespace zero::detail {

/// One parameter group's optimizer and step scalars.
struct GroupStep {
  OptimizerOptions optimizer;
  StepScalars scalars;
};

/// A step the engine decided to apply.
struct UpdateArgs {
  std::vector<GroupStep> groups;  // by group index
  double ema_decay = 0;  // EmaOptions::decay_at: 0 when this step leaves the EMA alone
  std::int64_t step = 0;  // optimizer steps applied, this one included
};

class Updater {
 public:
  virtual ~Updater() = default;
  /// Called by every step() once the statistics are agreed, before the
  /// update: the delayed updater joins the previous update here (rethrowing
  /// its error) and queues its parameters up, applied or skipped.
  virtual void finish_previous(StepResult& result) { (void)result; }
  /// Applies the step to master, state and EMA, writes the model-dtype
  /// parameters and starts the gathers that bring every rank's slices back.
  virtual void apply(const UpdateArgs& args, StepResult& result) = 0;
  /// Before anything reads or writes the state outside step(): nothing pending.
  virtual void settle() {}
  /// Before the state is only read outside step() (gathers for exports and
  /// validation images): every update running on the host has finished, but
  /// what reaches the device, and when, stays as if nothing had been read,
  /// so that reading mid-run does not change the next step.
  virtual void settle_for_reading() { settle(); }
  /// Backward handed over bucket b's gradients in the step's last
  /// micro-step: it reads the bucket's parameters no more until step().
  /// Called on the thread that drives the device (the delayed update sends
  /// its finished slices up here).
  virtual void on_bucket_released(std::size_t b) { (void)b; }
  /// The last micro-step's backward is done (after every on_bucket_released).
  virtual void on_backward_done() {}
  /// Engine::steps_before_steady: the first step makes the working set.
  virtual int steps_before_steady() const { return 1; }
  /// Where streamed gradients land: the host gradient shard (offload), null otherwise.
  virtual std::byte* host_gradients() { return nullptr; }
  /// Where the micro-steps after the first land before the CPU adds them
  /// into host_gradients() (plan.accumulates_on_host), null otherwise.
  virtual std::byte* host_gradient_staging() { return nullptr; }
  /// The model-dtype parameters recomputed from the master weights (after a
  /// restore): this rank's slices, not yet gathered.
  virtual void parameters_from_master() = 0;
};

/// The updater the engine's plan calls for; `engine` outlives it.
std::unique_ptr<Updater> make_updater(Engine::Impl& engine);

}  // namespace zero::detail
