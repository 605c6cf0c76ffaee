#include "zero/engine/engine.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <limits>
#include <functional>
#include <map>
#include <thread>
#include <utility>

#include <omp.h>

#include "zero/io/safetensors.hpp"

namespace zero {

void EngineOptions::validate() const {
  ZERO_CHECK(stage >= 0 && stage <= 3, "EngineOptions.stage must be 0, 1, 2 or 3, got ", stage);
  check_dtype(param_dtype, "EngineOptions.param_dtype");
  check_dtype(effective_grad_dtype(), "EngineOptions.grad_dtype");
  ZERO_CHECK(bucket_bytes >= 1, "EngineOptions.bucket_bytes must be >= 1");
  ZERO_CHECK(alignment_elements >= 1, "EngineOptions.alignment_elements must be >= 1, got ",
             alignment_elements);
  ZERO_CHECK(accumulation_steps >= 1, "EngineOptions.accumulation_steps must be >= 1, got ",
             accumulation_steps);
  ZERO_CHECK(accumulation == GradAccumulation::reduce_each_micro_step ||
                 accumulation == GradAccumulation::reduce_at_boundary,
             "EngineOptions.accumulation: unknown mode ", static_cast<int>(accumulation));
  ZERO_CHECK(std::isfinite(max_grad_norm) && max_grad_norm >= 0,
             "EngineOptions.max_grad_norm must be finite and >= 0 (0 disables), got ", max_grad_norm);
  ZERO_CHECK(max_reductions_in_flight >= 1, "EngineOptions.max_reductions_in_flight must be >= 1, got ",
             max_reductions_in_flight);
  ZERO_CHECK(ema_decay >= 0 && ema_decay < 1, "EngineOptions.ema_decay must be in [0, 1) (0 disables), got ",
             ema_decay);
  ZERO_CHECK(max_consecutive_nonfinite >= 0, "EngineOptions.max_consecutive_nonfinite must be >= 0");
  ZERO_CHECK(!offload_optimizer || stage >= 1, "EngineOptions.offload_optimizer needs stage 1, 2 or 3, got stage ",
             stage, " (stage 0 keeps the whole optimizer on every rank)");
  ZERO_CHECK(!offload_params || (stage == 3 && offload_optimizer),
             "EngineOptions.offload_params needs stage 3 with offload_optimizer, got stage ", stage,
             offload_optimizer ? "" : " without offload_optimizer",
             " (below stage 3 every rank keeps the full parameters on the device)");
  ZERO_CHECK(!offload_delayed_update || (offload_optimizer && accumulation_steps == 1 && !offload_params),
             "EngineOptions.offload_delayed_update needs offload_optimizer with accumulation_steps 1 and without "
             "offload_params, got ",
             offload_optimizer ? "" : "no offload_optimizer, ", "accumulation_steps ", accumulation_steps,
             offload_params ? ", offload_params" : "");
  ZERO_CHECK(delayed_update_warmup_steps >= 0, "EngineOptions.delayed_update_warmup_steps must be >= 0, got ",
             delayed_update_warmup_steps);
  optimizer.validate();
  if (effective_loss_scaling()) loss_scaler.validate();
}

namespace {
enum Category { kParams, kGrads, kMaster, kState, kEma, kBuffers, kCategories };

struct Pending {
  std::size_t bucket;
  WorkPtr work;
  void* scratch = nullptr;       // reduced values still to be added to the accumulator
  std::size_t scratch_bytes = 0;
};
}  // namespace

struct Engine::Impl {
  Communicator& comm;
  Backend& backend;
  const FlatLayout& layout;
  const EngineOptions& options;
  int rank, world, stage;
  DType pdt, gdt;
  std::size_t p_size, g_size;
  bool full_grads = false;        // backward writes into one full gradient buffer
  bool shard_accumulator = false; // reduced gradients accumulate in a shard buffer
  bool reduce_only_at_boundary = false;
  bool offload = false;           // master, state0/1 and ema are pinned host memory
  bool offload_params = false;    // param_shard is pinned host memory (stage 3)
  bool stream_grads = false;      // reduced gradients go down to grad_host during backward

  // Gradient downloads in flight (stream_grads): the device scratch holding a
  // bucket's reduced slice is reused only once its copy has landed.
  struct Download {
    std::byte* scratch = nullptr;  // null when the slice was reduced in place (stage 1)
    std::size_t bytes = 0;
    Event copied = nullptr;
  };
  std::deque<Download> downloads;

  // Offload staging (pinned host): the reduced gradient shard copied down,
  // and the updated model-dtype shard to copy back up.
  std::byte* grad_host = nullptr;
  std::byte* copy_host = nullptr;  // copies[0]; delayed updates alternate between copies[0] and [1]
  std::array<std::size_t, kCategories> host_current{}, host_peak{};

  // Persistent buffers (backend memory).
  std::byte* params_full = nullptr;   // stages 0-2
  std::byte* param_shard = nullptr;   // stage 3
  float* master = nullptr;            // stage 0: full; 1-3: shard; null when params are fp32
  float* state0 = nullptr;
  float* state1 = nullptr;
  float* ema = nullptr;               // like master, when EMA is on
  bool ema_initialized = false;
  std::byte* grads_full = nullptr;
  std::byte* grad_shard = nullptr;

  std::array<std::size_t, kCategories> current{}, peak{};
  std::map<std::size_t, std::vector<void*>> free_blocks;  // reusable transient blocks by size
  std::size_t free_bytes = 0;
  // Free blocks kept for reuse at most: two of the largest bucket. More would
  // let stage 3's released units pile up into a full copy of the model.
  std::size_t cache_limit = 0;

  // Per micro-step bookkeeping.
  std::vector<char> param_ready;
  std::vector<std::size_t> bucket_ready_count;
  std::vector<char> bucket_reduced;         // this micro-step
  std::vector<char> accumulator_has_data;   // this step
  std::vector<std::byte*> bucket_buffer;    // transient per-bucket grad buffers
  std::deque<Pending> pending;

  // Stages 1-2: the parameter all-gather of each bucket after a step, left
  // in flight so that it overlaps the next forward; waited for per bucket on
  // first use (gather_unit / param_data) or before anything else touches
  // the parameters.
  std::vector<WorkPtr> param_gathers;

  void finish_param_gather(std::size_t b) {
    if (!param_gathers[b]) return;
    param_gathers[b]->wait();
    param_gathers[b].reset();
    Event done = backend.record_event(backend.comm_stream());
    backend.stream_wait(backend.compute_stream(), done);
    backend.release_event(done);
  }
  void finish_param_gathers() {
    for (std::size_t b = 0; b < param_gathers.size(); ++b) finish_param_gather(b);
  }

  // Stage 3 gathers.
  std::vector<std::byte*> unit_buffer;
  std::vector<int> unit_refs;
  std::vector<WorkPtr> unit_work;

  Impl(Communicator& c, Backend& b, const FlatLayout& l, const EngineOptions& o)
      : comm(c), backend(b), layout(l), options(o) {}

  ~Impl() {
    if (update_thread.joinable()) update_thread.join();  // its error, if any, has no one left to go to
    for (Event& e : copy_uploaded)
      if (e) {
        backend.wait_event(e);
        backend.release_event(e);
      }
    pending.clear();  // Work destructors wait
    param_gathers.clear();
    unit_work.clear();
    auto release_ptr = [&](void* p, std::size_t bytes) {
      if (p) backend.deallocate(p, bytes);
    };
    for (auto& [bytes, blocks] : free_blocks)
      for (void* p : blocks) release_ptr(p, bytes);
    for (std::size_t b = 0; b < bucket_buffer.size(); ++b)
      release_ptr(bucket_buffer[b], layout.buckets()[b].padded * g_size);
    for (std::size_t u = 0; u < unit_buffer.size(); ++u)
      release_ptr(unit_buffer[u], layout.buckets()[u].padded * p_size);
    const std::size_t full = layout.padded_numel(), shard = layout.shard_numel();
    const std::size_t optimizer_elements = stage == 0 ? full : shard;
    release_ptr(params_full, full * p_size);
    for (Download& d : downloads) {
      backend.wait_event(d.copied);
      backend.release_event(d.copied);
      release_ptr(d.scratch, d.bytes);
    }
    auto release_host = [&](void* p, std::size_t bytes) {
      if (p) backend.deallocate_host(p, bytes);
    };
    if (offload_params) release_host(param_shard, shard * p_size);
    else release_ptr(param_shard, shard * p_size);
    for (float* state : {master, state0, state1, ema}) {
      if (offload) release_host(state, optimizer_elements * 4);
      else release_ptr(state, optimizer_elements * 4);
    }
    release_host(grad_host, shard * g_size);
    release_host(grad_host_spare, shard * g_size);
    release_host(copies[0], shard * p_size);
    release_host(copies[1], shard * p_size);
    release_ptr(grads_full, full * g_size);
    release_ptr(grad_shard, shard * g_size);
  }

