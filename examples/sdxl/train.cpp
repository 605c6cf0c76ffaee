// train: full fine-tuning of the SDXL UNet on zero.
//
//   mpirun -np N train --config examples/sdxl/configs/tiny.toml [--key value ...]
//
// One story, top to bottom (main, at the end, lists the phases):
// configuration -> the device, its communicator and backend -> UNet bound to
// the sharding engine -> data -> the DDPM training loop -> metrics,
// checkpoints, export. Only rank 0 prints. The device's specifics (GPU, NCCL,
// streams, the CUDA graph, memory queries) are behind device_runtime.hpp.
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "attention_backend.hpp"        // select_attention_backend
#include "data/cached_dataset.hpp"      // CachedDataset: latents and embeddings cached on disk
#include "data/epoch_schedule.hpp"      // EpochSchedule: the steps that end an epoch
#include "data/loader.hpp"              // PrefetchingLoader
#include "data/sampler.hpp"             // DistributedBucketSampler, SamplerState
#include "data/synthetic.hpp"           // SyntheticDataset
#include "device_runtime.hpp"           // DeviceRuntime, GraphedMicroStep
#include "diffusion.hpp"                // NoiseSchedule, diffusion_loss, learning_rate
#include "env_flag.hpp"                 // env_flag: A/B switches from the environment
#include "profile_trace.hpp"            // Kineto trace of one step
#include "stop_signals.hpp"             // SIGTERM/SIGINT/SIGUSR1: checkpoint and stop at a step boundary
#include "train_checkpoint.hpp"         // save_checkpoint, maybe_resume
#include "train_config.hpp"             // TrainConfig and its command line
#include "train_epochs.hpp"             // run_length, schedule_metadata: [train] epochs, *_every_epochs
#include "train_export.hpp"             // export_unets, check_export_options, write_export_check, write_loss_plot
#include "train_output_dir.hpp"         // claim_output_dir: writable, locked, no earlier run overwritten
#include "train_lora.hpp"               // [lora]: adapters on the frozen UNet, their export
#include "train_metrics.hpp"            // MetricsSinks, StepMeasures, record_step: what rank 0 records
#include "train_memory.hpp"             // out_of_memory_advice: what to change when a step runs out
#include "train_model.hpp"              // ModelOnEngine: the UNet bound to the engine
#include "train_validation.hpp"         // [validation]: sample images while training
#include "torch_errors.hpp"             // with_torch_errors: LibTorch's errors in one line
#include "unet.hpp"                     // UNet2DConditionModel
#include "zero/comm/mpi_communicator.hpp"
#include "zero/torch/sharded_model.hpp"

namespace fs = std::filesystem;
using namespace sdxl;
using torch::autograd::variable_list;

