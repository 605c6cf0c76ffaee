// EngineOptions: what a user chooses, grouped by concern (buckets, EMA,
// offload), validated once. The engine, the memory model and the planner all
// take these options; none copies them into a struct of its own. What the
// options mean for the buffers (full or sharded, device or host, where a
// reduction lands) is derived once, in StagePlan (stage_plan.hpp).
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "zero/core/dtype.hpp"
#include "zero/optim/loss_scaler.hpp"
#include "zero/optim/optimizer.hpp"

namespace zero {

enum class GradAccumulation {
  /// Reduce-scatter every micro-step's gradients into the (sharded)
  /// accumulator: least memory at stages 2-3, N x the communication.
  reduce_each_micro_step,
  /// Accumulate a full local gradient and reduce once at the boundary: one
  /// reduction per step, but every rank holds a full gradient buffer.
  reduce_at_boundary,
};

/// How parameters are packed into buckets, the unit of every collective.
struct BucketOptions {
  /// Target bucket size when parameters are grouped automatically.
  std::size_t bytes = std::size_t{32} << 20;
  /// Every parameter and every rank's bucket slice starts at a multiple of
  /// this many elements.
  std::size_t alignment_elements = 128;
  /// Bucket reductions allowed in flight before the oldest is waited for:
  /// overlap against memory for bucket buffers and communicator scratch.
  int max_reductions_in_flight = 2;
  /// Stage 3: how many units ahead of the one in use are gathered, in the
  /// pass's direction (forward: the next units; backward: the previous
  /// ones), checkpointed units too. Each holds a unit buffer (with
  /// offload_params, an upload) that overlaps the unit in use. 0 gathers each
  /// unit when it is entered. The planner's fit() picks the deepest that
  /// fits the memory cap (up to 4).
  int prefetch_units = 1;
  /// Free transient blocks (gradient buckets, scratch, stage-3 unit buffers)
  /// kept for reuse, in bytes. Default: two of the largest bucket between
  /// steps, and within a step the working set (blocks given back are kept
  /// while the pool holds no more than its peak in use; step() trims). Set,
  /// a hard limit at all times. 0 frees each block when it is given back:
  /// the least memory, but every free then waits for the device.
  std::optional<std::size_t> cache_bytes;
  /// On one rank the reduce-scatter and the gathers are the identity:
  /// stages 2-3 let backward write one full gradient buffer
  /// (StagePlan::full_grads) and stage 3 uses units where they lie in the
  /// shard (StagePlan::units_in_place). True keeps the bucket buffers, unit
  /// buffers and copies of several ranks there too: for tests of those paths
  /// on one GPU, not for speed.
  bool bucket_buffers_on_one_rank = false;
};

/// Exponential moving average of the weights (fp32, sharded like the master
/// weights), updated after every applied step.
struct EmaOptions {
  /// 0 disables the EMA.
  double decay = 0;
  /// Ramp the decay as min(decay, (1 + t) / (10 + t)) at step t, so early
  /// weights do not dominate (the convention of diffusers' EMAModel).
  bool warmup = true;
  /// Update the average every `every` applied steps only, with the product
  /// of the k per-step decays (decay^k without warm-up): the same horizon in
  /// steps, the weights between two updates skipped. With the optimizer
  /// offloaded the EMA is a quarter of the host memory traffic of an update
  /// (8 of ~34 bytes a parameter), so every = 4 cuts the CPU update by ~18%;
  /// the exponential moving average of ema-pytorch's update_every, with the
  /// decay adjusted. 1: every step. At most the horizon 1 / (1 - decay).
  int every = 1;
  bool enabled() const { return decay > 0; }
  /// The decay to apply at optimizer step `step` (1-based): the per-step
  /// decay with warm-up, multiplied over the `every` steps since the last
  /// update; 0 at a step that skips the average.
  double decay_at(std::int64_t step) const;
};

/// ZeRO-Offload (stages 1-3).
struct OffloadOptions {
  /// This rank's fp32 master weights, optimizer state and EMA live in pinned
  /// host memory. At step() the reduced gradient shard is copied down bucket
  /// by bucket, the CPU optimizer (vectorized, multi-threaded; bit-identical
  /// to the device kernels) updates it, and the new model-dtype values go
  /// back up and are all-gathered, each bucket's copies overlapping the next
  /// one's update.
  bool optimizer = false;
  /// Parameter offload (stage 3, with `optimizer`): this rank's model-dtype
  /// parameter shard lives in pinned host memory too. Gathering a unit copies
  /// the rank's slice up and all-gathers it in place; the CPU optimizer
  /// writes the updated shard where it lives, so nothing goes back up after
  /// a step. On the device only the gathered units stay.
  bool params = false;
  /// Delayed parameter update (ZeRO-Offload's DPU; needs `optimizer`; any
  /// accumulation_steps, with or without `params`): step() computes the gradient
  /// statistics (so clipping, loss scaling and skipping are decided at once),
  /// then runs the CPU update on a background thread while the next forward
  /// and backward run on the device with the parameters from before it. The
  /// update is joined and its parameters go up at the next step(): forward
  /// at step t+1 sees the update of step t-1, not t (the parameters lag one
  /// step; master weights, state and EMA are exact). Anything that reads or
  /// writes the state (save_state, load_state, set_param, gather_*) first
  /// completes the pending update and uploads it. Host memory: one more
  /// gradient shard (one micro-step only) and one more parameter staging
  /// shard (with `params`: a second host parameter shard, which the update
  /// writes while the gathers read the other).
  bool delayed_update = false;
  /// With delayed_update: the first this-many applied steps update
  /// synchronously, as without delay (the ZeRO-Offload paper's warm-up).
  int delayed_update_warmup_steps = 0;
  /// With several micro-steps (reduced each micro-step): every micro-step's
  /// reduced slices stream to host memory as with one micro-step, and the
  /// CPU adds them into the host gradient shard (the same fp32 add and
  /// rounding as the device's accumulation: the same bits), so no gradient
  /// shard stays on the device (its whole size at N = 1). Costs one more
  /// pinned gradient shard on the host and a CPU pass per micro-step.
  bool accumulate_on_host = false;
  /// Host threads beside the device. The CPU update that runs while the
  /// device computes (the delayed update, the EMA thread of the synchronous
  /// one) and the host gradient worker (statistics of the downloaded
  /// gradients, host accumulation) each run an OpenMP team, and with the
  /// delayed update both run during backward, beside the thread that
  /// launches the kernels. 0: OpenMP's default team (OMP_NUM_THREADS, else
  /// the cores) less one, left to that thread.
  int update_threads = 0;
  /// The host gradient worker's team; 0: as update_threads.
  int gradient_worker_threads = 0;
  /// With `optimizer` and an EMA, not with `params`: the EMA stays in device
  /// memory. The CPU update then writes neither the EMA nor a model-dtype
  /// copy: each bucket's fp32 master slice goes up (4 bytes a parameter
  /// instead of the copy's 2) into one bucket-sized staging block, and the
  /// device updates the EMA from it and rounds it into the parameters with
  /// the kernels of the on-device update (the same bits). The CPU's memory
  /// traffic with AdamW falls from 36 to 26 bytes a parameter, which is what
  /// bounds the offloaded step; the device holds the EMA (4 bytes a
  /// parameter of the rank's shard) and the staging block; the host no
  /// model-dtype copies.
  bool ema_on_device = false;
  /// With delayed_update at stages 1-2 (parameters on the device): the
  /// finished update's slices go up during the next backward, each once
  /// backward has handed over that bucket's gradients (it reads those
  /// parameters no more in this step) and the CPU is done with it, on a
  /// stream of their own (Backend::transfer_stream) beside the gradients
  /// going down; step() sends the rest and starts the gathers. Without it
  /// every slice goes up at step(), and the next forward waits behind them.
  /// The same values either way; costs one bucket-sized staging block on
  /// the device with ema_on_device.
  bool upload_during_backward = true;
  /// With `optimizer` and streamed gradients (one micro-step, or each
  /// micro-step streamed and added on the host): each bucket's gradient
  /// statistics (sum of squares, non-finite flag) are summed on the device
  /// from its reduced slice as that goes down (one kernel on the comm
  /// stream), and step() reads them back in one copy, instead of the host
  /// gradient worker reading the whole downloaded shard again (2 bytes a
  /// parameter of host memory traffic, and the worker's team, beside the CPU
  /// update: +7% and +15% offloaded images/s in two A/B rounds on an H100,
  /// session 32). The device adds eight squares at a time in fp32 in its own
  /// grouping, so the norm may differ from the worker's by a few 1e-8
  /// relative. Where the step's gradient is never whole on the device (the
  /// host adds several micro-steps) the worker sums it; without `optimizer`
  /// nothing streams and the device sums the gradients anyway. false: always
  /// the worker.
  bool gradient_stats_on_device = true;
};

/// A parameter group: the optimizer hyperparameters of some parameters
/// (ParamSpec::group indexes EngineOptions::param_groups). What a group does
/// not set is the engine's OptimizerOptions. The learning rate is the
/// engine's (set_lr, the schedule) times lr_scale.
struct ParamGroupOptions {
  std::string name;
  double lr_scale = 1.0;
  std::optional<double> weight_decay;
  std::optional<double> beta1, beta2, eps;  // AdamW, Lion
  std::optional<double> momentum;           // SGD (with momentum > 0 exactly when the base has it)
  /// The base options with this group's values in place.
  OptimizerOptions resolve(const OptimizerOptions& base) const {
    OptimizerOptions o = base;
    if (weight_decay) o.weight_decay = *weight_decay;
    if (beta1) o.beta1 = *beta1;
    if (beta2) o.beta2 = *beta2;
    if (eps) o.eps = *eps;
    if (momentum) o.momentum = *momentum;
    return o;
  }
};

struct EngineOptions {
  int stage = 2;
  /// Parameters as the model computes with them. fp32 needs no master copy.
  DType param_dtype = DType::bf16;
  /// Gradients as backward writes and the collectives reduce them; defaults
  /// to param_dtype.
  std::optional<DType> grad_dtype;
  int accumulation_steps = 1;
  GradAccumulation accumulation = GradAccumulation::reduce_each_micro_step;
  /// Global-norm clipping threshold; 0 disables clipping.
  double max_grad_norm = 0;
  OptimizerOptions optimizer{};
  /// Parameter groups (lr scale, weight decay, betas, eps, momentum per
  /// group); empty: every parameter in one group with `optimizer`'s values.
  /// Fixed at construction and saved in checkpoints.
  std::vector<ParamGroupOptions> param_groups;
  /// Dynamic loss scaling; defaults to on for fp16 params, off otherwise.
  std::optional<bool> loss_scaling;
  LossScalerOptions loss_scaler{};
  BucketOptions buckets{};
  EmaOptions ema{};
  OffloadOptions offload{};
  /// Steps with non-finite gradients in a row before step() throws (0 = never).
  /// Each such step is skipped and counted either way.
  int max_consecutive_nonfinite = 0;
  /// Hybrid sharding (HSDP): the world of N ranks is R = N / S replicas of a
  /// shard group of S consecutive ranks. Gradients, optimizer state and
  /// (stage 3) parameters are sharded over the S ranks of a group only;
  /// gradients are reduce-scattered within the group, then each reduced
  /// shard is averaged across the R replicas. 0 (or N): flat sharding over
  /// all N ranks. S must divide N.
  int shard_group_size = 0;

  DType effective_grad_dtype() const { return grad_dtype.value_or(param_dtype); }
  /// Groups in use: at least one.
  std::size_t group_count() const { return param_groups.empty() ? 1 : param_groups.size(); }
  /// The optimizer options of group g (the base options with no groups).
  OptimizerOptions group_optimizer(std::size_t g) const {
    return param_groups.empty() ? optimizer : param_groups.at(g).resolve(optimizer);
  }
  double group_lr_scale(std::size_t g) const { return param_groups.empty() ? 1.0 : param_groups.at(g).lr_scale; }
  bool effective_loss_scaling() const { return loss_scaling.value_or(param_dtype == DType::fp16); }
  /// Throws zero::InvalidArgument naming the option and what was expected.
  void validate() const;
  /// Why the offload switches cannot go with the rest of these options, in
  /// the names users know them by (offload_optimizer, offload_params, ...);
  /// empty when they can. validate() throws it after "EngineOptions.offload: ";
  /// a trainer can throw it as it is, naming its own keys.
  std::string offload_conflict() const;
};

}  // namespace zero