  // ---------------------------------------------------------------- accounting
  void count(Category c, std::ptrdiff_t delta) {
    current[c] = static_cast<std::size_t>(static_cast<std::ptrdiff_t>(current[c]) + delta);
    peak[c] = std::max(peak[c], current[c]);
  }
  template <typename T = std::byte>
  T* allocate(Category c, std::size_t bytes) {
    if (bytes == 0) return nullptr;
    void* p = backend.allocate(bytes);
    backend.fill_zero(p, bytes, backend.compute_stream());
    count(c, static_cast<std::ptrdiff_t>(bytes));
    return static_cast<T*>(p);
  }
  template <typename T = std::byte>
  T* allocate_host(Category c, std::size_t bytes) {
    if (bytes == 0) return nullptr;
    void* p = backend.allocate_host(bytes);
    std::memset(p, 0, bytes);
    host_current[c] += bytes;
    host_peak[c] = std::max(host_peak[c], host_current[c]);
    return static_cast<T*>(p);
  }
  // Reads and writes of fp32 state slices from host memory: a plain copy when
  // the state is offloaded, a device transfer otherwise.
  void state_to_host(void* host_dst, const void* state, std::size_t bytes) {
    if (offload) std::memcpy(host_dst, state, bytes);
    else backend.copy_to_host(host_dst, state, bytes);
  }
  void state_from_host(void* state, const void* host_src, std::size_t bytes) {
    if (offload) std::memcpy(state, host_src, bytes);
    else backend.copy_from_host(state, host_src, bytes);
  }
  /// A transient block, zeroed; free blocks of the same size are reused.
  std::byte* acquire(Category c, std::size_t bytes, Stream stream) {
    auto& blocks = free_blocks[bytes];
    std::byte* p;
    if (!blocks.empty()) {
      p = static_cast<std::byte*>(blocks.back());
      blocks.pop_back();
      free_bytes -= bytes;
      count(kBuffers, -static_cast<std::ptrdiff_t>(bytes));
    } else {
      p = static_cast<std::byte*>(backend.allocate(bytes));
    }
    backend.fill_zero(p, bytes, stream);
    count(c, static_cast<std::ptrdiff_t>(bytes));
    return p;
  }
  /// Returns a transient block: kept for reuse (counted as buffers) while
  /// the cache is under its limit, freed otherwise.
  void give_back(Category c, void* p, std::size_t bytes) {
    count(c, -static_cast<std::ptrdiff_t>(bytes));
    if (free_bytes + bytes > cache_limit) {
      // The device path orders frees after the work queued on these streams.
      backend.synchronize(backend.comm_stream());
      backend.synchronize(backend.compute_stream());
      backend.deallocate(p, bytes);
      return;
    }
    count(kBuffers, static_cast<std::ptrdiff_t>(bytes));
    free_blocks[bytes].push_back(p);
    free_bytes += bytes;
  }

  // ---------------------------------------------------------------- addresses
  std::size_t own_offset(std::size_t b) const {  // rank's slice of bucket b, full coordinates
    const Bucket& bucket = layout.buckets()[b];
    return bucket.offset + static_cast<std::size_t>(rank) * bucket.shard_size;
  }
  bool reduces_in_place() const { return !shard_accumulator; }
  /// The reduced (averaged) gradient of this rank's slice of bucket b.
  std::byte* reduced_grad(std::size_t b) const {
    if (reduces_in_place()) return grads_full + own_offset(b) * g_size;
    return grad_shard + layout.buckets()[b].shard_offset * g_size;
  }
  /// The fp32 master values of this rank's slice of bucket b.
  float* master_slice(std::size_t b) const {
    const Bucket& bucket = layout.buckets()[b];
    if (offload) return master + bucket.shard_offset;
    if (pdt != DType::fp32) {
      return master + (stage == 0 ? own_offset(b) : bucket.shard_offset);
    }
    if (stage == 3) return reinterpret_cast<float*>(param_shard) + bucket.shard_offset;
    return reinterpret_cast<float*>(params_full) + own_offset(b);
  }

  /// This rank's slice of bucket b in an fp32 buffer laid out like the
  /// optimizer state: full at stage 0, a shard otherwise.
  float* optimizer_slice(float* base, std::size_t b) const {
    return base + (stage == 0 ? own_offset(b) : layout.buckets()[b].shard_offset);
  }

  // ---------------------------------------------------------------- reductions
  void issue_reduce(std::size_t b) {
    const Bucket& bucket = layout.buckets()[b];
    const std::byte* input =
        full_grads ? grads_full + bucket.offset * g_size : bucket_buffer[b];
    ZERO_ASSERT(input != nullptr || bucket.padded == 0, "bucket ", b, " has no gradient buffer");
    Pending entry{b, nullptr};
    void* destination;
    if (reduces_in_place()) {
      destination = grads_full + own_offset(b) * g_size;
    } else if (stream_grads && world == 1) {
      // One rank: the average is the gradient itself, copied down straight
      // from the bucket buffer in complete() (no scratch, no collective).
      destination = nullptr;
    } else if (stream_grads) {  // no device shard: reduce into scratch, copied down in complete()
      entry.scratch_bytes = bucket.shard_size * g_size;
      entry.scratch = acquire(kBuffers, entry.scratch_bytes, backend.comm_stream());
      destination = entry.scratch;
    } else if (!accumulator_has_data[b]) {
      destination = grad_shard + bucket.shard_offset * g_size;
      accumulator_has_data[b] = 1;
    } else {
      entry.scratch_bytes = bucket.shard_size * g_size;
      entry.scratch = acquire(kBuffers, entry.scratch_bytes, backend.comm_stream());
      destination = entry.scratch;
    }
    // The gradients were written on the compute stream.
    Event ready = backend.record_event(backend.compute_stream());
    backend.stream_wait(backend.comm_stream(), ready);
    backend.release_event(ready);
    if (destination)
      entry.work = comm.reduce_scatter(input, destination, bucket.shard_size, gdt, ReduceOp::avg, backend.comm_stream());
    bucket_reduced[b] = 1;
    pending.push_back(std::move(entry));
    // Bound the memory of reductions in flight (their input buffers and the
    // communicator's scratch): complete the oldest beyond the limit.
    while (pending.size() > static_cast<std::size_t>(options.max_reductions_in_flight)) {
      complete(pending.front());
      pending.pop_front();
    }
  }

  void complete(Pending& entry) {
    if (entry.work) entry.work->wait();
    const Bucket& bucket = layout.buckets()[entry.bucket];
    if (stream_grads) {
      // The reduced slice goes down now, overlapping the rest of backward;
      // the device block it is read from is held until the copy lands.
      Download d{static_cast<std::byte*>(entry.scratch), entry.scratch_bytes, nullptr};
      const void* reduced = entry.scratch;
      if (!entry.scratch && reduces_in_place()) {
        reduced = reduced_grad(entry.bucket);
      } else if (!entry.scratch) {  // one rank: the bucket buffer itself
        d.scratch = bucket_buffer[entry.bucket];
        d.bytes = bucket.padded * g_size;
        bucket_buffer[entry.bucket] = nullptr;
        reduced = d.scratch;
      }
      backend.copy(grad_host + bucket.shard_offset * g_size, reduced, bucket.shard_size * g_size,
                   backend.comm_stream());
      d.copied = backend.record_event(backend.comm_stream());
      downloads.push_back(d);
      entry.scratch = nullptr;
      while (downloads.size() > static_cast<std::size_t>(options.max_reductions_in_flight)) retire_download();
    }
    if (entry.scratch) {
      backend.accumulate(grad_shard + bucket.shard_offset * g_size, entry.scratch, gdt,
                         bucket.shard_size, backend.comm_stream());
      give_back(kBuffers, entry.scratch, entry.scratch_bytes);
    }
    if (!full_grads && bucket_buffer[entry.bucket]) {
      give_back(kBuffers, bucket_buffer[entry.bucket], bucket.padded * g_size);
      bucket_buffer[entry.bucket] = nullptr;
    }
  }

  void retire_download() {
    Download d = downloads.front();
    downloads.pop_front();
    backend.wait_event(d.copied);
    backend.release_event(d.copied);
    if (d.scratch) give_back(kBuffers, d.scratch, d.bytes);
  }

  /// The CPU update of this rank's slice of bucket b from the gradients at
  /// grads (a shard laid out like grad_host): master, state and EMA, and the
  /// model-dtype values written to copy (a shard like copy_host) or, with
  /// offloaded parameters, to the parameter shard itself.
  void cpu_update_bucket(std::size_t b, const OptimizerOptions& opt, const StepScalars& scalars, double ema_decay,
                         const std::byte* grads, std::byte* copy) {
    const Bucket& bucket = layout.buckets()[b];
    const std::size_t at = bucket.shard_offset, n = bucket.shard_size;
    ShardUpdate u;
    u.master = master + at;
    u.grad = grads + at * g_size;
    u.grad_dtype = gdt;
    u.state0 = state0 ? state0 + at : nullptr;
    u.state1 = state1 ? state1 + at : nullptr;
    // Offloaded parameters are updated where they live; nothing goes up.
    u.model_copy = offload_params ? param_shard + at * p_size : copy + at * p_size;
    u.model_dtype = pdt;
    // In slices that fit the CPU's last-level cache, so the EMA reads the
    // master weights the update just wrote from cache, not from DRAM
    // (element-wise kernels: the same bits as one call over the bucket).
    constexpr std::size_t kSlice = std::size_t{2} << 20;  // 2M elements: ~40 MB of operands
    for (std::size_t lo = 0; lo < n; lo += kSlice) {
      const std::size_t count = std::min(kSlice, n - lo);
      ShardUpdate part = u;
      part.master = u.master + lo;
      part.grad = static_cast<const std::byte*>(u.grad) + lo * g_size;
      part.state0 = u.state0 ? u.state0 + lo : nullptr;
      part.state1 = u.state1 ? u.state1 + lo : nullptr;
      part.model_copy = u.model_copy ? static_cast<std::byte*>(u.model_copy) + lo * p_size : nullptr;
      part.count = count;
      cpu_optimizer_step(opt, scalars, part, CpuKernel::vectorized);
      if (ema) cpu_ema_update(ema + at + lo, master + at + lo, count, ema_decay);
    }
  }

