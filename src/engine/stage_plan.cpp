#include "zero/engine/stage_plan.hpp"

#include <algorithm>
#include <cmath>

namespace zero {

double EmaOptions::decay_at(std::int64_t step) const {
  if (!enabled() || step % every != 0) return 0;
  // Warm-up as diffusers' EMAModel: min(decay, (1 + t) / (10 + t)) at step t.
  // One factor when every = 1: the same bits as the per-step decay.
  double product = 1;
  for (std::int64_t t = step - every + 1; t <= step; ++t) {
    const double x = static_cast<double>(t);
    product *= warmup ? std::min(decay, (1 + x) / (10 + x)) : decay;
  }
  return product;
}

void EngineOptions::validate() const {
  ZERO_CHECK(stage >= 0 && stage <= 3, "EngineOptions.stage must be 0, 1, 2 or 3, got ", stage);
  check_dtype(param_dtype, "EngineOptions.param_dtype");
  check_dtype(effective_grad_dtype(), "EngineOptions.grad_dtype");
  ZERO_CHECK(buckets.bytes >= 1, "EngineOptions.buckets.bytes must be >= 1");
  ZERO_CHECK(buckets.alignment_elements >= 1, "EngineOptions.buckets.alignment_elements must be >= 1, got ",
             buckets.alignment_elements);
  ZERO_CHECK(accumulation_steps >= 1, "EngineOptions.accumulation_steps must be >= 1, got ",
             accumulation_steps);
  ZERO_CHECK(accumulation == GradAccumulation::reduce_each_micro_step ||
                 accumulation == GradAccumulation::reduce_at_boundary,
             "EngineOptions.accumulation: unknown mode ", static_cast<int>(accumulation));
  ZERO_CHECK(std::isfinite(max_grad_norm) && max_grad_norm >= 0,
             "EngineOptions.max_grad_norm must be finite and >= 0 (0 disables), got ", max_grad_norm);
  ZERO_CHECK(buckets.max_reductions_in_flight >= 1,
             "EngineOptions.buckets.max_reductions_in_flight must be >= 1, got ", buckets.max_reductions_in_flight);
  ZERO_CHECK(buckets.prefetch_units >= 0 && buckets.prefetch_units <= 64,
             "EngineOptions.buckets.prefetch_units must be in [0, 64] (0: gather each unit when entered), got ",
             buckets.prefetch_units);
  ZERO_CHECK(ema.decay >= 0 && ema.decay < 1, "EngineOptions.ema.decay must be in [0, 1) (0 disables), got ",
             ema.decay);
  ZERO_CHECK(ema.every >= 1, "EngineOptions.ema.every must be >= 1 (1: every step), got ", ema.every);
  ZERO_CHECK(!ema.enabled() || ema.every * (1 - ema.decay) <= 1, "EngineOptions.ema.every = ", ema.every,
             " is longer than the EMA's horizon 1 / (1 - decay) = ", 1 / (1 - ema.decay),
             " steps: the average would skip more weights than it keeps");
  ZERO_CHECK(max_consecutive_nonfinite >= 0, "EngineOptions.max_consecutive_nonfinite must be >= 0");
  ZERO_CHECK(shard_group_size >= 0, "EngineOptions.shard_group_size must be >= 0 (0: all ranks), got ",
             shard_group_size);
  const std::string conflict = offload_conflict();
  ZERO_CHECK(conflict.empty(), "EngineOptions.offload: ", conflict);
  ZERO_CHECK(offload.update_threads >= 0, "EngineOptions.offload.update_threads must be >= 0 (0: OpenMP's default less one), got ",
             offload.update_threads);
  ZERO_CHECK(offload.gradient_worker_threads >= 0,
             "EngineOptions.offload.gradient_worker_threads must be >= 0 (0: as update_threads), got ",
             offload.gradient_worker_threads);
  ZERO_CHECK(offload.delayed_update_warmup_steps >= 0,
             "EngineOptions.offload.delayed_update_warmup_steps must be >= 0, got ",
             offload.delayed_update_warmup_steps);
  optimizer.validate();
  for (std::size_t g = 0; g < param_groups.size(); ++g) {
    const ParamGroupOptions& group = param_groups[g];
    const std::string what = "EngineOptions.param_groups[" + std::to_string(g) + "] ('" + group.name + "')";
    ZERO_CHECK(std::isfinite(group.lr_scale) && group.lr_scale >= 0, what, ".lr_scale must be finite and >= 0, got ",
               group.lr_scale);
    const OptimizerOptions resolved = group.resolve(optimizer);
    try {
      resolved.validate();
    } catch (const InvalidArgument& e) {
      ZERO_THROW(InvalidArgument, what, ": ", e.message());
    }
    // Every parameter has the same state tensors: one layout for the state.
    ZERO_CHECK(resolved.state_slots() == optimizer.state_slots(), what, ": momentum ", resolved.momentum,
               " changes the optimizer's state tensors (", resolved.state_slots(), " instead of ",
               optimizer.state_slots(), "); give every group momentum > 0, or none");
  }
  if (effective_loss_scaling()) loss_scaler.validate();
}

std::string EngineOptions::offload_conflict() const {
  using detail::concat;
  // In the trainer's key names (offload_optimizer, offload_params,
  // offload_delayed_update, ...), which users know the switches by.
  if (offload.optimizer && stage < 1)
    return concat("offload_optimizer needs stage 1, 2 or 3, got stage ", stage,
                  " (stage 0 keeps the whole optimizer on every rank)");
  if (offload.params && !(stage == 3 && offload.optimizer))
    return concat("offload_params needs stage 3 with offload_optimizer, got stage ", stage,
                  offload.optimizer ? "" : " without offload_optimizer",
                  " (below stage 3 every rank keeps the full parameters on the device)");
  // The delayed update works with any accumulation and with offload_params
  // (DelayedOffloadUpdater double-buffers what the background update writes).
  if (offload.delayed_update && !offload.optimizer)
    return concat("offload_delayed_update needs offload_optimizer (the delayed update is the CPU optimizer's), "
                  "got stage ", stage, " without offload_optimizer");
  if (offload.accumulate_on_host && !offload.optimizer)
    return concat("offload_accumulate_on_host needs offload_optimizer (the host holds the optimizer's gradient "
                  "shard), got stage ", stage, " without offload_optimizer");
  if (offload.accumulate_on_host && accumulation == GradAccumulation::reduce_at_boundary)
    return "offload_accumulate_on_host adds each micro-step's reduced gradients on the host; with "
           "accumulation_mode boundary the micro-steps accumulate on the device before the one reduction (use "
           "accumulation_mode each)";
  if (offload.ema_on_device && !(offload.optimizer && ema.enabled() && !offload.params))
    return concat("offload_ema_on_device needs offload_optimizer and an EMA, without offload_params (got ",
                  offload.optimizer ? "" : "no offload_optimizer, ", ema.enabled() ? "" : "no EMA (ema_decay 0), ",
                  offload.params ? "offload_params, " : "", "stage ", stage,
                  "): it keeps the EMA beside parameters that live on the device");
  return {};
}

StagePlan StagePlan::of(const EngineOptions& o, int world_size) {
  o.validate();
  ZERO_CHECK(world_size >= 1, "world_size must be >= 1, got ", world_size);
  StagePlan p;
  p.stage = o.stage;
  p.world_size = world_size;
  p.param_dtype = o.param_dtype;
  p.grad_dtype = o.effective_grad_dtype();
  const bool multi = o.accumulation_steps > 1;
  const bool at_boundary = o.accumulation == GradAccumulation::reduce_at_boundary;

  p.params_full = o.stage < 3;
  p.gathers_units = o.stage == 3;
  p.gathers_params_after_step = o.stage == 1 || o.stage == 2;
  p.params_on_host = o.offload.params;
  p.units_in_place =
      p.gathers_units && world_size == 1 && !o.offload.optimizer && !o.buckets.bucket_buffers_on_one_rank;

  // Stages 0-1 reduce in place into the full buffer unless several
  // micro-steps are each reduced (then a sharded accumulator holds the
  // running sum); stages 2-3 always keep the sharded accumulator. Backward
  // writes into a full buffer at stages 0-1 and when accumulating locally to
  // the boundary over several micro-steps at 2-3; otherwise into transient
  // bucket buffers.
  // One rank in the shard group, one micro-step, no offload: the
  // reduce-scatter is the identity and the shard is the whole buffer, so
  // stages 2-3 take stage 1's path (backward writes the full buffer, reduced
  // in place): no bucket buffers, no copies, no more bytes than the shard.
  // (With offload the gradients stream to the host instead of staying on the
  // device; with accumulation the full buffer would come on top of the shard.)
  const bool identity_reduction =
      world_size == 1 && !multi && !o.offload.optimizer && !o.buckets.bucket_buffers_on_one_rank;
  p.full_grads = o.stage <= 1 || identity_reduction || (at_boundary && multi);
  p.shard_accumulator = (o.stage >= 2 && !identity_reduction) || (!at_boundary && multi);
  p.reduce_only_at_boundary = at_boundary && multi;
  // With several micro-steps the reduced gradients accumulate in a device
  // shard and go down at the step, unless the host accumulates them.
  p.streams_grads_to_host = o.offload.optimizer && (!multi || o.offload.accumulate_on_host);
  p.accumulates_on_host = p.streams_grads_to_host && multi;
  // The step's gradient goes down whole only where the host adds no micro-steps.
  p.grad_stats_on_device_before_download =
      p.streams_grads_to_host && !p.accumulates_on_host && o.offload.gradient_stats_on_device;

  p.optimizer_full = o.stage == 0;
  p.optimizer_on_host = o.offload.optimizer;
  p.uploads_master = o.offload.optimizer && o.offload.ema_on_device;
  p.ema_on_host = o.offload.optimizer && !p.uploads_master;
  p.has_master = o.param_dtype != DType::fp32 || o.offload.optimizer;
  p.state_slots = o.optimizer.state_slots();
  p.state_dtype = o.optimizer.state_dtype;
  p.ema = o.ema.enabled();
  p.delayed_update = o.offload.delayed_update;
  return p;
}

}  // namespace zero
