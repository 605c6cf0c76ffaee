#include "zero/engine/planner.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <deque>
#include <iomanip>
#include <map>
#include <sstream>
#include <tuple>

#include "zero/comm/simulated_communicator.hpp"
#include "zero/core/layout.hpp"
#include "zero/engine/counting_backend.hpp"
#include "zero/engine/engine.hpp"
#include "zero/engine/model_steps.hpp"
#include "plan_json.hpp"

namespace zero::plan {

using nlohmann::json;

std::size_t ActivationModel::bytes(int batch, double recomputed_share, std::size_t dtype_bytes) const {
  const double share = std::clamp(recomputed_share, 0.0, 1.0);
  const double fixed = fixed_bytes_full + share * (fixed_bytes_checkpointed - fixed_bytes_full);
  const double per_sample = per_sample_bytes_full + share * (per_sample_bytes_checkpointed - per_sample_bytes_full);
  const double dtype_scale = static_cast<double>(dtype_bytes) / static_cast<double>(reference_dtype_bytes);
  return static_cast<std::size_t>(std::llround((fixed + per_sample * batch) * area_scale * dtype_scale));
}

std::size_t PlanUnit::numel() const {
  std::size_t n = 0;
  for (std::size_t t : tensors) n += t;
  for (std::size_t t : frozen_tensors) n += t;
  return n;
}

std::size_t checkpointable_units(const std::vector<PlanUnit>& units) {
  return static_cast<std::size_t>(
      std::count_if(units.begin(), units.end(), [](const PlanUnit& u) { return u.checkpointed; }));
}

std::vector<std::size_t> recompute_order(const std::vector<PlanUnit>& units) {
  std::vector<std::size_t> order;
  for (std::size_t u = 0; u < units.size(); ++u)
    if (units[u].checkpointed) order.push_back(u);
  // Bytes per recompute time, compared as cross products (no division by a
  // zero weight): a unit that frees bytes for no recompute goes first.
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return units[a].activation_weight * units[b].recompute_weight >
           units[b].activation_weight * units[a].recompute_weight;
  });
  return order;
}

std::pair<double, double> recomputed_shares(const PlanInput& in) {
  if (!in.activation_checkpointing) return {0.0, 0.0};
  if (in.units.empty() || in.checkpoint_units == 0) return {1.0, 1.0};
  const std::vector<std::size_t> order = recompute_order(in.units);
  double bytes_all = 0, time_all = 0, bytes = 0, time = 0;
  for (std::size_t i = 0; i < order.size(); ++i) {
    const PlanUnit& u = in.units[order[i]];
    bytes_all += u.activation_weight;
    time_all += u.recompute_weight;
    if (i < in.checkpoint_units) {
      bytes += u.activation_weight;
      time += u.recompute_weight;
    }
  }
  const double count_share = static_cast<double>(in.checkpoint_units) / static_cast<double>(order.size());
  return {bytes_all > 0 ? bytes / bytes_all : count_share, time_all > 0 ? time / time_all : count_share};
}

// ---------------------------------------------------------------- validation