  /// Bucket b's updated model-dtype slice from the host copy up into this
  /// rank's place on the device; stages 1-2 then start its all-gather (left
  /// in flight like the device path's).
  void upload_bucket(std::size_t b, const std::byte* copy, std::vector<WorkPtr>& gathers) {
    const Bucket& bucket = layout.buckets()[b];
    const std::size_t at = bucket.shard_offset, n = bucket.shard_size;
    const Stream transfer = backend.comm_stream();
    std::byte* target = stage == 3 ? param_shard + at * p_size : params_full + own_offset(b) * p_size;
    backend.copy(target, copy + at * p_size, n * p_size, transfer);
    if (stage <= 2)
      gathers[b] = comm.all_gather(params_full + own_offset(b) * p_size, params_full + bucket.offset * p_size, n, pdt,
                                   transfer);
  }
  void finish_uploads() {
    if (stage == 3 && !offload_params) {  // the next forward's gathers read param_shard on the comm stream: already ordered
      Event up = backend.record_event(backend.comm_stream());
      backend.stream_wait(backend.compute_stream(), up);
      backend.release_event(up);
    }
  }

  /// The optimizer step with offloaded state (stages 1-3): per bucket, the
  /// reduced gradient slice goes down to pinned host memory (comm stream),
  /// the CPU updates master, state and EMA and writes the model-dtype copy,
  /// which goes back up into this rank's slice. All transfers are queued on
  /// the comm stream up front or as each bucket is done, so bucket b's
  /// update overlaps b+1's download and b-1's upload.
  void offload_step(const OptimizerOptions& opt, const StepScalars& scalars, double ema_decay,
                    std::vector<WorkPtr>& gathers) {
    const auto& buckets = layout.buckets();
    const Stream transfer = backend.comm_stream();
    // The last step's uploads read copy_host: they must be done before it is rewritten.
    backend.synchronize(transfer);
    std::vector<Event> down(buckets.size(), nullptr);
    try {
      // Streamed gradients are already down (finish_micro_step waited for them).
      for (std::size_t b = 0; b < buckets.size() && !stream_grads; ++b) {
        const Bucket& bucket = buckets[b];
        backend.copy(grad_host + bucket.shard_offset * g_size, reduced_grad(b), bucket.shard_size * g_size, transfer);
        down[b] = backend.record_event(transfer);
      }
      for (std::size_t b = 0; b < buckets.size(); ++b) {
        if (down[b]) {
          backend.wait_event(down[b]);
          backend.release_event(down[b]);
          down[b] = nullptr;
        }
        cpu_update_bucket(b, opt, scalars, ema_decay, grad_host, copy_host);
        if (!offload_params) upload_bucket(b, copy_host, gathers);
      }
    } catch (...) {
      for (Event e : down) backend.release_event(e);
      throw;
    }
    finish_uploads();
  }

  // ------------------------------------------------ delayed parameter update
  // Two gradient shards (backward streams into grad_host while the update
  // reads the other) and two parameter copies (the update writes one while
  // the other may still be going up).
  bool delayed = false;
  std::byte* grad_host_spare = nullptr;
  std::array<std::byte*, 2> copies{};
  std::array<Event, 2> copy_uploaded{};  // the last upload out of copies[i]
  int update_copy = 0;                   // the copy the running (or finished) update writes
  std::thread update_thread;
  std::exception_ptr update_error;
  double update_seconds = 0;
  bool upload_pending = false;           // an update finished (or running) whose values are not up yet

  /// Starts the CPU update of the gradients in grad_host on a background
  /// thread; the next backward streams into the other gradient shard.
  void start_delayed_update(const OptimizerOptions& opt, const StepScalars& scalars, double ema_decay) {
    ZERO_ASSERT(!update_thread.joinable(), "a delayed update is already running");
    std::swap(grad_host, grad_host_spare);
    const std::byte* grads = grad_host_spare;
    update_copy ^= 1;
    if (copy_uploaded[update_copy]) {  // queued a step ago: normally long done
      backend.wait_event(copy_uploaded[update_copy]);
      backend.release_event(copy_uploaded[update_copy]);
      copy_uploaded[update_copy] = nullptr;
    }
    std::byte* copy = copies[update_copy];
    upload_pending = true;
    update_error = nullptr;
    update_thread = std::thread([this, opt, scalars, ema_decay, grads, copy] {
      const auto start = std::chrono::steady_clock::now();
      try {
        // Leave a core to the thread that drives the device meanwhile.
        omp_set_num_threads(std::max(1, omp_get_max_threads() - 1));
        for (std::size_t b = 0; b < layout.buckets().size(); ++b)
          cpu_update_bucket(b, opt, scalars, ema_decay, grads, copy);
      } catch (...) {
        update_error = std::current_exception();
      }
      update_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    });
  }
  /// Waits for the background update; rethrows what it threw. Returns the seconds waited.
  double join_delayed_update() {
    if (!update_thread.joinable()) return 0;
    const auto start = std::chrono::steady_clock::now();
    update_thread.join();
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (update_error) {
      upload_pending = false;
      std::rethrow_exception(std::exchange(update_error, nullptr));
    }
    return waited;
  }
  /// Queues the finished update's parameters up (and their gathers).
  void upload_delayed_update(std::vector<WorkPtr>& gathers) {
    if (!upload_pending) return;
    ZERO_ASSERT(!update_thread.joinable(), "upload before the delayed update was joined");
    // The device may still be running backward, which reads the parameters.
    Event computed = backend.record_event(backend.compute_stream());
    backend.stream_wait(backend.comm_stream(), computed);
    backend.release_event(computed);
    for (std::size_t b = 0; b < layout.buckets().size(); ++b) upload_bucket(b, copies[update_copy], gathers);
    copy_uploaded[update_copy] = backend.record_event(backend.comm_stream());
    finish_uploads();
    upload_pending = false;
  }
  /// Before anything reads or writes the state: the pending update joined and uploaded.
  void settle_delayed_update(std::vector<WorkPtr>& gathers) {
    if (!delayed) return;
    join_delayed_update();
    upload_delayed_update(gathers);
  }

