// train: full fine-tuning of the SDXL UNet on zero.
//
//   mpirun -np N train --config examples/sdxl/configs/tiny.toml [--key value ...]
//
// One story, top to bottom: configuration -> communicator and backend ->
// UNet bound to the sharding engine -> data -> the DDPM training loop ->
// metrics, checkpoints, export. Only rank 0 prints.
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "attention_backend.hpp"
#include "data/cached_dataset.hpp"
#include "data/loader.hpp"
#include "data/sampler.hpp"
#include "data/synthetic.hpp"
#include "diffusion.hpp"
#include "metrics/jsonl_writer.hpp"
#include "metrics/loss_plot.hpp"
#include "metrics/progress.hpp"
#include "metrics/tensorboard_writer.hpp"
#include "train_config.hpp"
#include "unet.hpp"
#include "unet_io.hpp"
#include "unet_param_count.hpp"
#include "zero/engine/planner.hpp"
#include "zero/comm/mpi_communicator.hpp"
#include "zero/io/atomic_file.hpp"
#include "zero/io/checkpoint.hpp"
#include "zero/io/crc32c.hpp"
#include "zero/io/safetensors.hpp"
#include "zero/torch/sharded_model.hpp"

#if defined(ZERO_WITH_CUDA) && __has_include(<ATen/cuda/CUDAContext.h>)
#define ZERO_TRAIN_CUDA 1
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include "zero/comm/nccl_communicator.hpp"
#include "zero/cuda/check.hpp"
#include "zero/comm/staged_communicator.hpp"
#include "zero/cuda/cuda_backend.hpp"
#endif

namespace fs = std::filesystem;
using namespace sdxl;
using torch::autograd::variable_list;

namespace {

#ifdef ZERO_TRAIN_CUDA
// Forward and backward of one micro-step captured once in a CUDA graph and
// replayed: one launch instead of thousands (batch 1 is bound by launch
// overhead). The inputs are copied into tensors the graph reads; the
// gradients land in the engine's buffer (bind_gradients_to_engine), whose
// reductions and the optimizer stay outside the graph.
class GraphedMicroStep {
 public:
  explicit GraphedMicroStep(zero::adapter::ShardedModel& sharded) : sharded_(sharded) {}

  /// Returns the loss (a tensor the graph writes). `body` runs once, under capture.
  torch::Tensor run(const variable_list& inputs, const std::function<torch::Tensor(const variable_list&)>& body) {
    sharded_.wait_for_parameters();  // stage 1: the gathers step() left in flight
    if (!graph_) {
      const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream();
      ZERO_CHECK(stream != c10::cuda::getDefaultCUDAStream(stream.device_index()),
                 "cuda_graph: the current stream is the default stream, which cannot be captured");
      for (const torch::Tensor& t : inputs) static_inputs_.push_back(t.defined() ? t.clone() : t);
      // The eager step's activations are cached, unused, in the allocator;
      // give them back so that the graph's own pool does not double them.
      c10::cuda::CUDACachingAllocator::emptyCache();
      graph_.emplace();
      graph_->capture_begin();
      try {
        loss_ = body(static_inputs_);
      } catch (const std::exception& e) {
        // End the broken capture so that this error is what surfaces, not
        // every later CUDA call failing.
        cudaGraph_t broken = nullptr;
        (void)cudaStreamEndCapture(stream.stream(), &broken);
        if (broken) (void)cudaGraphDestroy(broken);
        (void)cudaGetLastError();
        ZERO_THROW(zero::Error, "[device] cuda_graph: capturing forward and backward failed: ", e.what());
      }
      graph_->capture_end();
    } else {
      ZERO_CHECK(inputs.size() == static_inputs_.size(), "cuda_graph: ", inputs.size(), " inputs, captured with ",
                 static_inputs_.size());
      torch::NoGradGuard no_grad;
      for (std::size_t i = 0; i < inputs.size(); ++i) {
        if (!inputs[i].defined()) continue;
        ZERO_CHECK(inputs[i].sizes() == static_inputs_[i].sizes(), "cuda_graph: input ", i, " has shape ",
                   inputs[i].sizes(), ", the captured step had ", static_inputs_[i].sizes(),
                   " (every step must have the same shapes)");
        static_inputs_[i].copy_(inputs[i]);
      }
    }
    graph_->replay();
    return loss_;
  }

 private:
  zero::adapter::ShardedModel& sharded_;
  std::optional<at::cuda::CUDAGraph> graph_;
  variable_list static_inputs_;
  torch::Tensor loss_;
};
#endif

// ------------------------------------------------------------------ model config

UNetConfig resolve_model_config(const std::string& name) {
  if (name == "sdxl-base") return UNetConfig::sdxl_base();
  if (name == "tiny") {
    // The fixture's small UNet of the SDXL family (examples/sdxl/configs/tiny_unet.json).
    return UNetConfig::from_json(R"({"sample_size": 32, "in_channels": 4, "out_channels": 4,
      "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"], "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
      "block_out_channels": [32, 64], "layers_per_block": 2, "cross_attention_dim": 64, "attention_head_dim": [2, 4],
      "use_linear_projection": true, "addition_embed_type": "text_time", "addition_time_embed_dim": 8,
      "projection_class_embeddings_input_dim": 80, "transformer_layers_per_block": [1, 2], "norm_num_groups": 32})");
  }
  return read_unet_config(name);
}