void PlanInput::validate() const {
  ZERO_CHECK(!units.empty() || param_count > 0, "plan: give the model as units or a parameter count (> 0)");
  for (std::size_t u = 0; u < units.size(); ++u)
    ZERO_CHECK(!(units[u].tensors.empty() && units[u].frozen_tensors.empty()) && units[u].numel() > 0, "plan: unit ",
               u, " ('", units[u].name, "') has no parameters");
  ZERO_CHECK(world_size >= 1, "plan: world_size must be >= 1, got ", world_size);
  ZERO_CHECK(gpus_per_host >= 1, "plan: gpus_per_host must be >= 1, got ", gpus_per_host);
  try {
    engine.validate();
  } catch (const InvalidArgument& e) {
    ZERO_THROW(InvalidArgument, "plan: ", e.message());
  }
  ZERO_CHECK(batch >= 1, "plan: batch must be >= 1, got ", batch);
  if (checkpoint_units > 0) {
    ZERO_CHECK(activation_checkpointing, "plan: checkpoint_units = ", checkpoint_units,
               " needs activation_checkpointing");
    ZERO_CHECK(!units.empty(), "plan: checkpoint_units = ", checkpoint_units,
               " needs the model as units (a bare parameter count has none to choose)");
    ZERO_CHECK(checkpoint_units <= checkpointable_units(units), "plan: checkpoint_units = ", checkpoint_units,
               ", but the model has ", checkpointable_units(units), " checkpointable units");
  }
  for (std::size_t u = 0; u < units.size(); ++u)
    ZERO_CHECK(units[u].activation_weight >= 0 && units[u].recompute_weight >= 0 &&
                   std::isfinite(units[u].activation_weight) && std::isfinite(units[u].recompute_weight),
               "plan: unit ", u, " ('", units[u].name, "') has a negative or non-finite activation or recompute weight");
  ZERO_CHECK(activations.area_scale > 0 && std::isfinite(activations.area_scale),
             "plan: activations.area_scale must be positive");
  ZERO_CHECK(activations.reference_dtype_bytes >= 1, "plan: activations.reference_dtype_bytes must be >= 1");
  ZERO_CHECK(speed.pcie_bytes_per_second > 0 && speed.param_gather_bytes_per_second >= 0,
             "plan: speed.pcie_bytes_per_second must be > 0 and param_gather_bytes_per_second >= 0");
  ZERO_CHECK(speed.gpu_seconds_per_step >= 0 && speed.gpu_seconds_per_sample >= 0 &&
                 speed.gpu_seconds_per_step + speed.gpu_seconds_per_sample > 0,
             "plan: speed.gpu_seconds_per_step and gpu_seconds_per_sample must be >= 0, not both 0");
  ZERO_CHECK(std::isfinite(speed.delayed_offload_fwd_bwd_factor) && speed.delayed_offload_fwd_bwd_factor >= 1,
             "plan: speed.delayed_offload_fwd_bwd_factor must be >= 1 (1: no slowdown), got ",
             speed.delayed_offload_fwd_bwd_factor);
  ZERO_CHECK(speed.cpu_update_share_ema_on_device > 0 && speed.cpu_update_share_ema_on_device <= 1,
             "plan: speed.cpu_update_share_ema_on_device must be in (0, 1], got ", speed.cpu_update_share_ema_on_device);
}

// ---------------------------------------------------------------- the engine, counted
//
// The planner builds the real Engine on a CountingBackend (fake addresses,
// no kernels, bytes tracked) with a SimulatedCommunicator (rank 0 of N,
// collectives complete at once) and runs two training steps through it in
// the order a model drives it: forward enters each unit (stage 3), backward
// enters them in reverse and hands in every gradient, the engine's unit
// schedule deciding what is prefetched. What it predicts is what the engine
// allocates; nothing here follows the engine's rules by hand.