  void complete_all() {
    while (!pending.empty()) {
      complete(pending.front());
      pending.pop_front();
    }
    while (!downloads.empty()) retire_download();
    Event done = backend.record_event(backend.comm_stream());
    backend.stream_wait(backend.compute_stream(), done);
    backend.release_event(done);
  }
};

// ---------------------------------------------------------------- construction

Engine::Engine(std::vector<ParamSpec> params, const EngineOptions& options, Communicator& comm,
               Backend& backend)
    : Engine(FlatLayout::build(params, {.world_size = comm.size(),
                                        .alignment = options.alignment_elements,
                                        .bucket_elements = std::max<std::size_t>(
                                            1, options.bucket_bytes / size_of(options.param_dtype))}),
             options, comm, backend) {}

Engine::Engine(std::vector<std::vector<ParamSpec>> groups, const EngineOptions& options,
               Communicator& comm, Backend& backend)
    : Engine(FlatLayout::build_grouped(groups, {.world_size = comm.size(),
                                                .alignment = options.alignment_elements,
                                                .bucket_elements = 1}),
             options, comm, backend) {}

Engine::Engine(FlatLayout layout, const EngineOptions& options, Communicator& comm, Backend& backend)
    : options_(options),
      layout_(std::move(layout)),
      rank_(comm.rank()),
      world_(comm.size()),
      lr_(options.optimizer.lr),
      scaler_(options.effective_loss_scaling() ? options.loss_scaler : LossScalerOptions{.dynamic = false, .initial_scale = 1.0}) {
  options_.validate();
  ZERO_CHECK(comm.memory_kind() == backend.memory_kind(), "communicator '", comm.backend_name(),
             "' works on ", comm.memory_kind() == MemoryKind::host ? "host" : "device",
             " memory but backend '", backend.name(), "' allocates ",
             backend.memory_kind() == MemoryKind::host ? "host" : "device", " memory");
  // Every rank must build the same layout; a mismatch would silently pair
  // different parameters in the collectives.
  std::array<double, 3> mine = {static_cast<double>(layout_.padded_numel()),
                                static_cast<double>(layout_.params().size()),
                                static_cast<double>(options_.stage)};
  std::array<double, 3> low = mine, high = mine;
  comm.all_reduce_host_f64(low.data(), 3, ReduceOp::min);
  comm.all_reduce_host_f64(high.data(), 3, ReduceOp::max);
  ZERO_CHECK(low == high, "ranks disagree on the model: this rank has ", layout_.params().size(),
             " parameters (", layout_.padded_numel(), " padded elements, stage ", options_.stage,
             "), others between ", low[1], " and ", high[1], " parameters (", low[0], " to ",
             high[0], " elements, stage ", low[2], " to ", high[2], ")");

  impl_ = std::make_unique<Impl>(comm, backend, layout_, options_);
  Impl& m = *impl_;
  m.rank = rank_;
  m.world = world_;
  m.stage = options_.stage;
  m.pdt = options_.param_dtype;
  m.gdt = options_.effective_grad_dtype();
  m.p_size = size_of(m.pdt);
  m.g_size = size_of(m.gdt);
  const bool multi = options_.accumulation_steps > 1;
  const bool at_boundary = options_.accumulation == GradAccumulation::reduce_at_boundary;
  m.full_grads = m.stage <= 1 || (at_boundary && multi);
  m.shard_accumulator = m.stage >= 2 || (!at_boundary && multi);
  m.reduce_only_at_boundary = at_boundary && multi;

  const std::size_t full = layout_.padded_numel(), shard = layout_.shard_numel();
  const std::size_t optimizer_elements = m.stage == 0 ? full : shard;
  const int slots = options_.optimizer.state_slots();
  m.offload = options_.offload_optimizer;
  m.offload_params = options_.offload_params;
  m.stream_grads = options_.streams_gradients_to_host();
  if (m.stage < 3) m.params_full = m.allocate(kParams, full * m.p_size);
  else if (m.offload_params) m.param_shard = m.allocate_host(kParams, shard * m.p_size);
  else m.param_shard = m.allocate(kParams, shard * m.p_size);
  if (m.offload) {
    m.master = m.allocate_host<float>(kMaster, shard * 4);  // also for fp32 parameters
    if (slots >= 1) m.state0 = m.allocate_host<float>(kState, shard * 4);
    if (slots >= 2) m.state1 = m.allocate_host<float>(kState, shard * 4);
    if (options_.ema_decay > 0) m.ema = m.allocate_host<float>(kEma, shard * 4);
    m.grad_host = m.allocate_host(kBuffers, shard * m.g_size);
    if (!m.offload_params) m.copy_host = m.copies[0] = m.allocate_host(kBuffers, shard * m.p_size);
    m.delayed = options_.offload_delayed_update;
    if (m.delayed) {
      m.grad_host_spare = m.allocate_host(kBuffers, shard * m.g_size);
      m.copies[1] = m.allocate_host(kBuffers, shard * m.p_size);
    }
  } else {
    if (m.pdt != DType::fp32) m.master = m.allocate<float>(kMaster, optimizer_elements * 4);
    if (slots >= 1) m.state0 = m.allocate<float>(kState, optimizer_elements * 4);
    if (slots >= 2) m.state1 = m.allocate<float>(kState, optimizer_elements * 4);
    if (options_.ema_decay > 0) m.ema = m.allocate<float>(kEma, optimizer_elements * 4);
  }
  if (m.full_grads) m.grads_full = m.allocate(kGrads, full * m.g_size);
  if (m.shard_accumulator && !m.stream_grads) m.grad_shard = m.allocate(kGrads, shard * m.g_size);

  std::size_t largest_bucket = 0;
  for (const Bucket& b : layout_.buckets()) largest_bucket = std::max(largest_bucket, b.padded);
  m.cache_limit = options_.buffer_cache_bytes.value_or(2 * largest_bucket * std::max(m.p_size, m.g_size));
  const std::size_t buckets = layout_.buckets().size();
  m.param_ready.assign(layout_.params().size(), 0);
  m.bucket_ready_count.assign(buckets, 0);
  m.bucket_reduced.assign(buckets, 0);
  m.accumulator_has_data.assign(buckets, 0);
  m.bucket_buffer.assign(buckets, nullptr);
  m.unit_buffer.assign(buckets, nullptr);
  m.unit_refs.assign(buckets, 0);
  m.unit_work.resize(buckets);
  m.param_gathers.resize(buckets);
}

// Impl refers to layout_ and options_: it must go before they do.
Engine::~Engine() { impl_.reset(); }

// ---------------------------------------------------------------- parameters

void Engine::set_param(std::size_t param, const float* host_values) {
  ZERO_CHECK(param < layout_.params().size(), "set_param: parameter index ", param, " of ",
             layout_.params().size());
  Impl& m = *impl_;
  m.settle_delayed_update(m.param_gathers);
  m.finish_param_gathers();
  const ParamSlot& slot = layout_.slots()[param];
  ZERO_CHECK(host_values != nullptr || slot.numel == 0, "set_param('", layout_.params()[param].name,
             "'): null values");
  std::vector<std::byte> rounded(slot.numel * m.p_size);
  for (std::size_t i = 0; i < slot.numel; ++i) store_from_float(rounded.data(), i, m.pdt, host_values[i]);
  const Bucket& bucket = layout_.buckets()[slot.bucket];
  const std::size_t own = m.own_offset(slot.bucket);
  // The part of the parameter inside this rank's slice, in full coordinates.
  const std::size_t lo = std::max(slot.offset, own);
  const std::size_t hi = std::min(slot.offset + slot.numel, own + bucket.shard_size);
  if (m.stage < 3) {
    m.backend.copy_from_host(m.params_full + slot.offset * m.p_size, rounded.data(), rounded.size());
  } else if (lo < hi) {
    std::byte* out = m.param_shard + (bucket.shard_offset + lo - own) * m.p_size;
    const std::byte* in = rounded.data() + (lo - slot.offset) * m.p_size;
    if (m.offload_params) std::memcpy(out, in, (hi - lo) * m.p_size);
    else m.backend.copy_from_host(out, in, (hi - lo) * m.p_size);
  }
  if (m.pdt == DType::fp32 && !m.offload) return;
  if (m.stage == 0) {
    m.backend.copy_from_host(m.master + slot.offset, host_values, slot.numel * 4);
  } else if (lo < hi) {
    m.state_from_host(m.master + bucket.shard_offset + (lo - own), host_values + (lo - slot.offset), (hi - lo) * 4);
  }
}

const void* Engine::param_data(std::size_t param) const {
  ZERO_CHECK(param < layout_.params().size(), "param_data: parameter index ", param, " of ",
             layout_.params().size());
  Impl& m = *impl_;
  const ParamSlot& slot = layout_.slots()[param];
  if (m.stage < 3) {
    m.finish_param_gather(slot.bucket);
    return m.params_full + slot.offset * m.p_size;
  }
  ZERO_CHECK(m.unit_refs[slot.bucket] > 0, "param_data('", layout_.params()[param].name,
             "'): its unit ", slot.bucket, " is not gathered (stage 3: call gather_unit first)");
  return m.unit_buffer[slot.bucket] + (slot.offset - layout_.buckets()[slot.bucket].offset) * m.p_size;
}

void Engine::prefetch_unit(std::size_t unit) {
  ZERO_CHECK(unit < unit_count(), "prefetch_unit: unit ", unit, " of ", unit_count());
  Impl& m = *impl_;
  if (m.stage < 3 || m.unit_buffer[unit]) return;
  const Bucket& bucket = layout_.buckets()[unit];
  m.unit_buffer[unit] = m.acquire(kParams, bucket.padded * m.p_size, m.backend.comm_stream());
  // The shard may have just been written by the optimizer on the compute stream.
  Event ready = m.backend.record_event(m.backend.compute_stream());
  m.backend.stream_wait(m.backend.comm_stream(), ready);
  m.backend.release_event(ready);
  const std::byte* own = m.param_shard + bucket.shard_offset * m.p_size;
  if (m.offload_params) {  // host shard: up into this rank's place, then gathered in place
    std::byte* place = m.unit_buffer[unit] + static_cast<std::size_t>(rank_) * bucket.shard_size * m.p_size;
    m.backend.copy(place, own, bucket.shard_size * m.p_size, m.backend.comm_stream());
    own = place;
  }
  m.unit_work[unit] = m.comm.all_gather(own, m.unit_buffer[unit], bucket.shard_size, m.pdt, m.backend.comm_stream());
}

void Engine::gather_unit(std::size_t unit) {
  ZERO_CHECK(unit < unit_count(), "gather_unit: unit ", unit, " of ", unit_count());
  Impl& m = *impl_;
  if (m.stage < 3) {
    m.finish_param_gather(unit);
    return;
  }
  prefetch_unit(unit);
  if (m.unit_work[unit]) {
    m.unit_work[unit]->wait();
    m.unit_work[unit].reset();
    Event done = m.backend.record_event(m.backend.comm_stream());
    m.backend.stream_wait(m.backend.compute_stream(), done);
    m.backend.release_event(done);
  }
  ++m.unit_refs[unit];
}

void Engine::release_unit(std::size_t unit) {
  ZERO_CHECK(unit < unit_count(), "release_unit: unit ", unit, " of ", unit_count());
  Impl& m = *impl_;
  if (m.stage < 3) return;
  ZERO_CHECK(m.unit_refs[unit] > 0, "release_unit: unit ", unit, " is not gathered");
  if (--m.unit_refs[unit] > 0) return;
  m.give_back(kParams, m.unit_buffer[unit], layout_.buckets()[unit].padded * m.p_size);
  m.unit_buffer[unit] = nullptr;
}

bool Engine::unit_gathered(std::size_t unit) const {
  return impl_->stage < 3 || impl_->unit_refs.at(unit) > 0;
}

// ---------------------------------------------------------------- gradients

void* Engine::grad_data(std::size_t param) {
  ZERO_CHECK(param < layout_.params().size(), "grad_data: parameter index ", param, " of ",
             layout_.params().size());
  Impl& m = *impl_;
  const ParamSlot& slot = layout_.slots()[param];
  ZERO_CHECK(!m.param_ready[param], "grad_data('", layout_.params()[param].name,
             "'): its gradient was already declared ready in this micro-step");
  ZERO_CHECK(micro_step_ < options_.accumulation_steps, "grad_data: all ", options_.accumulation_steps,
             " micro-steps of this step are done; call step() first");
  if (m.full_grads) return m.grads_full + slot.offset * m.g_size;
  const Bucket& bucket = layout_.buckets()[slot.bucket];
  if (!m.bucket_buffer[slot.bucket])
    m.bucket_buffer[slot.bucket] = m.acquire(kBuffers, bucket.padded * m.g_size, m.backend.compute_stream());
  return m.bucket_buffer[slot.bucket] + (slot.offset - bucket.offset) * m.g_size;
}

void Engine::grad_ready(std::size_t param) {
  ZERO_CHECK(param < layout_.params().size(), "grad_ready: parameter index ", param, " of ",
             layout_.params().size());
  Impl& m = *impl_;
  ZERO_CHECK(!m.param_ready[param], "grad_ready('", layout_.params()[param].name,
             "') called twice in one micro-step");
  ZERO_CHECK(micro_step_ < options_.accumulation_steps, "grad_ready: all ", options_.accumulation_steps,
             " micro-steps of this step are done; call step() first");
  const std::size_t b = layout_.slots()[param].bucket;
  if (!m.full_grads && !m.bucket_buffer[b]) grad_data(param);  // an unused parameter: zero gradient
  m.param_ready[param] = 1;
  if (++m.bucket_ready_count[b] < layout_.buckets()[b].param_count) return;
  const bool last_micro_step = micro_step_ + 1 == options_.accumulation_steps;
  if (m.reduce_only_at_boundary && !last_micro_step) return;
  m.issue_reduce(b);
}

void Engine::finish_micro_step() {
  Impl& m = *impl_;
  ZERO_CHECK(micro_step_ < options_.accumulation_steps, "finish_micro_step: all ",
             options_.accumulation_steps, " micro-steps of this step are done; call step() first");
  for (std::size_t p = 0; p < m.param_ready.size(); ++p)
    if (!m.param_ready[p]) grad_ready(p);
  m.complete_all();
  // Reducing every micro-step out of a full buffer (stages 0-1): it held only
  // this micro-step's local gradient, now in the accumulator.
  if (m.full_grads && m.shard_accumulator && !m.reduce_only_at_boundary)
    m.backend.fill_zero(m.grads_full, layout_.padded_numel() * m.g_size, m.backend.compute_stream());
  std::fill(m.param_ready.begin(), m.param_ready.end(), 0);
  std::fill(m.bucket_ready_count.begin(), m.bucket_ready_count.end(), 0);
  std::fill(m.bucket_reduced.begin(), m.bucket_reduced.end(), 0);
  ++micro_step_;
}

// ---------------------------------------------------------------- optimizer

StepResult Engine::step() {
  Impl& m = *impl_;
  ZERO_CHECK(micro_step_ == options_.accumulation_steps, "step() after ", micro_step_,
             " micro-steps; accumulation_steps is ", options_.accumulation_steps,
             " (call finish_micro_step() after each)");
  Backend& be = m.backend;
  const Stream compute = be.compute_stream();
  const auto& buckets = layout_.buckets();
  m.finish_param_gathers();  // the optimizer is about to write the parameters

  // Global statistics of the reduced gradients, each rank over the slices it
  // owns, summed in rank order: the same bits at every stage.
  GradStats local;
  using Clock = std::chrono::steady_clock;
  const auto stats_start = Clock::now();
  StepResult result;
  if (m.stream_grads) {  // the gradients are in host memory: summed there, the same way
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      const GradStats part = cpu_grad_stats(m.grad_host + buckets[b].shard_offset * m.g_size, buckets[b].shard_size, m.gdt);
      local.sum_squares += part.sum_squares;
      local.nonfinite = local.nonfinite || part.nonfinite;
    }
  } else {
    std::vector<Backend::Span> spans(buckets.size());
    for (std::size_t b = 0; b < buckets.size(); ++b) spans[b] = {m.reduced_grad(b), buckets[b].shard_size};
    local = be.grad_stats(spans.data(), spans.size(), m.gdt, compute);
  }
  if (m.stream_grads) result.cpu_grad_stats_seconds = std::chrono::duration<double>(Clock::now() - stats_start).count();
  std::array<double, 2> global = {local.sum_squares, local.nonfinite ? 1.0 : 0.0};
  m.comm.all_reduce_host_f64(global.data(), 2, ReduceOp::sum);
  const bool nonfinite = global[1] > 0 || !std::isfinite(global[0]);