zero::DType dtype_of(const std::string& precision) { return zero::parse_dtype(precision, "precision"); }

// ------------------------------------------------------------------ checkpoints
// output_dir/checkpoints/step-00000100/{rank-00000.safetensors ..., manifest.json}
// (zero/io/checkpoint.hpp, docs/checkpoints.md). The manifest is written
// last, atomically, by rank 0 after every rank has finished its file: a
// folder without it is an interrupted save and ignored.

fs::path checkpoints_root(const TrainConfig& c) { return fs::path(c.output_dir) / "checkpoints"; }

void save_checkpoint(const TrainConfig& c, std::int64_t step, zero::adapter::ShardedModel& model,
                     zero::Communicator& comm, const data::SamplerState& sampler, zero::MpiCommunicator& host) {
  const fs::path dir = zero::io::checkpoint_folder(checkpoints_root(c), step);
  const std::string own = zero::io::rank_file_name(comm.rank());
  if (comm.rank() == 0) {
    fs::create_directories(dir);
    std::error_code ec;
    fs::remove(dir / zero::io::kManifestName, ec);
  }
  host.barrier();
  std::vector<std::pair<std::string, std::string>> metadata = {{"train.config", c.to_toml()}};
  for (auto& [k, v] : sampler.to_metadata()) metadata.emplace_back(k, v);
  model.engine().save_state((dir / own).string(), metadata);
  // Every rank checksums its own file; rank 0 lists them all in the manifest.
  std::uint32_t crc = zero::io::file_crc32c(dir / own);
  std::vector<std::uint32_t> crcs(static_cast<std::size_t>(comm.size()));
  MPI_Request gather = MPI_REQUEST_NULL;
  ZERO_CHECK_MPI(MPI_Igather(&crc, 1, MPI_UINT32_T, crcs.data(), 1, MPI_UINT32_T, 0, host.mpi_comm(), &gather));
  host.wait_request(&gather, "checkpoint checksum gather");
  host.barrier();
  if (comm.rank() == 0) {
    zero::io::CheckpointManifest manifest;
    zero::io::describe_engine(model.engine(), manifest);
    manifest.step = step;
    manifest.world_size = comm.size();
    manifest.data_position = sampler.to_metadata();
    manifest.seed = static_cast<std::uint64_t>(c.seed);  // noise and timesteps derive from (seed, step)
    manifest.config = c.to_toml();
    for (int r = 0; r < comm.size(); ++r) {
      const std::string name = zero::io::rank_file_name(r);
      manifest.files.push_back({name, fs::file_size(dir / name), crcs[static_cast<std::size_t>(r)]});
    }
    zero::io::write_manifest(dir, manifest);
    zero::io::rotate_checkpoints(checkpoints_root(c), static_cast<std::size_t>(c.keep_checkpoints));
  }
  host.barrier();
}

struct Resumed {
  std::int64_t step = 0;
  std::optional<data::SamplerState> sampler;
};

Resumed maybe_resume(const TrainConfig& c, zero::adapter::ShardedModel& model, zero::Communicator& comm) {
  if (c.resume.empty()) return {};
  fs::path dir = c.resume;
  if (c.resume == "latest") {
    auto all = zero::io::list_complete_checkpoints(checkpoints_root(c));
    if (all.empty()) {
      if (comm.rank() == 0) std::printf("resume: no complete checkpoint under %s; starting fresh\n", c.output_dir.c_str());
      return {};
    }
    dir = all.back().path;
  }
  const fs::path manifest_path = dir / zero::io::kManifestName;
  ZERO_CHECK(fs::exists(manifest_path), "resume: ", manifest_path.string(),
             " is missing (an interrupted save, or not a checkpoint folder)");
  const zero::io::CheckpointManifest manifest = zero::io::read_manifest(manifest_path);
  const int old_world = manifest.world_size;
  const fs::path shard = dir / zero::io::rank_file_name(std::min(comm.rank(), old_world - 1));
  if (old_world == comm.size()) {
    zero::io::verify_checkpoint_file(dir, manifest, static_cast<std::size_t>(comm.rank()));
    model.engine().load_state((dir / zero::io::rank_file_name(comm.rank())).string());
  } else {
    // Another number of ranks: every rank reads its new slices from the old shards.
    std::vector<std::string> files;
    for (int r = 0; r < old_world; ++r) {
      zero::io::verify_checkpoint_file(dir, manifest, static_cast<std::size_t>(r));
      files.push_back((dir / zero::io::rank_file_name(r)).string());
    }
    model.engine().load_state_resharded(files);
    if (comm.rank() == 0)
      std::printf("resharded the checkpoint from %d to %d ranks (keep the global batch: batch_size x ranks)\n",
                  old_world, comm.size());
  }
  Resumed r;
  r.step = manifest.step;
  const zero::io::SafeTensorsFile file = zero::io::SafeTensorsFile::open(shard);
  r.sampler = data::SamplerState::from_metadata(file.metadata());
  if (comm.rank() == 0) std::printf("resumed from %s at step %lld\n", dir.string().c_str(), static_cast<long long>(r.step));
  return r;
}