namespace {

// ------------------------------------------------------------------ setup

/// LibTorch's intra-op threads share the host's cores with the other ranks
/// on it, unless [device] host_threads says how many; rank 0 prints the
/// configuration the run really uses.
void announce_run(const TrainConfig& cfg, const zero::MpiCommunicator& host_comm) {
  at::set_num_threads(cfg.host_threads > 0 ? static_cast<int>(cfg.host_threads)
                                           : std::max(1, static_cast<int>(std::thread::hardware_concurrency()) /
                                                             host_comm.local_size()));
  if (host_comm.rank() == 0)
    std::printf("zero SDXL trainer: %d ranks\n--- effective configuration ---\n%s---\n", host_comm.size(),
                cfg.to_toml().c_str());
}

// ------------------------------------------------------------------ fault injection (tests)

// ZERO_FAULT_NAN_GRAD_STEPS=<first>[-<last>][@<rank>]: on optimizer steps
// first..last (1-based, as logged) one element of the first parameter's
// gradient becomes NaN on one rank only (default: the last), before the
// reduce-scatter. The NaN lands in one rank's shard, so only the engine's
// cross-rank agreement makes every rank skip the step.
struct NanGradFault {
  std::int64_t first = 0, last = 0;
  int rank = 0;
  bool covers(std::int64_t step) const { return step >= first && step <= last; }
};

std::optional<NanGradFault> nan_grad_fault_from_env(int world) {
  const char* text = std::getenv("ZERO_FAULT_NAN_GRAD_STEPS");
  if (text == nullptr || *text == '\0') return std::nullopt;
  NanGradFault f;
  long long first = 0, last = 0;
  int rank = world - 1, used = 0;
  const std::string value = text;
  if (std::sscanf(text, "%lld-%lld@%d%n", &first, &last, &rank, &used) == 3 && used == static_cast<int>(value.size())) {
  } else if (used = 0, std::sscanf(text, "%lld-%lld%n", &first, &last, &used) == 2 && used == static_cast<int>(value.size())) {
  } else if (used = 0, std::sscanf(text, "%lld@%d%n", &first, &rank, &used) == 2 && used == static_cast<int>(value.size())) {
    last = first;
  } else if (used = 0, std::sscanf(text, "%lld%n", &first, &used) == 1 && used == static_cast<int>(value.size())) {
    last = first;
  } else {
    ZERO_THROW(zero::InvalidArgument, "ZERO_FAULT_NAN_GRAD_STEPS='", value, "': expected <first>[-<last>][@<rank>]");
  }
  ZERO_CHECK(first >= 1 && last >= first && rank >= 0 && rank < world, "ZERO_FAULT_NAN_GRAD_STEPS='", value,
             "': steps must be 1 <= first <= last and the rank in [0, ", world, ")");
  f.first = first;
  f.last = last;
  f.rank = rank;
  return f;
}

// ZERO_FAULT_SLOW_RANK=<milliseconds>@<rank>: that rank sleeps so long in
// every micro-step before its forward pass, as a rank on a slower or busier
// device would compute longer. Tests check that the imbalance metrics name it
// as the slowest rank (tests/sdxl_train/check_imbalance.py).
struct SlowRankFault {
  int rank = 0;
  std::chrono::milliseconds delay{0};
};

std::optional<SlowRankFault> slow_rank_fault_from_env(int world) {
  const char* text = std::getenv("ZERO_FAULT_SLOW_RANK");
  if (text == nullptr || *text == '\0') return std::nullopt;
  long long ms = 0;
  int rank = 0, used = 0;
  ZERO_CHECK(std::sscanf(text, "%lld@%d%n", &ms, &rank, &used) == 2 && used == static_cast<int>(std::string(text).size()) &&
                 ms >= 0 && rank >= 0 && rank < world,
             "ZERO_FAULT_SLOW_RANK='", text, "': expected <milliseconds>@<rank> with the rank in [0, ", world, ")");
  return SlowRankFault{rank, std::chrono::milliseconds(ms)};
}

struct GradientFaults {
  std::optional<NanGradFault> nan_grad;
  std::optional<SlowRankFault> slow_rank;
  bool poison_this_step = false;  // read by the gradient hook, set by the step loop
};

/// Where backward's gradients go: with cuda_graph straight into the engine's
/// buffer; with the test hook, through a hook that can poison one of them.
void prepare_gradients(const TrainConfig& cfg, ModelOnEngine& m, GradientFaults& faults,
                       const zero::MpiCommunicator& host_comm) {
  faults.nan_grad = nan_grad_fault_from_env(host_comm.size());
  faults.slow_rank = slow_rank_fault_from_env(host_comm.size());
  if (faults.slow_rank && host_comm.rank() == 0)
    std::printf("fault injection: rank %d sleeps %lld ms in every micro-step\n", faults.slow_rank->rank,
                static_cast<long long>(faults.slow_rank->delay.count()));
  ZERO_CHECK(!(faults.nan_grad && cfg.cuda_graph), "ZERO_FAULT_NAN_GRAD_STEPS does not work with [device] cuda_graph "
             "(its hook runs on the host, which a replayed graph skips)");
  // The graph captures the gradient hooks' writes into the engine's buffer
  // and the reductions. (Not bind_gradients_to_engine: autograd would add each
  // gradient into a zeroed buffer, where the hooks write it: one pass over
  // the gradients more per step, and the zero fill.)
  if (!faults.nan_grad) return;
  const NanGradFault& fault = *faults.nan_grad;
  if (host_comm.rank() == 0)
    std::printf("fault injection: NaN gradient on rank %d at steps %lld-%lld\n", fault.rank,
                static_cast<long long>(fault.first), static_cast<long long>(fault.last));
  if (host_comm.rank() != fault.rank) return;
  // The first parameter that gets a gradient: a frozen one has none to poison.
  for (const ParameterUnit& u : m.unet->units())
    for (const auto& [name, tensor] : u.parameters) {
      if (!tensor.requires_grad()) continue;
      tensor.register_hook([&poison = faults.poison_this_step](torch::Tensor grad) {
        if (!poison) return grad;
        grad = grad.clone();
        grad.view({-1})[0] = std::numeric_limits<float>::quiet_NaN();
        return grad;
      });
      return;
    }
}

// ------------------------------------------------------------------ data

struct TrainData {
  data::TextDims text;
  data::EpochSchedule epochs{1, 1};  // which steps end an epoch of the sampler
  std::int64_t steps = 0;            // the run's length: [train] steps, or what [train] epochs come to
  std::map<std::string, std::string> schedule_record;  // saved with every checkpoint (schedule_metadata)
  Resumed resumed;  // the step and data position a resumed run starts from
  std::unique_ptr<data::PrefetchingLoader> loader;
  // The dataset's empty-prompt conditioning, kept when caption_dropout > 0.
  std::optional<data::EmptyPrompt> empty_prompt;
  // The dataset's cached validation prompts, kept when [validation] is on.
  std::optional<data::ValidationPrompts> validation_prompts;
};

/// The dataset (synthetic or cached), each rank's sampler, the run's length
/// and epochs, and the engine's state and data position from a checkpoint
/// when resuming.
TrainData open_data(const TrainConfig& cfg, ModelOnEngine& m, zero::Communicator& comm,
                    const zero::MpiCommunicator& host_comm) {
  TrainData d;
  const UNetConfig& ucfg = m.config;
  d.text = {.sequence_length = cfg.text_length, .width = ucfg.cross_attention_dim.at(0),
            .pooled_width = ucfg.projection_class_embeddings_input_dim - 6 * ucfg.addition_time_embed_dim};
  std::shared_ptr<const data::Dataset> dataset;
  if (cfg.synthetic) {
    dataset = std::make_shared<data::SyntheticDataset>(data::SyntheticOptions{
        .num_samples = static_cast<std::size_t>(cfg.synthetic_samples), .seed = static_cast<std::uint64_t>(cfg.seed),
        .latent_sizes = {{cfg.latent_size, cfg.latent_size}}, .text_dims = d.text});
  } else {
    dataset = data::CachedDataset::open(cfg.dataset);
    // Cross-attention takes any sequence length: the dataset's is used (text_length is for synthetic data).
    d.text.sequence_length = dataset->text_dims().sequence_length;
  }
  data::check_text_dims(*dataset, d.text);
  if (cfg.caption_dropout > 0) {
    const data::EmptyPrompt* empty = dataset->empty_prompt();
    ZERO_CHECK(empty != nullptr, "caption_dropout ([data], --caption_dropout) = ", cfg.caption_dropout,
               " needs the empty prompt's text conditioning, but the dataset '", cfg.dataset, "' has no ",
               data::kEmptyPromptFileName, " (index.json names none: a dataset of format version 1); write it with ",
               "examples/sdxl/prepare (it caches the empty prompt) or CachedDatasetWriter::set_empty_prompt, or set ",
               "caption_dropout = 0");
    d.empty_prompt = *empty;
  }
  if (cfg.validation_every > 0 && dataset->validation_prompts() != nullptr)
    d.validation_prompts = *dataset->validation_prompts();
  data::DistributedBucketSampler sampler(*dataset, {.batch_size = static_cast<std::size_t>(cfg.batch_size),
                                                     .world_size = host_comm.size(),
                                                     .rank = host_comm.rank(),
                                                     .seed = static_cast<std::uint64_t>(cfg.seed)});
  d.epochs = data::EpochSchedule(sampler.batches_per_epoch(), static_cast<std::uint64_t>(cfg.accumulation));
  d.steps = run_length(cfg, d.epochs);
  d.schedule_record = schedule_metadata(cfg, d.epochs);
  if (host_comm.rank() == 0) {
    std::printf("data: %zu samples, %s (global batch %zu = batch_size %lld x %d ranks; %zu samples of partly filled "
                "batches left out of each epoch); the run: %lld steps = %.4g epochs\n",
                dataset->size(), d.epochs.describe().c_str(), sampler.global_batch_size(),
                static_cast<long long>(cfg.batch_size), host_comm.size(), sampler.leftover_per_epoch(),
                static_cast<long long>(d.steps), d.epochs.progress(d.steps));
    std::fflush(stdout);
  }
  d.resumed = maybe_resume(cfg, d.epochs, *m.sharded, comm);
  if (d.resumed.sampler) sampler.restore(*d.resumed.sampler);
  // Only now, with every check of the resume passed.
  if (host_comm.rank() == 0 && !d.resumed.folder.empty())
    std::printf("resumed from %s at step %lld\n", d.resumed.folder.c_str(), static_cast<long long>(d.resumed.step));
  d.loader = std::make_unique<data::PrefetchingLoader>(dataset, std::move(sampler));
  return d;
}

// ------------------------------------------------------------------ the training loop

/// What the phases above built, for the step loop and the export.
struct Run {
  const TrainConfig& cfg;
  zero::MpiCommunicator& host_comm;
  DeviceRuntime& runtime;
  ModelOnEngine& model;
  GradientFaults& faults;
  TrainData& data;
  MetricsSinks& metrics;
  ValidationImages* validation = nullptr;  // [validation] every > 0
  int world = 1;
  bool leader = false;