  // The reduced gradient is the rank average of the sum over micro-steps of
  // (loss scale x gradient); the optimizer wants the plain mean.
  const double scale_used = scaler_.scale();
  const double divisor = scale_used * options_.accumulation_steps;
  const bool proceed = scaler_.update(nonfinite) && !nonfinite;
  if (m.delayed) {
    // The last step's update (run while this step's forward and backward
    // were on the device) is done before anything else touches the state,
    // and its parameters go up whether or not this step applies.
    const bool was_running = m.update_thread.joinable();
    result.cpu_update_wait_seconds = m.join_delayed_update();
    if (was_running) result.cpu_update_seconds = m.update_seconds;
    m.upload_delayed_update(m.param_gathers);
  }

  result.loss_scale = scaler_.scale();
  result.grad_norm = nonfinite ? std::numeric_limits<double>::infinity() : std::sqrt(global[0]) / divisor;
  if (proceed) {
    consecutive_nonfinite_ = 0;
    if (options_.max_grad_norm > 0 && result.grad_norm > options_.max_grad_norm)
      result.clip_coefficient = options_.max_grad_norm / (result.grad_norm + 1e-6);
    ++step_;
    const StepScalars scalars =
        make_step_scalars(options_.optimizer, step_, lr_, result.clip_coefficient / divisor);
    const bool copy = m.pdt != DType::fp32;
    const OptimizerOptions& opt = options_.optimizer;
    if (m.ema && !m.ema_initialized) {  // the average starts at the weights before the first update
      if (m.stage == 0)
        be.copy(m.ema, copy ? m.master : reinterpret_cast<float*>(m.params_full), layout_.padded_numel() * 4, compute);
      else if (m.offload)
        std::memcpy(m.ema, m.master, layout_.shard_numel() * 4);
      else
        for (std::size_t b = 0; b < buckets.size(); ++b)
          be.copy(m.optimizer_slice(m.ema, b), m.master_slice(b), buckets[b].shard_size * 4, compute);
      m.ema_initialized = true;
    }
    const double ema_decay = [&] {
      const double t = static_cast<double>(step_);
      return options_.ema_warmup ? std::min(options_.ema_decay, (1 + t) / (10 + t)) : options_.ema_decay;
    }();
    if (m.delayed && step_ > options_.delayed_update_warmup_steps) {
      m.start_delayed_update(opt, scalars, ema_decay);  // joined and uploaded at the next step()
    } else if (m.offload) {
      const auto update_start = Clock::now();
      m.offload_step(opt, scalars, ema_decay, m.param_gathers);
      result.cpu_update_seconds = std::chrono::duration<double>(Clock::now() - update_start).count();
    } else if (m.stage == 0) {
      // Every rank updates everything: it first needs every reduced slice.
      std::vector<WorkPtr> gathers;
      for (std::size_t b = 0; b < buckets.size(); ++b)
        gathers.push_back(m.comm.all_gather(m.reduced_grad(b), m.grads_full + buckets[b].offset * m.g_size,
                                            buckets[b].shard_size, m.gdt, be.comm_stream()));
      for (auto& g : gathers) g->wait();
      Event done = be.record_event(be.comm_stream());
      be.stream_wait(compute, done);
      be.release_event(done);
      ShardUpdate u;
      u.master = copy ? m.master : reinterpret_cast<float*>(m.params_full);
      u.grad = m.grads_full;
      u.grad_dtype = m.gdt;
      u.state0 = m.state0;
      u.state1 = m.state1;
      u.model_copy = copy ? m.params_full : nullptr;
      u.model_dtype = m.pdt;
      u.count = layout_.padded_numel();
      be.optimizer_step(opt, scalars, u, compute);
    } else {
      for (std::size_t b = 0; b < buckets.size(); ++b) {
        const std::size_t shard_offset = buckets[b].shard_offset;
        ShardUpdate u;
        u.master = m.master_slice(b);
        u.grad = m.reduced_grad(b);
        u.grad_dtype = m.gdt;
        u.state0 = m.state0 ? m.state0 + shard_offset : nullptr;
        u.state1 = m.state1 ? m.state1 + shard_offset : nullptr;
        if (copy) {
          u.model_copy = m.stage == 3 ? m.param_shard + shard_offset * m.p_size
                                      : m.params_full + m.own_offset(b) * m.p_size;
        }
        u.model_dtype = m.pdt;
        u.count = buckets[b].shard_size;
        be.optimizer_step(opt, scalars, u, compute);
      }
    }
    if (m.ema && !m.offload) {
      // Stage 0 updates every slice (it holds them all); the others their own.
      if (m.stage == 0) be.ema_update(m.ema, copy ? m.master : reinterpret_cast<float*>(m.params_full),
                                      layout_.padded_numel(), ema_decay, compute);
      else
        for (std::size_t b = 0; b < buckets.size(); ++b)
          be.ema_update(m.optimizer_slice(m.ema, b), m.master_slice(b), buckets[b].shard_size, ema_decay, compute);
    }
    if (m.offload) {
      // offload_step brought the parameters back and started the gathers.
    } else if (m.stage != 0) {
      if (m.stage <= 2) {
        // Bring every rank's updated slices back into the full parameters.
        Event updated = be.record_event(compute);
        be.stream_wait(be.comm_stream(), updated);
        be.release_event(updated);
        // Left in flight: each bucket is waited for when first used.
        for (std::size_t b = 0; b < buckets.size(); ++b)
          m.param_gathers[b] = m.comm.all_gather(m.params_full + m.own_offset(b) * m.p_size,
                                                 m.params_full + buckets[b].offset * m.p_size,
                                                 buckets[b].shard_size, m.pdt, be.comm_stream());
      }
    }
  } else {
    ++skipped_total_;
    ++consecutive_nonfinite_;
  }
  result.applied = proceed;
  result.step = step_;

