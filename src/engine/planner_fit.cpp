// zero::plan::fit and its reports: the search over stage, offload,
// checkpointing, micro-batch and accumulation for the fastest configuration
// whose predicted peak fits a GPU (docs/planner.md, "Fitting"). Each
// candidate is a Plan from make_plan (planner.cpp).
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <sstream>

#include "plan_json.hpp"
#include "zero/engine/planner.hpp"

namespace zero::plan {

using nlohmann::json;

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

/// Partial checkpointing on a plan that recomputes every unit: the fewest
/// units in recompute_order() whose plan fits `limit` (0: none; the
/// checkpointable count: every one), nullopt when not even every unit fits.
/// Only the activations depend on the count (the engine's buffers do not),
/// so it is found by bisection on copies of the plan.
std::optional<std::size_t> fewest_count(const Plan& all, const FitOptions& options, std::size_t limit) {
  const PlanInput& in = all.input;
  const std::size_t total = checkpointable_units(in.units);
  const std::size_t dtype_bytes = size_of(in.engine.param_dtype);
  auto fits_with = [&](std::size_t count) {
    Plan p = all;  // count 0: no checkpointing; count == total: every unit (as checkpoint_units = 0)
    p.input.activation_checkpointing = count > 0;
    p.input.checkpoint_units = count < total ? count : 0;
    p.activations = in.activations.bytes(in.batch, recomputed_shares(p.input).first, dtype_bytes);
    return peak_of(p, options) <= limit;
  };
  if (!fits_with(total)) return std::nullopt;
  if (fits_with(0)) return 0;
  std::size_t lo = 1, hi = total;  // the peak falls as units are added
  while (lo < hi) {
    const std::size_t mid = lo + (hi - lo) / 2;
    if (fits_with(mid)) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

/// The candidate of fit()'s search with partial checkpointing: from the one
/// that recomputes every unit, the fewest units that fit, when recomputing
/// none does not fit (that candidate is searched already) and fewer than
/// every unit do.
std::optional<FitResult::Candidate> fewest_recomputed(const FitResult::Candidate& all, const FitOptions& options,
                                                      std::size_t limit) {
  const PlanInput& in = all.plan.input;
  if (!all.fits || in.units.empty()) return std::nullopt;
  const std::optional<std::size_t> count = fewest_count(all.plan, options, limit);
  if (!count || *count == 0 || *count >= checkpointable_units(in.units)) return std::nullopt;
  PlanInput partial = in;
  partial.checkpoint_units = *count;
  return candidate(std::move(partial), options, limit);
}

std::vector<FitResult::Candidate> search(const PlanInput& base, std::size_t gpu_bytes, const FitOptions& options) {
  std::vector<FitResult::Candidate> out;
  const std::size_t limit = usable(gpu_bytes, options);
  // The delayed update needs offload_optimizer (any accumulation, with or
  // without offload_params); host accumulation needs offload_optimizer and
  // several micro-steps, each reduced; the EMA on the GPU needs
  // offload_optimizer without offload_params. With a global batch all three
  // are searched; without one the base's choice is kept where it is allowed.
  const bool searched = options.global_batch > 0;
  for (const auto& [micro, accumulation] : batches_of(base, options))
    for (int stage = 0; stage <= 3; ++stage)
      for (Offload offload : {Offload{false, false}, Offload{true, false}, Offload{true, true}}) {
        if ((offload.optimizer && stage == 0) || (offload.params && stage != 3)) continue;
        const bool host_allowed = offload.optimizer && accumulation > 1 &&
                                  base.engine.accumulation == GradAccumulation::reduce_each_micro_step;
        // The EMA kept on the GPU: with the optimizer offloaded, an EMA, and
        // the parameters on the GPU.
        const bool ema_device_allowed = offload.optimizer && !offload.params && base.engine.ema.enabled();
        for (bool checkpointing : {false, true})
          for (bool delayed : {false, true})
            for (bool on_host : {false, true})
              for (bool ema_device : {false, true}) {
                if (delayed != ((searched ? delayed : base.engine.offload.delayed_update) && offload.optimizer)) continue;
                if (on_host != ((searched ? on_host : base.engine.offload.accumulate_on_host) && host_allowed)) continue;
                if (ema_device != ((searched ? ema_device : base.engine.offload.ema_on_device) && ema_device_allowed))
                  continue;
                PlanInput in = base;
                in.batch = micro;
                in.engine.accumulation_steps = accumulation;
                in.engine.stage = stage;
                in.engine.offload.optimizer = offload.optimizer;
                in.engine.offload.params = offload.params;
                in.engine.offload.delayed_update = delayed;
                in.engine.offload.accumulate_on_host = on_host;
                in.engine.offload.ema_on_device = ema_device;
                in.activation_checkpointing = checkpointing;
                in.checkpoint_units = 0;  // every unit; the fewest that fit are searched below
                FitResult::Candidate all = candidate(std::move(in), options, limit);
                if (checkpointing) {
                  if (auto partial = fewest_recomputed(all, options, limit)) out.push_back(std::move(*partial));
                }
                out.push_back(std::move(all));
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

Plan deepest_prefetch(const Plan& plan, std::size_t gpu_bytes, const FitOptions& options) {
  const PlanInput& in = plan.input;
  const bool gathers = in.engine.stage == 3 && (in.world_size > 1 || in.engine.offload.params);
  if (!gathers) return plan;
  const std::size_t limit = usable(gpu_bytes, options);
  for (int depth = options.max_prefetch_units; depth > in.engine.buckets.prefetch_units; --depth) {
    PlanInput deeper = in;
    deeper.engine.buckets.prefetch_units = depth;
    FitResult::Candidate c = candidate(std::move(deeper), options, limit);
    if (c.fits) return std::move(c.plan);
  }
  return plan;
}

std::optional<std::size_t> fewest_recomputed_units(const PlanInput& base, std::size_t gpu_bytes,
                                                   const FitOptions& options) {
  ZERO_CHECK(!base.units.empty(), "fewest_recomputed_units: needs the model as units");
  PlanInput in = base;
  in.activation_checkpointing = true;
  in.checkpoint_units = 0;
  return fewest_recomputed_units(make_plan(in), gpu_bytes, options);
}

std::optional<std::size_t> fewest_recomputed_units(const Plan& every_unit, std::size_t gpu_bytes,
                                                   const FitOptions& options) {
  const PlanInput& in = every_unit.input;
  ZERO_CHECK(!in.units.empty(), "fewest_recomputed_units: needs the model as units");
  ZERO_CHECK(in.activation_checkpointing && in.checkpoint_units == 0,
             "fewest_recomputed_units: the plan must recompute every unit (checkpoint_units 0), got ",
             in.activation_checkpointing ? std::to_string(in.checkpoint_units) + " units" : "no checkpointing");
  return fewest_count(every_unit, options, usable(gpu_bytes, options));
}

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
      result.best = deepest_prefetch(c.plan, gpu_bytes, options);
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
  j["best"] = best ? detail::plan_json(*best) : json(nullptr);
  json list = json::array();
  for (const Candidate& c : candidates) {
    list.push_back({{"label", c.plan.label()},
                    {"stage", c.plan.input.engine.stage},
                    {"offload_optimizer", c.plan.input.engine.offload.optimizer},
                    {"offload_params", c.plan.input.engine.offload.params},
                    {"activation_checkpointing", c.plan.input.activation_checkpointing},
                    {"checkpoint_units", c.plan.input.checkpoint_units},
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
