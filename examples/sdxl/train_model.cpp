// The UNet bound to the sharding engine (train_model.hpp).
#include "train_model.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <optional>

#include "torch_errors.hpp"      // with_torch_errors: LibTorch's errors in one line
#include "train_checkpoint.hpp"  // saved_config_to_resume
#include "train_export.hpp"      // starting_unet
#include "train_groups.hpp"      // [model] freeze; parameter groups
#include "train_lora.hpp"        // [lora]: adapters on the frozen UNet
#include "train_memory.hpp"      // the memory plan, max_gpu_memory and fit
#include "unet_io.hpp"           // read_unet_config
#include "unet_param_count.hpp"  // count_parameters
#include "zero/engine/memory_model.hpp"

namespace sdxl {

using torch::autograd::variable_list;

namespace {

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

/// Before the UNet is built: each rank on this host builds it in fp32 first,
/// so a config whose parameters cannot fit the host's memory is refused here
/// with its size, not in an allocation failure inside LibTorch.
void check_model_fits_host(const TrainConfig& cfg, const UNetConfig& ucfg, int ranks_on_host) {
  const double parameters = static_cast<double>(count_parameters(ucfg));
  const double per_rank = parameters * 4;  // fp32 while building and loading
  const long pages = ::sysconf(_SC_PHYS_PAGES), page_bytes = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_bytes <= 0) return;
  const double host = static_cast<double>(pages) * static_cast<double>(page_bytes);
  const double gib = 1024.0 * 1024.0 * 1024.0;
  ZERO_CHECK(per_rank * ranks_on_host <= host, "model_config '", cfg.model_config, "': the UNet has ",
             static_cast<long long>(parameters), " parameters, ", per_rank / gib, " GiB in fp32 per rank to build (",
             ranks_on_host, " rank(s) on this host), more than this host's ", host / gib,
             " GiB of memory; choose a smaller model_config or fewer ranks per host");
}

}  // namespace