  if (m.grads_full) be.fill_zero(m.grads_full, layout_.padded_numel() * m.g_size, compute);
  if (m.grad_shard) be.fill_zero(m.grad_shard, layout_.shard_numel() * m.g_size, compute);
  std::fill(m.accumulator_has_data.begin(), m.accumulator_has_data.end(), 0);
  micro_step_ = 0;
  if (!proceed && options_.max_consecutive_nonfinite > 0 &&
      consecutive_nonfinite_ >= options_.max_consecutive_nonfinite) {
    ZERO_THROW(Error, consecutive_nonfinite_, " steps in a row had non-finite gradients (limit ",
               options_.max_consecutive_nonfinite, "); stopping. Master weights are untouched since step ",
               step_, ". Lower the learning rate or check the data.");
  }
  return result;
}

// ---------------------------------------------------------------- inspection

namespace {
std::vector<std::vector<float>> split_params(const FlatLayout& layout, const std::vector<float>& full) {
  std::vector<std::vector<float>> out(layout.params().size());
  for (std::size_t p = 0; p < out.size(); ++p) {
    const ParamSlot& slot = layout.slots()[p];
    out[p].assign(full.begin() + static_cast<std::ptrdiff_t>(slot.offset),
                  full.begin() + static_cast<std::ptrdiff_t>(slot.offset + slot.numel));
  }
  return out;
}
}  // namespace

std::vector<std::vector<float>> Engine::gather_master_params() {
  Impl& m = *impl_;
  return gather_fp32_slices([&m](std::size_t b) -> const float* { return m.master_slice(b); });
}

std::vector<std::vector<float>> Engine::gather_ema_params() {
  Impl& m = *impl_;
  ZERO_CHECK(m.ema != nullptr, "gather_ema_params: EMA is off (EngineOptions.ema_decay is 0)");
  if (!m.ema_initialized) return gather_master_params();  // no step yet: the average is the weights
  return gather_fp32_slices([&m](std::size_t b) -> const float* { return m.optimizer_slice(m.ema, b); });
}

std::vector<std::vector<float>> Engine::gather_optimizer_state(int slot) {
  Impl& m = *impl_;
  float* base = slot == 0 ? m.state0 : slot == 1 ? m.state1 : nullptr;
  ZERO_CHECK(base != nullptr, "gather_optimizer_state: the optimizer has no state tensor ", slot);
  return gather_fp32_slices([&m, base](std::size_t b) -> const float* { return m.optimizer_slice(base, b); });
}

std::vector<std::vector<float>> Engine::gather_fp32_slices(const std::function<const float*(std::size_t)>& slice) {
  Impl& m = *impl_;
  m.settle_delayed_update(m.param_gathers);
  m.finish_param_gathers();
  Backend& be = m.backend;
  const std::size_t full = layout_.padded_numel();
  std::vector<float> host(full);
  be.synchronize(be.compute_stream());
  float* gathered = static_cast<float*>(be.allocate(full * 4));
  try {
    std::vector<WorkPtr> works;
    for (std::size_t b = 0; b < layout_.buckets().size(); ++b) {
      const Bucket& bucket = layout_.buckets()[b];
      const float* source = slice(b);
      if (m.offload) {  // host memory: upload into this rank's place, then gather in place
        float* own = gathered + m.own_offset(b);
        be.copy(own, source, bucket.shard_size * 4, be.comm_stream());
        source = own;
      }
      works.push_back(m.comm.all_gather(source, gathered + bucket.offset, bucket.shard_size, DType::fp32,
                                        be.comm_stream()));
    }
    for (auto& w : works) w->wait();
    be.synchronize(be.comm_stream());
    be.copy_to_host(host.data(), gathered, full * 4);
  } catch (...) {
    be.deallocate(gathered, full * 4);
    throw;
  }
  be.deallocate(gathered, full * 4);
  return split_params(layout_, host);
}

std::vector<std::vector<float>> Engine::gather_model_params() {
  Impl& m = *impl_;
  m.settle_delayed_update(m.param_gathers);
  m.finish_param_gathers();
  Backend& be = m.backend;
  const std::size_t full = layout_.padded_numel();
  std::vector<std::byte> raw(full * m.p_size);
  be.synchronize(be.compute_stream());
  if (m.stage < 3) {
    be.copy_to_host(raw.data(), m.params_full, raw.size());
  } else {
    std::byte* gathered = static_cast<std::byte*>(be.allocate(raw.size()));
    try {
      std::vector<WorkPtr> works;
      for (std::size_t b = 0; b < layout_.buckets().size(); ++b) {
        const Bucket& bucket = layout_.buckets()[b];
        const std::byte* own = m.param_shard + bucket.shard_offset * m.p_size;
        if (m.offload_params) {  // host memory: upload into this rank's place, then gather in place
          std::byte* place = gathered + m.own_offset(b) * m.p_size;
          be.copy(place, own, bucket.shard_size * m.p_size, be.comm_stream());
          own = place;
        }
        works.push_back(m.comm.all_gather(own, gathered + bucket.offset * m.p_size, bucket.shard_size, m.pdt,
                                          be.comm_stream()));
      }
      for (auto& w : works) w->wait();
      be.synchronize(be.comm_stream());
      be.copy_to_host(raw.data(), gathered, raw.size());
    } catch (...) {
      be.deallocate(gathered, raw.size());
      throw;
    }
    be.deallocate(gathered, raw.size());
  }
  std::vector<float> host(full);
  for (std::size_t i = 0; i < full; ++i) host[i] = load_as_float(raw.data(), i, m.pdt);
  return split_params(layout_, host);
}

// ---------------------------------------------------------------- memory

MemoryByCategory Engine::memory() const {
  const Impl& m = *impl_;
  return {m.current[kParams], m.current[kGrads], m.current[kMaster], m.current[kState], m.current[kEma],
          m.current[kBuffers] + m.comm.workspace_bytes()};
}

MemoryByCategory Engine::peak_memory() const {
  const Impl& m = *impl_;
  return {m.peak[kParams], m.peak[kGrads], m.peak[kMaster], m.peak[kState], m.peak[kEma],
          m.peak[kBuffers] + m.comm.peak_workspace_bytes()};
}

MemoryByCategory Engine::host_memory() const {
  const Impl& m = *impl_;
  return {m.host_current[kParams], m.host_current[kGrads], m.host_current[kMaster], m.host_current[kState],
          m.host_current[kEma], m.host_current[kBuffers]};
}

ModelStateConfig model_state_config(const EngineOptions& o, std::size_t padded_numel, int world_size) {
  return {.numel = padded_numel,
          .world_size = world_size,
          .stage = o.stage,
          .param_dtype = o.param_dtype,
          .grad_dtype = o.effective_grad_dtype(),
          .optimizer = o.optimizer,
          .accumulation = o.accumulation,
          .accumulation_steps = o.accumulation_steps,
          .ema = o.ema_decay > 0,
          .offload_optimizer = o.offload_optimizer,
          .offload_params = o.offload_params,
          .offload_delayed_update = o.offload_delayed_update};
}

MemoryByCategory Engine::predicted_host_state() const {
  return host_model_state_bytes(model_state_config(options_, layout_.padded_numel(), world_));
}

MemoryByCategory Engine::predicted_model_state() const {
  return model_state_bytes(model_state_config(options_, layout_.padded_numel(), world_));
}

}  // namespace zero

// ---------------------------------------------------------------- checkpoints
// (kept with the engine: it needs the buffers' placement at every stage)

