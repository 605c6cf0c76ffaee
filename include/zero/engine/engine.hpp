// The sharding engine. It owns the flat parameter and gradient buffers and
// this rank's optimizer shard, and runs the stage 0..3 schedules against a
// Backend (memory and kernels) and a Communicator (collectives). It knows
// nothing of torch: a model hands it parameter sizes, writes gradients where
// it is told, and reads parameters where it is told.
//
// One step, every stage:
//   for each micro-step:
//     [stage 3: gather_unit(u) before using unit u's parameters, release after]
//     forward/backward; for each parameter: add its gradient into
//     grad_data(id), then grad_ready(id). A bucket whose parameters are all
//     ready is reduce-scattered (average over ranks) at once.
//     finish_micro_step()
//   step(): global grad norm (one scalar all-reduce), overflow check agreed
//   across ranks, clipping and unscaling folded into the optimizer kernel,
//   update of this rank's shard, then the parameter all-gather (stages 1-2).
//
// Every stage reduces gradients with the same bucketed reduce-scatter and
// updates with the same element-wise kernel, so stages 0..3 produce the same
// bits at the same world size.
#pragma once

#include <cstddef>
#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "zero/comm/communicator.hpp"
#include "zero/core/layout.hpp"
#include "zero/engine/backend.hpp"
#include "zero/engine/memory_model.hpp"
#include "zero/optim/loss_scaler.hpp"
#include "zero/optim/optimizer.hpp"

namespace zero {

struct EngineOptions {
  int stage = 2;
  /// Parameters as the model computes with them. fp32 needs no master copy.
  DType param_dtype = DType::bf16;
  /// Gradients as backward writes and the collectives reduce them; defaults
  /// to param_dtype.
  std::optional<DType> grad_dtype;
  /// Target bucket size when parameters are grouped automatically.
  std::size_t bucket_bytes = std::size_t{32} << 20;
  /// Every parameter and every rank's bucket slice starts at a multiple of
  /// this many elements.
  std::size_t alignment_elements = 128;
  int accumulation_steps = 1;
  GradAccumulation accumulation = GradAccumulation::reduce_each_micro_step;
  /// Global-norm clipping threshold; 0 disables clipping.
  double max_grad_norm = 0;
  OptimizerOptions optimizer{};
  /// Dynamic loss scaling; defaults to on for fp16 params, off otherwise.
  std::optional<bool> loss_scaling;
  LossScalerOptions loss_scaler{};
  /// Exponential moving average of the weights (fp32, sharded like the
  /// master weights); 0 disables it. Updated after every applied step.
  double ema_decay = 0;
  /// Ramp the EMA decay as min(decay, (1 + t) / (10 + t)) at step t, so early
  /// weights do not dominate (the convention of diffusers' EMAModel).
  bool ema_warmup = true;
  /// Bucket reductions allowed in flight before the oldest is waited for:
  /// overlap against memory for bucket buffers and communicator scratch.
  int max_reductions_in_flight = 2;
  /// Free transient blocks (gradient buckets, scratch, stage-3 unit buffers)
  /// kept for reuse, in bytes; default: two of the largest bucket. 0 frees
  /// each block when it is given back: the least memory, but every free
  /// then waits for the device.
  std::optional<std::size_t> buffer_cache_bytes;
  /// Steps with non-finite gradients in a row before step() throws (0 = never).
  /// Each such step is skipped and counted either way.
  int max_consecutive_nonfinite = 0;
  /// ZeRO-Offload (stages 1-3): this rank's fp32 master weights, optimizer
  /// state and EMA live in pinned host memory. At step() the reduced
  /// gradient shard is copied down bucket by bucket, the CPU optimizer
  /// (vectorized, multi-threaded; bit-identical to the device kernels)
  /// updates it, and the new model-dtype values go back up and are
  /// all-gathered, each bucket's copies overlapping the next one's update.
  bool offload_optimizer = false;
  /// Parameter offload (stage 3, with offload_optimizer): this rank's
  /// model-dtype parameter shard lives in pinned host memory too. Gathering a
  /// unit copies the rank's slice up and all-gathers it in place; the CPU
  /// optimizer writes the updated shard where it lives, so nothing goes back
  /// up after a step. On the device only the gathered units stay.
  bool offload_params = false;
  /// Delayed parameter update (ZeRO-Offload's DPU; offload_optimizer with
  /// one micro-step per step, not offload_params): step() computes the
  /// gradient statistics (so clipping, loss scaling and skipping are decided
  /// at once), then runs the CPU update on a background thread while the
  /// next forward and backward run on the device with the parameters from
  /// before it. The update is joined and its parameters go up at the next
  /// step(): forward at step t+1 sees the update of step t-1, not t (the
  /// parameters lag one step; master weights, state and EMA are exact).
  /// Anything that reads or writes the state (save_state, load_state,
  /// set_param, gather_*) first completes the pending update and uploads it.
  /// Host memory: one more gradient and one more parameter staging shard.
  bool offload_delayed_update = false;
  /// With offload_delayed_update: the first this-many applied steps update
  /// synchronously, as without delay (the ZeRO-Offload paper's warm-up).
  int delayed_update_warmup_steps = 0;

