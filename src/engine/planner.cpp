#include "zero/engine/planner.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <deque>
#include <iomanip>
#include <map>
#include <sstream>

#include "zero/comm/simulated_communicator.hpp"
#include "zero/core/layout.hpp"
#include "zero/engine/counting_backend.hpp"
#include "zero/engine/engine.hpp"

namespace zero::plan {

using nlohmann::json;

std::size_t ActivationModel::bytes(int batch, bool checkpointing, std::size_t dtype_bytes) const {
  const double fixed = checkpointing ? fixed_bytes_checkpointed : fixed_bytes_full;
  const double per_sample = checkpointing ? per_sample_bytes_checkpointed : per_sample_bytes_full;
  const double dtype_scale = static_cast<double>(dtype_bytes) / static_cast<double>(reference_dtype_bytes);
  return static_cast<std::size_t>(std::llround((fixed + per_sample * batch) * area_scale * dtype_scale));
}

std::size_t PlanUnit::numel() const {
  std::size_t n = 0;
  for (std::size_t t : tensors) n += t;
  for (std::size_t t : frozen_tensors) n += t;
  return n;
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
  ZERO_CHECK(activations.area_scale > 0 && std::isfinite(activations.area_scale),
             "plan: activations.area_scale must be positive");
  ZERO_CHECK(activations.reference_dtype_bytes >= 1, "plan: activations.reference_dtype_bytes must be >= 1");
  ZERO_CHECK(speed.pcie_bytes_per_second > 0 && speed.param_gather_bytes_per_second >= 0,
             "plan: speed.pcie_bytes_per_second must be > 0 and param_gather_bytes_per_second >= 0");
  ZERO_CHECK(speed.gpu_seconds_per_step >= 0 && speed.gpu_seconds_per_sample >= 0 &&
                 speed.gpu_seconds_per_step + speed.gpu_seconds_per_sample > 0,
             "plan: speed.gpu_seconds_per_step and gpu_seconds_per_sample must be >= 0, not both 0");
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

std::vector<std::vector<ParamSpec>> groups_of(const PlanInput& in) {
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

void run_steps(Engine& engine, const PlanInput& in, int steps) {
  const std::size_t units = engine.unit_count();
  auto recomputed = [&](std::size_t u) {
    return in.activation_checkpointing && (in.units.empty() || in.units[u].checkpointed);
  };
  for (int s = 0; s < steps; ++s) {
    for (int micro = 0; micro < in.engine.accumulation_steps; ++micro) {
      if (engine.plan().gathers_units) {
        for (std::size_t u = 0; u < units; ++u) {
          engine.enter_unit(u, Pass::forward, recomputed(u));
          engine.release_unit(u);
        }
      }
      for (std::size_t u = units; u-- > 0;) {
        engine.enter_unit(u, Pass::backward, recomputed(u));
        for (std::size_t p : engine.unit_params(u)) {
          if (engine.frozen(p)) continue;
          engine.grad_data(p);
          engine.grad_ready(p);
        }
        engine.release_unit(u);
      }
      engine.finish_micro_step();
    }
    engine.step();
  }
}

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

// ---------------------------------------------------------------- make_plan

Plan make_plan(const PlanInput& input) {
  input.validate();
  Plan plan;
  plan.input = input;
  CountingBackend backend;
  SimulatedCommunicator comm(input.world_size);
  Engine engine(groups_of(input), input.engine, comm, backend);
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
  run_steps(engine, input, 1);
  comm.reset_traffic();  // the second step is the steady state
  run_steps(engine, input, 1);
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
  plan.activations =
      input.activations.bytes(input.batch, input.activation_checkpointing, size_of(input.engine.param_dtype));
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
  double gpu = plain * (input.activation_checkpointing ? s.checkpointing_factor : 1.0);
  if (input.engine.stage == 3) gpu *= 1.0 + s.stage3_gather_cost / samples;
  else gpu *= 1.0 + s.stage_step_cost * input.engine.stage;
  gpu *= input.engine.accumulation_steps;
  if (!input.engine.offload.optimizer)
    gpu += s.optimizer_seconds_per_step * size / (input.engine.stage == 0 ? 1.0 : input.world_size);
  double offload = 0, gathers = 0, host_additions = 0;
  if (input.engine.offload.optimizer) {
    const double shard = static_cast<double>(padded_numel) / input.world_size;
    // Transfers overlap the CPU update bucket by bucket: the slower one
    // counts. Offloaded parameters instead go up at every gather (forward
    // and backward of each micro-step), counted as not hidden by compute.
    const double p = static_cast<double>(size_of(input.engine.param_dtype));
    const double up_after_step = input.engine.offload.params ? 0.0 : p;
    offload = std::max(shard * ranks_per_host / s.cpu_elements_per_second,
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
  const double step = input.engine.offload.delayed_update ? std::max(gpu + gathers, offload + host_additions)
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
         ", activation_checkpointing = " + flag(input.activation_checkpointing) +
         ", batch_size = " + std::to_string(input.batch) +
         ", accumulation = " + std::to_string(input.engine.accumulation_steps);
}

std::string Plan::label() const {
  std::string text = "stage " + std::to_string(input.engine.stage);
  if (input.engine.offload.optimizer) text += input.engine.offload.params ? ", offload (optimizer + params)" : ", offload";
  if (input.engine.offload.delayed_update) text += ", delayed update";
  if (input.engine.offload.accumulate_on_host && input.engine.accumulation_steps > 1) text += ", host accumulation";
  text += input.activation_checkpointing ? ", checkpointing" : ", no checkpointing";
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

json plan_json(const Plan& p) {
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
                 {"ema", in.engine.ema.enabled()},
                 {"offload_optimizer", in.engine.offload.optimizer},
                 {"offload_params", in.engine.offload.params},
                 {"offload_delayed_update", in.engine.offload.delayed_update},
                 {"offload_accumulate_on_host", in.engine.offload.accumulate_on_host},
                 {"accumulation_steps", in.engine.accumulation_steps},
                 {"accumulation", in.engine.accumulation == GradAccumulation::reduce_at_boundary ? "boundary" : "each"},
                 {"max_reductions_in_flight", in.engine.buckets.max_reductions_in_flight},
                 {"batch", in.batch},
                 {"activation_checkpointing", in.activation_checkpointing},
                 {"latent_area_scale", in.activations.area_scale}};
  j["activation_model"] = in.activations.source;
  j["gpu_bytes"] = gpu;
  j["host_bytes"] = host;
  j["relative_time_per_sample"] = p.relative_time();
  j["label"] = p.label();
  j["traffic_per_rank_per_step"] = {{"shard_group_size", p.traffic.shard_group_size},
                                    {"within_shard_group_bytes", p.traffic.within_shard_group},
                                    {"across_replicas_bytes", p.traffic.across_replicas},
                                    {"intra_node_bytes", p.traffic.intra_node()},
                                    {"inter_node_bytes", p.traffic.inter_node()}};
  return j;
}

void line(std::ostringstream& out, const char* name, std::size_t bytes, const std::string& note = "") {
  char text[160];
  std::snprintf(text, sizeof text, "  %-28s %12s%s%s\n", name, gib_text(bytes).c_str(), note.empty() ? "" : "  ",
                note.c_str());
  out << text;
}

}  // namespace

std::string Plan::to_json(int indent) const { return plan_json(*this).dump(indent); }

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
  line(out, "ema", model_state.ema, in.engine.offload.optimizer && in.engine.ema.enabled() ? "(offloaded)" : "");
  line(out, "engine: bucket buffers", engine.bucket_buffers);
  line(out, "engine: gathered units", engine.gathered_units);
  line(out, "engine: cached free blocks", engine.cached_blocks);
  line(out, "engine: comm scratch", engine.comm_scratch);
  line(out, "activations", activations, "(" + in.activations.source + ")");
  line(out, "runtime overhead", runtime_overhead, "(CUDA context, libraries, allocator)");
  line(out, "total, peak", gpu_peak());
  line(out, "total, between steps", gpu_at_step_end(), "(what cudaMemGetInfo shows after a step)");
  line(out, "total, peak at least", gpu_peak_lower(), "(the true peak lies between this and the peak)");
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

// ---------------------------------------------------------------- fit

namespace {

std::size_t usable(std::size_t gpu_bytes, const FitOptions& o) {
  return static_cast<std::size_t>(static_cast<double>(gpu_bytes) * (1.0 - o.safety_margin));
}

std::size_t peak_of(const Plan& plan, const FitOptions& o) {
  return o.estimate == PeakEstimate::lower ? plan.gpu_peak_lower() : plan.gpu_peak();
}

/// Micro-batches to search: the base's, or every divisor of the global
/// batch per GPU (accumulation makes up the rest).
std::vector<std::pair<int, int>> batches_of(const PlanInput& base, const FitOptions& options) {
  if (options.global_batch <= 0) return {{base.batch, base.engine.accumulation_steps}};
  ZERO_CHECK(options.global_batch % base.world_size == 0, "fit: the global batch ", options.global_batch,
             " is not a multiple of the world size ", base.world_size);
  const int per_gpu = options.global_batch / base.world_size;
  std::vector<std::pair<int, int>> out;
  for (int micro = 1; micro <= per_gpu; ++micro)
    if (per_gpu % micro == 0) out.emplace_back(micro, per_gpu / micro);
  return out;
}

struct Offload {
  bool optimizer, params;
};

/// One configuration the search tries, planned and checked against the limit.
FitResult::Candidate candidate(PlanInput in, const FitOptions& options, std::size_t limit) {
  FitResult::Candidate c{make_plan(in), false, ""};
  const std::size_t need = peak_of(c.plan, options);
  c.fits = need <= limit;
  if (!c.fits) c.why_not = "needs " + format_bytes(need) + " of " + format_bytes(limit) + " usable";
  if (c.fits && options.host_bytes > 0 && c.plan.host_per_host() > options.host_bytes) {
    c.fits = false;
    c.why_not = "host needs " + format_bytes(c.plan.host_per_host()) + " of " + format_bytes(options.host_bytes);
  }
  return c;
}

std::vector<FitResult::Candidate> search(const PlanInput& base, std::size_t gpu_bytes, const FitOptions& options) {
  std::vector<FitResult::Candidate> out;
  const std::size_t limit = usable(gpu_bytes, options);
  // The delayed update needs offload_optimizer (any accumulation, with or
  // without offload_params); host accumulation needs offload_optimizer and
  // several micro-steps, each reduced. With a global batch both are
  // searched; without one the base's choice is kept where it is allowed.
  const bool searched = options.global_batch > 0;
  for (const auto& [micro, accumulation] : batches_of(base, options))
    for (int stage = 0; stage <= 3; ++stage)
      for (Offload offload : {Offload{false, false}, Offload{true, false}, Offload{true, true}}) {
        if ((offload.optimizer && stage == 0) || (offload.params && stage != 3)) continue;
        const bool host_allowed = offload.optimizer && accumulation > 1 &&
                                  base.engine.accumulation == GradAccumulation::reduce_each_micro_step;
        for (bool checkpointing : {false, true})
          for (bool delayed : {false, true})
            for (bool on_host : {false, true}) {
              if (delayed != ((searched ? delayed : base.engine.offload.delayed_update) && offload.optimizer)) continue;
              if (on_host != ((searched ? on_host : base.engine.offload.accumulate_on_host) && host_allowed)) continue;
              PlanInput in = base;
              in.batch = micro;
              in.engine.accumulation_steps = accumulation;
              in.engine.stage = stage;
              in.engine.offload.optimizer = offload.optimizer;
              in.engine.offload.params = offload.params;
              in.engine.offload.delayed_update = delayed;
              in.engine.offload.accumulate_on_host = on_host;
              in.activation_checkpointing = checkpointing;
              out.push_back(candidate(std::move(in), options, limit));
            }
      }
  // Most images per second first (at one batch: least time per sample).
  // Equal speed (the CPU update bounds the step, whatever the device does):
  // fewer micro-steps first, then less memory. The model does not see that
  // the update's threads slow the launches of small micro-batches beside
  // them: SDXL at 24 GiB on the H200 (bench/results/session15-h200.md), all
  // three predicted 7.01 images/s, measured 7.14 at batch 8, 7.10 at 4 x 2
  // and about 5.4 at 2 x 4.
  std::stable_sort(out.begin(), out.end(), [](const FitResult::Candidate& a, const FitResult::Candidate& b) {
    const double ra = a.plan.images_per_second(), rb = b.plan.images_per_second();
    if (std::abs(ra - rb) > 1e-9 * std::max(ra, rb)) return ra > rb;
    const int ma = a.plan.input.engine.accumulation_steps, mb = b.plan.input.engine.accumulation_steps;
    if (ma != mb) return ma < mb;
    return a.plan.gpu_peak() < b.plan.gpu_peak();
  });
  return out;
}

std::optional<Plan> fastest_fitting(const PlanInput& base, std::size_t gpu_bytes, const FitOptions& options) {
  for (auto& c : search(base, gpu_bytes, options))
    if (c.fits) return std::move(c.plan);
  return std::nullopt;
}

}  // namespace

FitResult fit(const PlanInput& base, std::size_t gpu_bytes, const FitOptions& options) {
  ZERO_CHECK(gpu_bytes > 0, "fit: the GPU budget must be positive");
  ZERO_CHECK(options.safety_margin >= 0 && options.safety_margin < 1, "fit: safety_margin must be in [0, 1), got ",
             options.safety_margin);
  FitResult result;
  result.gpu_bytes = gpu_bytes;
  result.options = options;
  result.candidates = search(base, gpu_bytes, options);
  for (const auto& c : result.candidates)
    if (c.fits) {
      result.best = c.plan;
      break;
    }
  if (result.best) return result;

  // Nothing fits: the largest smaller batch that does, and the fewest GPUs
  // (at one batch: a global batch search has tried every micro-batch).
  FitOptions fixed_batch = options;
  fixed_batch.global_batch = 0;
  for (int batch = base.batch - 1; batch >= 1; --batch) {
    PlanInput in = base;
    in.batch = batch;
    if (auto p = fastest_fitting(in, gpu_bytes, fixed_batch)) {
      const int accumulation = (base.batch * base.engine.accumulation_steps + batch - 1) / batch;
      result.suggestions.push_back("batch " + std::to_string(batch) + " per GPU fits (" + p->label() + ", " +
                                   format_bytes(peak_of(*p, options)) + "); accumulation_steps " +
                                   std::to_string(accumulation) + " keeps the global batch");
      break;
    }
  }
  for (int world = base.world_size * 2; world <= 4096; world *= 2) {
    PlanInput in = base;
    in.world_size = world;
    if (auto p = fastest_fitting(in, gpu_bytes, fixed_batch)) {
      result.suggestions.push_back(std::to_string(world) + " GPUs fit at batch " + std::to_string(base.batch) +
                                   " (" + p->label() + ", " + format_bytes(peak_of(*p, options)) + " per GPU)");
      break;
    }
  }
  if (result.suggestions.empty()) {
    // The floor: the least any searched configuration needs at batch 1 on
    // many GPUs (what is left is activations, runtime and unit buffers).
    PlanInput in = base;
    in.batch = 1;
    in.world_size = 4096;
    const auto floor = search(in, gpu_bytes, fixed_batch);
    const auto least = std::min_element(floor.begin(), floor.end(), [&](const auto& a, const auto& b) {
      return peak_of(a.plan, options) < peak_of(b.plan, options);
    });
    result.suggestions.push_back("even batch 1 on 4096 GPUs needs " + format_bytes(peak_of(least->plan, options)) +
                                 " per GPU (" + least->plan.label() + ": activations " +
                                 format_bytes(least->plan.activations) + ", engine buffers " +
                                 format_bytes(least->plan.engine.peak()) + ", runtime overhead " +
                                 format_bytes(least->plan.runtime_overhead) +
                                 "): use a GPU with more memory, smaller inputs or smaller units");
  }
  return result;
}

std::string FitResult::summary() const {
  std::ostringstream out;
  const std::size_t limit = usable(gpu_bytes, options);
  if (best) {
    out << "fits " << format_bytes(gpu_bytes) << " (" << format_bytes(limit) << " usable with a "
        << options.safety_margin * 100 << "% margin): " << best->label() << ", predicted peak "
        << format_bytes(peak_of(*best, options)) << " per GPU, relative time per sample " << std::fixed
        << std::setprecision(2) << best->relative_time() << ", predicted " << best->images_per_second()
        << " images/s (speed model calibrated on an H200; its measured errors: docs/planner.md); trainer: " << best->trainer_options();
    return out.str();
  }
  out << "nothing fits " << format_bytes(gpu_bytes) << " (" << format_bytes(limit) << " usable with a "
      << options.safety_margin * 100 << "% margin) at N=" << (candidates.empty() ? 0 : candidates[0].plan.input.world_size);
  if (options.global_batch > 0)
    out << ", global batch " << options.global_batch << " (every micro-batch tried).";
  else
    out << ", batch " << (candidates.empty() ? 0 : candidates[0].plan.input.batch) << ".";
  for (const std::string& s : suggestions) out << " Suggestion: " << s << ".";
  return out.str();
}

std::string FitResult::to_json(int indent) const {
  json j;
  j["gpu_budget_bytes"] = gpu_bytes;
  j["usable_bytes"] = usable(gpu_bytes, options);
  j["safety_margin"] = options.safety_margin;
  j["peak_estimate"] = options.estimate == PeakEstimate::lower ? "lower" : "upper";
  if (options.host_bytes) j["host_budget_bytes"] = options.host_bytes;
  if (options.global_batch > 0) j["global_batch"] = options.global_batch;
  j["fits"] = best.has_value();
  j["best"] = best ? plan_json(*best) : json(nullptr);
  json list = json::array();
  for (const Candidate& c : candidates) {
    list.push_back({{"label", c.plan.label()},
                    {"stage", c.plan.input.engine.stage},
                    {"offload_optimizer", c.plan.input.engine.offload.optimizer},
                    {"offload_params", c.plan.input.engine.offload.params},
                    {"activation_checkpointing", c.plan.input.activation_checkpointing},
                    {"gpu_peak_bytes", c.plan.gpu_peak()},
                    {"gpu_peak_lower_bytes", c.plan.gpu_peak_lower()},
                    {"host_bytes_per_host", c.plan.host_per_host()},
                    {"relative_time_per_sample", c.plan.relative_time()},
                    {"batch", c.plan.input.batch},
                    {"accumulation_steps", c.plan.input.engine.accumulation_steps},
                    {"offload_delayed_update", c.plan.input.engine.offload.delayed_update},
                    {"offload_accumulate_on_host", c.plan.input.engine.offload.accumulate_on_host},
                    {"images_per_second", c.plan.images_per_second()},
                    {"trainer_options", c.plan.trainer_options()},
                    {"fits", c.fits},
                    {"why_not", c.why_not}});
  }
  j["candidates"] = list;
  j["suggestions"] = suggestions;
  j["summary"] = summary();
  return j.dump(indent);
}

std::string FitResult::table() const {
  std::ostringstream out;
  out << "candidates, fastest first (images/s predicted; relative time per sample; peak per GPU; host per host):\n";
  // A global batch search lists many: the fastest, and the first that fits.
  constexpr std::size_t kShown = 15;
  std::size_t shown = 0;
  bool fit_shown = false;
  for (const Candidate& c : candidates) {
    if (shown >= kShown && (fit_shown || !c.fits)) continue;
    fit_shown = fit_shown || c.fits;
    ++shown;
    char text[320];
    std::snprintf(text, sizeof text, "  %-4s %-60s %8.3f  %6.2f  %12s  %12s  %s", c.fits ? "fits" : "-",
                  c.plan.label().c_str(), c.plan.images_per_second(), c.plan.relative_time(),
                  format_bytes(peak_of(c.plan, options)).c_str(), format_bytes(c.plan.host_per_host()).c_str(),
                  c.why_not.c_str());
    std::string row = text;
    row.erase(row.find_last_not_of(' ') + 1);
    out << row << "\n";
  }
  if (shown < candidates.size()) out << "  (" << candidates.size() - shown << " more not shown; --json lists all)\n";
  out << "\n" << summary() << "\n";
  if (best) out << "\n" << best->table();
  return out.str();
}

std::optional<std::string> check_fits(const Plan& plan, std::size_t cap_bytes, const FitOptions& options) {
  const std::size_t limit = usable(cap_bytes, options);
  const std::size_t need = peak_of(plan, options);
  if (need <= limit) return std::nullopt;
  std::ostringstream out;
  out << "predicted peak GPU memory " << format_bytes(need)
      << (options.estimate == PeakEstimate::lower ? " at least" : "") << " per GPU (model state "
      << format_bytes(plan.model_state.model_state()) << ", engine buffers " << format_bytes(plan.engine.peak())
      << ", activations " << format_bytes(plan.activations) << ", runtime " << format_bytes(plan.runtime_overhead)
      << ") exceeds " << format_bytes(limit) << " usable of " << format_bytes(cap_bytes) << " for "
      << plan.label() << " at N=" << plan.input.world_size << ". ";
  out << fit(plan.input, cap_bytes, options).summary();
  return out.str();
}

std::optional<std::string> check_cap(const Plan& plan, std::size_t cap_bytes) {
  const FitOptions exact{.safety_margin = 0, .estimate = PeakEstimate::upper};
  if (plan.gpu_peak() <= usable(cap_bytes, exact)) return std::nullopt;
  std::ostringstream out;
  out << "predicted peak GPU memory " << format_bytes(plan.gpu_peak_lower()) << " .. " << format_bytes(plan.gpu_peak())
      << " per GPU for " << plan.label() << " at N=" << plan.input.world_size << " (model state "
      << format_bytes(plan.model_state.model_state()) << ", engine buffers " << format_bytes(plan.engine.peak())
      << ", activations " << format_bytes(plan.activations) << ", runtime " << format_bytes(plan.runtime_overhead)
      << "): the upper bound exceeds the cap of " << format_bytes(cap_bytes)
      << ", so the run could die out of memory mid-step. ";
  // A proposal at the same global batch, judged by the same upper bound.
  FitOptions search_options = exact;
  search_options.global_batch = plan.input.world_size * plan.input.batch * plan.input.engine.accumulation_steps;
  const FitResult proposal = fit(plan.input, cap_bytes, search_options);
  if (proposal.best)
    out << "Fits at the same global batch of " << search_options.global_batch << ": " << proposal.best->trainer_options()
        << " (predicted peak up to " << format_bytes(proposal.best->gpu_peak()) << ").";
  else
    out << proposal.summary();
  return out.str();
}

}  // namespace zero::plan