namespace zero {

namespace {

constexpr const char* kShardFormat = "zero.engine.shard";
constexpr int kShardVersion = 1;

nlohmann::json layout_json(const FlatLayout& layout) {
  nlohmann::json params = nlohmann::json::array(), groups = nlohmann::json::array();
  for (const ParamSpec& p : layout.params()) {
    nlohmann::json entry = {{"name", p.name}, {"numel", p.numel}};
    // The shape, where the model gave one, lets a consolidated file carry real
    // tensor shapes. Files from before it have name and numel only.
    if (!p.shape.empty()) entry["shape"] = p.shape;
    params.push_back(std::move(entry));
  }
  for (const Bucket& b : layout.buckets()) groups.push_back(b.param_count);
  return {{"world_size", layout.world_size()}, {"alignment", layout.alignment()},
          {"padded_numel", layout.padded_numel()}, {"params", params}, {"bucket_param_counts", groups}};
}

}  // namespace

void Engine::save_state(const std::string& path, const std::vector<std::pair<std::string, std::string>>& metadata) {
  Impl& m = *impl_;
  Backend& be = m.backend;
  ZERO_CHECK(micro_step_ == 0, "save_state: in the middle of a step (", micro_step_,
             " micro-steps done); save between steps");
  m.settle_delayed_update(m.param_gathers);
  m.finish_param_gathers();
  be.synchronize(be.compute_stream());
  const std::size_t shard = layout_.shard_numel();
  auto collect = [&](auto slice_of) {
    std::vector<float> host(shard);
    for (std::size_t b = 0; b < layout_.buckets().size(); ++b)
      m.state_to_host(host.data() + layout_.buckets()[b].shard_offset, slice_of(b), layout_.buckets()[b].shard_size * 4);
    return host;
  };
  std::vector<std::pair<std::string, std::vector<float>>> tensors;
  tensors.emplace_back("master", collect([&](std::size_t b) { return m.master_slice(b); }));
  if (m.state0) tensors.emplace_back("state0", collect([&](std::size_t b) { return m.optimizer_slice(m.state0, b); }));
  if (m.state1) tensors.emplace_back("state1", collect([&](std::size_t b) { return m.optimizer_slice(m.state1, b); }));
  if (m.ema && m.ema_initialized)
    tensors.emplace_back("ema", collect([&](std::size_t b) { return m.optimizer_slice(m.ema, b); }));
  std::vector<io::TensorView> views;
  for (auto& [name, data] : tensors)
    views.push_back({name, io::TensorDType::F32, {static_cast<std::int64_t>(data.size())}, data.data()});

  nlohmann::json state = {{"format", kShardFormat},
                          {"version", kShardVersion},
                          {"rank", rank_},
                          {"stage", options_.stage},
                          {"param_dtype", std::string(name_of(options_.param_dtype))},
                          {"optimizer", std::string(name_of(options_.optimizer.kind))},
                          {"state_slots", options_.optimizer.state_slots()},
                          {"step", step_},
                          {"skipped_total", skipped_total_},
                          {"consecutive_nonfinite", consecutive_nonfinite_},
                          {"loss_scale", scaler_.scale()},
                          {"loss_scale_good_steps", scaler_.good_steps()},
                          {"loss_scale_hysteresis_left", scaler_.hysteresis_left()},
                          {"loss_scale_skipped", scaler_.skipped_steps()},
                          {"layout", layout_json(layout_)}};
  std::map<std::string, std::string> meta(metadata.begin(), metadata.end());
  meta["zero.engine"] = state.dump();
  io::write_safetensors(path, views, meta);
}

namespace {

nlohmann::json shard_metadata(const io::SafeTensorsFile& file, const std::string& path) {
  auto it = file.metadata().find("zero.engine");
  if (it == file.metadata().end())
    ZERO_THROW(IoError, "checkpoint shard '", path, "': no 'zero.engine' metadata (not written by Engine::save_state)");
  try {
    return nlohmann::json::parse(it->second);
  } catch (const std::exception& e) {
    ZERO_THROW(IoError, "checkpoint shard '", path, "': 'zero.engine' metadata is not JSON: ", e.what());
  }
}

// The parameters and their bucketing must match; the world size and the
// alignment may differ (resharding).
void check_same_model(const nlohmann::json& state, const nlohmann::json& here, const std::string& path) {
  auto expect = [&](const char* key, const nlohmann::json& want) {
    if (!state.contains(key) || state[key] != want)
      ZERO_THROW(IoError, "checkpoint shard '", path, "': ", key, " is ",
                 state.contains(key) ? state[key].dump() : std::string("missing"), ", this run has ", want.dump());
  };
  expect("format", kShardFormat);
  expect("version", kShardVersion);
  if (!state.contains("layout") || !state["layout"].is_object())
    ZERO_THROW(IoError, "checkpoint shard '", path, "': no layout in its metadata");
  const nlohmann::json& layout = state["layout"];
  const auto& theirs = layout.value("params", nlohmann::json::array());
  const auto& ours = here["params"];
  std::string detail;
  if (theirs.size() != ours.size()) {
    detail = std::to_string(theirs.size()) + " parameters in the checkpoint, " + std::to_string(ours.size()) + " here";
  } else {
    // Name and numel decide; shapes only where both sides recorded one (files
    // written before shapes were recorded still load).
    auto same = [](const nlohmann::json& a, const nlohmann::json& b) {
      if (!a.is_object() || a.value("name", nlohmann::json()) != b["name"] ||
          a.value("numel", nlohmann::json()) != b["numel"])
        return false;
      return !a.contains("shape") || !b.contains("shape") || a["shape"] == b["shape"];
    };
    for (std::size_t i = 0; i < ours.size() && detail.empty(); ++i)
      if (!same(theirs[i], ours[i]))
        detail = "parameter " + std::to_string(i) + " is " + theirs[i].dump() + " in the checkpoint, " +
                 ours[i].dump() + " here";
  }
  if (detail.empty() && layout.value("bucket_param_counts", nlohmann::json()) != here["bucket_param_counts"])
    detail = "the parameters are grouped into other buckets/units";
  if (!detail.empty()) ZERO_THROW(IoError, "checkpoint shard '", path, "' belongs to another model: ", detail);
}

const float* shard_tensor(const io::SafeTensorsFile& file, const std::string& path, const char* name, std::size_t count) {
  const io::TensorInfo* info = file.find(name);
  if (!info) return nullptr;
  if (info->dtype != io::TensorDType::F32 || info->shape != std::vector<std::int64_t>{static_cast<std::int64_t>(count)})
    ZERO_THROW(IoError, "checkpoint shard '", path, "': tensor '", name, "' should be F32 [", count, "]");
  return reinterpret_cast<const float*>(file.data(*info).data());
}

}  // namespace

void Engine::load_state(const std::string& path) {
  const io::SafeTensorsFile file = io::SafeTensorsFile::open(path);
  const nlohmann::json state = shard_metadata(file, path);
  check_same_model(state, layout_json(layout_), path);
  if (state["layout"].value("world_size", -1) != world_)
    ZERO_THROW(IoError, "checkpoint shard '", path, "' was written by ", state["layout"].value("world_size", -1),
               " ranks; this run has ", world_, ": resume with load_state_resharded and every rank's file");
  if (state.value("rank", -1) != rank_)
    ZERO_THROW(IoError, "checkpoint shard '", path, "': rank is ", state.value("rank", -1), ", this run has ", rank_);
  const std::size_t shard = layout_.shard_numel();
  std::array<const float*, 4> tensors = {shard_tensor(file, path, "master", shard), shard_tensor(file, path, "state0", shard),
                                         shard_tensor(file, path, "state1", shard), shard_tensor(file, path, "ema", shard)};
  restore_state(tensors, state.dump(), path);
}

void Engine::load_state_resharded(const std::vector<std::string>& paths) {
  ZERO_CHECK(!paths.empty(), "load_state_resharded: no checkpoint files");
  std::vector<io::SafeTensorsFile> files;
  for (const std::string& path : paths) files.push_back(io::SafeTensorsFile::open(path));
  const nlohmann::json here = layout_json(layout_);
  const nlohmann::json first = shard_metadata(files[0], paths[0]);
  const int old_world = first["layout"].value("world_size", -1);
  ZERO_CHECK(old_world == static_cast<int>(paths.size()), "load_state_resharded: the checkpoint was written by ",
             old_world, " ranks but ", paths.size(), " files were given (", paths[0], ")");
  for (std::size_t r = 0; r < files.size(); ++r) {
    const nlohmann::json state = r == 0 ? first : shard_metadata(files[r], paths[r]);
    check_same_model(state, here, paths[r]);
    if (state.value("rank", -1) != static_cast<int>(r))
      ZERO_THROW(IoError, "checkpoint shard '", paths[r], "': rank is ", state.value("rank", -1), ", expected ", r,
                 " (files must be given in rank order)");
    if (state["layout"] != first["layout"] || state.value("step", -1) != first.value("step", -1))
      ZERO_THROW(IoError, "checkpoint shard '", paths[r], "' does not belong with '", paths[0],
                 "' (another layout or step)");
  }
  // The old placement of the same parameters.
  std::vector<std::vector<ParamSpec>> groups;
  std::size_t next = 0;
  for (const Bucket& b : layout_.buckets()) {
    groups.emplace_back(layout_.params().begin() + static_cast<std::ptrdiff_t>(next),
                        layout_.params().begin() + static_cast<std::ptrdiff_t>(next + b.param_count));
    next += b.param_count;
  }
  const FlatLayout old = FlatLayout::build_grouped(
      groups, {.world_size = old_world, .alignment = first["layout"].value("alignment", std::size_t{1})});
  ZERO_CHECK(old.padded_numel() == first["layout"].value("padded_numel", std::size_t{0}), "checkpoint shard '",
             paths[0], "': its layout could not be rebuilt (padded size differs)");

  // This rank's new slices, filled from whichever old ranks held those elements.
  const std::size_t shard = layout_.shard_numel(), old_shard = old.shard_numel();
  const char* names[4] = {"master", "state0", "state1", "ema"};
  std::array<std::vector<float>, 4> hosts;
  std::array<const float*, 4> pointers{};
  for (int k = 0; k < 4; ++k) {
    std::vector<const float*> sources;
    for (std::size_t r = 0; r < files.size(); ++r) sources.push_back(shard_tensor(files[r], paths[r], names[k], old_shard));
    if (std::find(sources.begin(), sources.end(), nullptr) != sources.end()) continue;  // absent in this checkpoint
    hosts[k].assign(shard, 0.0f);
    for (std::size_t b = 0; b < layout_.buckets().size(); ++b) {
      const Bucket& nb = layout_.buckets()[b];
      const std::size_t lo = nb.offset + static_cast<std::size_t>(rank_) * nb.shard_size, hi = lo + nb.shard_size;
      for (std::size_t p = nb.first_param; p < nb.first_param + nb.param_count; ++p) {
        const ParamSlot& ns = layout_.slots()[p];
        const std::size_t a = std::max(lo, ns.offset), c = std::min(hi, ns.offset + ns.numel);
        if (a >= c) continue;
        // Elements [a, c) of the new full buffer, i.e. [a - ns.offset, c - ns.offset) of parameter p,
        // from whichever old shards hold them.
        float* dest = hosts[k].data() + nb.shard_offset + (a - lo);
        for_each_shard_run(old, p, a - ns.offset, c - a,
                           [&](int owner, std::size_t index, std::size_t element, std::size_t run) {
                             std::copy_n(sources[static_cast<std::size_t>(owner)] + index, run,
                                         dest + (element - (a - ns.offset)));
                           });
      }
    }
    pointers[k] = hosts[k].data();
  }
  restore_state(pointers, first.dump(), paths[0]);
}

void Engine::restore_state(const std::array<const float*, 4>& tensors, const std::string& state_json,
                           const std::string& path) {
  Impl& m = *impl_;
  m.settle_delayed_update(m.param_gathers);
  m.finish_param_gathers();
  m.backend.synchronize(m.backend.comm_stream());  // uploads out of the host copies are done
  Backend& be = m.backend;
  const nlohmann::json state = nlohmann::json::parse(state_json);
  if (state.value("optimizer", std::string()) != name_of(options_.optimizer.kind) ||
      state.value("state_slots", -1) != options_.optimizer.state_slots())
    ZERO_THROW(IoError, "checkpoint shard '", path, "': optimizer is ", state.value("optimizer", nlohmann::json()).dump(),
               " with ", state.value("state_slots", -1), " state tensors, this run has \"",
               name_of(options_.optimizer.kind), "\" with ", options_.optimizer.state_slots());
  const auto [master, state0, state1, ema] = tensors;
  if (!master) ZERO_THROW(IoError, "checkpoint shard '", path, "': tensor 'master' is missing");
  if ((m.state0 && !state0) || (m.state1 && !state1))
    ZERO_THROW(IoError, "checkpoint shard '", path, "': optimizer state tensors are missing");
  be.synchronize(be.compute_stream());
  const auto& buckets = layout_.buckets();
  // Own slices first; stage 0 then gathers every rank's slices into its full buffers.
  auto restore = [&](const float* host, const std::function<float*(std::size_t)>& slice, float* full_base) {
    for (std::size_t b = 0; b < buckets.size(); ++b)
      m.state_from_host(slice(b), host + buckets[b].shard_offset, buckets[b].shard_size * 4);
    if (m.stage == 0 && full_base) {
      std::vector<WorkPtr> works;
      for (std::size_t b = 0; b < buckets.size(); ++b)
        works.push_back(m.comm.all_gather(full_base + m.own_offset(b), full_base + buckets[b].offset,
                                          buckets[b].shard_size, DType::fp32, be.comm_stream()));
      for (auto& w : works) w->wait();
      be.synchronize(be.comm_stream());
    }
  };
  const bool fp32 = m.pdt == DType::fp32;
  restore(master, [&](std::size_t b) { return m.master_slice(b); },
          fp32 ? (m.stage == 0 ? reinterpret_cast<float*>(m.params_full) : nullptr) : m.master);
  if (m.state0) restore(state0, [&](std::size_t b) { return m.optimizer_slice(m.state0, b); }, m.state0);
  if (m.state1) restore(state1, [&](std::size_t b) { return m.optimizer_slice(m.state1, b); }, m.state1);
  if (m.ema && ema) {
    restore(ema, [&](std::size_t b) { return m.optimizer_slice(m.ema, b); }, m.ema);
    m.ema_initialized = true;
  }
  // The model copy is the master rounded, as after every step.
  if (m.offload) {
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      const std::size_t at = buckets[b].shard_offset;
      if (m.offload_params) {  // the shard lives on the host: written in place
        cpu_convert(m.master + at, DType::fp32, m.param_shard + at * m.p_size, m.pdt, buckets[b].shard_size);
        continue;
      }
      cpu_convert(m.master + at, DType::fp32, m.copy_host + at * m.p_size, m.pdt, buckets[b].shard_size);
      void* out = m.stage == 3 ? static_cast<void*>(m.param_shard + at * m.p_size)
                               : static_cast<void*>(m.params_full + m.own_offset(b) * m.p_size);
      be.copy(out, m.copy_host + at * m.p_size, buckets[b].shard_size * m.p_size, be.compute_stream());
    }
  } else if (!fp32) {
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      void* out = m.stage == 3 ? static_cast<void*>(m.param_shard + buckets[b].shard_offset * m.p_size)
                               : static_cast<void*>(m.params_full + m.own_offset(b) * m.p_size);
      be.convert(m.master_slice(b), DType::fp32, out, m.pdt, buckets[b].shard_size, be.compute_stream());
    }
  }
  if (m.stage <= 2 && !(fp32 && m.stage == 0)) {
    be.synchronize(be.compute_stream());
    std::vector<WorkPtr> works;
    for (std::size_t b = 0; b < buckets.size(); ++b)
      works.push_back(m.comm.all_gather(m.params_full + m.own_offset(b) * m.p_size,
                                        m.params_full + buckets[b].offset * m.p_size, buckets[b].shard_size, m.pdt,
                                        be.comm_stream()));
    for (auto& w : works) w->wait();
    be.synchronize(be.comm_stream());
  }
  step_ = state.value("step", std::int64_t{0});
  skipped_total_ = state.value("skipped_total", std::int64_t{0});
  consecutive_nonfinite_ = state.value("consecutive_nonfinite", 0);
  scaler_.restore(state.value("loss_scale", 1.0), state.value("loss_scale_good_steps", 0),
                  state.value("loss_scale_hysteresis_left", 1), state.value("loss_scale_skipped", std::int64_t{0}));
}