/// The UNet (the same initial weights on every rank), its parameters handed
/// to the engine unit by unit, and every block's forward routed through the
/// engine (gathers under stage 3, recomputation with checkpointing).
ModelOnEngine build_model_on_engine(TrainConfig& cfg, zero::MpiCommunicator& host_comm,
                                    DeviceRuntime& runtime) {
  const int world = host_comm.size();
  const bool leader = host_comm.rank() == 0;
  ModelOnEngine m;
  m.config = resolve_model_config(cfg.model_config);
  check_model_fits_host(cfg, m.config, host_comm.local_size());
  m.unet = with_torch_errors("building the UNet of model_config '" + cfg.model_config + "'",
                             "choose a smaller model_config or fewer ranks per host",
                             [&] { return starting_unet(cfg, m.config); });  // the same initial weights on every rank
  if (lora_enabled(cfg)) add_lora_adapters(cfg, *m.unet);  // before units(): adapters are in their layer's unit
  std::vector<zero::adapter::UnitSpec> units;
  std::vector<std::string> names;
  std::vector<std::int64_t> numels;
  for (const ParameterUnit& u : m.unet->units()) {
    units.push_back({u.name, u.parameters});
    for (auto& [n, t] : u.parameters) {
      names.push_back(n);
      numels.push_back(t.numel());
    }
  }
  // [model] freeze: ShardedModel treats a parameter that does not require
  // grad as frozen (values only, never changed), so the flag is all it takes.
  // LoRA freezes everything but the adapters.
  std::vector<bool> frozen(names.size());
  if (lora_enabled(cfg)) {
    for (std::size_t i = 0; i < names.size(); ++i) frozen[i] = !is_lora_parameter(names[i]);
  } else {
    frozen = frozen_parameters(cfg, names);
  }
  std::size_t next = 0;  // units list the parameters in the order of names
  for (zero::adapter::UnitSpec& u : units)
    for (auto& [n, t] : u.params)
      if (frozen[next++]) t.requires_grad_(false);
  zero::EngineOptions options = engine_options(cfg);
  const ParamGrouping grouping = group_parameters(cfg, names, frozen);
  options.param_groups = grouping.groups;
  if (leader)
    std::printf("%s%s", lora_enabled(cfg) ? describe_lora(cfg, *m.unet, names, numels).c_str()
                                          : describe_freeze(cfg, frozen, numels).c_str(),
                describe_grouping(grouping, options.optimizer, numels).c_str());
  // A frozen parameter's group is never used (the engine reads groups of
  // trained parameters only); 0 keeps it a valid index.
  std::map<std::string, int> group_by_name;
  for (std::size_t i = 0; i < names.size(); ++i) group_by_name[names[i]] = std::max(grouping.group_of[i], 0);
  // The planner counts frozen tensors as parameters only.
  std::vector<std::vector<std::size_t>> frozen_sizes_by_unit;
  if (std::find(frozen.begin(), frozen.end(), true) != frozen.end())
    for (const zero::adapter::UnitSpec& u : units) {
      frozen_sizes_by_unit.emplace_back();
      for (const auto& [name, tensor] : u.params)
        if (!tensor.requires_grad()) frozen_sizes_by_unit.back().push_back(static_cast<std::size_t>(tensor.numel()));
    }
  // [device] fit: the planner chooses batch, accumulation, stage, offload,
  // checkpointing and the delayed update (a resumed run keeps its
  // checkpoint's) before the engine is built from them. Every rank runs the
  // same deterministic search, so all choose the same.
  if (!cfg.fit.empty()) {
    const FitDecision decision = fit_gpu_memory(cfg, m.config, options, world, host_comm.local_size(),
                                                frozen_sizes_by_unit, saved_config_to_resume(cfg));
    if (leader) {
      std::printf("%s", decision.report.c_str());
      std::fflush(stdout);
    }
    options = engine_options(cfg);
    options.param_groups = grouping.groups;
  }
  // The memory planner's view of the run (its constants are calibrated for
  // the GPU): printed, and with max_gpu_memory (or fit) checked before anything is allocated.
  const std::size_t cap = gpu_memory_cap(cfg);
  // The smallest GPU among the ranks (0 on the CPU): what checkpoint_units =
  // "fit" and the uncapped check below size against, so that every rank
  // decides alike (stage 3 gathers a recomputed unit again: the collectives
  // must match).
  double smallest_gpu_bytes = cfg.device == "cuda" ? static_cast<double>(runtime.settled_memory().total) : 0;
  host_comm.all_reduce_host_f64(&smallest_gpu_bytes, 1, zero::ReduceOp::min);
  const auto smallest_gpu = static_cast<std::size_t>(smallest_gpu_bytes);
  if (cfg.checkpoint_units == "fit") {
    const std::size_t budget = cap > 0 ? cap : smallest_gpu;
    const std::string line =
        resolve_checkpoint_fit(cfg, m.config, options, world, host_comm.local_size(), budget, frozen_sizes_by_unit);
    if (leader) std::printf("%s", line.c_str());
  }
  const std::optional<zero::plan::Plan> run_plan =
      plan_gpu_memory(cfg, m.config, options, cap, world, host_comm.local_size(), leader, frozen_sizes_by_unit);
  if (run_plan && cap == 0) {
    const std::string warning = check_plan_against_gpu(*run_plan, smallest_gpu);
    if (leader && !warning.empty()) std::printf("%s", warning.c_str());
  }
  if (run_plan)
    m.memory_plan_note = " (the memory plan estimated a GPU peak of " + zero::format_bytes(run_plan->gpu_peak_lower()) +
                         " .. " + zero::format_bytes(run_plan->gpu_peak()) + " per rank)";
  m.sharded = std::make_unique<zero::adapter::ShardedModel>(
      std::move(units), options, runtime.communicator(), runtime.backend(),
      [&group_by_name](const std::string& name) { return group_by_name.at(name); });
  // The engine lays each unit out by group: the export names follow its order.
  for (const zero::ParamSpec& p : m.sharded->engine().params()) m.parameter_names.push_back(p.name);
  if (cap > 0 && run_plan) apply_gpu_memory_cap(cfg, cap, m.sharded->engine(), *run_plan, runtime, world, leader);
  m.unet->set_activation_checkpointing(cfg.activation_checkpointing);
  m.unet->set_recomputed_units(recomputed_unit_mask(m.config, unit_granularity_from(cfg.units, "[zero] units"),
                                                    cfg.latent_size, cfg.checkpoint_unit_count()));
  m.unet->set_channels_last(cfg.channels_last);
  m.unet->set_unit_runner([sharded = m.sharded.get()](std::size_t unit, const variable_list& inputs,
                                                      const UNet2DConditionModelImpl::UnitBody& body, bool recompute) {
    return sharded->run_unit(unit, inputs, body, recompute);
  });
  m.compute_type = zero::adapter::scalar_type_of(options.param_dtype);
  return m;
}

void describe_model(const TrainConfig& cfg, const ModelOnEngine& m) {
  const zero::Engine& engine = m.sharded->engine();
  // layout() holds the trained parameters only; frozen ones have their own.
  const std::size_t frozen = engine.frozen_layout().param_numel();
  const std::string frozen_note = frozen == 0 ? "" : " (" + std::to_string(frozen) + " more frozen)";
  std::printf("UNet: %zu parameters trained%s in %zu units; stage %lld; model state per rank: %s\n",
              engine.layout().param_numel(), frozen_note.c_str(), m.sharded->unit_count(),
              static_cast<long long>(cfg.stage), zero::format_memory(engine.memory()).c_str());
  if (cfg.offload_optimizer)
    std::printf("optimizer offloaded: pinned host memory per rank: %s\n",
                zero::format_memory(engine.host_memory()).c_str());
}

}  // namespace sdxl
