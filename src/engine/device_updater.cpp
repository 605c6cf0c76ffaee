// DeviceUpdater: the optimizer step with the state where the backend keeps
// its buffers. Stage 0 gathers every reduced slice and updates everything;
// stages 1-3 update their slices; stages 1-2 then all-gather the parameters.
#include "updaters.hpp"

namespace zero::detail {

DeviceUpdater::DeviceUpdater(Engine::Impl& engine) : m_(engine) {}

void DeviceUpdater::initialize_ema() {
  // The average starts at the weights before the first update.
  if (!m_.ema || m_.ema_initialized) return;
  Backend& be = m_.backend;
  const auto& buckets = m_.layout.buckets();
  if (m_.plan.optimizer_full)
    be.copy(m_.ema, full_weights(), m_.layout.padded_numel() * 4, be.compute_stream());
  else
    for (std::size_t b = 0; b < buckets.size(); ++b)
      be.copy(m_.optimizer_slice(m_.ema, b), m_.master_slice(b), buckets[b].shard_size * 4, be.compute_stream());
  m_.ema_initialized = true;
}

void DeviceUpdater::apply(const UpdateArgs& args, StepResult& result) {
  (void)result;
  Backend& be = m_.backend;
  const Stream compute = be.compute_stream();
  const auto& buckets = m_.layout.buckets();
  initialize_ema();
  const bool copy = m_.pdt != DType::fp32;
  if (m_.plan.optimizer_full) {
    // Every rank updates everything: it first needs every reduced slice.
    auto gathers = m_.gather_buckets(
        m_.grads_full, m_.gdt, [&](std::size_t b) -> const void* { return m_.reduced_grad(b); }, false);
    for (auto& g : gathers) m_.wait_for_collective(*g);
    m_.order_after(compute, be.comm_stream());
    float* weights = full_weights();
    ShardUpdate u;
    u.master = weights;
    u.grad = m_.grads_full;
    u.grad_dtype = m_.gdt;
    u.state0 = m_.state0;
    u.state1 = m_.state1;
    u.state_dtype = m_.sdt;
    u.first_index = 0;
    u.model_copy = copy ? m_.params_full : nullptr;
    u.model_dtype = m_.pdt;
    u.count = m_.layout.padded_numel();
    update(args, m_.full_segments, u);
    if (m_.ema && args.ema_decay > 0) be.ema_update(m_.ema, weights, m_.layout.padded_numel(), args.ema_decay, compute);
    return;
  }
  for (std::size_t b = 0; b < buckets.size(); ++b) {
    ShardUpdate u;
    u.master = m_.master_slice(b);
    u.grad = m_.reduced_grad(b);
    u.grad_dtype = m_.gdt;
    u.state0 = m_.state0 ? m_.state_slice(m_.state0, b) : nullptr;
    u.state1 = m_.state1 ? m_.state_slice(m_.state1, b) : nullptr;
    u.state_dtype = m_.sdt;
    u.first_index = m_.own_offset(b);
    u.model_copy = copy ? m_.own_params(b) : nullptr;
    u.model_dtype = m_.pdt;
    u.count = buckets[b].shard_size;
    update(args, m_.segments[b], u);
  }
  if (m_.ema && args.ema_decay > 0)  // 0: a step between two EMA updates (EmaOptions::every)
    for (std::size_t b = 0; b < buckets.size(); ++b)
      be.ema_update(m_.optimizer_slice(m_.ema, b), m_.master_slice(b), buckets[b].shard_size, args.ema_decay,
                    compute);
  if (m_.plan.gathers_params_after_step) {
    // Bring every rank's updated slices back into the full parameters, left
    // in flight: each bucket is waited for when first used.
    m_.order_after(be.comm_stream(), compute);
    for (std::size_t b = 0; b < buckets.size(); ++b)
      m_.param_gathers[b] = m_.gather_bucket(b, m_.params_full + buckets[b].offset * m_.p_size, m_.pdt,
                                             m_.own_params(b), false);
  }
}

void DeviceUpdater::update(const UpdateArgs& args, const std::vector<Engine::Impl::Segment>& segments,
                           const ShardUpdate& u) {
  // One launch per run of a group: a single launch over the span without groups.
  for (const Engine::Impl::Segment& s : segments)
    m_.backend.optimizer_step(args.groups[static_cast<std::size_t>(s.group)].optimizer,
                              args.groups[static_cast<std::size_t>(s.group)].scalars, u.slice(s.begin, s.count),
                              m_.backend.compute_stream());
}

void DeviceUpdater::parameters_from_master() {
  if (m_.pdt == DType::fp32) return;  // the master weights are the parameters
  Backend& be = m_.backend;
  const auto& buckets = m_.layout.buckets();
  for (std::size_t b = 0; b < buckets.size(); ++b)
    be.convert(m_.master_slice(b), DType::fp32, m_.own_params(b), m_.pdt, buckets[b].shard_size, be.compute_stream());
}

std::unique_ptr<Updater> make_updater(Engine::Impl& engine) {
  if (engine.plan.delayed_update) return std::make_unique<DelayedOffloadUpdater>(engine);
  if (engine.plan.optimizer_on_host) return std::make_unique<OffloadUpdater>(engine);
  return std::make_unique<DeviceUpdater>(engine);
}

}  // namespace zero::detail