// ---------------------------------------------------------------- saved shards (for tools)

SavedShard read_saved_shard(const io::SafeTensorsFile& file) {
  const std::string path = file.path().string();
  const nlohmann::json state = shard_metadata(file, path);
  auto fail = [&](const std::string& key, const char* expected) {
    ZERO_THROW(IoError, "checkpoint shard '", path, "': 'zero.engine' metadata key '", key, "' should be ", expected);
  };
  if (!state.is_object()) fail("(root)", "an object");
  auto integer = [&](const nlohmann::json& in, const char* key, std::int64_t lo, std::int64_t hi,
                     const std::string& prefix = "") -> std::int64_t {
    auto it = in.find(key);
    if (it == in.end() || !it->is_number_integer()) fail(prefix + key, "an integer");
    if (it->is_number_unsigned() && it->get<std::uint64_t>() > static_cast<std::uint64_t>(hi))
      fail(prefix + key, "an integer in range");
    const auto x = it->get<std::int64_t>();
    if (x < lo || x > hi) fail(prefix + key, "an integer in range");
    return x;
  };
  auto text = [&](const char* key) -> std::string {
    auto it = state.find(key);
    if (it == state.end() || !it->is_string()) fail(key, "a string");
    return it->get<std::string>();
  };
  if (state.value("format", nlohmann::json()) != kShardFormat) fail("format", "\"zero.engine.shard\"");
  if (state.value("version", nlohmann::json()) != kShardVersion) fail("version", "1");
  SavedShard out;
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  out.rank = static_cast<int>(integer(state, "rank", 0, 1 << 20));
  out.stage = static_cast<int>(integer(state, "stage", 0, 3));
  out.step = integer(state, "step", 0, kMax);
  out.param_dtype = text("param_dtype");
  out.optimizer = text("optimizer");
  out.state_slots = static_cast<int>(integer(state, "state_slots", 0, 2));
  if (auto it = state.find("loss_scale"); it == state.end() || !it->is_number()) fail("loss_scale", "a number");
  out.loss_scale = state["loss_scale"].get<double>();
  auto lit = state.find("layout");
  if (lit == state.end() || !lit->is_object()) fail("layout", "an object");
  const nlohmann::json& layout = *lit;
  out.world_size = static_cast<int>(integer(layout, "world_size", 1, 1 << 20, "layout."));
  if (out.rank >= out.world_size) fail("rank", "below layout.world_size");
  const auto alignment = static_cast<std::size_t>(integer(layout, "alignment", 1, 1 << 30, "layout."));
  const auto padded = static_cast<std::size_t>(integer(layout, "padded_numel", 0, kMax, "layout."));
  auto pit = layout.find("params");
  auto cit = layout.find("bucket_param_counts");
  if (pit == layout.end() || !pit->is_array()) fail("layout.params", "an array");
  if (cit == layout.end() || !cit->is_array()) fail("layout.bucket_param_counts", "an array");
  std::vector<ParamSpec> params;
  for (const nlohmann::json& p : *pit) {
    if (!p.is_object() || !p.contains("name") || !p["name"].is_string())
      fail("layout.params[].name", "a string");
    ParamSpec spec{p["name"].get<std::string>(),
                   static_cast<std::size_t>(integer(p, "numel", 0, std::int64_t{1} << 50, "layout.params[].")), {}};
    if (auto sit = p.find("shape"); sit != p.end()) {
      if (!sit->is_array()) fail("layout.params[].shape", "an array of integers >= 0");
      for (const nlohmann::json& d : *sit) {
        if (!d.is_number_integer() || d.get<std::int64_t>() < 0)
          fail("layout.params[].shape", "an array of integers >= 0");
        spec.shape.push_back(d.get<std::int64_t>());
      }
    }
    params.push_back(std::move(spec));
  }
  std::vector<std::vector<ParamSpec>> groups;
  std::size_t next = 0;
  for (const nlohmann::json& c : *cit) {
    if (!c.is_number_unsigned() || c.get<std::size_t>() == 0 || c.get<std::size_t>() > params.size() - next)
      fail("layout.bucket_param_counts", "counts >= 1 that add up to the number of parameters");
    const std::size_t n = c.get<std::size_t>();
    groups.emplace_back(params.begin() + static_cast<std::ptrdiff_t>(next),
                        params.begin() + static_cast<std::ptrdiff_t>(next + n));
    next += n;
  }
  if (next != params.size()) fail("layout.bucket_param_counts", "counts that add up to the number of parameters");
  try {
    out.layout = FlatLayout::build_grouped(groups, {.world_size = out.world_size, .alignment = alignment});
  } catch (const InvalidArgument& e) {
    ZERO_THROW(IoError, "checkpoint shard '", path, "': its layout does not rebuild: ", e.message());
  }
  if (out.layout.padded_numel() != padded)
    ZERO_THROW(IoError, "checkpoint shard '", path, "': its layout rebuilds to ", out.layout.padded_numel(),
               " padded elements, the file says ", padded);
  out.layout_text = layout_json(out.layout).dump();  // rebuilt, not echoed: bounded depth
  return out;
}

}  // namespace zero