// ------------------------------------------------------------------ export

void export_weights(const TrainConfig& c, const UNetConfig& ucfg, const std::vector<std::vector<float>>& weights,
                    const fs::path& where, const std::vector<std::string>& names) {
  UNet2DConditionModel model(ucfg, UNetBuildOptions{.initialize = false});
  std::map<std::string, torch::Tensor> by_name;
  for (auto& item : model->named_parameters()) by_name[item.key()] = item.value();
  torch::NoGradGuard no_grad;
  for (std::size_t i = 0; i < names.size(); ++i) {
    torch::Tensor p = by_name.at(names[i]);
    p.copy_(torch::from_blob(const_cast<float*>(weights[i].data()), p.sizes(), torch::kFloat32));
  }
  save_unet(*model, where);
  if (c.export_single_file) save_unet(*model, fs::path(where.string() + ".safetensors"), std::nullopt,
                                      CheckpointFormat::kOriginalSingleFile);
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

// ------------------------------------------------------------------ GPU memory cap
// --max_gpu_memory makes a big GPU behave like a smaller card: the run fails
// before training when the model state alone cannot fit, and LibTorch's
// caching allocator gets what is left of the cap once the CUDA context, NCCL
// and the engine's persistent buffers (cudaMalloc, outside the allocator)
// are in place, minus the engine's transient buffers to come.

std::string memory_suggestion(const TrainConfig& c, int world) {
  std::string s;
  if (c.stage < 3 && world > 1) s += " a higher ZeRO stage (stage = 3 shards everything),";
  if (!c.offload_optimizer) s += " offload_optimizer = true (master, optimizer state and EMA to host memory; stages 1-3),";
  if (!c.offload_params) s += " stage = 3 with offload_params = true (parameter shards to host memory too),";
  if (!c.activation_checkpointing) s += " activation_checkpointing = true,";
  if (c.batch_size > 1) s += " a smaller batch_size with accumulation,";
  s += s.empty() ? " more GPUs" : " or more GPUs";
  return s;
}

/// The memory planner's view of this run (model, engine options, batch,
/// checkpointing, latent size), before anything is allocated.
zero::plan::Plan plan_run(const TrainConfig& c, const UNetConfig& ucfg, const zero::EngineOptions& options, int world,
                          int ranks_per_host) {
  zero::plan::PlanInput in = zero::plan::input_from_engine_options(options, world);
  in.units = sdxl::plan_units(ucfg);
  in.model_name = c.model_config;
  in.activations = sdxl::plan_activations(ucfg, c.latent_size);
  in.gpus_per_host = ranks_per_host;
  in.batch = static_cast<int>(c.batch_size);
  in.activation_checkpointing = c.activation_checkpointing;
  return zero::plan::make_plan(in);
}

/// Before the engine exists: fail when the planner's lower bound of the peak
/// (model state, engine buffers, runtime; activations at their least) is
/// over the cap. Such a run cannot fit; what the lower bound lets through
/// may still run out in a step, and LibTorch then reports it.
void check_plan_fits(const TrainConfig& c, std::size_t cap, const zero::plan::Plan& plan) {
  const auto why = zero::plan::check_fits(plan, cap, {.safety_margin = 0, .estimate = zero::plan::PeakEstimate::lower});
  if (why) ZERO_THROW(zero::OutOfMemory, "max_gpu_memory = ", c.max_gpu_memory, ": ", *why);
}

#ifdef ZERO_TRAIN_CUDA
void apply_gpu_memory_cap(const TrainConfig& c, std::size_t cap, const zero::Engine& engine,
                          const zero::plan::Plan& plan, int device, int world, bool leader) {
  ZERO_CHECK_CUDA(cudaDeviceSynchronize());
  c10::cuda::CUDACachingAllocator::emptyCache();
  std::size_t free_bytes = 0, total_bytes = 0;
  ZERO_CHECK_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));
  const std::size_t outside = total_bytes - free_bytes;  // context, NCCL, the engine's buffers
  // The engine's transient buffers at their peak (gradient buckets and
  // scratch in flight, gathered units, cached blocks), replayed by the planner.
  const std::size_t transient = plan.engine.peak();
  if (outside + transient >= cap)
    ZERO_THROW(zero::OutOfMemory, "max_gpu_memory = ", c.max_gpu_memory, ": ", zero::format_bytes(outside),
               " are in use before training (CUDA context, NCCL, the engine's model state: ",
               zero::format_memory(engine.memory()), ") and the engine's transient buffers need up to ",
               zero::format_bytes(transient), "; nothing is left for activations. Try",
               memory_suggestion(c, world), ".");
  const std::size_t for_torch = cap - outside - transient;
  c10::cuda::CUDACachingAllocator::setMemoryFraction(static_cast<double>(for_torch) / static_cast<double>(total_bytes),
                                                     device);
  if (leader)
    std::printf("GPU memory cap %s: %s in use before training, up to %s for the engine's transient buffers, %s for "
                "LibTorch (activations)\n",
                zero::format_bytes(cap).c_str(), zero::format_bytes(outside).c_str(),
                zero::format_bytes(transient).c_str(), zero::format_bytes(for_torch).c_str());
}
#endif

}  // namespace

