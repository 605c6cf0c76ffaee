// OffloadUpdater: the optimizer step with master, state and EMA in pinned
// host memory (ZeRO-Offload). Per bucket, the reduced gradient slice goes
// down (or has already streamed down during backward), the CPU updates
// master, state and EMA and writes the model-dtype copy, which goes back up
// into this rank's slice. All transfers are queued on the comm stream up
// front or as each bucket is done, so bucket b's update overlaps b+1's
// download and b-1's upload.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <utility>

#include "updaters.hpp"

namespace zero::detail {

OffloadUpdater::OffloadUpdater(Engine::Impl& engine) : m_(engine) {
  const std::size_t shard = m_.layout.shard_numel();
  grad_host_ = m_.pool.allocate_host(kBuffers, shard * m_.g_size);
  // Sending the master up, the device rounds it: no model-dtype copy on the host.
  if (!m_.plan.params_on_host && !m_.plan.uploads_master) copy_host_ = m_.pool.allocate_host(kBuffers, shard * m_.p_size);
  master_sent_.assign(m_.layout.buckets().size(), nullptr);
  if (m_.plan.accumulates_on_host) grad_staging_ = m_.pool.allocate_host(kBuffers, shard * m_.g_size);
  // The master goes up in pieces of a bucket buffer's size (the largest
  // bucket's gradient bytes), a block the pool already holds from backward:
  // a block of a new size would be allocated and freed again every step.
  std::size_t largest = 0;
  for (const Bucket& bucket : m_.layout.buckets()) largest = std::max(largest, bucket.padded);
  master_piece_ = std::max<std::size_t>(1, largest * m_.g_size / 4);
}

OffloadUpdater::~OffloadUpdater() {
  if (ema_thread_.joinable()) ema_thread_.join();  // its error, if any, has no one left to go to
  try {
    // The copies of the master and parameters up read host memory.
    m_.backend.synchronize(m_.backend.transfer_stream());
    m_.backend.synchronize(m_.backend.comm_stream());
  } catch (...) {
    // A failed device has stopped its copies; the memory goes either way.
  }
  release_master_sent();
  const std::size_t shard = m_.layout.shard_numel();
  m_.pool.free_host(grad_host_, shard * m_.g_size);
  m_.pool.free_host(copy_host_, shard * m_.p_size);
  m_.pool.free_host(grad_staging_, shard * m_.g_size);
}

void OffloadUpdater::initialize_ema() {
  // The average starts at the weights before the first update.
  if (!m_.ema || m_.ema_initialized) return;
  if (m_.plan.uploads_master) {  // up before the update rewrites the master (once)
    m_.copy_to_device(m_.ema, m_.master, m_.layout.shard_numel() * 4, m_.backend.comm_stream());
    m_.backend.synchronize(m_.backend.comm_stream());
  } else {
    m_.backend.host_copy(m_.ema, m_.master, m_.layout.shard_numel() * 4);
  }
  m_.ema_initialized = true;
}

void OffloadUpdater::apply(const UpdateArgs& args, StepResult& result) {
  const auto start = std::chrono::steady_clock::now();
  join_ema();  // the last step's EMA read the master this update writes
  initialize_ema();
  update_now(args);
  result.cpu_update_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  start_ema(args.ema_decay);
}

void OffloadUpdater::start_ema(double decay) {
  // 0: a step between two EMA updates (EmaOptions::every). On the device,
  // the EMA was updated as the master went up.
  if (!m_.ema || decay == 0 || m_.plan.uploads_master) return;
  ZERO_ASSERT(!ema_thread_.joinable(), "an EMA update is already running");
  ema_error_ = nullptr;
  ema_thread_ = std::thread([this, decay] {
    try {
      omp_set_num_threads(host_team_threads(m_.options.offload.update_threads));
      // In the update's slices (the kernel is element-wise: the same bits in any cut).
      constexpr std::size_t kSlice = std::size_t{2} << 20;
      const std::size_t n = m_.layout.shard_numel();
      for (std::size_t lo = 0; lo < n; lo += kSlice)
        m_.backend.host_ema_update(m_.ema + lo, m_.master + lo, std::min(kSlice, n - lo), decay);
    } catch (...) {
      ema_error_ = std::current_exception();
    }
  });
}

void OffloadUpdater::join_ema() {
  if (!ema_thread_.joinable()) return;
  ema_thread_.join();
  if (ema_error_) std::rethrow_exception(std::exchange(ema_error_, nullptr));
}

void OffloadUpdater::update_bucket(std::size_t b, const UpdateArgs& args, const std::byte* grads, std::byte* copy,
                                   bool with_ema) {
  const Bucket& bucket = m_.layout.buckets()[b];
  const std::size_t at = bucket.shard_offset;
  ShardUpdate u;
  u.master = m_.master + at;
  u.grad = grads + at * m_.g_size;
  u.grad_dtype = m_.gdt;
  u.state0 = m_.state0 ? m_.state_slice(m_.state0, b) : nullptr;
  u.state1 = m_.state1 ? m_.state_slice(m_.state1, b) : nullptr;
  u.state_dtype = m_.sdt;
  u.first_index = m_.own_offset(b);
  u.model_copy = copy ? copy + at * m_.p_size : nullptr;  // none: the device rounds the master sent up
  u.model_dtype = m_.pdt;
  u.count = bucket.shard_size;
  // The EMA in the update's own pass: each new master value goes into the
  // average from a register (the same bits as a second pass over the master,
  // which read it back and cost a second parallel region per slice). One
  // call per group run (element-wise kernels: the same bits at any cut).
  if (m_.ema && with_ema && args.ema_decay > 0 && m_.plan.ema_on_host) {
    u.ema = m_.ema + at;
    u.ema_decay = args.ema_decay;
  }
  for (const Engine::Impl::Segment& s : m_.segments[b]) {
    const GroupStep& group = args.groups[static_cast<std::size_t>(s.group)];
    m_.backend.host_optimizer_step(group.optimizer, group.scalars, u.slice(s.begin, s.count));
  }
}

void OffloadUpdater::upload_bucket(std::size_t b, const std::byte* copy) {
  const Bucket& bucket = m_.layout.buckets()[b];
  const std::byte* slice = copy + bucket.shard_offset * m_.p_size;
  if (m_.plan.gathers_params_after_step) {
    m_.param_gathers[b] = m_.gather_bucket(b, m_.params_full + bucket.offset * m_.p_size, m_.pdt, slice, true);
  } else {
    m_.copy_to_device(m_.own_params(b), slice, bucket.shard_size * m_.p_size, m_.backend.comm_stream());
  }
}

void OffloadUpdater::send_master(std::size_t b, double ema_decay, MasterUse use, Stream stream, float* staging) {
  Backend& be = m_.backend;
  const Stream transfer = stream ? stream : be.comm_stream();
  const Bucket& bucket = m_.layout.buckets()[b];
  const std::size_t n = bucket.shard_size;
  // The slice in pieces through one pool block: each piece's copy, EMA and
  // rounding are queued in that order on one stream, so the block is free
  // for the next piece once they are done (element-wise: the same bits in
  // any cut).
  const std::size_t piece = std::min(n, master_piece_);
  const bool own_block = staging == nullptr;
  if (own_block) staging = reinterpret_cast<float*>(m_.pool.acquire(kBuffers, piece * 4, transfer));
  // A slice sent twice (for the EMA alone, then for the parameters), maybe
  // on two streams: the second send's event must cover the first copy too.
  if (master_sent_[b]) be.stream_wait(transfer, master_sent_[b]);
  const float* master = m_.optimizer_slice(m_.master, b);
  float* ema = m_.ema ? m_.optimizer_slice(m_.ema, b) : nullptr;
  std::byte* params = m_.own_params(b);
  for (std::size_t lo = 0; lo < n; lo += piece) {
    const std::size_t count = std::min(piece, n - lo);
    m_.copy_to_device(staging, master + lo, count * 4, transfer);
    if (ema_decay > 0) be.ema_update(ema + lo, staging, count, ema_decay, transfer);
    if (use != MasterUse::ema_only) be.convert(staging, DType::fp32, params + lo * m_.p_size, m_.pdt, count, transfer);
  }
  be.release_event(std::exchange(master_sent_[b], be.record_event(transfer)));
  if (use == MasterUse::params_and_gather && m_.plan.gathers_params_after_step)
    m_.param_gathers[b] = m_.gather_bucket(b, m_.params_full + bucket.offset * m_.p_size, m_.pdt, params, false);
  if (own_block) m_.pool.give_back(kBuffers, reinterpret_cast<std::byte*>(staging), piece * 4, transfer);
}

void OffloadUpdater::release_master_sent() {
  for (Event& e : master_sent_) m_.backend.release_event(std::exchange(e, nullptr));
}

void OffloadUpdater::finish_uploads() {
  // Stage 3: the next forward's gathers read param_shard on the comm stream,
  // already ordered; the compute stream waits for the uploads.
  if (m_.plan.gathers_units && !m_.plan.params_on_host)
    m_.order_after(m_.backend.compute_stream(), m_.backend.comm_stream());
}

void OffloadUpdater::update_now(const UpdateArgs& args) {
  Backend& be = m_.backend;
  const auto& buckets = m_.layout.buckets();
  const Stream transfer = be.comm_stream();
  // The last step's uploads read copy_host_: they must be done before it is rewritten.
  be.synchronize(transfer);
  std::vector<Event> down(buckets.size(), nullptr);
  try {
    // Streamed gradients are already down (finish_micro_step waited for them).
    for (std::size_t b = 0; b < buckets.size() && !m_.plan.streams_grads_to_host; ++b) {
      m_.copy_to_host(grad_host_ + buckets[b].shard_offset * m_.g_size, m_.reduced_grad(b),
                      buckets[b].shard_size * m_.g_size, transfer);
      down[b] = be.record_event(transfer);
    }
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      if (down[b]) {
        be.wait_event(down[b]);
        be.release_event(down[b]);
        down[b] = nullptr;
      }
      // Offloaded parameters are updated where they live; nothing goes up.
      update_bucket(b, args, grad_host_, m_.plan.params_on_host ? m_.param_shard : copy_host_, false);
      if (m_.plan.uploads_master) send_master(b, args.ema_decay, MasterUse::params_and_gather);
      else if (!m_.plan.params_on_host) upload_bucket(b, copy_host_);
    }
  } catch (...) {
    for (Event e : down) be.release_event(e);
    throw;
  }
  finish_uploads();
}

void OffloadUpdater::parameters_from_master() {
  Backend& be = m_.backend;
  const auto& buckets = m_.layout.buckets();
  for (std::size_t b = 0; b < buckets.size(); ++b) {
    const std::size_t at = buckets[b].shard_offset, n = buckets[b].shard_size;
    if (m_.plan.params_on_host) {  // the shard lives on the host: written in place
      be.host_convert(m_.master + at, DType::fp32, m_.param_shard + at * m_.p_size, m_.pdt, n);
      continue;
    }
    if (m_.plan.uploads_master) {  // rounded on the device, as after every step
      send_master(b, 0, MasterUse::params);
      if (b + 1 == buckets.size()) m_.order_after(be.compute_stream(), be.comm_stream());
      continue;
    }
    be.host_convert(m_.master + at, DType::fp32, copy_host_ + at * m_.p_size, m_.pdt, n);
    m_.copy_to_device(m_.own_params(b), copy_host_ + at * m_.p_size, n * m_.p_size, be.compute_stream());
  }
}

}  // namespace zero::detail
