#include "zero/engine/planner.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <deque>
#include <iomanip>
#include <map>
#include <sstream>

#include "zero/core/layout.hpp"
#include "zero/engine/engine.hpp"

namespace zero::plan {

using nlohmann::json;

// ---------------------------------------------------------------- calibration
//
// One H200, LibTorch 2.11, bf16, full SDXL UNet (2,567,463,684 parameters),
// 128x128 latents (bench/results/sdxl-train-h200.json, sdxl-unet-fwdbwd.jsonl;
// docs/planner.md has the whole table):
//  - per sample with checkpointing: the slope of the trainer's stage-0 peak,
//    (67.41 - 51.54 GiB) / 7 between batch 1 and batch 8. No fixed part: the
//    peak is the recompute of the largest block (up_blocks.0), which scales
//    with the batch; the saved block inputs are small.
//  - runtime overhead: the trainer's stage-0 batch-1 peak (51.54 GiB) minus
//    the model state (47.82 GiB) minus one sample of checkpointed activations.
//  - without checkpointing: unet_bench's peak allocated minus the bf16 weights
//    (its peak is at the start of backward, before gradients exist): 6.61 GiB
//    at batch 1, 51.74 GiB at batch 8 -> 0.165 GiB + 6.447 GiB per sample.

namespace {
constexpr double kGiBf = 1024.0 * 1024.0 * 1024.0;
constexpr double kSdxlParams = 2567463684.0;
constexpr double kPerSampleCheckpointedGiB = (67.41 - 51.54) / 7.0;  // 2.267
constexpr double kFixedFullGiB = 0.165;
constexpr double kPerSampleFullGiB = 6.447;
constexpr double kRuntimeOverheadGiB = 1.453;
}  // namespace

ActivationModel ActivationModel::sdxl_unet() {
  ActivationModel m;
  m.fixed_bytes_checkpointed = 0;
  m.per_sample_bytes_checkpointed = kPerSampleCheckpointedGiB * kGiBf;
  m.fixed_bytes_full = kFixedFullGiB * kGiBf;
  m.per_sample_bytes_full = kPerSampleFullGiB * kGiBf;
  m.source = "calibrated: SDXL UNet, H200";
  return m;
}

ActivationModel ActivationModel::scaled_from_sdxl(std::size_t param_count) {
  ActivationModel m = sdxl_unet();
  const double ratio = static_cast<double>(param_count) / kSdxlParams;
  m.fixed_bytes_checkpointed *= ratio;
  m.per_sample_bytes_checkpointed *= ratio;
  m.fixed_bytes_full *= ratio;
  m.per_sample_bytes_full *= ratio;
  m.source = "extrapolated from SDXL by parameter count (rough)";
  return m;
}

std::size_t ActivationModel::bytes(int batch, bool checkpointing, std::size_t dtype_bytes) const {
  const double fixed = checkpointing ? fixed_bytes_checkpointed : fixed_bytes_full;
  const double per_sample = checkpointing ? per_sample_bytes_checkpointed : per_sample_bytes_full;
  const double dtype_scale = static_cast<double>(dtype_bytes) / static_cast<double>(reference_dtype_bytes);
  return static_cast<std::size_t>(std::llround((fixed + per_sample * batch) * area_scale * dtype_scale));
}

std::size_t calibrated_runtime_overhead() { return static_cast<std::size_t>(kRuntimeOverheadGiB * kGiBf); }

std::size_t PlanUnit::numel() const {
  std::size_t n = 0;
  for (std::size_t t : tensors) n += t;
  return n;
}

// ---------------------------------------------------------------- validation

void PlanInput::validate() const {
  ZERO_CHECK(!units.empty() || param_count > 0, "plan: give the model as units or a parameter count (> 0)");
  for (std::size_t u = 0; u < units.size(); ++u)
    ZERO_CHECK(!units[u].tensors.empty() && units[u].numel() > 0, "plan: unit ", u, " ('", units[u].name,
               "') has no parameters");
  ZERO_CHECK(world_size >= 1, "plan: world_size must be >= 1, got ", world_size);
  ZERO_CHECK(gpus_per_host >= 1, "plan: gpus_per_host must be >= 1, got ", gpus_per_host);
  ZERO_CHECK(stage >= 0 && stage <= 3, "plan: stage must be 0, 1, 2 or 3, got ", stage);
  check_dtype(param_dtype, "plan: param_dtype");
  check_dtype(effective_grad_dtype(), "plan: grad_dtype");
  optimizer.validate();
  ZERO_CHECK(!offload_optimizer || stage >= 1,
             "plan: offload_optimizer needs stage 1, 2 or 3 (stage 0 keeps a full optimizer on every rank)");
  ZERO_CHECK(!offload_params || (stage == 3 && offload_optimizer),
             "plan: offload_params needs stage 3 with offload_optimizer");
  ZERO_CHECK(!offload_delayed_update || (offload_optimizer && !offload_params && accumulation_steps == 1),
             "plan: offload_delayed_update needs offload_optimizer with one micro-step per step and no offload_params");
  ZERO_CHECK(accumulation_steps >= 1, "plan: accumulation_steps must be >= 1, got ", accumulation_steps);
  ZERO_CHECK(bucket_bytes >= 1, "plan: bucket_bytes must be >= 1");
  ZERO_CHECK(alignment_elements >= 1, "plan: alignment_elements must be >= 1");
  ZERO_CHECK(max_reductions_in_flight >= 1, "plan: max_reductions_in_flight must be >= 1, got ",
             max_reductions_in_flight);
  ZERO_CHECK(batch >= 1, "plan: batch must be >= 1, got ", batch);
  ZERO_CHECK(activations.area_scale > 0 && std::isfinite(activations.area_scale),
             "plan: activations.area_scale must be positive");
  ZERO_CHECK(activations.reference_dtype_bytes >= 1, "plan: activations.reference_dtype_bytes must be >= 1");
}

// ---------------------------------------------------------------- engine replay
//
// Replays what src/engine/engine.cpp and src/torch/sharded_model.cpp allocate
// beyond the persistent state, in the order they do it, over two steps:
//  - acquire(): a transient block (bucket gradient buffer, accumulation
//    scratch, stage-3 gathered unit), reused from the free-block cache when
//    one of the same size is there;
//  - give_back(): kept in the cache while it holds at most 2 x the largest
//    bucket, freed otherwise;
//  - a bucket's reduction is issued when its gradients are complete; beyond
//    max_reductions_in_flight the oldest is completed (its buffers given back);
//  - stage 3: forward gathers each unit and prefetches the next (not inside a
//    checkpointed unit); backward gathers each unit again, prefetching the one
//    before it when the unit is not recomputed.
// If the engine's rules change, this replay must follow (tests/unit
// test_planner.cpp checks it against the measured runs).

namespace {

class EngineReplay {
 public:
  EngineReplay(const PlanInput& in, const FlatLayout& layout) : in_(in), layout_(layout) {
    const auto& buckets = layout.buckets();
    units_ = buckets.size();
    p_ = size_of(in.param_dtype);
    g_ = size_of(in.effective_grad_dtype());
    std::size_t largest = 0;
    for (const Bucket& b : buckets) largest = std::max(largest, b.padded);
    limit_ = in.buffer_cache_bytes.value_or(2 * largest * std::max(p_, g_));
    const bool multi = in.accumulation_steps > 1;
    const bool at_boundary = in.accumulation == GradAccumulation::reduce_at_boundary;
    full_grads_ = in.stage <= 1 || (at_boundary && multi);
    shard_accumulator_ = in.stage >= 2 || (!at_boundary && multi);
    reduce_only_at_boundary_ = at_boundary && multi;
    stream_grads_ = in.offload_optimizer && !multi;
    unit_buffer_.assign(units_, false);
    unit_refs_.assign(units_, 0);
    bucket_buffer_.assign(units_, false);
    accumulator_has_data_.assign(units_, false);
  }