  DType effective_grad_dtype() const { return grad_dtype.value_or(param_dtype); }
  /// With the optimizer offloaded and one micro-step per step, each bucket's
  /// reduced gradient is copied to host memory as soon as its reduction
  /// completes (while backward goes on), and stages 2-3 keep no gradient
  /// shard on the device.
  bool streams_gradients_to_host() const { return offload_optimizer && accumulation_steps == 1; }
  bool effective_loss_scaling() const { return loss_scaling.value_or(param_dtype == DType::fp16); }
  void validate() const;
};

/// The memory model's description of an engine with these options over
/// padded_numel elements (a multiple of world_size) on world_size ranks.
ModelStateConfig model_state_config(const EngineOptions& options, std::size_t padded_numel, int world_size);

struct StepResult {
  bool applied = false;      // false: skipped for non-finite gradients
  double grad_norm = 0;      // global L2 norm of the averaged, unscaled gradient, before clipping
  double clip_coefficient = 1;
  double loss_scale = 1;
  std::int64_t step = 0;     // optimizer steps applied so far
  /// Offload: host wall time of step()'s CPU work, the gradient statistics
  /// of streamed gradients and the CPU update (optimizer, EMA, and waiting
  /// for gradients still on their way down); 0 without offload.
  double cpu_grad_stats_seconds = 0;
  double cpu_update_seconds = 0;
  /// offload_delayed_update: cpu_update_seconds is the background update
  /// that step() joined (the previous step's), and this is how long step()
  /// waited for it: the part of the CPU update not hidden behind the device.
  double cpu_update_wait_seconds = 0;
};

class Engine {
 public:
  /// Parameters grouped automatically into buckets of about bucket_bytes.
  Engine(std::vector<ParamSpec> params, const EngineOptions& options, Communicator& comm,
         Backend& backend);
  /// One bucket per group: the units of stage 3 (e.g. one UNet block each).
  Engine(std::vector<std::vector<ParamSpec>> groups, const EngineOptions& options,
         Communicator& comm, Backend& backend);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const EngineOptions& options() const { return options_; }
  const FlatLayout& layout() const { return layout_; }
  int rank() const { return rank_; }
  int world_size() const { return world_; }
  std::size_t param_count() const { return layout_.params().size(); }
  std::size_t unit_count() const { return layout_.buckets().size(); }
  std::size_t unit_of(std::size_t param) const { return layout_.slots().at(param).bucket; }

  // ------------------------------------------------------------ parameters
  /// Sets parameter `param` from fp32 host values (numel of them). Every rank
  /// must pass the same values; each keeps what its stage needs. The master
  /// copy keeps the fp32 values, the model copy their rounding.
  void set_param(std::size_t param, const float* host_values);
  /// Model-dtype values of a parameter, in backend memory. Stages 0-2:
  /// always valid. Stage 3: only while its unit is gathered.
  const void* param_data(std::size_t param) const;
  /// Stage 3: gathers unit u's parameters (waits for a prefetch if one was
  /// issued). Other stages: no-op. Gathers nest: each needs a release.
  void gather_unit(std::size_t unit);
  /// Stage 3: issues the gather of unit u without waiting for it.
  void prefetch_unit(std::size_t unit);
  void release_unit(std::size_t unit);
  bool unit_gathered(std::size_t unit) const;

  // ------------------------------------------------------------ gradients
  /// Where this micro-step's gradient of `param` is to be added (grad dtype,
  /// numel elements, zeroed at the start of the micro-step).
  void* grad_data(std::size_t param);
  /// Declares param's gradient complete for this micro-step; the bucket is
  /// reduce-scattered as soon as all its parameters are ready.
  void grad_ready(std::size_t param);
  /// Ends a micro-step: parameters never declared ready count as zero
  /// gradients (unused parameters), every reduction issued is completed.
  void finish_micro_step();
  int micro_step() const { return micro_step_; }

