// The updaters' classes (see updater.hpp). Internal to src/engine.
#pragma once

#include <array>
#include <atomic>
#include <exception>
#include <thread>
#include <vector>

#include "engine_impl.hpp"

namespace zero::detail {

class DeviceUpdater final : public Updater {
 public:
  explicit DeviceUpdater(Engine::Impl& engine);
  void apply(const UpdateArgs& args, StepResult& result) override;
  void parameters_from_master() override;

 private:
  void initialize_ema();
  /// The optimizer over span u, one call per segment (a group's run).
  void update(const UpdateArgs& args, const std::vector<Engine::Impl::Segment>& segments, const ShardUpdate& u);
  /// Stage 0: the full fp32 weights the optimizer updates (the master, or
  /// the parameters themselves when they are fp32).
  float* full_weights() const { return m_.master ? m_.master : reinterpret_cast<float*>(m_.params_full); }
  Engine::Impl& m_;
};

class OffloadUpdater : public Updater {
 public:
  explicit OffloadUpdater(Engine::Impl& engine);
  ~OffloadUpdater() override;
  void apply(const UpdateArgs& args, StepResult& result) override;
  void settle() override { join_ema(); }
  std::byte* host_gradients() override { return grad_host_; }
  std::byte* host_gradient_staging() override { return grad_staging_; }
  void parameters_from_master() override;

 protected:
  void initialize_ema();
  /// The whole synchronous update: gradients down (unless streamed), the CPU
  /// update of each bucket (master and state; the EMA follows on its own
  /// thread), its parameters up and gathered.
  void update_now(const UpdateArgs& args);
  /// The synchronous update's EMA of the new master weights, on a background
  /// thread while the next forward and backward run: the same per-element
  /// kernel on the same values as inside the update, so the same bits.
  void start_ema(double decay);
  /// Waits for that EMA (before the master is written again or anything
  /// reads the state); rethrows what it threw.
  void join_ema();
  /// The CPU update of this rank's slice of bucket b from the gradient shard
  /// `grads`: master, state and (with_ema) EMA, and the model-dtype values written to
  /// the shard `copy` (a staging shard, or with offloaded parameters the
  /// host parameter shard itself or, delayed, its second copy).
  void update_bucket(std::size_t b, const UpdateArgs& args, const std::byte* grads, std::byte* copy, bool with_ema);
  /// Bucket b's updated model-dtype slice from `copy` up into this rank's
  /// place; stages 1-2 then start its all-gather (left in flight).
  void upload_bucket(std::size_t b, const std::byte* copy);
  /// Stage 3 (parameters on the device): the next forward waits for the uploads.
  void finish_uploads();
  /// What a master slice sent up (plan.uploads_master) is used for on the device.
  enum class MasterUse { ema_only, params, params_and_gather };
  /// offload.ema_on_device: bucket b's fp32 master slice up into a staging
  /// block; the device adds it into the EMA (ema_decay > 0) and, unless
  /// ema_only, rounds it into this rank's parameters (and starts the
  /// bucket's all-gather where stages 1-2 gather after the step). Records
  /// master_sent_[b]: the host must not rewrite the slice before it.
  /// On `stream` (the comm stream unless given), through `staging` (a block
  /// of master_piece_ floats; null: one from the pool for this call).
  void send_master(std::size_t b, double ema_decay, MasterUse use, Stream stream = nullptr, float* staging = nullptr);
  /// Releases master_sent_ (the copies are done, or no one waits for them).
  void release_master_sent();