  void run_steps(int steps) {
    for (int s = 0; s < steps; ++s) {
      std::fill(accumulator_has_data_.begin(), accumulator_has_data_.end(), false);
      for (int micro = 0; micro < in_.accumulation_steps; ++micro) {
        last_micro_ = micro + 1 == in_.accumulation_steps;
        forward();
        backward();
        complete_all();  // finish_micro_step
      }
      // step(): updates and parameter all-gathers work in place (offload
      // copies straight from and to the persistent buffers).
    }
  }

  EngineBuffers result() const {
    EngineBuffers e = peak_;
    e.at_step_end = held();
    return e;
  }

 private:
  enum Kind { kUnits, kGrads };

  std::size_t unit_bytes(std::size_t u) const { return layout_.buckets()[u].padded * p_; }
  std::size_t grad_bytes(std::size_t u) const { return layout_.buckets()[u].padded * g_; }
  std::size_t scratch_bytes(std::size_t u) const { return layout_.buckets()[u].shard_size * g_; }
  bool recomputed(std::size_t u) const {
    if (!in_.activation_checkpointing) return false;
    return in_.units.empty() || in_.units[u].checkpointed;
  }
  std::size_t held() const { return live_[kUnits] + live_[kGrads] + free_bytes_; }

  void note_peak() {
    if (held() <= peak_.peak()) return;
    peak_.gathered_units = live_[kUnits];
    peak_.bucket_buffers = live_[kGrads];
    peak_.cached_blocks = free_bytes_;
  }
  void acquire(Kind kind, std::size_t bytes) {
    auto it = free_blocks_.find(bytes);
    if (it != free_blocks_.end() && it->second > 0) {
      --it->second;
      free_bytes_ -= bytes;
    }
    live_[kind] += bytes;
    note_peak();
  }
  void give_back(Kind kind, std::size_t bytes) {
    live_[kind] -= bytes;
    if (free_bytes_ + bytes > limit_) return;  // freed
    ++free_blocks_[bytes];
    free_bytes_ += bytes;
  }