  zero::adapter::ShardedModel& sharded() { return *model.sharded; }
};

/// The host's share of one micro-step's inputs: the loader's batch (caption
/// dropout applied), the noise and timesteps drawn for it, the min-SNR
/// weights, all in host memory.
struct HostInputs {
  std::int64_t step = -1, micro = -1;
  data::Batch batch;
  std::int64_t captions_dropped = 0;
  torch::Tensor noise, timesteps, weights;  // weights: undefined without min-SNR
};

struct StepLoop {
  explicit StepLoop(Run& run)
      : prediction(parse_prediction(run.cfg.prediction)),
        lr_scale(run.cfg.scale_lr ? static_cast<double>(run.world * run.cfg.batch_size * run.cfg.accumulation) : 1.0),
        start(Clock::now()),
        sampler_state(run.data.resumed.sampler.value_or(run.data.loader->state())),
        graphed(run.sharded()),
        inputs(run.runtime.device()) {}

  const NoiseSchedule schedule;
  const Prediction prediction;
  const double lr_scale;
  const Clock::time_point start;
  data::SamplerState sampler_state;  // the data position a checkpoint saves
  std::int64_t nonfinite_in_a_row = 0;
  std::int64_t captions_dropped = 0;  // by this rank in the current step (caption_dropout)
  // [device] cuda_graph: the first step of this process runs eagerly (cuDNN's
  // algorithm search, cuBLAS handles and workspaces), the second is
  // captured, and every step from there replays it.
  std::int64_t eager_steps_done = 0;
  GraphedMicroStep graphed;
  InputUploads inputs;
  /// The next micro-step's host inputs, made while the device ran this one
  /// (SDXL_NO_INPUT_PREFETCH=1: made when needed, for A/B runs).
  std::optional<HostInputs> prefetched;
  const bool prefetch_inputs = !env_flag("SDXL_NO_INPUT_PREFETCH");
};

/// Caption dropout: replaces the text conditioning (prompt embeds and pooled)
/// of the batch's dropped samples by the empty prompt's, in place; time ids
/// stay the sample's. Returns how many were dropped.
std::int64_t drop_captions(const TrainConfig& cfg, const data::EmptyPrompt& empty, data::Batch& batch,
                           std::int64_t step, std::int64_t micro) {
  std::int64_t dropped = 0;
  const std::size_t embeds = empty.prompt_embeds.size();
  const std::size_t pooled = empty.pooled_prompt_embeds.size();
  for (std::size_t b = 0; b < batch.size(); ++b) {
    if (!data::drop_caption(static_cast<std::uint64_t>(cfg.seed), step, micro, batch.indices[b], cfg.caption_dropout))
      continue;
    std::copy(empty.prompt_embeds.begin(), empty.prompt_embeds.end(),
              batch.prompt_embeds.begin() + static_cast<std::ptrdiff_t>(b * embeds));
    std::copy(empty.pooled_prompt_embeds.begin(), empty.pooled_prompt_embeds.end(),
              batch.pooled_prompt_embeds.begin() + static_cast<std::ptrdiff_t>(b * pooled));
    ++dropped;
  }
  return dropped;
}

HostInputs prepare_host_inputs(Run& run, const StepLoop& loop, std::int64_t step, std::int64_t micro) {
  const TrainConfig& cfg = run.cfg;
  HostInputs in{.step = step, .micro = micro, .batch = run.data.loader->next()};
  if (run.data.empty_prompt) in.captions_dropped = drop_captions(cfg, *run.data.empty_prompt, in.batch, step, micro);
  // Noise and timestep of each sample depend on (seed, step, micro-step,
  // sample index) only: a resumed run draws what the uninterrupted one
  // did, and any world size draws the same for the same global batch.
  const auto& shape = in.batch.latents_shape;
  std::vector<torch::Tensor> noises, times;
  for (std::size_t b = 0; b < in.batch.size(); ++b) {
    torch::Generator generator = at::detail::createCPUGenerator(static_cast<std::uint64_t>(
        cfg.seed * 1000003 + step * 7919 + micro * 131 + static_cast<std::int64_t>(in.batch.indices[b]) * 2654435761LL));
    times.push_back(torch::randint(0, loop.schedule.steps(), {1}, generator, torch::kLong));
    noises.push_back(sample_noise(torch::empty({1, shape[1], shape[2], shape[3]}), cfg.noise_offset, generator));
  }
  in.timesteps = torch::cat(times);
  in.noise = torch::cat(noises);
  if (cfg.min_snr_gamma > 0) in.weights = loop.schedule.min_snr_weights(loop.prediction, in.timesteps, cfg.min_snr_gamma);
  return in;
}

/// The micro-step after (step, micro) in this run, if there is one.
std::optional<std::pair<std::int64_t, std::int64_t>> next_micro_step(const Run& run, std::int64_t step,
                                                                     std::int64_t micro) {
  if (micro + 1 < run.cfg.accumulation) return std::pair{step, micro + 1};
  if (step + 1 < run.data.steps) return std::pair{step + 1, std::int64_t{0}};
  return std::nullopt;
}

/// Forward and backward of one micro-step on the next batch; returns its loss.
double run_micro_step(Run& run, StepLoop& loop, std::int64_t step, std::int64_t micro) {
  const TrainConfig& cfg = run.cfg;
  // Each input through its own slot of loop.inputs (pinned and non-blocking on a GPU).
  enum Slot : std::size_t { kLatents, kPrompt, kPooled, kTimeIds, kNoise, kTimesteps, kWeights };
  auto tensor_of = [&](Slot slot, const std::vector<float>& v, c10::IntArrayRef shape) {
    return loop.inputs.up(slot, torch::from_blob(const_cast<float*>(v.data()), shape, torch::kFloat32),
                          run.model.compute_type);
  };
  if (run.faults.slow_rank && run.faults.slow_rank->rank == run.host_comm.rank())
    std::this_thread::sleep_for(run.faults.slow_rank->delay);
  // Made during the previous micro-step where there was one. (A prefetched
  // micro-step a run stops before, after a signal or stop_after, is dropped:
  // checkpoints save the sampler state of the batches consumed.)
  ZERO_CHECK(!loop.prefetched || (loop.prefetched->step == step && loop.prefetched->micro == micro),
             "internal: inputs prefetched for step ", loop.prefetched ? loop.prefetched->step + 1 : 0, " micro-step ",
             loop.prefetched ? loop.prefetched->micro : 0, ", used at step ", step + 1, " micro-step ", micro);
  HostInputs in = loop.prefetched ? std::move(*loop.prefetched) : prepare_host_inputs(run, loop, step, micro);
  loop.prefetched.reset();
  loop.sampler_state = in.batch.state_after;
  loop.captions_dropped += in.captions_dropped;
  seed_lora_dropout(cfg, step, micro, run.host_comm.rank());
  const data::Batch& batch = in.batch;
  torch::Tensor latents = tensor_of(kLatents, batch.latents, batch.latents_shape);
  torch::Tensor prompt = tensor_of(kPrompt, batch.prompt_embeds, batch.prompt_embeds_shape);
  torch::Tensor pooled = tensor_of(kPooled, batch.pooled_prompt_embeds, batch.pooled_prompt_embeds_shape);
  torch::Tensor time_ids = tensor_of(kTimeIds, batch.time_ids, batch.time_ids_shape);
  torch::Tensor noise = loop.inputs.up(kNoise, in.noise, run.model.compute_type);
  const torch::Tensor timesteps_on_device = loop.inputs.up(kTimesteps, in.timesteps, torch::kLong);
  torch::Tensor noisy = loop.schedule.add_noise(latents, noise, timesteps_on_device);
  torch::Tensor target = loop.schedule.target(loop.prediction, latents, noise, timesteps_on_device);
  torch::Tensor weights;
  torch::Tensor timesteps_in = timesteps_on_device.to(torch::kFloat32);
  if (in.weights.defined()) weights = loop.inputs.up(kWeights, in.weights, torch::kFloat32);
  UNet2DConditionModel& model = run.model.unet;
  zero::adapter::ShardedModel& sharded = run.sharded();
  torch::Tensor loss;
  if (cfg.cuda_graph && loop.eager_steps_done > 0) {
    loss = loop.graphed.run({noisy, timesteps_in, prompt, pooled, time_ids, target, weights}, [&](const variable_list& in) {
      torch::Tensor out = model->forward(in[0], in[1], in[2], in[3], in[4]);
      torch::Tensor l = diffusion_loss(out, in[5], in[6]);
      (l * sharded.engine().loss_scale()).backward();
      return l;
    });  // finishes the micro-step
  } else {
    torch::Tensor out = model->forward(noisy, timesteps_in, prompt, pooled, time_ids);
    loss = diffusion_loss(out, target, weights);
    (loss * sharded.engine().loss_scale()).backward();
    sharded.finish_micro_step();
  }
  // While the device works on this micro-step: the next one's host inputs,
  // so that after step() the GPU does not wait for the loader and the noise.
  if (loop.prefetch_inputs)
    if (const auto next = next_micro_step(run, step, micro))
      loop.prefetched = prepare_host_inputs(run, loop, next->first, next->second);
  return loss.item<double>();  // waits for the device: the step's timings are device-inclusive
}

/// The engine's step. Non-finite gradients (agreed across ranks) skip it;
/// the engine throws after max_nonfinite_steps of them in a row.
zero::StepResult take_optimizer_step(Run& run, std::int64_t step) {
  const std::int64_t skipped_before = run.sharded().engine().steps_skipped();
  try {
    return run.sharded().step();
  } catch (const zero::Error& e) {
    if (run.sharded().engine().steps_skipped() == skipped_before) throw;
    ZERO_THROW(zero::Error, "training stopped at step ", step + 1, ": ", e.message(),
               " (max_nonfinite_steps = ", run.cfg.max_nonfinite_steps, " in [optimizer]; 0 never stops)");
  }
}

void count_skipped_step(Run& run, StepLoop& loop, const zero::StepResult& result, std::int64_t step) {
  loop.nonfinite_in_a_row = result.applied ? 0 : loop.nonfinite_in_a_row + 1;
  if (result.applied || !run.leader) return;
  const std::string limit = run.cfg.max_nonfinite_steps > 0
                                ? "the run stops at " + std::to_string(run.cfg.max_nonfinite_steps) + " in a row"
                                : "max_nonfinite_steps = 0: never stops";
  std::printf("step %lld: non-finite gradients, step skipped (%lld in a row, %lld in total; %s)\n",
              static_cast<long long>(step + 1), static_cast<long long>(loop.nonfinite_in_a_row),
              static_cast<long long>(run.sharded().engine().steps_skipped()), limit.c_str());
  std::fflush(stdout);
}

enum class StepsEnd { finished, stopped_as_asked, stopped_by_signal };

/// A stop signal reached some rank during step `done`: every rank checkpoints
/// that step, rank 0 says so.
void stop_after_signal(Run& run, const StepLoop& loop, std::int64_t done, int signal) {
  if (run.leader) {
    std::printf("step %lld: %s received; writing a checkpoint, then stopping "
                "(SIGINT again or another signal stops at once)\n",
                static_cast<long long>(done), signal_name(signal));
    std::fflush(stdout);
  }
  save_checkpoint(run.cfg, done, run.sharded(), run.runtime.communicator(), loop.sampler_state,
                  run.data.schedule_record, run.host_comm);
  if (run.leader) {
    std::printf("stopped after step %lld on %s: checkpoint written under %s/checkpoints; resume with --resume latest "
                "(exit code %d)\n",
                static_cast<long long>(done), signal_name(signal), run.cfg.output_dir.c_str(), kExitStoppedBySignal);
    std::fflush(stdout);
  }
}

void export_trained_model(Run& run, const fs::path& where, std::int64_t epoch);

/// The validation images of step `done` (train_validation.hpp); the device
/// memory they took is given back before training goes on.
void draw_validation_images(Run& run, std::int64_t done) {
  with_torch_errors("step " + std::to_string(done) + ": validation images of " +
                        std::to_string(run.cfg.validation_width) + "x" + std::to_string(run.cfg.validation_height),
                    "lower [validation] height and width, or set [validation] every = 0 (validation needs a whole "
                    "UNet in the model dtype on each rank with a prompt)",
                    [&] {
                      run.validation->generate(done, run.sharded().engine(), run.host_comm,
                                               run.metrics.tensorboard ? &*run.metrics.tensorboard : nullptr);
                    });
  if (run.runtime.device().is_cuda()) (void)run.runtime.settled_memory();
}

/// The steps from the resumed one to the run's length, with their
/// checkpoints and the exports of epochs. Ends early after stop_after steps,
/// or after the step during which a rank got SIGTERM, SIGINT or SIGUSR1 (with
/// a checkpoint of that step).
StepsEnd train_steps(Run& run) {
  const TrainConfig& cfg = run.cfg;
  const std::int64_t steps = run.data.steps;
  const data::EpochSchedule& epochs = run.data.epochs;
  zero::adapter::ShardedModel& sharded = run.sharded();
  StepLoop loop(run);
  const StopSignals stop_signals(run.host_comm.rank());
  auto checkpoint = [&](std::int64_t done) {
    save_checkpoint(cfg, done, sharded, run.runtime.communicator(), loop.sampler_state, run.data.schedule_record,
                    run.host_comm);
  };
  for (std::int64_t step = run.data.resumed.step; step < steps; ++step) {
    const bool profiling = run.leader && cfg.profile_step == step + 1;
    if (profiling) {
      run.runtime.synchronize();  // the trace starts with an idle GPU
      start_profile_trace();
    }
    StepMeasures m;
    const zero::Engine& engine = sharded.engine();
    const double waited_before = engine.comm_wait_seconds();
    m.step_start = Clock::now();
    run.faults.poison_this_step = run.faults.nan_grad && run.faults.nan_grad->covers(step + 1);
    m.lr = loop.lr_scale * learning_rate(cfg.lr_schedule, cfg.lr, step, cfg.warmup_steps, steps);
    sharded.engine().set_lr(m.lr);
    double loss_sum = 0;
    loop.captions_dropped = 0;
    for (std::int64_t micro = 0; micro < cfg.accumulation; ++micro)
      loss_sum += with_torch_errors(
          "step " + std::to_string(step + 1) + ": forward and backward of batch_size " +
              std::to_string(cfg.batch_size) + " at latent_size " + std::to_string(cfg.latent_size) +
              run.model.memory_plan_note,
          out_of_memory_advice(cfg),
          [&] { return run_micro_step(run, loop, step, micro); });
    ++loop.eager_steps_done;
    m.step_call = Clock::now();
    const double waited_in_fwd_bwd = engine.comm_wait_seconds() - waited_before;
    m.result = take_optimizer_step(run, step);
    m.step_call_seconds = seconds_between(m.step_call, Clock::now());
    const double waited_in_step = engine.comm_wait_seconds() - waited_before - waited_in_fwd_bwd;
    count_skipped_step(run, loop, m.result, step);
    // The dropped-caption count rides along the loss's reduction (avg x
    // world = the sum over ranks): no extra collective.
    double stats[2] = {loss_sum / static_cast<double>(cfg.accumulation), static_cast<double>(loop.captions_dropped)};
    run.host_comm.all_reduce_host_f64(stats, 2, zero::ReduceOp::avg);
    if (profiling) {
      run.runtime.synchronize();  // the step's optimizer kernels are in the trace
      const fs::path trace = fs::path(cfg.output_dir) / ("profile-step-" + std::to_string(step + 1) + ".json");
      save_profile_trace(trace.string());
      std::printf("step %lld: Kineto trace written to %s\n", static_cast<long long>(step + 1), trace.c_str());
    }
    const double step_seconds = seconds_between(m.step_start, Clock::now());
    m.step_seconds = step_seconds;
    m.images_per_s = static_cast<double>(run.world * cfg.batch_size * cfg.accumulation) / step_seconds;
    // GPU: what the driver reports in use; CPU: the engine's own peak.
    const std::size_t mem = run.runtime.memory_in_use().value_or(sharded.engine().peak_memory().total());
    // The memory maximum carries the stop signal along (0: none), so every
    // rank sees the same one and all stop after the same step, at no extra collective.
    double maxima[2] = {static_cast<double>(mem), static_cast<double>(stop_signals.received())};
    double minimum = static_cast<double>(mem);
    run.host_comm.all_reduce_host_f64(maxima, 2, zero::ReduceOp::max);
    run.host_comm.all_reduce_host_f64(&minimum, 1, zero::ReduceOp::min);
    m.imbalance = gather_phase_times(run.host_comm,
                                     {.fwd_bwd_s = seconds_between(m.step_start, m.step_call) - waited_in_fwd_bwd,
                                      .comm_wait_s = waited_in_fwd_bwd + waited_in_step,
                                      .optimizer_s = m.step_call_seconds - waited_in_step});
    m.mem_max_bytes = maxima[0];
    m.mem_min_bytes = minimum;
    m.loss = stats[0];
    m.captions_dropped = std::llround(stats[1] * run.world);
    run.metrics.loss_ema.update(m.loss);
    m.done = step + 1;
    if (run.leader)
      record_step(cfg, run.metrics,
                  {.total_steps = steps, .start_step = run.data.resumed.step, .epochs = epochs, .start = loop.start,
                   .steps_skipped = engine.steps_skipped()},
                  m);
    if (const int signal = static_cast<int>(maxima[1]); signal != 0) {
      stop_after_signal(run, loop, m.done, signal);
      return StepsEnd::stopped_by_signal;
    }
    if (run.validation != nullptr && run.validation->due_after(m.done, steps)) draw_validation_images(run, m.done);
    if (cfg.stop_after > 0 && m.done == cfg.stop_after && m.done < steps) {
      checkpoint(m.done);
      if (run.leader)
        std::printf("stopped after step %lld as asked; resume with --resume latest\n", static_cast<long long>(m.done));
      return StepsEnd::stopped_as_asked;
    }
    // The last step's checkpoint and export are the run's final ones (save_final, export_unet).
    if (m.done == steps) continue;
    const bool every_steps = cfg.checkpoint_every > 0 && m.done % cfg.checkpoint_every == 0;
    if (every_steps || epochs.completes_multiple_of(m.done, cfg.checkpoint_every_epochs)) checkpoint(m.done);
    if (epochs.completes_multiple_of(m.done, cfg.export_every_epochs)) {
      // The multiple of export_every_epochs this step completes (the last, when one step completes several epochs).
      const std::int64_t epoch = epochs.completed(m.done) / cfg.export_every_epochs * cfg.export_every_epochs;
      export_trained_model(run, fs::path(cfg.output_dir) / "exports" / epoch_folder_name(epoch), epoch);
    }
  }
  if (cfg.save_final && run.data.resumed.step < steps) checkpoint(steps);
  return StepsEnd::finished;
}

// ------------------------------------------------------------------ export

/// The trained UNet (and its EMA) in diffusers' layout (with LoRA: the
/// adapters, merged too with merge_lora), the check of its prediction, into
/// the folder `where` as the final export writes them into output_dir; the
/// final export (`epoch` 0) adds the loss curve. Every rank takes part (the
/// gathers, the forward of the check).
void export_trained_model(Run& run, const fs::path& where, std::int64_t epoch) {
  // The exports below write under their configuration's output_dir.
  TrainConfig cfg = run.cfg;
  cfg.output_dir = where.string();
  if (run.leader) fs::create_directories(where);
  run.host_comm.barrier();
  write_export_check(cfg, run.model.unet, run.data.text, run.runtime.device(), run.model.compute_type, run.leader);
  zero::Engine& engine = run.sharded().engine();
  auto weights = engine.gather_master_params();
  auto ema = cfg.ema_decay > 0 ? engine.gather_ema_params() : std::vector<std::vector<float>>{};
  if (!run.leader) return;
  // Frozen tensors as they were loaded, not rounded to the model dtype.
  use_exact_frozen_values(cfg, run.model.config, engine, {&weights, &ema});
  const fs::path out = cfg.output_dir;
  std::string exported = out.string() + "/unet" + (ema.empty() ? "" : " and unet_ema");
  if (lora_enabled(cfg)) {
    // The adapters, and with merge_lora the UNet they make (exported like any other).
    const MergedUNet merged = export_lora(cfg, run.model.config, weights, run.model.parameter_names, out / "lora");
    const MergedUNet merged_ema =
        ema.empty() ? MergedUNet{} : export_lora(cfg, run.model.config, ema, run.model.parameter_names, out / "lora_ema");
    if (cfg.merge_lora) export_unets(cfg, run.model.config, merged.weights, merged_ema.weights, merged.names);
    exported = out.string() + "/lora" + (ema.empty() ? "" : " and lora_ema") +
               (cfg.merge_lora ? " (merged: " + exported + ")" : "");
  } else {
    export_unets(cfg, run.model.config, weights, ema, run.model.parameter_names);
  }
  if (epoch > 0) {
    std::printf("epoch %lld: exported %s\n", static_cast<long long>(epoch), exported.c_str());
    std::fflush(stdout);
    return;
  }
  run.metrics.tensorboard->flush();
  write_loss_plot(cfg);
  std::printf("exported %s; metrics in %s/metrics.jsonl, tensorboard/, loss.svg\n", exported.c_str(),
              cfg.output_dir.c_str());
}

}  // namespace