  Engine::Impl& m_;
  std::byte* grad_host_ = nullptr;  // the reduced gradient shard, copied down
  std::byte* copy_host_ = nullptr;  // the updated model-dtype shard, to copy up (none with offloaded parameters)
  std::byte* grad_staging_ = nullptr;  // plan.accumulates_on_host: later micro-steps' slices, added into grad_host_
  std::vector<Event> master_sent_;     // plan.uploads_master, per bucket: the last copy of its master slice up
  std::size_t master_piece_ = 1;       // plan.uploads_master: elements sent up through the staging block at once
  std::thread ema_thread_;
  std::exception_ptr ema_error_;
};

/// The delayed parameter update (EngineOptions::offload.delayed_update): two
/// gradient shards with one micro-step (backward streams into one while the
/// update reads the other; with several the gradients go down at step(), into
/// the one) and two parameter copies (the
/// update writes one while the other may still be going up, or, with
/// offloaded parameters, is what the gathers read).
class DelayedOffloadUpdater final : public OffloadUpdater {
 public:
  explicit DelayedOffloadUpdater(Engine::Impl& engine);
  ~DelayedOffloadUpdater() override;
  void finish_previous(StepResult& result) override;
  void apply(const UpdateArgs& args, StepResult& result) override;
  void settle() override;
  /// Joins the background update but leaves its parameters to go up at the
  /// next step(), as they would without the read.
  void settle_for_reading() override;
  void on_bucket_released(std::size_t b) override;
  void on_backward_done() override;
  /// The synchronous warm-up steps, the step that starts the first
  /// background update, and the one whose backward first sends an update up
  /// (taking the staging block it keeps from then on).
  int steps_before_steady() const override { return m_.options.offload.delayed_update_warmup_steps + 2; }

 private:
  /// Starts the CPU update of this step's gradients on a background thread;
  /// the next backward streams into the other gradient shard.
  void start(const UpdateArgs& args);
  /// Several micro-steps: queues the device accumulator's download into
  /// `grads` (an event per bucket, which the update waits for).
  void download_accumulated(std::byte* grads);
  void release_downloads();
  /// Waits for the background update; rethrows what it threw. Returns the seconds waited.
  double join();
  /// Queues the finished update's parameters up (and their gathers), or with
  /// offloaded parameters makes the updated host shard the one gathered.
  void upload();
  /// offload.upload_during_backward: sends up every bucket that backward has
  /// released and the update has finished, not yet sent.
  void send_released();
  /// Whether the device's EMA still owes the pending update bucket b.
  bool ema_owed(std::size_t b) const { return pending_ema_decay_ > 0 && !ema_up_[b]; }

  std::byte* grad_host_spare_ = nullptr;  // one micro-step: the shard backward streams into next
  std::array<std::byte*, 2> copies_{};    // staging copies (parameters on the device)
  std::byte* params_spare_ = nullptr;     // offloaded parameters: the host shard not gathered now
  std::array<Event, 2> copy_uploaded_{};  // the last upload out of copies_[i]
  std::vector<Event> grad_downloaded_;    // per bucket: the accumulated gradients are down
  int update_copy_ = 0;                   // the copy the running (or finished) update writes
  std::thread thread_;
  std::exception_ptr error_;
  double update_seconds_ = 0;
  bool upload_pending_ = false;  // an update finished (or running) whose values are not up yet
  double pending_ema_decay_ = 0;  // plan.uploads_master: the decay the device's EMA still owes that update
  // offload.upload_during_backward (stages 1-2, parameters on the device).
  bool sends_during_backward_ = false;
  std::atomic<std::size_t> buckets_updated_{0};  // the running update has finished buckets [0, this)
  // Per bucket, for the pending update: backward released it (this step's
  // last micro-step); its parameters went up; its EMA was updated on the device.
  std::vector<char> released_, params_up_, ema_up_;
  std::vector<Event> up_event_;        // per bucket sent during backward: its copy (and rounding) done
  float* backward_staging_ = nullptr;  // uploads_master: taken at the first release, kept until destruction
  std::uint64_t up_during_backward_ = 0;  // buckets sent up during backward, for the next StepResult
  // The master_sent_ events of the copies before the running update, which
  // its thread waits for (released at the join); master_sent_ then collects
  // this update's own sends.
  std::vector<Event> sent_before_update_;
};

}  // namespace zero::detail