namespace {

std::string gib_text(std::size_t bytes) { return format_bytes(bytes); }

std::string with_commas(std::size_t n) {
  std::string digits = std::to_string(n), out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

}  // namespace

std::vector<std::vector<ParamSpec>> engine_groups(const PlanInput& in) {
  std::vector<std::vector<ParamSpec>> groups;
  if (!in.units.empty()) {
    for (const PlanUnit& unit : in.units) {
      std::vector<ParamSpec> group;
      for (std::size_t t = 0; t < unit.tensors.size(); ++t)
        group.push_back({unit.name + "." + std::to_string(t), unit.tensors[t], {}});
      for (std::size_t t = 0; t < unit.frozen_tensors.size(); ++t)
        group.push_back({unit.name + ".frozen" + std::to_string(t), unit.frozen_tensors[t], {}, 0, true});
      groups.push_back(std::move(group));
    }
    return groups;
  }
  // A bare count: buckets of buckets.bytes, as the engine groups parameters
  // automatically (parameter boundaries unknown).
  const std::size_t per_bucket = std::max<std::size_t>(1, in.engine.buckets.bytes / size_of(in.engine.param_dtype));
  for (std::size_t done = 0; done < in.param_count;) {
    const std::size_t n = std::min(per_bucket, in.param_count - done);
    groups.push_back({{"bucket" + std::to_string(groups.size()), n, {}}});
    done += n;
  }
  return groups;
}

// ---------------------------------------------------------------- make_plan

Plan make_plan(const PlanInput& input) {
  input.validate();
  Plan plan;
  plan.input = input;
  CountingBackend backend;
  SimulatedCommunicator comm(input.world_size);
  Engine engine(engine_groups(input), input.engine, comm, backend);
  const FlatLayout& layout = engine.layout();
  plan.padded_numel = layout.padded_numel();
  plan.unit_count = layout.buckets().size();
  for (const Bucket& b : layout.buckets()) plan.largest_unit_elements = std::max(plan.largest_unit_elements, b.padded);
  if (plan.input.param_count == 0 || !input.units.empty())
    plan.input.param_count = layout.param_numel() + engine.frozen_layout().param_numel();
  plan.ranks_per_host = std::min(input.world_size, input.gpus_per_host);

  // Before the first step the engine holds its persistent state only.
  plan.model_state = engine.memory();
  plan.model_state.buffers = 0;
  plan.host_state = engine.host_memory();
  // The steady step: the engine says how many steps come before it.
  run_model_steps(engine, engine.steps_before_steady());
  comm.reset_traffic();
  // The pool's calls as step() reports them: what the trainer logs.
  const StepResult steady = run_model_steps(engine, 1);
  plan.engine.allocations_per_step = steady.block_allocations;
  plan.engine.frees_per_step = steady.block_frees;
  plan.engine.waits_per_step = steady.block_waits;
  const SimulatedTraffic& sent = comm.traffic();
  const int shard_size = engine.world_size();
  plan.traffic.shard_group_size = shard_size;
  plan.traffic.within_shard_group =
      sent.bytes_sent[SimulatedTraffic::world] + sent.bytes_sent[SimulatedTraffic::shard];
  plan.traffic.across_replicas = sent.bytes_sent[SimulatedTraffic::replica];
  plan.traffic.shard_group_in_node = shard_size <= input.gpus_per_host;
  plan.traffic.replicas_in_node = input.world_size <= input.gpus_per_host;
  const TransientMemory transient = engine.transient_memory();
  plan.engine.gathered_units = transient.gathered_units_at_peak;
  plan.engine.bucket_buffers = transient.bucket_buffers_at_peak;
  plan.engine.cached_blocks = transient.cached_blocks_at_peak;
  plan.engine.at_step_end = transient.now;
  if (input.fp32_accumulate_reductions && input.engine.effective_grad_dtype() != DType::fp32) {
    std::size_t largest_shard = 0;
    for (const Bucket& b : layout.buckets()) largest_shard = std::max(largest_shard, b.shard_size);
    plan.engine.comm_scratch = (plan.largest_unit_elements + largest_shard) * 4;
    plan.engine.at_step_end += plan.engine.comm_scratch;
  }
  std::tie(plan.recomputed_bytes_share, plan.recomputed_time_share) = recomputed_shares(input);
  plan.recomputed_units = !input.activation_checkpointing ? 0
                          : input.checkpoint_units > 0   ? input.checkpoint_units
                          : input.units.empty()          ? plan.unit_count
                                                         : checkpointable_units(input.units);
  plan.activations =
      input.activations.bytes(input.batch, plan.recomputed_bytes_share, size_of(input.engine.param_dtype));
  plan.runtime_overhead = input.runtime_overhead_bytes;
  return plan;
}

std::size_t Plan::gpu_peak() const {
  return runtime_overhead + model_state.model_state() + engine.peak() + activations;
}

std::size_t Plan::gpu_at_step_end() const {
  return runtime_overhead + model_state.model_state() + engine.at_step_end + activations;
}

std::size_t Plan::gpu_peak_lower() const {
  return std::max(gpu_at_step_end(), runtime_overhead + model_state.model_state() + engine.peak());
}

namespace {

// Piecewise-linear in the measured (batch, seconds) points; the first point's
// time below it, the per-sample slope beyond the last.
double interpolate_micro_step(const SpeedModel& s, double batch) {
  const auto& points = s.measured_micro_step_seconds;
  if (batch <= points.front().first) return points.front().second;
  for (std::size_t i = 1; i < points.size(); ++i) {
    if (batch <= points[i].first) {
      const auto& [b0, t0] = points[i - 1];
      const auto& [b1, t1] = points[i];
      return t0 + (t1 - t0) * (batch - b0) / (b1 - b0);
    }
  }
  return points.back().second + s.gpu_seconds_per_sample * (batch - points.back().first);
}

}  // namespace

double Plan::seconds_per_step() const {
  const SpeedModel& s = input.speed;
  // GPU time per micro-step (SpeedModel), then checkpointing, stage and
  // offload costs; offload is not assumed to overlap the GPU's work.
  // Times scale by parameters from the model the speed model was measured on.
  const double size =
      s.reference_param_count > 0 ? static_cast<double>(input.param_count) / s.reference_param_count : 1.0;
  const double fixed_seconds = s.gpu_seconds_per_step * size;
  const double per_sample = s.gpu_seconds_per_sample * size * input.activations.area_scale;
  const double samples = static_cast<double>(input.batch);
  // Stage 0, no checkpointing: the measured points where the model has them
  // (latent area counts as batch), else the line.
  const double plain = s.measured_micro_step_seconds.empty()
                           ? fixed_seconds + per_sample * samples
                           : size * interpolate_micro_step(s, samples * input.activations.area_scale);
  // Partial checkpointing recomputes its share of the recompute time.
  double gpu = plain * (1.0 + (s.checkpointing_factor - 1.0) * recomputed_time_share);
  if (input.engine.stage == 3) gpu *= 1.0 + s.stage3_gather_cost / samples;
  else gpu *= 1.0 + s.stage_step_cost * input.engine.stage;
  gpu *= input.engine.accumulation_steps;
  // The update's constants were measured with fp32 state; on the device the
  // update is a stream at HBM's ceiling, so bf16 state scales it by the bytes
  // it moves (master 8, gradient and copy, two per state slot, the EMA's 8).
  // The host's scale is measured where given (SpeedModel::cpu_bf16_state_share).
  const EngineOptions& e = input.engine;
  const bool bf16_state = e.optimizer.state_dtype != DType::fp32;
  auto bytes_scale = [&] {
    const double slots = e.optimizer.state_slots();
    const double common = 8.0 + static_cast<double>(size_of(e.effective_grad_dtype())) +
                          static_cast<double>(size_of(e.param_dtype)) + (e.ema.enabled() ? 8.0 / e.ema.every : 0.0);
    return (common + 2.0 * slots * static_cast<double>(size_of(e.optimizer.state_dtype))) / (common + 8.0 * slots);
  };
  if (!e.offload.optimizer)
    gpu += s.optimizer_seconds_per_step * size * (bf16_state ? bytes_scale() : 1.0) /
           (e.stage == 0 ? 1.0 : input.world_size);
  double offload = 0, gathers = 0, host_additions = 0;
  if (input.engine.offload.optimizer) {
    const double shard = static_cast<double>(padded_numel) / input.world_size;
    // Transfers overlap the CPU update bucket by bucket: the slower one
    // counts. Offloaded parameters instead go up at every gather (forward
    // and backward of each micro-step), counted as not hidden by compute.
    const double p = static_cast<double>(size_of(input.engine.param_dtype));
    // With the EMA on the device, the fp32 master goes up instead of the
    // model-dtype copy, and the CPU writes neither the EMA nor the copy (a
    // measured share of the whole update's time).
    const bool ema_on_device = input.engine.offload.ema_on_device;
    const double up_after_step = input.engine.offload.params ? 0.0 : ema_on_device ? 4.0 : p;
    const EmaOptions& ema = input.engine.ema;
    const double update_share =
        ema_on_device ? s.cpu_update_share_ema_on_device
                      : 1.0 - s.cpu_ema_share + (ema.enabled() ? s.cpu_ema_share / ema.every : 0.0);
    const double host_state_scale =
        !bf16_state ? 1.0 : s.cpu_bf16_state_share > 0 ? s.cpu_bf16_state_share : bytes_scale();
    offload = std::max(shard * ranks_per_host * update_share * host_state_scale / s.cpu_elements_per_second,
                       shard * (static_cast<double>(size_of(input.engine.effective_grad_dtype())) + up_after_step) /
                           s.pcie_bytes_per_second);
    const double gather_rate = s.param_gather_bytes_per_second > 0 ? s.param_gather_bytes_per_second
                                                                    : s.pcie_bytes_per_second;
    if (input.engine.offload.params) gathers = 2.0 * input.engine.accumulation_steps * shard * p / gather_rate;
    // Accumulating on the host: every micro-step after the first goes down
    // too (counted as not hidden, as the uploads are), and the adder thread
    // adds it into the host shard while the device computes on.
    if (input.engine.offload.accumulate_on_host && input.engine.accumulation_steps > 1) {
      const double g = static_cast<double>(size_of(input.engine.effective_grad_dtype()));
      const double later = input.engine.accumulation_steps - 1;
      gathers += later * shard * g / s.pcie_bytes_per_second;
      host_additions = later * shard * ranks_per_host / s.cpu_add_elements_per_second;
    }
  }
  // A delayed update runs beside the next step's device work (the gathers'
  // uploads included, which it does not hide), and the host additions share
  // the CPU with it: the slower side counts. Without it, the additions run
  // beside the micro-steps and the update follows them.
  const double step = input.engine.offload.delayed_update
                          ? std::max(gpu * s.delayed_offload_fwd_bwd_factor + gathers, offload + host_additions)
                          : std::max(gpu + gathers, host_additions) + offload;
  return step;
}

double Plan::relative_time() const {
  const SpeedModel& s = input.speed;
  const double size =
      s.reference_param_count > 0 ? static_cast<double>(input.param_count) / s.reference_param_count : 1.0;
  const double plain = s.gpu_seconds_per_step * size +
                       s.gpu_seconds_per_sample * size * input.activations.area_scale * static_cast<double>(input.batch);
  return seconds_per_step() / (plain * input.engine.accumulation_steps);
}

double Plan::images_per_second() const {
  return static_cast<double>(input.world_size) * input.batch * input.engine.accumulation_steps / seconds_per_step();
}

std::string Plan::trainer_options() const {
  const auto flag = [](bool on) { return on ? "true" : "false"; };
  return "stage = " + std::to_string(input.engine.stage) + ", offload_optimizer = " +
         flag(input.engine.offload.optimizer) + ", offload_params = " + flag(input.engine.offload.params) +
         ", offload_delayed_update = " + flag(input.engine.offload.delayed_update) +
         (input.engine.offload.accumulate_on_host ? ", offload_accumulate_on_host = true" : "") +
         (input.engine.offload.ema_on_device ? ", offload_ema_on_device = true" : "") +
         ", activation_checkpointing = " + flag(input.activation_checkpointing) +
         (input.activation_checkpointing && input.checkpoint_units > 0
              ? ", checkpoint_units = " + std::to_string(input.checkpoint_units)
              : "") +
         ", batch_size = " + std::to_string(input.batch) +
         ", accumulation = " + std::to_string(input.engine.accumulation_steps) +
         (input.engine.stage == 3 ? ", prefetch_units = " + std::to_string(input.engine.buckets.prefetch_units) : "");
}

std::string Plan::label() const {
  std::string text = "stage " + std::to_string(input.engine.stage);
  if (input.engine.offload.optimizer) text += input.engine.offload.params ? ", offload (optimizer + params)" : ", offload";
  if (input.engine.offload.delayed_update) text += ", delayed update";
  if (input.engine.offload.accumulate_on_host && input.engine.accumulation_steps > 1) text += ", host accumulation";
  if (input.engine.offload.ema_on_device) text += ", EMA on the GPU";
  if (!input.activation_checkpointing) text += ", no checkpointing";
  else if (input.checkpoint_units == 0) text += ", checkpointing";
  else text += ", checkpointing " + std::to_string(input.checkpoint_units) + " of " +
               std::to_string(checkpointable_units(input.units)) + " units";
  text += ", batch " + std::to_string(input.batch);
  if (input.engine.accumulation_steps > 1) text += " x " + std::to_string(input.engine.accumulation_steps);
  return text;
}

namespace {

json categories_json(const MemoryByCategory& m) {
  return {{"params", m.params},
          {"grads", m.grads},
          {"master", m.master},
          {"optimizer_state", m.optimizer_state},
          {"ema", m.ema}};
}


void line(std::ostringstream& out, const char* name, std::size_t bytes, const std::string& note = "") {
  char text[160];
  std::snprintf(text, sizeof text, "  %-28s %12s%s%s\n", name, gib_text(bytes).c_str(), note.empty() ? "" : "  ",
                note.c_str());
  out << text;
}

}  // namespace

namespace detail {

nlohmann::json plan_json(const Plan& p) {
  const PlanInput& in = p.input;
  json gpu = categories_json(p.model_state);
  gpu["engine_bucket_buffers"] = p.engine.bucket_buffers;
  gpu["engine_gathered_units"] = p.engine.gathered_units;
  gpu["engine_cached_blocks"] = p.engine.cached_blocks;
  gpu["engine_comm_scratch"] = p.engine.comm_scratch;
  gpu["activations"] = p.activations;
  gpu["runtime_overhead"] = p.runtime_overhead;
  gpu["model_state"] = p.model_state.model_state();
  gpu["total_peak"] = p.gpu_peak();
  gpu["total_at_step_end"] = p.gpu_at_step_end();
  gpu["total_peak_lower"] = p.gpu_peak_lower();
  gpu["engine_calls_per_step"] = {{"allocations", p.engine.allocations_per_step},
                                  {"frees", p.engine.frees_per_step},
                                  {"waits", p.engine.waits_per_step}};
  json host = categories_json(p.host_state);
  host["staging"] = p.host_state.buffers;
  host["total_per_rank"] = p.host_per_rank();
  host["ranks_per_host"] = p.ranks_per_host;
  host["total_per_host"] = p.host_per_host();
  json j;
  j["model"] = {{"name", in.model_name},
                {"parameters", in.param_count},
                {"padded_elements", p.padded_numel},
                {"units", p.unit_count},
                {"largest_unit_elements", p.largest_unit_elements}};
  j["config"] = {{"world_size", in.world_size},
                 {"stage", in.engine.stage},
                 {"param_dtype", std::string(name_of(in.engine.param_dtype))},
                 {"grad_dtype", std::string(name_of(in.engine.effective_grad_dtype()))},
                 {"optimizer", std::string(name_of(in.engine.optimizer.kind))},
                 {"optimizer_state_slots", in.engine.optimizer.state_slots()},
                 {"optimizer_state_dtype", std::string(name_of(in.engine.optimizer.state_dtype))},
                 {"ema", in.engine.ema.enabled()},
                 {"offload_optimizer", in.engine.offload.optimizer},
                 {"offload_params", in.engine.offload.params},
                 {"offload_delayed_update", in.engine.offload.delayed_update},
                 {"offload_accumulate_on_host", in.engine.offload.accumulate_on_host},
                 {"offload_ema_on_device", in.engine.offload.ema_on_device},
                 {"accumulation_steps", in.engine.accumulation_steps},
                 {"accumulation", in.engine.accumulation == GradAccumulation::reduce_at_boundary ? "boundary" : "each"},
                 {"max_reductions_in_flight", in.engine.buckets.max_reductions_in_flight},
                 {"prefetch_units", in.engine.buckets.prefetch_units},
                 {"batch", in.batch},
                 {"activation_checkpointing", in.activation_checkpointing},
                 {"checkpoint_units", in.checkpoint_units},
                 {"recomputed_units", p.recomputed_units},
                 {"recomputed_activation_share", p.recomputed_bytes_share},
                 {"recomputed_time_share", p.recomputed_time_share},
                 {"latent_area_scale", in.activations.area_scale}};
  j["activation_model"] = in.activations.source;
  j["gpu_bytes"] = gpu;
  j["host_bytes"] = host;
  j["relative_time_per_sample"] = p.relative_time();
  j["label"] = p.label();
  j["trainer_options"] = p.trainer_options();
  j["traffic_per_rank_per_step"] = {{"shard_group_size", p.traffic.shard_group_size},
                                    {"within_shard_group_bytes", p.traffic.within_shard_group},
                                    {"across_replicas_bytes", p.traffic.across_replicas},
                                    {"intra_node_bytes", p.traffic.intra_node()},
                                    {"inter_node_bytes", p.traffic.inter_node()}};
  return j;
}

}  // namespace detail

std::string Plan::to_json(int indent) const { return detail::plan_json(*this).dump(indent); }

std::string Plan::table() const {
  const PlanInput& in = input;
  std::ostringstream out;
  out << "model: " << (in.model_name.empty() ? "(parameters)" : in.model_name) << ", "
      << with_commas(in.param_count) << " parameters in " << unit_count << " units (padded "
      << with_commas(padded_numel) << ")\n";
  out << "config: N=" << in.world_size << ", " << label() << ", " << name_of(in.engine.param_dtype) << ", "
      << name_of(in.engine.optimizer.kind) << (in.engine.ema.enabled() ? " + EMA" : "");
  if (in.engine.accumulation_steps > 1)
    out << ", accumulation " << in.engine.accumulation_steps
        << (in.engine.accumulation == GradAccumulation::reduce_at_boundary ? " (boundary)" : " (each)");
  if (in.activations.area_scale != 1.0) out << ", latent area x" << in.activations.area_scale;
  out << "\n\nper GPU\n";
  line(out, "params", model_state.params, in.engine.offload.params ? "(offloaded; gathered units below)" : "");
  line(out, "grads", model_state.grads);
  line(out, "master (fp32)", model_state.master, in.engine.offload.optimizer ? "(offloaded)" : "");
  line(out, "optimizer state", model_state.optimizer_state, in.engine.offload.optimizer ? "(offloaded)" : "");
  line(out, "ema", model_state.ema, in.engine.offload.optimizer && in.engine.ema.enabled() && !in.engine.offload.ema_on_device ? "(offloaded)" : "");
  line(out, "engine: bucket buffers", engine.bucket_buffers);
  line(out, "engine: gathered units", engine.gathered_units);
  line(out, "engine: cached free blocks", engine.cached_blocks);
  line(out, "engine: comm scratch", engine.comm_scratch);
  line(out, "activations", activations, "(" + in.activations.source + ")");
  line(out, "runtime overhead", runtime_overhead, "(CUDA context, libraries, allocator)");
  line(out, "total, peak", gpu_peak());
  line(out, "total, between steps", gpu_at_step_end(), "(what cudaMemGetInfo shows after a step)");
  line(out, "total, peak at least", gpu_peak_lower(), "(the true peak lies between this and the peak)");
  out << "  engine, steady step:         " << engine.allocations_per_step << " allocations, " << engine.frees_per_step
      << " frees, " << engine.waits_per_step
      << " host waits for both streams (metrics.jsonl's engine/block_*; a free mid-step drains the GPU's queue)\n";
  out << "\nper host (" << ranks_per_host << (ranks_per_host == 1 ? " rank" : " ranks") << ", pinned memory)\n";
  if (host_state.params) line(out, "params (shards)", host_state.params * ranks_per_host);
  line(out, "master (fp32)", host_state.master * ranks_per_host);
  line(out, "optimizer state", host_state.optimizer_state * ranks_per_host);
  line(out, "ema", host_state.ema * ranks_per_host);
  line(out, !in.engine.offload.params ? "staging (grad + param copy)"
           : in.engine.offload.delayed_update ? "staging (grad, second param shard)" : "staging (grad)", host_state.buffers * ranks_per_host);
  line(out, "total", host_per_host());
  char sent[256];
  std::snprintf(sent, sizeof sent,
                "\nsent per rank and step (ring collectives, %d GPUs per node): %.2f GB inside a node, %.2f GB "
                "between nodes\n  (shard groups of %d: %.2f GB; across %d replicas: %.2f GB)\n",
                in.gpus_per_host, traffic.intra_node() / 1e9, traffic.inter_node() / 1e9, traffic.shard_group_size,
                traffic.within_shard_group / 1e9, in.world_size / traffic.shard_group_size,
                traffic.across_replicas / 1e9);
  out << sent;
  char speed[96];
  std::snprintf(speed, sizeof speed, "\nrelative time per sample: %.2f (1 = stage 0 without checkpointing)\n",
                relative_time());
  out << speed;
  return out.str();
}

}  // namespace zero::plan