// ------------------------------------------------------------------ main

int main(int argc, char** argv) {
  return zero::run_or_abort([&] {
    zero::MpiSession session(&argc, &argv);
    TrainConfig cfg;
    if (!parse_train_config(argc, argv, cfg)) return 0;
    zero::MpiCommunicator host_comm;
    const bool leader = host_comm.rank() == 0;
    announce_run(cfg, host_comm);
    // Before the model is built: a folder that cannot be written, is in use
    // by another run or holds one that would be overwritten ends the run now.
    const std::unique_ptr<OutputDirLock> output_lock = claim_output_dir(cfg, host_comm);

    select_attention_backend(cfg.attention, "[device] attention");
    DeviceRuntime runtime(cfg, host_comm);

    ModelOnEngine model = build_model_on_engine(cfg, host_comm, runtime);
    GradientFaults faults;  // its address is in the gradient hook: lives as long as the model
    prepare_gradients(cfg, model, faults, host_comm);
    if (leader) describe_model(cfg, model);
    check_export_options(cfg, *model.unet, leader);  // before training: a bad export_full_checkpoint fails now

    TrainData data = open_data(cfg, model, runtime.communicator(), host_comm);
    // Before training: a validation that cannot work (prompts, pipeline, sizes) fails now.
    const std::unique_ptr<ValidationImages> validation = ValidationImages::create(
        cfg, data.validation_prompts ? &*data.validation_prompts : nullptr, data.text,
        {.config = model.config, .parameter_names = model.parameter_names, .device = runtime.device(),
         .dtype = model.compute_type},
        host_comm);
    MetricsSinks metrics(cfg, data.resumed.step, host_comm);

    Run run{.cfg = cfg, .host_comm = host_comm, .runtime = runtime, .model = model, .faults = faults,
            .data = data, .metrics = metrics, .validation = validation.get(), .world = host_comm.size(),
            .leader = leader};
    const StepsEnd end = train_steps(run);
    if (end == StepsEnd::stopped_by_signal) return kExitStoppedBySignal;
    if (end == StepsEnd::stopped_as_asked) return 0;
    if (cfg.export_unet) export_trained_model(run, cfg.output_dir, 0);
    return 0;
  }, describe_torch_failure);
}