  // ------------------------------------------------------------ optimizer
  /// Applies the optimizer after accumulation_steps micro-steps.
  StepResult step();
  void set_lr(double lr) { lr_ = lr; }
  double lr() const { return lr_; }
  double loss_scale() const { return scaler_.scale(); }
  std::int64_t steps_applied() const { return step_; }
  std::int64_t steps_skipped() const { return skipped_total_; }

  // ------------------------------------------------------------ inspection (collective)
  /// All parameters as fp32 master values, in parameter order, each numel long
  /// (collective: every rank must call it). For tests and checkpoints.
  std::vector<std::vector<float>> gather_master_params();
  /// All parameters as model-dtype values widened to float (collective).
  std::vector<std::vector<float>> gather_model_params();
  /// The EMA weights (collective); throws when EMA is off.
  std::vector<std::vector<float>> gather_ema_params();

  // ------------------------------------------------------------ checkpoints
  /// Writes this rank's part of the training state to one safetensors file
  /// (atomically): master weights, optimizer moments and EMA of the slices it
  /// owns, plus step, loss-scaler state and the layout as metadata. The
  /// format does not depend on the stage: a stage-0 engine writes its own
  /// slices only, so a checkpoint can be resumed at another stage.
  /// `metadata` adds string entries (the trainer's config, RNG states...).
  void save_state(const std::string& path, const std::vector<std::pair<std::string, std::string>>& metadata = {});
  /// Restores what save_state wrote for this rank, at the same world size and
  /// layout (any stage); the model parameters are recomputed from the master
  /// weights. Collective. Throws zero::IoError naming the file and the mismatch.
  void load_state(const std::string& path);
  /// Restores a state saved at any world size (and any stage), given every
  /// old rank's file in rank order: each rank reads the elements of its new
  /// slices from whichever old shards hold them. The model must be the same
  /// (names, sizes, units); padding and alignment may differ. Collective.
  void load_state_resharded(const std::vector<std::string>& rank_files);
  /// The optimizer state tensor `slot` (0 or 1) of every parameter (collective; tests).
  std::vector<std::vector<float>> gather_optimizer_state(int slot);

  // ------------------------------------------------------------ memory
  /// Bytes held now, by category (communicator workspace in buffers).
  MemoryByCategory memory() const;
  /// The most held at once, per category, since construction.
  MemoryByCategory peak_memory() const;
  /// What model_state_bytes() predicts for this engine's padded layout.
  MemoryByCategory predicted_model_state() const;
  /// Host (pinned) bytes the engine holds: offloaded master, state, EMA and
  /// staging buffers; all zero without offload_optimizer.
  MemoryByCategory host_memory() const;
  /// The memory model's prediction of host_memory().
  MemoryByCategory predicted_host_state() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  void restore_state(const std::array<const float*, 4>& tensors, const std::string& state_json, const std::string& path);
  std::vector<std::vector<float>> gather_fp32_slices(const std::function<const float*(std::size_t)>& slice);
  Engine(FlatLayout layout, const EngineOptions& options, Communicator& comm, Backend& backend);

  EngineOptions options_;
  FlatLayout layout_;
  int rank_ = 0;
  int world_ = 1;
  int micro_step_ = 0;
  std::int64_t step_ = 0;
  std::int64_t skipped_total_ = 0;
  int consecutive_nonfinite_ = 0;
  double lr_ = 0;
  DynamicLossScaler scaler_;
};

namespace io {
class SafeTensorsFile;
}

/// What Engine::save_state records in a shard file's "zero.engine" metadata.
struct SavedShard {
  int rank = 0;
  int world_size = 1;
  int stage = 0;
  std::int64_t step = 0;
  std::string param_dtype;  // fp32, bf16, fp16
  std::string optimizer;    // adamw, sgd, lion
  int state_slots = 0;
  double loss_scale = 1;
  /// The saved placement rebuilt: parameters in order (with their shapes
  /// where the writer recorded them), buckets, world size and alignment.
  FlatLayout layout;
  /// The layout as recorded (canonical JSON text): equal text, same placement.
  std::string layout_text;
};

/// Reads and checks the metadata of a file written by Engine::save_state:
/// every key present with its type, and a layout that rebuilds to the padded
/// size recorded. Throws zero::IoError naming the file and the key.
SavedShard read_saved_shard(const io::SafeTensorsFile& file);

}  // namespace zero
