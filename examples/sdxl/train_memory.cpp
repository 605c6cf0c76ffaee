#include "train_memory.hpp"

#include <algorithm>
#include <cstdio>
#include <sstream>
#include <string>
#include <utility>

#include "sdxl_calibration.hpp"
#include "unet_param_count.hpp"
#include "zero/engine/memory_model.hpp"

namespace sdxl {

namespace {

std::string memory_suggestion(const TrainConfig& c, int world) {
  std::string s;
  if (c.stage < 3 && world > 1) s += " a higher ZeRO stage (stage = 3 shards everything),";
  if (!c.offload_optimizer) s += " offload_optimizer = true (master, optimizer state and EMA to host memory; stages 1-3),";
  if (!c.offload_params) s += " stage = 3 with offload_params = true (parameter shards to host memory too),";
  if (!c.activation_checkpointing) s += " activation_checkpointing = true,";
  else if (c.checkpoint_units != "all") s += " checkpoint_units = \"all\" (recompute every unit),";
  if (c.batch_size > 1) s += " a smaller batch_size with accumulation,";
  s += s.empty() ? " more GPUs" : " or more GPUs";
  return s;
}

/// The memory planner's input for this run (model, engine options, batch,
/// checkpointing, latent size), before anything is allocated.
zero::plan::PlanInput plan_input(const TrainConfig& c, const UNetConfig& ucfg, const zero::EngineOptions& options,
                                 int world, int ranks_per_host,
                                 const std::vector<std::vector<std::size_t>>& frozen_sizes_by_unit) {
  zero::plan::PlanInput in;
  in.engine = options;
  in.world_size = world;
  sdxl::calibration::apply(in, static_cast<std::size_t>(count_parameters(ucfg)));
  in.units = sdxl::plan_units(ucfg, unit_granularity_from(c.units, "[zero] units"), c.latent_size);
  // Frozen tensors count as parameters only: each unit's frozen sizes (from
  // the model) are moved out of the planner's list of the unit's tensors.
  ZERO_CHECK(frozen_sizes_by_unit.empty() || frozen_sizes_by_unit.size() == in.units.size(),
             "memory plan: the model has ", frozen_sizes_by_unit.size(), " units, the planner's count of the UNet "
             "config ", in.units.size());
  for (std::size_t u = 0; u < frozen_sizes_by_unit.size(); ++u) {
    zero::plan::PlanUnit& unit = in.units[u];
    for (std::size_t size : frozen_sizes_by_unit[u]) {
      auto it = std::find(unit.tensors.begin(), unit.tensors.end(), size);
      ZERO_CHECK(it != unit.tensors.end(), "memory plan: unit '", unit.name, "' has a frozen tensor of ", size,
                 " elements that the planner's count of the UNet config does not list");
      unit.tensors.erase(it);
      unit.frozen_tensors.push_back(size);
    }
  }
  in.model_name = c.model_config;
  in.activations = sdxl::plan_activations(ucfg, c.latent_size);
  in.gpus_per_host = ranks_per_host;
  in.batch = static_cast<int>(c.batch_size);
  in.activation_checkpointing = c.activation_checkpointing;
  in.checkpoint_units = static_cast<std::size_t>(c.checkpoint_unit_count());
  return in;
}

zero::plan::Plan plan_run(const TrainConfig& c, const UNetConfig& ucfg, const zero::EngineOptions& options, int world,
                          int ranks_per_host, const std::vector<std::vector<std::size_t>>& frozen_sizes_by_unit) {
  return zero::plan::make_plan(plan_input(c, ucfg, options, world, ranks_per_host, frozen_sizes_by_unit));
}

/// "max_gpu_memory = 24GiB" or "fit = 12GiB": the option that set the cap, for messages.
std::string cap_option(const TrainConfig& c) {
  return c.max_gpu_memory.empty() ? "fit = " + c.fit : "max_gpu_memory = " + c.max_gpu_memory;
}

// ---------------------------------------------------------------- [device] fit

/// The options [device] fit chooses, by key, read and written on a config.
struct FitSetting {
  const char* key;
  std::string (*show)(const TrainConfig&);
  void (*take)(TrainConfig& to, const TrainConfig& from);
};

std::string yes_no(bool b) { return b ? "true" : "false"; }

const std::vector<FitSetting>& fit_settings() {
  static const std::vector<FitSetting> settings = {
      {"batch_size", [](const TrainConfig& c) { return std::to_string(c.batch_size); },
       [](TrainConfig& t, const TrainConfig& f) { t.batch_size = f.batch_size; }},
      {"accumulation", [](const TrainConfig& c) { return std::to_string(c.accumulation); },
       [](TrainConfig& t, const TrainConfig& f) { t.accumulation = f.accumulation; }},
      {"stage", [](const TrainConfig& c) { return std::to_string(c.stage); },
       [](TrainConfig& t, const TrainConfig& f) { t.stage = f.stage; }},
      {"offload_optimizer", [](const TrainConfig& c) { return yes_no(c.offload_optimizer); },
       [](TrainConfig& t, const TrainConfig& f) { t.offload_optimizer = f.offload_optimizer; }},
      {"offload_params", [](const TrainConfig& c) { return yes_no(c.offload_params); },
       [](TrainConfig& t, const TrainConfig& f) { t.offload_params = f.offload_params; }},
      {"offload_delayed_update", [](const TrainConfig& c) { return yes_no(c.offload_delayed_update); },
       [](TrainConfig& t, const TrainConfig& f) { t.offload_delayed_update = f.offload_delayed_update; }},
      {"offload_accumulate_on_host", [](const TrainConfig& c) { return yes_no(c.offload_accumulate_on_host); },
       [](TrainConfig& t, const TrainConfig& f) { t.offload_accumulate_on_host = f.offload_accumulate_on_host; }},
      {"offload_ema_on_device", [](const TrainConfig& c) { return yes_no(c.offload_ema_on_device); },
       [](TrainConfig& t, const TrainConfig& f) { t.offload_ema_on_device = f.offload_ema_on_device; }},
      {"activation_checkpointing", [](const TrainConfig& c) { return yes_no(c.activation_checkpointing); },
       [](TrainConfig& t, const TrainConfig& f) { t.activation_checkpointing = f.activation_checkpointing; }},
      {"checkpoint_units", [](const TrainConfig& c) { return c.checkpoint_units; },
       [](TrainConfig& t, const TrainConfig& f) { t.checkpoint_units = f.checkpoint_units; }},
      {"prefetch_units", [](const TrainConfig& c) { return std::to_string(c.prefetch_units); },
       [](TrainConfig& t, const TrainConfig& f) { t.prefetch_units = f.prefetch_units; }},
  };
  return settings;
}

bool pinned(const TrainConfig& c, const char* key) {
  return std::find(c.command_line_keys.begin(), c.command_line_keys.end(), key) != c.command_line_keys.end();
}

/// `c` with a candidate's settings.
TrainConfig with_plan_settings(const TrainConfig& c, const zero::plan::Plan& p) {
  TrainConfig t = c;
  t.batch_size = p.input.batch;
  t.accumulation = p.input.engine.accumulation_steps;
  t.stage = p.input.engine.stage;
  t.offload_optimizer = p.input.engine.offload.optimizer;
  t.offload_params = p.input.engine.offload.params;
  t.offload_delayed_update = p.input.engine.offload.delayed_update;
  t.offload_accumulate_on_host = p.input.engine.offload.accumulate_on_host;
  t.offload_ema_on_device = p.input.engine.offload.ema_on_device;
  t.activation_checkpointing = p.input.activation_checkpointing;
  t.checkpoint_units = p.input.checkpoint_units == 0 ? "all" : std::to_string(p.input.checkpoint_units);
  t.prefetch_units = p.input.engine.buckets.prefetch_units;
  return t;
}

/// "batch_size 4 -> 1, offload_optimizer false -> true", or "nothing".
std::string changes(const TrainConfig& from, const TrainConfig& to) {
  std::string out;
  for (const FitSetting& s : fit_settings())
    if (s.show(from) != s.show(to))
      out += (out.empty() ? "" : ", ") + std::string(s.key) + " " + s.show(from) + " -> " + s.show(to);
  return out.empty() ? "nothing" : out;
}

/// Why `t` (a candidate applied to c) cannot be the run's: a setting given
/// on the command line that it changes, or what validate() refuses; empty: none.
std::string passed_over(const TrainConfig& c, const TrainConfig& t) {
  for (const FitSetting& s : fit_settings())
    if (pinned(c, s.key) && s.show(c) != s.show(t))
      return std::string("--") + s.key + " " + s.show(c) + " was given on the command line";
  try {
    t.validate();
  } catch (const zero::InvalidArgument& e) {
    return e.message();
  }
  return "";
}

std::string peak_range(const zero::plan::Plan& p) {
  return zero::format_bytes(p.gpu_peak_lower()) + " .. " + zero::format_bytes(p.gpu_peak());
}

std::string images_per_second(const zero::plan::Plan& p) {
  char text[32];
  std::snprintf(text, sizeof text, "%.4g", p.images_per_second());
  return text;
}

/// A resumed run keeps the settings of the checkpoint it continues: its
/// global batch and data order (the sampler refuses another batch_size x
/// ranks; the engine's state was saved for its stage and offload).
FitDecision keep_checkpoint_settings(TrainConfig& c, const zero::plan::PlanInput& base,
                                     const std::string& resumed_config) {
  TrainConfig saved;
  try {
    saved = train_config_from_toml(resumed_config, "the checkpoint's saved configuration");
  } catch (const zero::Error& e) {
    ZERO_THROW(zero::InvalidArgument, "fit = ", c.fit, " with resume = \"", c.resume, "\": ", e.message(),
               "; resume without fit, with the checkpoint's settings given explicitly");
  }
  TrainConfig kept = c;
  std::string pinned_keys;
  for (const FitSetting& s : fit_settings()) {
    if (pinned(c, s.key)) {
      pinned_keys += (pinned_keys.empty() ? "" : ", ") + std::string(s.key);
      continue;
    }
    s.take(kept, saved);
  }
  kept.validate();
  zero::plan::PlanInput in = base;
  in.batch = static_cast<int>(kept.batch_size);
  in.engine.accumulation_steps = static_cast<int>(kept.accumulation);
  in.engine.stage = static_cast<int>(kept.stage);
  in.engine.offload.optimizer = kept.offload_optimizer;
  in.engine.offload.params = kept.offload_params;
  in.engine.offload.delayed_update = kept.offload_delayed_update;
  in.engine.offload.accumulate_on_host = kept.offload_accumulate_on_host;
  in.engine.offload.ema_on_device = kept.offload_ema_on_device;
  in.activation_checkpointing = kept.activation_checkpointing;
  in.checkpoint_units = static_cast<std::size_t>(kept.checkpoint_unit_count());
  in.engine.buckets.prefetch_units = static_cast<int>(kept.prefetch_units);
  FitDecision d{zero::plan::make_plan(in), ""};
  const std::size_t cap = zero::parse_bytes(c.fit, "fit");
  if (const auto why = zero::plan::check_cap(d.plan, cap))
    ZERO_THROW(zero::OutOfMemory, "fit = ", c.fit, ": resuming keeps the settings of the checkpoint (",
               d.plan.trainer_options(), "), and ", *why);
  std::ostringstream out;
  out << "--- fit = " << c.fit << ": resuming, so nothing is searched: the run keeps the checkpoint's settings (its "
      << "global batch and data order)\n  " << d.plan.trainer_options() << "\n  predicted peak " << peak_range(d.plan)
      << " per rank, predicted " << images_per_second(d.plan)
      << " images/s (speed model calibrated on an H200; its measured errors: docs/planner.md)\n  changed from the configuration: "
      << changes(c, kept) << "\n";
  if (!pinned_keys.empty()) out << "  kept as given on the command line: " << pinned_keys << "\n";
  out << "---\n";
  d.report = out.str();
  c = kept;
  return d;
}

/// Before the engine exists: fail when the planner's UPPER bound of the
/// peak is over the cap. A run refused only on the lower bound was accepted
/// with a range reaching past the cap and then died mid-step in a raw CUDA
/// out-of-memory; the refusal names the range, the cap and a configuration
/// that fits at the same global batch.
void check_plan_fits(const TrainConfig& c, std::size_t cap, const zero::plan::Plan& plan) {
  const auto why = zero::plan::check_cap(plan, cap);
  if (why) ZERO_THROW(zero::OutOfMemory, cap_option(c), ": ", *why);
}

}  // namespace

std::size_t gpu_memory_cap(const TrainConfig& c) {
  if (c.device != "cuda") return 0;
  if (!c.max_gpu_memory.empty()) return zero::parse_bytes(c.max_gpu_memory, "max_gpu_memory");
  return c.fit.empty() ? 0 : zero::parse_bytes(c.fit, "fit");
}

std::string check_plan_against_gpu(const zero::plan::Plan& plan, std::size_t gpu_total_bytes) {
  if (gpu_total_bytes == 0) return {};
  const auto why = zero::plan::check_cap(plan, gpu_total_bytes);
  if (!why) return {};
  const std::string gpu = "this GPU has " + zero::format_bytes(gpu_total_bytes) +
                          " (the smallest among the ranks; no max_gpu_memory or fit set): ";
  const double refused_above = static_cast<double>(gpu_total_bytes) * (1.0 + kUncappedRefusalSlack);
  if (static_cast<double>(plan.gpu_peak_lower()) > refused_above)
    ZERO_THROW(zero::OutOfMemory, gpu, *why, " Refused before loading: even the lower bound is more than ",
               static_cast<int>(kUncappedRefusalSlack * 100), "% over the GPU.");
  return "warning: " + gpu + *why + " Starting anyway: the prediction may be high.\n";
}

FitDecision fit_gpu_memory(TrainConfig& c, const UNetConfig& ucfg, const zero::EngineOptions& options, int world,
                           int ranks_per_host, const std::vector<std::vector<std::size_t>>& frozen_sizes_by_unit,
                           const std::optional<std::string>& resumed_config) {
  ZERO_CHECK(!c.fit.empty(), "fit_gpu_memory: [device] fit is not set");
  const std::size_t cap = zero::parse_bytes(c.fit, "fit");
  const zero::plan::PlanInput base = plan_input(c, ucfg, options, world, ranks_per_host, frozen_sizes_by_unit);
  if (resumed_config) return keep_checkpoint_settings(c, base, *resumed_config);
  // Exactly `zero-plan --fit SIZE --global-batch G`: the default margin and
  // the upper bound of the peak.
  zero::plan::FitOptions search;
  search.global_batch = static_cast<int>(world * c.batch_size * c.accumulation);
  const zero::plan::FitResult result = zero::plan::fit(base, cap, search);
  const zero::plan::FitResult::Candidate* chosen = nullptr;
  std::vector<std::string> skipped;  // faster candidates that fit but were passed over, and why
  std::size_t fitting = 0;
  for (const zero::plan::FitResult::Candidate& candidate : result.candidates) {
    if (!candidate.fits) continue;
    ++fitting;
    const std::string why = passed_over(c, with_plan_settings(c, candidate.plan));
    if (why.empty()) {
      chosen = &candidate;
      break;
    }
    skipped.push_back(candidate.plan.trainer_options() + ": " + why);
  }
  const auto least = std::min_element(result.candidates.begin(), result.candidates.end(),
                                      [](const auto& a, const auto& b) { return a.plan.gpu_peak() < b.plan.gpu_peak(); });
  if (chosen == nullptr) {
    const std::size_t usable = static_cast<std::size_t>(static_cast<double>(cap) * (1 - search.safety_margin));
    std::ostringstream why;
    why << "fit = " << c.fit << ": ";
    if (fitting > 0) {
      // Something fits, but every such candidate changes a pinned option or is refused by the configuration.
      why << fitting << " of " << result.candidates.size() << " configurations at the global batch "
          << search.global_batch << " fit " << zero::format_bytes(cap) << " per rank (" << zero::format_bytes(usable)
          << " usable), but each changes an option given on the command line or is refused by the configuration; "
          << "the fastest: " << skipped.front();
      ZERO_THROW(zero::OutOfMemory, why.str());
    }
    why << "no configuration fits " << zero::format_bytes(cap) << " per rank at the global batch "
        << search.global_batch << " (" << world << (world == 1 ? " rank" : " ranks")
        << " x batch_size x accumulation; " << result.candidates.size() << " configurations of micro-batch, "
        << "accumulation, stage, offload, activation checkpointing and the delayed update searched, "
        << zero::format_bytes(usable) << " usable with the " << search.safety_margin * 100 << "% margin)";
    if (least != result.candidates.end())
      why << ": the smallest predicted peak is " << zero::format_bytes(least->plan.gpu_peak()) << " ("
          << least->plan.trainer_options() << "). " << result.summary();
    ZERO_THROW(zero::OutOfMemory, why.str());
  }
  // The deepest prefetch that still fits, unless given on the command line.
  zero::plan::FitOptions deepen = search;
  if (pinned(c, "prefetch_units")) deepen.max_prefetch_units = 0;
  const zero::plan::Plan chosen_plan = zero::plan::deepest_prefetch(chosen->plan, cap, deepen);
  const TrainConfig applied = with_plan_settings(c, chosen_plan);
  const zero::plan::Plan as_given = zero::plan::make_plan(base);
  std::ostringstream out;
  out << "--- fit = " << c.fit << ": the fastest predicted of " << result.candidates.size()
      << " configurations (micro-batch x accumulation = global batch " << search.global_batch << " over " << world
      << (world == 1 ? " rank" : " ranks") << ", stage, offload, activation checkpointing, delayed update) whose "
      << "predicted peak fits " << zero::format_bytes(static_cast<std::size_t>(static_cast<double>(cap) *
                                                                                (1 - search.safety_margin)))
      << " (" << c.fit << " less a " << search.safety_margin * 100 << "% margin; zero-plan --fit " << c.fit
      << " --global-batch " << search.global_batch << " ranks the same)\n  chosen: " << chosen_plan.trainer_options()
      << "\n  predicted peak " << peak_range(chosen_plan) << " per rank, predicted " << images_per_second(chosen_plan)
      << " images/s (speed model calibrated on an H200; its measured errors: docs/planner.md)\n  the configuration as given ("
      << as_given.trainer_options() << "): predicted peak up to " << zero::format_bytes(as_given.gpu_peak()) << ", "
      << images_per_second(as_given) << " images/s\n  changed from the configuration: " << changes(c, applied) << "\n";
  for (const std::string& s : skipped) out << "  passed over (faster, fits): " << s << "\n";
  out << "---\n";
  FitDecision d{chosen_plan, out.str()};
  c = applied;
  return d;
}

std::string resolve_checkpoint_fit(TrainConfig& c, const UNetConfig& ucfg, const zero::EngineOptions& options,
                                   int world, int ranks_per_host, std::size_t gpu_bytes,
                                   const std::vector<std::vector<std::size_t>>& frozen_sizes_by_unit) {
  if (c.checkpoint_units != "fit") return "";
  c.checkpoint_units = "all";
  if (!c.activation_checkpointing) return "";  // nothing is recomputed anyway
  if (gpu_bytes == 0)
    return "checkpoint_units = fit: no GPU memory to fit on the CPU; every unit is recomputed\n";
  const zero::plan::PlanInput base = plan_input(c, ucfg, options, world, ranks_per_host, frozen_sizes_by_unit);
  const zero::plan::FitOptions search;  // zero-plan --fit's: the upper bound, a 5% margin
  zero::plan::PlanInput every = base;
  every.checkpoint_units = 0;
  const zero::plan::Plan all = zero::plan::make_plan(every);
  const std::optional<std::size_t> count = zero::plan::fewest_recomputed_units(all, gpu_bytes, search);
  const std::size_t total = zero::plan::checkpointable_units(base.units);
  const std::size_t usable = static_cast<std::size_t>(static_cast<double>(gpu_bytes) * (1 - search.safety_margin));
  std::ostringstream out;
  out << "checkpoint_units = fit (" << zero::format_bytes(gpu_bytes) << ", " << zero::format_bytes(usable)
      << " usable): ";
  if (!count) {
    out << "not even recomputing every unit fits (predicted peak " << zero::format_bytes(all.gpu_peak())
        << "); every unit is recomputed\n";
    return out.str();
  }
  if (*count == 0) {
    c.activation_checkpointing = false;
    zero::plan::PlanInput none = base;
    none.activation_checkpointing = false;
    none.checkpoint_units = 0;
    out << "nothing is recomputed: the predicted peak without checkpointing, "
        << zero::format_bytes(zero::plan::make_plan(none).gpu_peak()) << ", fits\n";
    return out.str();
  }
  if (*count < total) c.checkpoint_units = std::to_string(*count);
  zero::plan::PlanInput chosen = base;
  chosen.checkpoint_units = *count < total ? *count : 0;
  const zero::plan::Plan plan = zero::plan::make_plan(chosen);
  out << "recomputing " << *count << " of " << total
      << " units (those that free the most activation memory per recompute FLOP), predicted peak "
      << zero::format_bytes(plan.gpu_peak()) << " (every unit: " << zero::format_bytes(all.gpu_peak())
      << "), predicted " << images_per_second(plan) << " images/s (every unit: " << images_per_second(all) << ")\n";
  return out.str();
}

std::string out_of_memory_advice(const TrainConfig& c) {
  const std::string smaller = "lower batch_size (raising accumulation keeps the global batch) or latent_size";
  if (!c.activation_checkpointing)
    return c.device == "cuda" ? "set activation_checkpointing = true (with checkpoint_units = \"fit\": only the "
                                "units this GPU needs recomputed), or " + smaller
                              : "set activation_checkpointing = true, or " + smaller;
  if (const std::int64_t count = c.checkpoint_unit_count(); count > 0)
    return "recompute more units: checkpoint_units = " + std::to_string(count) +
           " now (\"all\" recomputes every one), or " + smaller;
  std::string advice = smaller;
  if (c.stage < 3) advice += ", or raise stage (3 shards the parameters too)";
  if (!c.offload_optimizer && c.stage >= 1) advice += ", or set offload_optimizer = true";
  return advice + "; zero-plan --fit SIZE proposes settings that fit";
}

std::optional<zero::plan::Plan> plan_gpu_memory(const TrainConfig& c, const UNetConfig& ucfg,
                                                zero::EngineOptions& options, std::size_t cap, int world,
                                                int ranks_per_host, bool leader,
                                                const std::vector<std::vector<std::size_t>>& frozen_sizes_by_unit) {
  if (c.device != "cuda") return std::nullopt;
  zero::plan::Plan run_plan = plan_run(c, ucfg, options, world, ranks_per_host, frozen_sizes_by_unit);
  if (cap > 0 && run_plan.gpu_peak() > cap) {
    // Tight cap: the engine frees its transient blocks instead of caching
    // them (each free then waits for the device; that is what the cap
    // costs), where that is what lets the run fit.
    zero::EngineOptions uncached = options;
    uncached.buckets.cache_bytes = 0;
    zero::plan::Plan uncached_plan = plan_run(c, ucfg, uncached, world, ranks_per_host, frozen_sizes_by_unit);
    if (uncached_plan.gpu_peak() <= cap) {
      options = uncached;
      run_plan = std::move(uncached_plan);
      if (leader) std::printf("%s: the engine's block cache is off to fit the cap\n", cap_option(c).c_str());
    }
  }
  if (leader)
    std::printf("memory plan (zero-plan): GPU peak %s .. %s per rank, pinned host %s per rank\n",
                zero::format_bytes(run_plan.gpu_peak_lower()).c_str(), zero::format_bytes(run_plan.gpu_peak()).c_str(),
                zero::format_bytes(run_plan.host_per_rank()).c_str());
  if (cap > 0) check_plan_fits(c, cap, run_plan);
  return run_plan;
}

void apply_gpu_memory_cap(const TrainConfig& c, std::size_t cap, const zero::Engine& engine,
                          const zero::plan::Plan& plan, DeviceRuntime& runtime, int world, bool leader) {
  const DeviceMemory settled = runtime.settled_memory();
  const std::size_t outside = settled.in_use;  // context, NCCL, the engine's buffers
  // The engine's transient buffers at their peak (gradient buckets and
  // scratch in flight, gathered units, cached blocks), as the planner ran them.
  const std::size_t transient = plan.engine.peak();
  if (outside + transient >= cap)
    ZERO_THROW(zero::OutOfMemory, cap_option(c), ": ", zero::format_bytes(outside),
               " are in use before training (CUDA context, NCCL, the engine's model state: ",
               zero::format_memory(engine.memory()), ") and the engine's transient buffers need up to ",
               zero::format_bytes(transient), "; nothing is left for activations. Try",
               memory_suggestion(c, world), ".");
  const std::size_t for_torch = cap - outside - transient;
  runtime.limit_torch_memory(static_cast<double>(for_torch) / static_cast<double>(settled.total));
  if (leader)
    std::printf("GPU memory cap %s: %s in use before training, up to %s for the engine's transient buffers, %s for "
                "LibTorch (activations)\n",
                zero::format_bytes(cap).c_str(), zero::format_bytes(outside).c_str(),
                zero::format_bytes(transient).c_str(), zero::format_bytes(for_torch).c_str());
}

}  // namespace sdxl
