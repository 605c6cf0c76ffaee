// zero::torch — the LibTorch adapter. It binds a module's parameters onto the
// engine's flat buffers (parameters become views into them), feeds gradients
// to the engine from autograd as each one is produced, and wraps "units"
// (groups of parameters, e.g. one UNet block) so that under stage 3 their
// parameters exist only around their forward and backward. All sharding
// logic stays in zero::Engine; this file only converts and hooks.
//
// Stage 3 and saved tensors: a unit's parameters are views into one storage
// object per unit whose data pointer is set when the unit is gathered and
// cleared when it is released. Tensors that autograd saved during forward
// refer to that same storage, so when the unit is gathered again for
// backward they see the parameters again, without recomputing anything.
// With recompute on, the unit's forward runs without saving anything and is
// re-run, gathered, inside its backward (activation checkpointing).
#pragma once

#include <torch/torch.h>

#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "zero/comm/communicator.hpp"
#include "zero/engine/backend.hpp"
#include "zero/engine/engine.hpp"

namespace zero::adapter {

/// A unit: parameters gathered and released together; one bucket of the engine.
struct UnitSpec {
  std::string name;
  std::vector<std::pair<std::string, torch::Tensor>> params;
};

/// One unit per direct child of `module` (in registration order), plus one for
/// the module's own direct parameters if it has any; children without
/// parameters are skipped.
std::vector<UnitSpec> units_by_child(torch::nn::Module& module);

/// The device tensors of a backend: kCPU for host backends, the current CUDA
/// device for device backends.
torch::Device device_of(const Backend& backend);
torch::ScalarType scalar_type_of(DType dtype);

using UnitBody = std::function<torch::autograd::variable_list(const torch::autograd::variable_list&)>;

class ShardedModel {
 public:
  /// Takes over the parameters in `units` (every parameter must be in exactly
  /// one unit). Their current values become the initial weights; every rank
  /// must hold the same values (checked). A parameter that does not require
  /// grad is frozen: the engine keeps its values only (sharded and gathered
  /// with its unit at stage 3) and never changes them.
  ///
  /// `group_of` gives each parameter's group (EngineOptions::param_groups)
  /// by name; none: group 0. Inside a unit the parameters are laid out
  /// ordered by group (stable), so a bucket holds few runs of one group and
  /// the optimizer needs few launches per bucket.
  using GroupOf = std::function<int(const std::string& name)>;
  ShardedModel(std::vector<UnitSpec> units, const EngineOptions& options, Communicator& comm, Backend& backend,
               const GroupOf& group_of = {});
  ~ShardedModel();
  ShardedModel(const ShardedModel&) = delete;
  ShardedModel& operator=(const ShardedModel&) = delete;

  Engine& engine() { return *engine_; }
  const Engine& engine() const { return *engine_; }
  std::size_t unit_count() const { return units_.size(); }
  const std::string& unit_name(std::size_t u) const { return units_.at(u).name; }

  /// Runs `body` (the unit's forward) on `inputs`. Stage 3: gathers the unit
  /// first (prefetching the next), releases it after, and arranges the gather
  /// again before its backward. recompute: activation checkpointing of the
  /// unit (any stage). Outputs must be tensors; those that require grad carry
  /// the unit's backward.
  torch::autograd::variable_list run_unit(std::size_t unit, const torch::autograd::variable_list& inputs,
                                          const UnitBody& body, bool recompute = false);

  /// After backward of a micro-step: parameters that received no gradient
  /// count as zero, reductions complete, units gathered for backward are released.
  void finish_micro_step();
  StepResult step() { return engine_->step(); }

  /// Makes each parameter's .grad a view of the engine's full gradient
  /// buffer, so that autograd accumulates into it in place and the
  /// per-parameter hooks do no work; finish_micro_step() then declares every
  /// gradient ready and starts the reductions. Forward and backward then do
  /// no gradient work on the host, and write fixed addresses.
  /// Needs a full gradient buffer (stage 0 or 1, or any stage on one rank:
  /// StagePlan::full_grads), one micro-step per step, no offload, and
  /// gradients in the parameters' dtype;
  /// throws InvalidArgument naming what is missing otherwise. Do not clear
  /// the parameters' .grad afterwards (step() zeroes the buffer).
  void bind_gradients_to_engine();
  bool gradients_bound() const { return gradients_bound_; }


  // Called from autograd hooks and functions (public for them, not for users).
  void on_gradient(std::size_t param);
  void gather_for_backward(std::size_t unit);
  void release_after_backward(std::size_t unit);
  void gather(std::size_t unit, Pass pass);
  void release(std::size_t unit);

 private:
  struct Unit {
    std::string name;
    std::size_t first_param = 0, param_count = 0;
    std::size_t trainable = 0;     // parameters that get gradients
    // Stage 3: the gathered unit's bytes (trainable, frozen), or none. The
    // first parameter of each kind, where the unit has one, sits at the start.
    c10::Storage storage, frozen_storage;
    std::optional<std::size_t> first_trainable, first_frozen;
    std::size_t ready = 0;         // parameters whose gradient arrived this micro-step
    bool backward_gathered = false;
    // A unit with frozen parameters still needs them after its last trained
    // gradient is in (the gradient of its inputs runs through the frozen
    // layers), so it waits for its inputs' gradients too this micro-step.
    bool inputs_pending = false;
    bool releasable() const { return ready == trainable && !inputs_pending; }
  };
  void bind_unit(std::size_t unit);

  std::unique_ptr<Engine> engine_;
  Backend& backend_;
  torch::Device device_;
  torch::ScalarType param_type_, grad_type_;
  std::vector<torch::Tensor> params_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;  // keeps the hooked nodes alive
  std::vector<Unit> units_;
  torch::Tensor anchor_;  // see RecomputeUnit
  std::deque<UnitBody> recompute_bodies_;  // bodies re-run in backward, until finish_micro_step
  bool gradients_bound_ = false;
};

}  // namespace zero::adapter