  // Stage 3 gathers (Engine::gather_unit / prefetch_unit / release_unit).
  void prefetch(std::size_t u) {
    if (unit_buffer_[u]) return;
    acquire(kUnits, unit_bytes(u));
    unit_buffer_[u] = true;
  }
  void gather(std::size_t u) {
    prefetch(u);
    ++unit_refs_[u];
  }
  void release(std::size_t u) {
    if (--unit_refs_[u] > 0) return;
    give_back(kUnits, unit_bytes(u));
    unit_buffer_[u] = false;
  }

  // Gradients of unit u, then its reduction (grad_data / grad_ready / issue_reduce).
  void gradients(std::size_t u) {
    if (!full_grads_ && !bucket_buffer_[u]) {
      acquire(kGrads, grad_bytes(u));
      bucket_buffer_[u] = true;
    }
    if (reduce_only_at_boundary_ && !last_micro_) return;
    std::size_t scratch = 0;
    if (shard_accumulator_ && stream_grads_ && in_.world_size == 1) {
      // copied down straight from the bucket buffer in complete()
    } else if (shard_accumulator_ && stream_grads_) {  // reduced into scratch, copied down in complete()
      scratch = scratch_bytes(u);
      acquire(kGrads, scratch);
    } else if (shard_accumulator_) {
      if (!accumulator_has_data_[u]) {
        accumulator_has_data_[u] = true;
      } else {
        scratch = scratch_bytes(u);
        acquire(kGrads, scratch);
      }
    }
    pending_.push_back({u, scratch});
    while (pending_.size() > static_cast<std::size_t>(in_.max_reductions_in_flight)) {
      complete(pending_.front());
      pending_.pop_front();
    }
  }
  struct Pending {
    std::size_t bucket;
    std::size_t scratch;
  };
  void complete(const Pending& p) {
    if (stream_grads_ && shard_accumulator_ && in_.world_size == 1) {  // the bucket buffer is held until copied
      downloads_.push_back(grad_bytes(p.bucket));
      bucket_buffer_[p.bucket] = false;
      while (downloads_.size() > static_cast<std::size_t>(in_.max_reductions_in_flight)) retire_download();
      return;
    }
    if (stream_grads_) {  // the scratch stays until its copy to the host has landed
      downloads_.push_back(p.scratch);
      while (downloads_.size() > static_cast<std::size_t>(in_.max_reductions_in_flight)) retire_download();
    } else if (p.scratch) {
      give_back(kGrads, p.scratch);
    }
    if (!full_grads_ && bucket_buffer_[p.bucket]) {
      give_back(kGrads, grad_bytes(p.bucket));
      bucket_buffer_[p.bucket] = false;
    }
  }
  void retire_download() {
    if (downloads_.front()) give_back(kGrads, downloads_.front());
    downloads_.pop_front();
  }
  void complete_all() {
    while (!pending_.empty()) {
      complete(pending_.front());
      pending_.pop_front();
    }
    while (!downloads_.empty()) retire_download();
  }

