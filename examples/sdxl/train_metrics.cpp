#include "train_metrics.hpp"

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace sdxl {

MetricsSinks::MetricsSinks(const TrainConfig& cfg, std::int64_t resumed_step, const zero::MpiCommunicator& host_comm) {
  const bool leader = host_comm.rank() == 0;
  fs::create_directories(cfg.output_dir);
  if (leader) {
    jsonl.emplace(fs::path(cfg.output_dir) / "metrics.jsonl");
    jsonl->truncate_after(resumed_step);  // a resumed run rewrites the steps after its checkpoint
    tensorboard.emplace(fs::path(cfg.output_dir) / "tensorboard");
    if (resumed_step > 0) tensorboard->add_session_start(resumed_step + 1);
  }
  tty = leader && metrics::is_tty(stdout) && host_comm.size() == 1;
}

void record_step(const TrainConfig& cfg, MetricsSinks& sinks, const RunPosition& run, const StepMeasures& m) {
  metrics::StepRecord record;
  record.step = m.done;
  record.loss = m.loss;
  record.lr = m.lr;
  record.grad_norm = m.result.grad_norm;
  record.images_per_s = m.images_per_s;
  record.mem_max_bytes = static_cast<std::uint64_t>(m.mem_max_bytes);
  record.mem_min_bytes = static_cast<std::uint64_t>(m.mem_min_bytes);
  record.loss_scale = m.result.loss_scale;
  record.skipped_steps = run.steps_skipped;
  record.elapsed_s = seconds_between(run.start, Clock::now());
  record.extra["epoch"] = run.epochs.progress(m.done);  // epochs done after this step (fraction: of the next)
  // Where a step's time goes (rank 0): forward/backward until the last
  // loss is read back, the host time of step() (with offload: the CPU
  // update, of which the gradient statistics and the update loop).
  if (cfg.caption_dropout > 0) record.extra["data/captions_dropped"] = static_cast<double>(m.captions_dropped);
  record.extra["timing/fwd_bwd_s"] = seconds_between(m.step_start, m.step_call);
  record.extra["timing/step_call_s"] = m.step_call_seconds;
  // Load imbalance: each phase's min/max over ranks, waits for collectives
  // taken out of forward+backward and the optimizer (examples/sdxl/README.md,
  // "Load imbalance").
  for (const auto& [key, value] : metrics::imbalance_scalars(m.imbalance)) record.extra[key] = value;
  // The engine's transient blocks this step (rank 0): a handful in the steady
  // state; hundreds mean host waits in the middle of the passes.
  record.extra["engine/block_allocations"] = static_cast<double>(m.result.block_allocations);
  record.extra["engine/block_frees"] = static_cast<double>(m.result.block_frees);
  record.extra["engine/block_waits"] = static_cast<double>(m.result.block_waits);
  if (cfg.offload_optimizer) {
    record.extra["timing/cpu_grad_stats_s"] = m.result.cpu_grad_stats_seconds;
    record.extra["timing/cpu_update_s"] = m.result.cpu_update_seconds;
    if (cfg.offload_delayed_update) {
      record.extra["timing/cpu_update_wait_s"] = m.result.cpu_update_wait_seconds;
      record.extra["transfer/buckets_up_during_backward"] = static_cast<double>(m.result.buckets_up_during_backward);
    }
    if (cfg.offload_accumulate_on_host) record.extra["timing/host_add_wait_s"] = m.result.host_add_wait_seconds;
    // This rank's traffic between host and GPU memory in the step (PCIe),
    // and its rate over the step's wall time: against the link's ~55 GB/s
    // each way, how busy offload keeps it.
    const double up = static_cast<double>(m.result.host_to_device_bytes);
    const double down = static_cast<double>(m.result.device_to_host_bytes);
    record.extra["transfer/to_device_bytes"] = up;
    record.extra["transfer/to_host_bytes"] = down;
    if (m.step_seconds > 0) {
      record.extra["transfer/to_device_GBps"] = up / m.step_seconds / 1e9;
      record.extra["transfer/to_host_GBps"] = down / m.step_seconds / 1e9;
    }
  }
  sinks.jsonl->write(record);
  sinks.tensorboard->add_scalars({{"train/loss", m.loss}, {"train/lr", m.lr}, {"train/grad_norm", m.result.grad_norm},
                                  {"train/images_per_s", m.images_per_s}, {"train/mem_max_bytes", m.mem_max_bytes},
                                  {"imbalance/fwd_bwd_max_s", m.imbalance.fwd_bwd.max},
                                  {"imbalance/fwd_bwd_min_s", m.imbalance.fwd_bwd.min},
                                  {"imbalance/comm_wait_max_s", m.imbalance.comm_wait.max},
                                  {"imbalance/slowest_rank", static_cast<double>(m.imbalance.slowest_rank)}},
                                 m.done);
  if (m.done % cfg.log_every == 0 || m.done == run.total_steps) {
    metrics::Progress p{.step = m.done, .total_steps = run.total_steps, .start_step = run.start_step,
                        .epoch = record.extra.at("epoch"),
                        .loss = m.loss, .loss_ema = sinks.loss_ema.value(), .lr = m.lr,
                        .images_per_s = m.images_per_s, .mem_max_bytes = static_cast<std::uint64_t>(m.mem_max_bytes),
                        .mem_min_bytes = static_cast<std::uint64_t>(m.mem_min_bytes), .elapsed_s = *record.elapsed_s,
                        .imbalance = m.imbalance};
    const std::string line = sinks.progress.render(p, sinks.tty ? metrics::terminal_width(stdout) : 0);
    std::printf("%s\n", line.c_str());  // one line per interval: mpirun relays lines, not '\r'
    std::fflush(stdout);
  }
}

metrics::RankImbalance gather_phase_times(zero::MpiCommunicator& host_comm, const metrics::PhaseTimes& mine) {
  float own[metrics::kPhaseValues];
  metrics::pack(mine, own);
  std::vector<float> all(metrics::kPhaseValues * static_cast<std::size_t>(host_comm.size()));
  host_comm.all_gather(own, all.data(), metrics::kPhaseValues, zero::DType::fp32)->wait();
  return metrics::summarize_ranks(all);
}

}  // namespace sdxl