int main(int argc, char** argv) {
  return zero::run_or_abort([&] {
    zero::MpiSession session(&argc, &argv);
    TrainConfig cfg;
    if (!parse_train_config(argc, argv, cfg)) return 0;
    zero::MpiCommunicator host_comm;
    const int rank = host_comm.rank(), world = host_comm.size();
    const bool leader = rank == 0;
    at::set_num_threads(std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / host_comm.local_size()));
    if (leader) std::printf("zero SDXL trainer: %d ranks\n--- effective configuration ---\n%s---\n", world,
                            cfg.to_toml().c_str());

    // ---------------------------------------------------------------- device, communicator, backend
    torch::Device device = torch::kCPU;
    std::unique_ptr<zero::Communicator> device_comm;
    std::unique_ptr<zero::Backend> backend;
    select_attention_backend(cfg.attention, "[device] attention");
    if (cfg.device == "cuda") {
#ifdef ZERO_TRAIN_CUDA
      const int gpus = static_cast<int>(torch::cuda::device_count());
      ZERO_CHECK(gpus > 0, "device = cuda but no GPU is visible");
      const int index = host_comm.local_rank() % gpus;
      c10::cuda::set_device(static_cast<c10::DeviceIndex>(index));
      device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
      if (host_comm.local_size() <= gpus)
        device_comm = std::make_unique<zero::NcclCommunicator>(host_comm.mpi_comm(), zero::NcclOptions{.device = index});
      else
        device_comm = std::make_unique<zero::StagedCommunicator>(host_comm);
      if (cfg.cuda_graph) {
        // A graph cannot be captured on the legacy default stream, and each
        // parameter's gradient accumulator runs on the stream the parameter
        // was first used on: the whole run goes on one pool stream.
        c10::cuda::setCurrentCUDAStream(c10::cuda::getStreamFromPool(false, static_cast<c10::DeviceIndex>(index)));
      }
      backend = zero::make_cuda_backend(index, at::cuda::getCurrentCUDAStream().stream());
      // Shapes are fixed per bucket: timing the algorithms once pays back.
      at::globalContext().setBenchmarkCuDNN(cfg.cudnn_benchmark);
#else
      ZERO_THROW(zero::InvalidArgument, "device = cuda: this build has no CUDA (configure with the cuda preset)");
#endif
    } else {
      backend = zero::make_host_backend();
    }
    zero::Communicator& comm = device_comm ? *device_comm : static_cast<zero::Communicator&>(host_comm);

    // ---------------------------------------------------------------- model on the engine
    const UNetConfig ucfg = resolve_model_config(cfg.model_config);
    torch::manual_seed(static_cast<std::uint64_t>(cfg.seed));  // the same initial weights on every rank
    UNet2DConditionModel model(ucfg);
    if (!cfg.model_weights.empty()) load_unet_weights(*model, cfg.model_weights);
    std::vector<zero::adapter::UnitSpec> units;
    std::vector<std::string> names;
    for (const ParameterUnit& u : model->units()) {
      units.push_back({u.name, u.parameters});
      for (auto& [n, t] : u.parameters) names.push_back(n);
    }
    zero::EngineOptions options;
    options.stage = static_cast<int>(cfg.stage);
    options.param_dtype = dtype_of(cfg.precision);
    options.bucket_bytes = static_cast<std::size_t>(cfg.bucket_mib * (1 << 20));
    options.accumulation_steps = static_cast<int>(cfg.accumulation);
    options.accumulation = cfg.accumulation_mode == "boundary" ? zero::GradAccumulation::reduce_at_boundary
                                                               : zero::GradAccumulation::reduce_each_micro_step;
    options.max_grad_norm = cfg.max_grad_norm;
    options.optimizer = {.kind = zero::parse_optimizer_kind(cfg.optimizer, "optimizer"), .lr = cfg.lr,
                         .beta1 = cfg.beta1, .beta2 = cfg.beta2, .eps = cfg.eps, .weight_decay = cfg.weight_decay,
                         .momentum = cfg.optimizer == "sgd" ? cfg.momentum : 0.0};
    options.ema_decay = cfg.ema_decay;
    options.max_consecutive_nonfinite = static_cast<int>(cfg.max_nonfinite_steps);
    options.offload_optimizer = cfg.offload_optimizer;
    options.offload_params = cfg.offload_params;
    options.offload_delayed_update = cfg.offload_delayed_update;
    options.delayed_update_warmup_steps = static_cast<int>(cfg.delayed_update_warmup);
    // The memory planner's view of the run (its constants are calibrated for
    // the GPU): printed, and with max_gpu_memory checked before anything is allocated.
    const std::size_t cap = cfg.max_gpu_memory.empty() ? 0 : zero::parse_bytes(cfg.max_gpu_memory, "max_gpu_memory");
    std::optional<zero::plan::Plan> run_plan;
    if (cfg.device == "cuda") {
      run_plan = plan_run(cfg, ucfg, options, world, host_comm.local_size());
      if (cap > 0 && run_plan->gpu_peak() > cap) {
        // Tight cap: the engine frees its transient blocks instead of caching
        // them (each free then waits for the device; that is what the cap
        // costs), where that is what lets the run fit.
        zero::EngineOptions uncached = options;
        uncached.buffer_cache_bytes = 0;
        zero::plan::Plan uncached_plan = plan_run(cfg, ucfg, uncached, world, host_comm.local_size());
        if (uncached_plan.gpu_peak_lower() <= cap) {
          options = uncached;
          run_plan = std::move(uncached_plan);
          if (leader) std::printf("max_gpu_memory: the engine's block cache is off to fit the cap\n");
        }
      }
      if (leader)
        std::printf("memory plan (zero-plan): GPU peak %s .. %s per rank, pinned host %s per rank\n",
                    zero::format_bytes(run_plan->gpu_peak_lower()).c_str(),
                    zero::format_bytes(run_plan->gpu_peak()).c_str(),
                    zero::format_bytes(run_plan->host_per_rank()).c_str());
      if (cap > 0) check_plan_fits(cfg, cap, *run_plan);
    }
    zero::adapter::ShardedModel sharded(std::move(units), options, comm, *backend);
#ifdef ZERO_TRAIN_CUDA
    if (cap > 0) apply_gpu_memory_cap(cfg, cap, sharded.engine(), *run_plan, device.index(), world, leader);
#endif
    model->set_activation_checkpointing(cfg.activation_checkpointing);
    model->set_channels_last(cfg.channels_last);
    model->set_unit_runner([&sharded](std::size_t unit, const variable_list& inputs, const UNet2DConditionModelImpl::UnitBody& body,
                                      bool recompute) { return sharded.run_unit(unit, inputs, body, recompute); });
    const torch::ScalarType compute_type = zero::adapter::scalar_type_of(options.param_dtype);
    // Test hook (ZERO_FAULT_NAN_GRAD_STEPS): a NaN in one gradient element on one rank.
    const std::optional<NanGradFault> nan_fault = nan_grad_fault_from_env(world);
    bool poison_gradients = false;
    ZERO_CHECK(!(nan_fault && cfg.cuda_graph), "ZERO_FAULT_NAN_GRAD_STEPS does not work with [device] cuda_graph "
               "(its hook runs on the host, which a replayed graph skips)");
    if (cfg.cuda_graph) sharded.bind_gradients_to_engine();
    if (nan_fault) {
      if (leader)
        std::printf("fault injection: NaN gradient on rank %d at steps %lld-%lld\n", nan_fault->rank,
                    static_cast<long long>(nan_fault->first), static_cast<long long>(nan_fault->last));
      if (rank == nan_fault->rank)
        model->units().front().parameters.front().second.register_hook([&poison_gradients](torch::Tensor grad) {
          if (!poison_gradients) return grad;
          grad = grad.clone();
          grad.view({-1})[0] = std::numeric_limits<float>::quiet_NaN();
          return grad;
        });
    }
    if (leader) {
      const auto m = sharded.engine().memory();
      std::printf("UNet: %zu parameters in %zu units; stage %lld; model state per rank: %s\n",
                  sharded.engine().layout().param_numel(), sharded.unit_count(), static_cast<long long>(cfg.stage),
                  zero::format_memory(m).c_str());
      if (cfg.offload_optimizer)
        std::printf("optimizer offloaded: pinned host memory per rank: %s\n",
                    zero::format_memory(sharded.engine().host_memory()).c_str());
    }

    // ---------------------------------------------------------------- data
    const data::TextDims text{.sequence_length = cfg.text_length, .width = ucfg.cross_attention_dim.at(0),
                              .pooled_width = ucfg.projection_class_embeddings_input_dim - 6 * ucfg.addition_time_embed_dim};
    std::shared_ptr<const data::Dataset> dataset;
    if (cfg.synthetic) {
      dataset = std::make_shared<data::SyntheticDataset>(data::SyntheticOptions{
          .num_samples = static_cast<std::size_t>(cfg.synthetic_samples), .seed = static_cast<std::uint64_t>(cfg.seed),
          .latent_sizes = {{cfg.latent_size, cfg.latent_size}}, .text_dims = text});
    } else {
      dataset = data::CachedDataset::open(cfg.dataset);
    }
    data::check_text_dims(*dataset, text);
    data::DistributedBucketSampler sampler(*dataset, {.batch_size = static_cast<std::size_t>(cfg.batch_size),
                                                       .world_size = world,
                                                       .rank = rank,
                                                       .seed = static_cast<std::uint64_t>(cfg.seed)});
    const Resumed resumed = maybe_resume(cfg, sharded, comm);
    if (resumed.sampler) sampler.restore(*resumed.sampler);
    data::PrefetchingLoader loader(dataset, std::move(sampler));

    // ---------------------------------------------------------------- metrics (rank 0)
    fs::create_directories(cfg.output_dir);
    std::optional<metrics::JsonlWriter> jsonl;
    std::optional<metrics::TensorBoardWriter> tensorboard;
    if (leader) {
      jsonl.emplace(fs::path(cfg.output_dir) / "metrics.jsonl");
      jsonl->truncate_after(resumed.step);
      tensorboard.emplace(fs::path(cfg.output_dir) / "tensorboard");
      if (resumed.step > 0) tensorboard->add_session_start(resumed.step + 1);
    }
    metrics::ProgressLine progress;
    metrics::Ema loss_ema(0.9);
    const bool tty = leader && metrics::is_tty(stdout) && world == 1;

    // ---------------------------------------------------------------- training loop
    const NoiseSchedule schedule;
    const Prediction prediction = parse_prediction(cfg.prediction);
    const double lr_scale = cfg.scale_lr ? static_cast<double>(world * cfg.batch_size * cfg.accumulation) : 1.0;
    const auto start = std::chrono::steady_clock::now();
    auto tensor_of = [&](const std::vector<float>& v, c10::IntArrayRef shape) {
      return torch::from_blob(const_cast<float*>(v.data()), shape, torch::kFloat32).to(device, compute_type);
    };
    data::SamplerState sampler_state = resumed.sampler.value_or(loader.state());
    std::int64_t nonfinite_in_a_row = 0;
    // [device] cuda_graph: the first step of this process runs eagerly (cuDNN's
    // algorithm search, cuBLAS handles and workspaces), the second is
    // captured, and every step from there replays it.
    std::int64_t eager_steps_done = 0;
#ifdef ZERO_TRAIN_CUDA
    GraphedMicroStep graphed(sharded);
#endif
    for (std::int64_t step = resumed.step; step < cfg.steps; ++step) {
      [[maybe_unused]] const bool profiling = leader && cfg.profile_step == step + 1;
#ifdef ZERO_TRAIN_CUDA
      namespace kineto = torch::autograd::profiler;
      const torch::profiler::impl::ProfilerConfig profiler_config(torch::profiler::impl::ProfilerState::KINETO);
      const std::set<torch::profiler::impl::ActivityType> profiler_activities{
          torch::profiler::impl::ActivityType::CPU, torch::profiler::impl::ActivityType::CUDA};
      if (profiling) {
        ZERO_CHECK_CUDA(cudaDeviceSynchronize());  // the trace starts with an idle GPU
        kineto::prepareProfiler(profiler_config, profiler_activities);
        kineto::enableProfiler(profiler_config, profiler_activities);
      }
#endif
      const auto step_start = std::chrono::steady_clock::now();
      poison_gradients = nan_fault && nan_fault->covers(step + 1);
      const double lr = lr_scale * learning_rate(cfg.lr_schedule, cfg.lr, step, cfg.warmup_steps, cfg.steps);
      sharded.engine().set_lr(lr);
      double loss_sum = 0;
      for (std::int64_t micro = 0; micro < cfg.accumulation; ++micro) {
        data::Batch batch = loader.next();
        sampler_state = batch.state_after;
        torch::Tensor latents = tensor_of(batch.latents, batch.latents_shape);
        torch::Tensor prompt = tensor_of(batch.prompt_embeds, batch.prompt_embeds_shape);
        torch::Tensor pooled = tensor_of(batch.pooled_prompt_embeds, batch.pooled_prompt_embeds_shape);
        torch::Tensor time_ids = tensor_of(batch.time_ids, batch.time_ids_shape);
        // Noise and timestep of each sample depend on (seed, step, micro-step,
        // sample index) only: a resumed run draws what the uninterrupted one
        // did, and any world size draws the same for the same global batch.
        std::vector<torch::Tensor> noises, times;
        for (std::size_t b = 0; b < batch.size(); ++b) {
          torch::Generator generator = at::detail::createCPUGenerator(static_cast<std::uint64_t>(
              cfg.seed * 1000003 + step * 7919 + micro * 131 + static_cast<std::int64_t>(batch.indices[b]) * 2654435761LL));
          times.push_back(torch::randint(0, schedule.steps(), {1}, generator, torch::kLong));
          noises.push_back(sample_noise(torch::empty({1, latents.size(1), latents.size(2), latents.size(3)}),
                                        cfg.noise_offset, generator));
        }
        torch::Tensor timesteps = torch::cat(times);
        torch::Tensor noise = torch::cat(noises).to(device, compute_type);
        const torch::Tensor timesteps_on_device = timesteps.to(device);
        torch::Tensor noisy = schedule.add_noise(latents, noise, timesteps_on_device);
        torch::Tensor target = schedule.target(prediction, latents, noise, timesteps_on_device);
        torch::Tensor weights;
        if (cfg.min_snr_gamma > 0) weights = schedule.min_snr_weights(prediction, timesteps, cfg.min_snr_gamma);
        torch::Tensor timesteps_in = timesteps_on_device.to(torch::kFloat32);
        if (weights.defined()) weights = weights.to(device, torch::kFloat32);
        torch::Tensor loss;
        if (cfg.cuda_graph && eager_steps_done > 0) {
#ifdef ZERO_TRAIN_CUDA
          loss = graphed.run({noisy, timesteps_in, prompt, pooled, time_ids, target, weights}, [&](const variable_list& in) {
            torch::Tensor out = model->forward(in[0], in[1], in[2], in[3], in[4]);
            torch::Tensor l = diffusion_loss(out, in[5], in[6]);
            (l * sharded.engine().loss_scale()).backward();
            return l;
          });
#endif
        } else {
          torch::Tensor out = model->forward(noisy, timesteps_in, prompt, pooled, time_ids);
          loss = diffusion_loss(out, target, weights);
          (loss * sharded.engine().loss_scale()).backward();
        }
        sharded.finish_micro_step();
        loss_sum += loss.item<double>();  // waits for the device: the timings below are device-inclusive
      }
      ++eager_steps_done;
      const auto step_call = std::chrono::steady_clock::now();
      // Non-finite gradients (agreed across ranks) skip the step; the engine
      // throws after max_nonfinite_steps of them in a row.
      const std::int64_t skipped_before = sharded.engine().steps_skipped();
      zero::StepResult result;
      try {
        result = sharded.step();
      } catch (const zero::Error& e) {
        if (sharded.engine().steps_skipped() == skipped_before) throw;
        ZERO_THROW(zero::Error, "training stopped at step ", step + 1, ": ", e.what(),
                   " (max_nonfinite_steps = ", cfg.max_nonfinite_steps, " in [optimizer]; 0 never stops)");
      }
      const double step_call_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - step_call).count();
      nonfinite_in_a_row = result.applied ? 0 : nonfinite_in_a_row + 1;
      if (!result.applied && leader) {
        const std::string limit = cfg.max_nonfinite_steps > 0
                                      ? "the run stops at " + std::to_string(cfg.max_nonfinite_steps) + " in a row"
                                      : "max_nonfinite_steps = 0: never stops";
        std::printf("step %lld: non-finite gradients, step skipped (%lld in a row, %lld in total; %s)\n",
                    static_cast<long long>(step + 1), static_cast<long long>(nonfinite_in_a_row),
                    static_cast<long long>(sharded.engine().steps_skipped()), limit.c_str());
        std::fflush(stdout);
      }
      double stats[2] = {loss_sum / static_cast<double>(cfg.accumulation), 0};
      host_comm.all_reduce_host_f64(stats, 1, zero::ReduceOp::avg);
#ifdef ZERO_TRAIN_CUDA
      if (profiling) {
        ZERO_CHECK_CUDA(cudaDeviceSynchronize());  // the step's optimizer kernels are in the trace
        const fs::path trace = fs::path(cfg.output_dir) / ("profile-step-" + std::to_string(step + 1) + ".json");
        kineto::disableProfiler()->save(trace.string());
        std::printf("step %lld: Kineto trace written to %s\n", static_cast<long long>(step + 1), trace.c_str());
      }
#endif
      const double step_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count();
      const double images_per_s = static_cast<double>(world * cfg.batch_size * cfg.accumulation) / step_seconds;
      std::size_t mem = sharded.engine().peak_memory().total();
#ifdef ZERO_TRAIN_CUDA
      if (device.is_cuda()) {
        std::size_t free = 0, total = 0;
        cudaMemGetInfo(&free, &total);
        mem = total - free;
      }
#endif
      double mem_range[2] = {static_cast<double>(mem), static_cast<double>(mem)};
      host_comm.all_reduce_host_f64(&mem_range[0], 1, zero::ReduceOp::max);
      host_comm.all_reduce_host_f64(&mem_range[1], 1, zero::ReduceOp::min);
      const double loss_value = stats[0];
      loss_ema.update(loss_value);
      const std::int64_t done = step + 1;
      if (leader) {
        metrics::StepRecord record;
        record.step = done;
        record.loss = loss_value;
        record.lr = lr;
        record.grad_norm = result.grad_norm;
        record.images_per_s = images_per_s;
        record.mem_max_bytes = static_cast<std::uint64_t>(mem_range[0]);
        record.mem_min_bytes = static_cast<std::uint64_t>(mem_range[1]);
        record.loss_scale = result.loss_scale;
        record.skipped_steps = sharded.engine().steps_skipped();
        record.elapsed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        // Where a step's time goes (rank 0): forward/backward until the last
        // loss is read back, the host time of step() (with offload: the CPU
        // update, of which the gradient statistics and the update loop).
        record.extra["timing/fwd_bwd_s"] = std::chrono::duration<double>(step_call - step_start).count();
        record.extra["timing/step_call_s"] = step_call_seconds;
        if (cfg.offload_optimizer) {
          record.extra["timing/cpu_grad_stats_s"] = result.cpu_grad_stats_seconds;
          record.extra["timing/cpu_update_s"] = result.cpu_update_seconds;
          if (cfg.offload_delayed_update) record.extra["timing/cpu_update_wait_s"] = result.cpu_update_wait_seconds;
        }
        jsonl->write(record);
        tensorboard->add_scalars({{"train/loss", loss_value}, {"train/lr", lr}, {"train/grad_norm", result.grad_norm},
                                  {"train/images_per_s", images_per_s}, {"train/mem_max_bytes", mem_range[0]}},
                                 done);
        if (done % cfg.log_every == 0 || done == cfg.steps) {
          metrics::Progress p{.step = done, .total_steps = cfg.steps, .start_step = resumed.step, .loss = loss_value,
                              .loss_ema = loss_ema.value(), .lr = lr, .images_per_s = images_per_s,
                              .mem_max_bytes = static_cast<std::uint64_t>(mem_range[0]),
                              .mem_min_bytes = static_cast<std::uint64_t>(mem_range[1]),
                              .elapsed_s = *record.elapsed_s};
          const std::string line = progress.render(p, tty ? metrics::terminal_width(stdout) : 0);
          std::printf("%s\n", line.c_str());  // one line per interval: mpirun relays lines, not '\r'
          std::fflush(stdout);
        }
      }
      if (cfg.stop_after > 0 && done == cfg.stop_after && done < cfg.steps) {
        save_checkpoint(cfg, done, sharded, comm, sampler_state, host_comm);
        if (leader) std::printf("stopped after step %lld as asked; resume with --resume latest\n", static_cast<long long>(done));
        return 0;
      }
      if (cfg.checkpoint_every > 0 && done % cfg.checkpoint_every == 0 && done < cfg.steps)
        save_checkpoint(cfg, done, sharded, comm, sampler_state, host_comm);
    }
    if (cfg.save_final && resumed.step < cfg.steps) save_checkpoint(cfg, cfg.steps, sharded, comm, sampler_state, host_comm);
    if (!cfg.export_unet) return 0;

    // The trained model's prediction on fixed inputs, next to the export, so
    // that anyone can check the exported UNet reproduces it (unet_forward).
    {
      torch::NoGradGuard no_grad;
      torch::manual_seed(7);
      const std::int64_t h = cfg.latent_size;
      std::map<std::string, torch::Tensor> io = {
          {"sample", torch::randn({2, 4, h, h})},
          {"timestep", torch::tensor({999.0f, 250.0f})},
          {"encoder_hidden_states", torch::randn({2, cfg.text_length, text.width})},
          {"text_embeds", torch::randn({2, text.pooled_width})},
          {"time_ids", torch::tensor({8.0f * h, 8.0f * h, 0.0f, 0.0f, 8.0f * h, 8.0f * h}).repeat({2, 1})}};
      auto on = [&](const torch::Tensor& t) { return t.to(device, compute_type); };
      torch::Tensor out = model->forward(on(io["sample"]), io["timestep"].to(device), on(io["encoder_hidden_states"]),
                                         on(io["text_embeds"]), on(io["time_ids"]));
      io["expected"] = out.to(torch::kCPU, torch::kFloat32);
      if (leader) write_tensors(fs::path(cfg.output_dir) / "export_check.safetensors", io);
    }

    // ---------------------------------------------------------------- export
    const auto weights = sharded.engine().gather_master_params();
    const auto ema = cfg.ema_decay > 0 ? sharded.engine().gather_ema_params() : std::vector<std::vector<float>>{};
    if (leader) {
      export_weights(cfg, ucfg, weights, fs::path(cfg.output_dir) / "unet", names);
      if (!ema.empty()) export_weights(cfg, ucfg, ema, fs::path(cfg.output_dir) / "unet_ema", names);
      tensorboard->flush();
      std::vector<std::int64_t> steps;
      std::vector<double> losses;
      for (const auto& row : metrics::JsonlWriter::read_all(fs::path(cfg.output_dir) / "metrics.jsonl")) {
        if (!row.contains("loss") || row["loss"].is_null()) continue;
        steps.push_back(row["step"].get<std::int64_t>());
        losses.push_back(row["loss"].get<double>());
      }
      metrics::write_loss_svg(fs::path(cfg.output_dir) / "loss.svg", steps, losses,
                              {.title = "SDXL UNet training loss", .x_label = "step", .y_label = "loss"});
      std::printf("exported %s/unet%s; metrics in %s/metrics.jsonl, tensorboard/, loss.svg\n", cfg.output_dir.c_str(),
                  ema.empty() ? "" : " and unet_ema", cfg.output_dir.c_str());
    }
    return 0;
  });
}