  void forward() {
    if (in_.stage < 3) return;
    for (std::size_t u = 0; u < units_; ++u) {
      gather(u);
      if (!recomputed(u) && u + 1 < units_) prefetch(u + 1);
      release(u);
    }
  }
  void backward() {
    for (std::size_t u = units_; u-- > 0;) {
      if (in_.stage < 3) {
        gradients(u);
        continue;
      }
      gather(u);
      if (!recomputed(u) && u > 0) prefetch(u - 1);
      gradients(u);
      release(u);
    }
  }

  const PlanInput& in_;
  const FlatLayout& layout_;
  std::size_t units_ = 0, p_ = 2, g_ = 2, limit_ = 0;
  bool full_grads_ = false, shard_accumulator_ = false, reduce_only_at_boundary_ = false, last_micro_ = true;
  bool stream_grads_ = false;  // Engine: EngineOptions::streams_gradients_to_host()
  std::deque<std::size_t> downloads_;  // scratch bytes of gradient copies to the host in flight
  std::vector<bool> unit_buffer_, bucket_buffer_, accumulator_has_data_;
  std::vector<int> unit_refs_;
  std::deque<Pending> pending_;
  std::map<std::size_t, int> free_blocks_;
  std::size_t free_bytes_ = 0;
  std::size_t live_[2] = {0, 0};
  EngineBuffers peak_;
};

FlatLayout layout_of(const PlanInput& in) {
  const LayoutOptions options{.world_size = in.world_size, .alignment = in.alignment_elements, .bucket_elements = 1};
  if (!in.units.empty()) {
    std::vector<std::vector<ParamSpec>> groups;
    for (const PlanUnit& unit : in.units) {
      std::vector<ParamSpec> group;
      for (std::size_t t = 0; t < unit.tensors.size(); ++t)
        group.push_back({unit.name + "." + std::to_string(t), unit.tensors[t], {}});
      groups.push_back(std::move(group));
    }
    return FlatLayout::build_grouped(groups, options);
  }
  // A bare count: buckets of bucket_bytes, as the engine groups parameters
  // automatically (parameter boundaries unknown).
  const std::size_t per_bucket = std::max<std::size_t>(1, in.bucket_bytes / size_of(in.param_dtype));
  std::vector<std::vector<ParamSpec>> groups;
  for (std::size_t done = 0; done < in.param_count;) {
    const std::size_t n = std::min(per_bucket, in.param_count - done);
    groups.push_back({{"bucket" + std::to_string(groups.size()), n, {}}});
    done += n;
  }
  return FlatLayout::build_grouped(groups, options);
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

PlanInput input_from_engine_options(const EngineOptions& options, int world_size) {
  PlanInput in;
  in.world_size = world_size;
  in.stage = options.stage;
  in.param_dtype = options.param_dtype;
  in.grad_dtype = options.effective_grad_dtype();
  in.optimizer = options.optimizer;
  in.ema = options.ema_decay > 0;
  in.offload_optimizer = options.offload_optimizer;
  in.offload_params = options.offload_params;
  in.offload_delayed_update = options.offload_delayed_update;
  in.accumulation = options.accumulation;
  in.accumulation_steps = options.accumulation_steps;
  in.bucket_bytes = options.bucket_bytes;
  in.alignment_elements = options.alignment_elements;
  in.max_reductions_in_flight = options.max_reductions_in_flight;
  in.buffer_cache_bytes = options.buffer_cache_bytes;
  return in;
}

Plan make_plan(const PlanInput& input) {
  input.validate();
  Plan plan;
  plan.input = input;
  const FlatLayout layout = layout_of(input);
  plan.padded_numel = layout.padded_numel();
  plan.unit_count = layout.buckets().size();
  for (const Bucket& b : layout.buckets()) plan.largest_unit_elements = std::max(plan.largest_unit_elements, b.padded);
  if (plan.input.param_count == 0 || !input.units.empty()) plan.input.param_count = layout.param_numel();
  plan.ranks_per_host = std::min(input.world_size, input.gpus_per_host);

  const ModelStateConfig state{.numel = layout.padded_numel(),
                               .world_size = input.world_size,
                               .stage = input.stage,
                               .param_dtype = input.param_dtype,
                               .grad_dtype = input.effective_grad_dtype(),
                               .optimizer = input.optimizer,
                               .accumulation = input.accumulation,
                               .accumulation_steps = input.accumulation_steps,
                               .ema = input.ema,
                               .offload_optimizer = input.offload_optimizer,
                               .offload_params = input.offload_params,
                               .offload_delayed_update = input.offload_delayed_update};
  plan.model_state = model_state_bytes(state);
  plan.host_state = host_model_state_bytes(state);

  EngineReplay replay(input, layout);
  replay.run_steps(2);
  plan.engine = replay.result();
  if (input.fp32_accumulate_reductions && input.effective_grad_dtype() != DType::fp32) {
    std::size_t largest_shard = 0;
    for (const Bucket& b : layout.buckets()) largest_shard = std::max(largest_shard, b.shard_size);
    plan.engine.comm_scratch = (plan.largest_unit_elements + largest_shard) * 4;
    plan.engine.at_step_end += plan.engine.comm_scratch;
  }
  plan.activations =
      input.activations.bytes(input.batch, input.activation_checkpointing, size_of(input.param_dtype));
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

double Plan::relative_time() const {
  const SpeedModel& s = input.speed;
  // GPU time per micro-step (SpeedModel), then checkpointing, stage and
  // offload costs; offload is not assumed to overlap the GPU's work.
  const double size = static_cast<double>(input.param_count) / kSdxlParams;
  const double fixed_seconds = s.gpu_seconds_per_step * size;
  const double per_sample = s.gpu_seconds_per_sample * size * input.activations.area_scale;
  const double samples = static_cast<double>(input.batch);
  const double plain = fixed_seconds + per_sample * samples;  // stage 0, no checkpointing
  double gpu = plain * (input.activation_checkpointing ? s.checkpointing_factor : 1.0);
  if (input.stage == 3) gpu *= 1.0 + s.stage3_gather_cost / samples;
  else gpu *= 1.0 + s.stage_step_cost * input.stage;
  gpu *= input.accumulation_steps;
  double offload = 0;
  if (input.offload_optimizer) {
    const double shard = static_cast<double>(padded_numel) / input.world_size;
    // Transfers overlap the CPU update bucket by bucket: the slower one
    // counts. Offloaded parameters instead go up at every gather (forward
    // and backward of each micro-step), counted as not hidden by compute.
    const double p = static_cast<double>(size_of(input.param_dtype));
    const double up_after_step = input.offload_params ? 0.0 : p;
    offload = std::max(shard * ranks_per_host / s.cpu_elements_per_second,
                       shard * (static_cast<double>(size_of(input.effective_grad_dtype())) + up_after_step) /
                           s.pcie_bytes_per_second);
    if (input.offload_params) offload += 2.0 * input.accumulation_steps * shard * p / s.pcie_bytes_per_second;
  }
  // A delayed update runs beside the next step's device work: the slower counts.
  const double step = input.offload_delayed_update ? std::max(gpu, offload) : gpu + offload;
  return step / (plain * input.accumulation_steps);
}

std::string Plan::label() const {
  std::string text = "stage " + std::to_string(input.stage);
  if (input.offload_optimizer) text += input.offload_params ? ", offload (optimizer + params)" : ", offload";
  if (input.offload_delayed_update) text += ", delayed update";
  text += input.activation_checkpointing ? ", checkpointing" : ", no checkpointing";
  text += ", batch " + std::to_string(input.batch);
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
                 {"stage", in.stage},
                 {"param_dtype", std::string(name_of(in.param_dtype))},
                 {"grad_dtype", std::string(name_of(in.effective_grad_dtype()))},
                 {"optimizer", std::string(name_of(in.optimizer.kind))},
                 {"optimizer_state_slots", in.optimizer.state_slots()},
                 {"ema", in.ema},
                 {"offload_optimizer", in.offload_optimizer},
                 {"offload_params", in.offload_params},
                 {"offload_delayed_update", in.offload_delayed_update},
                 {"accumulation_steps", in.accumulation_steps},
                 {"accumulation", in.accumulation == GradAccumulation::reduce_at_boundary ? "boundary" : "each"},
                 {"max_reductions_in_flight", in.max_reductions_in_flight},
                 {"batch", in.batch},
                 {"activation_checkpointing", in.activation_checkpointing},
                 {"latent_area_scale", in.activations.area_scale}};
  j["activation_model"] = in.activations.source;
  j["gpu_bytes"] = gpu;
  j["host_bytes"] = host;
  j["relative_time_per_sample"] = p.relative_time();
  j["label"] = p.label();
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
  out << "config: N=" << in.world_size << ", " << label() << ", " << name_of(in.param_dtype) << ", "
      << name_of(in.optimizer.kind) << (in.ema ? " + EMA" : "");
  if (in.accumulation_steps > 1)
    out << ", accumulation " << in.accumulation_steps
        << (in.accumulation == GradAccumulation::reduce_at_boundary ? " (boundary)" : " (each)");
  if (in.activations.area_scale != 1.0) out << ", latent area x" << in.activations.area_scale;
  out << "\n\nper GPU\n";
  line(out, "params", model_state.params, in.offload_params ? "(offloaded; gathered units below)" : "");
  line(out, "grads", model_state.grads);
  line(out, "master (fp32)", model_state.master, in.offload_optimizer ? "(offloaded)" : "");
  line(out, "optimizer state", model_state.optimizer_state, in.offload_optimizer ? "(offloaded)" : "");
  line(out, "ema", model_state.ema, in.offload_optimizer && in.ema ? "(offloaded)" : "");
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
  line(out, in.offload_params ? "staging (grad)" : "staging (grad + param copy)", host_state.buffers * ranks_per_host);
  line(out, "total", host_per_host());
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

std::vector<FitResult::Candidate> search(const PlanInput& base, std::size_t gpu_bytes, const FitOptions& options) {
  std::vector<FitResult::Candidate> out;
  const std::size_t limit = usable(gpu_bytes, options);
  struct Offload {
    bool optimizer, params;
  };
  for (int stage = 0; stage <= 3; ++stage)
    for (Offload offload : {Offload{false, false}, Offload{true, false}, Offload{true, true}})
      for (bool checkpointing : {false, true}) {
        if (offload.optimizer && stage == 0) continue;
        if (offload.params && stage != 3) continue;
        PlanInput in = base;
        in.stage = stage;
        in.offload_optimizer = offload.optimizer;
        in.offload_params = offload.params;
        in.activation_checkpointing = checkpointing;
        FitResult::Candidate c{make_plan(in), false, ""};
        const std::size_t need = peak_of(c.plan, options);
        c.fits = need <= limit;
        if (!c.fits) c.why_not = "needs " + format_bytes(need) + " of " + format_bytes(limit) + " usable";
        if (c.fits && options.host_bytes > 0 && c.plan.host_per_host() > options.host_bytes) {
          c.fits = false;
          c.why_not = "host needs " + format_bytes(c.plan.host_per_host()) + " of " + format_bytes(options.host_bytes);
        }
        out.push_back(std::move(c));
      }
  // Fastest first; equal speed: less memory first.
  std::stable_sort(out.begin(), out.end(), [](const FitResult::Candidate& a, const FitResult::Candidate& b) {
    const double ta = a.plan.relative_time(), tb = b.plan.relative_time();
    if (std::abs(ta - tb) > 1e-9) return ta < tb;
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

  // Nothing fits: the largest smaller batch that does, and the fewest GPUs.
  for (int batch = base.batch - 1; batch >= 1; --batch) {
    PlanInput in = base;
    in.batch = batch;
    if (auto p = fastest_fitting(in, gpu_bytes, options)) {
      const int accumulation = (base.batch * base.accumulation_steps + batch - 1) / batch;
      result.suggestions.push_back("batch " + std::to_string(batch) + " per GPU fits (" + p->label() + ", " +
                                   format_bytes(peak_of(*p, options)) + "); accumulation_steps " +
                                   std::to_string(accumulation) + " keeps the global batch");
      break;
    }
  }
  for (int world = base.world_size * 2; world <= 4096; world *= 2) {
    PlanInput in = base;
    in.world_size = world;
    if (auto p = fastest_fitting(in, gpu_bytes, options)) {
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
    const auto floor = search(in, gpu_bytes, options);
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
        << std::setprecision(2) << best->relative_time();
    return out.str();
  }
  out << "nothing fits " << format_bytes(gpu_bytes) << " (" << format_bytes(limit) << " usable with a "
      << options.safety_margin * 100 << "% margin) at N=" << (candidates.empty() ? 0 : candidates[0].plan.input.world_size)
      << ", batch " << (candidates.empty() ? 0 : candidates[0].plan.input.batch) << ".";
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
  j["fits"] = best.has_value();
  j["best"] = best ? plan_json(*best) : json(nullptr);
  json list = json::array();
  for (const Candidate& c : candidates) {
    list.push_back({{"label", c.plan.label()},
                    {"stage", c.plan.input.stage},
                    {"offload_optimizer", c.plan.input.offload_optimizer},
                    {"offload_params", c.plan.input.offload_params},
                    {"activation_checkpointing", c.plan.input.activation_checkpointing},
                    {"gpu_peak_bytes", c.plan.gpu_peak()},
                    {"gpu_peak_lower_bytes", c.plan.gpu_peak_lower()},
                    {"host_bytes_per_host", c.plan.host_per_host()},
                    {"relative_time_per_sample", c.plan.relative_time()},
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
  out << "candidates, fastest first (relative time per sample; peak per GPU; host per host):\n";
  for (const Candidate& c : candidates) {
    char text[256];
    std::snprintf(text, sizeof text, "  %-4s %-45s %6.2f  %12s  %12s  %s", c.fits ? "fits" : "-",
                  c.plan.label().c_str(), c.plan.relative_time(), format_bytes(peak_of(c.plan, options)).c_str(),
                  format_bytes(c.plan.host_per_host()).c_str(), c.why_not.c_str());
    std::string row = text;
    row.erase(row.find_last_not_of(' ') + 1);
    out << row << "\n";
  }
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

}  // namespace zero::plan
