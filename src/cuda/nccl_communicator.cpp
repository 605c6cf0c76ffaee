// NcclCommunicator: NCCL collectives on device memory, bootstrapped over MPI.

#include "zero/comm/nccl_communicator.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <mutex>
#include <thread>
#include <vector>

#include "zero/comm/launch_env.hpp"
#include "zero/cuda/check.hpp"
#include "zero/cuda/kernels.hpp"
#include "device_guard.hpp"

// MPI calls here only bootstrap and serve host reductions; the lead's
// MpiCommunicator has its own checker, this file keeps a private one.
#define ZERO_NCCL_CHECK_MPI(call)                                                      \
  do {                                                                                 \
    const int zero_mpi_status_ = (call);                                               \
    if (zero_mpi_status_ != MPI_SUCCESS) {                                             \
      char zero_mpi_text_[MPI_MAX_ERROR_STRING] = {};                                  \
      int zero_mpi_length_ = 0;                                                        \
      MPI_Error_string(zero_mpi_status_, zero_mpi_text_, &zero_mpi_length_);           \
      ZERO_THROW(::zero::CommError, #call " failed: ", zero_mpi_text_);                \
    }                                                                                  \
  } while (0)

namespace zero {

using detail::DeviceGuard;

// What outstanding Work needs after the communicator object is gone: the NCCL
// communicator lives until the last Work that might poll it is destroyed.
struct NcclCommunicator::State {
  ncclComm_t comm = nullptr;
  bool owned = false;
  int device = 0;
  std::chrono::milliseconds timeout{};
  std::atomic<bool> aborted{false};
  std::mutex abort_mutex;

  // fp32 scratch for HalfReduction::fp32_accumulate and host f64 reductions.
  void* scratch = nullptr;
  std::size_t scratch_bytes = 0;
  std::size_t peak_scratch_bytes = 0;
  cudaEvent_t scratch_free = nullptr;  // recorded after the last use of scratch
  // The CUDA graph capture scratch_free was last recorded in (0: none). An
  // event recorded in one capture can be waited for only in that capture.
  unsigned long long scratch_free_capture = 0;
  cudaStream_t internal = nullptr;     // barrier() and host reductions without MPI

  /// Aborts once; later collectives throw. Safe from several Work objects.
  void abort() {
    std::lock_guard<std::mutex> lock(abort_mutex);
    if (aborted.exchange(true)) return;
    (void)ncclCommAbort(comm);
  }

  void check_usable() const {
    if (aborted.load())
      ZERO_THROW(CommError,
                 "the NCCL communicator was aborted after a failed or timed-out collective; "
                 "recreate it on every rank");
  }

  /// Throws CommError (after aborting) when NCCL reports an asynchronous error.
  void check_async() {
    if (aborted.load()) check_usable();
    ncclResult_t async = ncclSuccess;
    ZERO_CHECK_NCCL(ncclCommGetAsyncError(comm, &async));
    if (async != ncclSuccess && async != ncclInProgress) {
      const std::string what = ncclGetErrorString(async);
      abort();
      ZERO_THROW(CommError, "NCCL reported an asynchronous error: ", what,
                 detail::nccl_last_error_suffix(), "; the communicator was aborted");
    }
  }

  ~State() {
    // Best effort throughout: destructors must not throw.
    (void)cudaSetDevice(device);
    if (internal != nullptr) {
      (void)cudaStreamSynchronize(internal);
      (void)cudaStreamDestroy(internal);
    }
    if (scratch_free != nullptr) {
      (void)cudaEventSynchronize(scratch_free);
      (void)cudaEventDestroy(scratch_free);
    }
    if (scratch != nullptr) (void)cudaFree(scratch);
    if (owned && comm != nullptr && !aborted.load()) {
      // Finalize flushes enqueued operations before the resources go.
      (void)ncclCommFinalize(comm);
      (void)ncclCommDestroy(comm);
    }
  }
};

namespace {

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::fp32: return ncclFloat32;
    case DType::bf16: return ncclBfloat16;
    case DType::fp16: return ncclFloat16;
  }
  ZERO_THROW(InvalidArgument, "unknown dtype value ", static_cast<int>(dtype));
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::avg: return ncclAvg;
    case ReduceOp::max: return ncclMax;
    case ReduceOp::min: return ncclMin;
  }
  ZERO_THROW(InvalidArgument, "unknown reduce op ", static_cast<int>(op));
}

bool overlaps(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) {
  const auto x = reinterpret_cast<std::uintptr_t>(a);
  const auto y = reinterpret_cast<std::uintptr_t>(b);
  return a_bytes > 0 && b_bytes > 0 && x < y + b_bytes && y < x + a_bytes;
}

/// Blocks on the event while watching the communicator. Spins briefly
/// (collectives of small messages finish in microseconds), then sleeps in
/// short steps so that a long wait does not burn a core.
void wait_for_event(NcclCommunicator::State& state, cudaEvent_t event) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  for (int polls = 0;; ++polls) {
    const cudaError_t status = cudaEventQuery(event);
    if (status == cudaSuccess) return;
    if (status != cudaErrorNotReady) ZERO_CHECK_CUDA(status);
    state.check_async();
    const auto waited = clock::now() - start;
    if (waited > state.timeout) {
      state.abort();
      ZERO_THROW(CommError, "an NCCL collective did not finish within ",
                 std::chrono::duration_cast<std::chrono::milliseconds>(state.timeout).count(),
                 " ms (NcclOptions::timeout); the communicator was aborted: recreate it");
    }
    if (polls < 1000) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<NcclCommunicator::State> state, cudaEvent_t event)
      : state_(std::move(state)), event_(event) {}

  ~NcclWork() override {
    try {
      wait();
    } catch (...) {
      // The contract waits on destruction; a failure has aborted the
      // communicator already and surfaces at its next use.
    }
    (void)cudaEventDestroy(event_);
  }

  void wait() override {
    if (done_) return;
    DeviceGuard guard(state_->device);
    done_ = true;  // a throwing wait is not retried: the communicator is aborted
    wait_for_event(*state_, event_);
  }

  // Inside a capture the event is a capture node: never queried.
  void detach() override { done_ = true; }

  bool test() override {
    if (done_) return true;
    const cudaError_t status = cudaEventQuery(event_);
    if (status == cudaSuccess) return done_ = true;
    if (status != cudaErrorNotReady) ZERO_CHECK_CUDA(status);
    state_->check_async();
    return false;
  }

 private:
  std::shared_ptr<NcclCommunicator::State> state_;
  cudaEvent_t event_;
  bool done_ = false;
};

}  // namespace

void NcclOptions::validate() const {
  ZERO_CHECK(timeout.count() > 0, "NcclOptions.timeout must be positive, got ", timeout.count(),
             " ms");
  ZERO_CHECK(device >= -1, "NcclOptions.device must be -1 (from the local rank) or a GPU index, got ",
             device);
  ZERO_CHECK(half_reduction == HalfReduction::native ||
                 half_reduction == HalfReduction::fp32_accumulate,
             "NcclOptions.half_reduction: unknown value ", static_cast<int>(half_reduction));
}

NcclCommunicator::NcclCommunicator(MPI_Comm comm, NcclOptions options)
    : state_(std::make_shared<State>()), options_(options) {
  options_.validate();
  ZERO_CHECK(comm != MPI_COMM_NULL, "NcclCommunicator: MPI communicator is MPI_COMM_NULL");
  // A private duplicate keeps our bootstrap and host reductions from ever
  // matching messages of the caller's.
  ZERO_NCCL_CHECK_MPI(MPI_Comm_dup(comm, &host_comm_));
  owns_host_comm_ = true;
  ZERO_NCCL_CHECK_MPI(MPI_Comm_rank(host_comm_, &rank_));
  ZERO_NCCL_CHECK_MPI(MPI_Comm_size(host_comm_, &size_));
  set_process_rank(rank_);

  MPI_Comm node = MPI_COMM_NULL;
  ZERO_NCCL_CHECK_MPI(
      MPI_Comm_split_type(host_comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node));
  ZERO_NCCL_CHECK_MPI(MPI_Comm_rank(node, &local_rank_));
  ZERO_NCCL_CHECK_MPI(MPI_Comm_size(node, &local_size_));
  ZERO_NCCL_CHECK_MPI(MPI_Comm_free(&node));

  int device_count = 0;
  const cudaError_t count_status = cudaGetDeviceCount(&device_count);
  if (count_status != cudaSuccess) device_count = 0;
  // Decide together, so that a node without enough GPUs fails every rank
  // instead of leaving the others blocked in the bootstrap.
  int problem = 0;  // 1: no GPU, 2: more local ranks than GPUs, 3: bad device option
  if (device_count == 0) problem = 1;
  else if (options_.device < 0 && local_size_ > device_count) problem = 2;
  else if (options_.device >= device_count) problem = 3;
  int worst = 0;
  ZERO_NCCL_CHECK_MPI(MPI_Allreduce(&problem, &worst, 1, MPI_INT, MPI_MAX, host_comm_));
  if (worst != 0) {
    ZERO_NCCL_CHECK_MPI(MPI_Comm_free(&host_comm_));
    owns_host_comm_ = false;
    switch (worst) {
      case 1:
        ZERO_THROW(InvalidArgument, "NcclCommunicator: a rank sees no CUDA device (",
                   count_status == cudaSuccess ? "none visible" : cudaGetErrorString(count_status),
                   " here)");
      case 2:
        ZERO_THROW(InvalidArgument, "NcclCommunicator: a node runs more ranks than it has GPUs (here ",
                   local_size_, " ranks, ", device_count,
                   " GPUs); NCCL cannot place two ranks on one GPU: use StagedCommunicator");
      default:
        ZERO_THROW(InvalidArgument, "NcclCommunicator: NcclOptions.device ", options_.device,
                   " is not a visible GPU on some rank (here ", device_count, " visible)");
    }
  }
  device_ = options_.device >= 0 ? options_.device : local_rank_ % device_count;
  ZERO_CHECK_CUDA(cudaSetDevice(device_));

  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (rank_ == 0) ZERO_CHECK_NCCL(ncclGetUniqueId(&id));
  ZERO_NCCL_CHECK_MPI(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, host_comm_));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 1;
  ZERO_CHECK_NCCL(ncclCommInitRankConfig(&state_->comm, size_, id, rank_, &config));
  state_->owned = true;
  init_common();
}

NcclCommunicator::NcclCommunicator(ncclComm_t comm, MPI_Comm host_comm, NcclOptions options,
                                   int local_rank, int local_size)
    : state_(std::make_shared<State>()), options_(options), host_comm_(host_comm) {
  options_.validate();
  ZERO_CHECK(comm != nullptr, "NcclCommunicator: the ncclComm_t is null");
  state_->comm = comm;
  state_->owned = false;
  ZERO_CHECK_NCCL(ncclCommUserRank(comm, &rank_));
  ZERO_CHECK_NCCL(ncclCommCount(comm, &size_));
  ZERO_CHECK_NCCL(ncclCommCuDevice(comm, &device_));
  if (host_comm_ != MPI_COMM_NULL) {
    int mpi_rank = 0, mpi_size = 0;
    ZERO_NCCL_CHECK_MPI(MPI_Comm_rank(host_comm_, &mpi_rank));
    ZERO_NCCL_CHECK_MPI(MPI_Comm_size(host_comm_, &mpi_size));
    ZERO_CHECK(mpi_rank == rank_ && mpi_size == size_, "NcclCommunicator: host communicator rank ",
               mpi_rank, " of ", mpi_size, " does not match NCCL's rank ", rank_, " of ", size_);
  }
  const LaunchEnv env = discover_launch_env();
  local_rank_ = local_rank >= 0 ? local_rank : env.local_rank;
  local_size_ = local_size >= 0 ? local_size : env.local_size;
  ZERO_CHECK(local_rank_ < local_size_, "NcclCommunicator: local rank ", local_rank_,
             " outside local size ", local_size_);
  set_process_rank(rank_);
  ZERO_CHECK_CUDA(cudaSetDevice(device_));
  init_common();
}

NcclCommunicator::NcclCommunicator(SplitTag, NcclOptions options, int device, int local_rank,
                                   int local_size)
    : state_(std::make_shared<State>()), options_(options), local_rank_(local_rank),
      local_size_(local_size), device_(device) {
  state_->device = device_;
}

std::unique_ptr<Communicator> NcclCommunicator::split(int color, int key) {
#if NCCL_VERSION_CODE < NCCL_VERSION(2, 18, 0)
  (void)color;
  (void)key;
  ZERO_THROW(InvalidArgument, "NcclCommunicator::split needs ncclCommSplit (NCCL >= 2.18); zero was "
             "built against NCCL ", NCCL_MAJOR, ".", NCCL_MINOR, ".", NCCL_PATCH);
#else
  state_->check_usable();
  agree_on_split_color(*this, color);
  // The child frees what it holds if a later step throws: its host comm
  // (owns_host_comm_) and its NCCL comm (State::owned, set once it exists).
  std::unique_ptr<NcclCommunicator> child(
      new NcclCommunicator(SplitTag{}, options_, device_, local_rank_, local_size_));
  if (host_comm_ != MPI_COMM_NULL) {
    ZERO_NCCL_CHECK_MPI(MPI_Comm_split(host_comm_, color, key, &child->host_comm_));
    child->owns_host_comm_ = true;
  }
  {
    DeviceGuard guard(device_);
    // Blocking, as the bootstrap's: the child's calls then return final
    // results, which is what every call in this file expects. Given rather
    // than inherited (a null config), so the child does not depend on how
    // a wrapped parent was configured.
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 1;
    ncclComm_t comm = nullptr;
    ZERO_CHECK_NCCL(ncclCommSplit(state_->comm, color, key, &comm, &config));
    ZERO_ASSERT(comm != nullptr, "ncclCommSplit gave no communicator for color ", color);
    child->state_->comm = comm;
    child->state_->owned = true;
  }
  // An error NCCL reports after the split returned surfaces here, on the
  // communicator it concerns, which is then aborted (State::check_async).
  state_->check_async();
  child->state_->check_async();
  ZERO_CHECK_NCCL(ncclCommUserRank(child->state_->comm, &child->rank_));
  ZERO_CHECK_NCCL(ncclCommCount(child->state_->comm, &child->size_));
  if (child->host_comm_ != MPI_COMM_NULL) {
    // NCCL and MPI both order a group by key, then by the parent's rank;
    // a mismatch would pair one rank's host reductions with another's.
    int mpi_rank = 0, mpi_size = 0;
    ZERO_NCCL_CHECK_MPI(MPI_Comm_rank(child->host_comm_, &mpi_rank));
    ZERO_NCCL_CHECK_MPI(MPI_Comm_size(child->host_comm_, &mpi_size));
    ZERO_ASSERT(mpi_rank == child->rank_ && mpi_size == child->size_, "split host communicator: rank ",
                mpi_rank, " of ", mpi_size, ", NCCL's: ", child->rank_, " of ", child->size_);
  }
  child->init_common();
  return child;
#endif
}

void NcclCommunicator::init_common() {
  state_->device = device_;
  state_->timeout = options_.timeout;
  ZERO_CHECK_CUDA(cudaEventCreateWithFlags(&state_->scratch_free, cudaEventDisableTiming));
  ZERO_CHECK_CUDA(cudaStreamCreateWithFlags(&state_->internal, cudaStreamNonBlocking));
}

NcclCommunicator::~NcclCommunicator() {
  // The NCCL communicator goes with the last outstanding Work (State's
  // destructor); only the MPI duplicate is ours to free here, unless MPI has
  // been finalized already (freeing then is an error).
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (owns_host_comm_ && !finalized) MPI_Comm_free(&host_comm_);
}

ncclComm_t NcclCommunicator::nccl_comm() const { return state_->comm; }
bool NcclCommunicator::aborted() const { return state_->aborted.load(); }
std::size_t NcclCommunicator::workspace_bytes() const { return state_->scratch_bytes; }
std::size_t NcclCommunicator::peak_workspace_bytes() const { return state_->peak_scratch_bytes; }

WorkPtr NcclCommunicator::finish(Stream stream) {
  cudaEvent_t event = nullptr;
  ZERO_CHECK_CUDA(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  const cudaError_t status = cudaEventRecord(event, static_cast<cudaStream_t>(stream));
  if (status != cudaSuccess) (void)cudaEventDestroy(event);
  ZERO_CHECK_CUDA(status);
  return std::make_unique<NcclWork>(state_, event);
}

// One rank: every reduction of a single contribution is that contribution
// (sum, average, min, max; the fp32 widening round-trips exactly), and a
// gather of one slice is the slice. A device copy, or nothing in place,
// gives the same bits as NCCL's one-rank kernels without their passes over
// the data (and, for half precision, the fp32 conversions).
WorkPtr NcclCommunicator::one_rank_copy(void* dst, const void* src, std::size_t bytes, Stream stream) {
  if (dst != src)
    ZERO_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream)));
  return finish(stream);
}

bool NcclCommunicator::widen(DType dtype, ReduceOp op) const {
  return options_.half_reduction == HalfReduction::fp32_accumulate && dtype != DType::fp32 &&
         (op == ReduceOp::sum || op == ReduceOp::avg);
}

namespace {
/// The id of the capture `stream` is in, 0 when it is not capturing.
unsigned long long capture_id(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  ZERO_CHECK_CUDA(cudaStreamGetCaptureInfo(stream, &status, &id));
  return status == cudaStreamCaptureStatusActive ? id : 0;
}
}  // namespace

float* NcclCommunicator::fp32_scratch(std::size_t elements, Stream stream) {
  State& s = *state_;
  const std::size_t bytes = elements * sizeof(float);
  const unsigned long long capture = capture_id(static_cast<cudaStream_t>(stream));
  ZERO_CHECK(capture == 0 || bytes <= s.scratch_bytes, "NCCL fp32 scratch of ", bytes,
             " bytes needed inside a CUDA graph capture (it holds ", s.scratch_bytes,
             "): run the captured work once eagerly first, so that the scratch has its size");
  if (bytes > s.scratch_bytes) {
    // cudaFree waits for the device, so the old buffer's users are done.
    if (s.scratch != nullptr) ZERO_CHECK_CUDA(cudaFree(s.scratch));
    s.scratch = nullptr;
    s.scratch_bytes = 0;
    ZERO_CHECK_CUDA(cudaMalloc(&s.scratch, bytes));
    s.scratch_bytes = bytes;
    s.peak_scratch_bytes = std::max(s.peak_scratch_bytes, bytes);
  }
  // Scratch is shared by collectives on any stream: wait for its last user.
  // Across a capture's boundary the caller orders the graph's replays with
  // the work around them (Engine::prepare_graph_replay), and the event of
  // the other side cannot be waited for.
  if (s.scratch_free_capture == capture)
    ZERO_CHECK_CUDA(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), s.scratch_free, 0));
  return static_cast<float*>(s.scratch);
}

void NcclCommunicator::release_scratch(Stream stream) {
  ZERO_CHECK_CUDA(cudaEventRecord(state_->scratch_free, static_cast<cudaStream_t>(stream)));
  state_->scratch_free_capture = capture_id(static_cast<cudaStream_t>(stream));
}

WorkPtr NcclCommunicator::reduce_scatter(const void* send, void* recv, std::size_t count,
                                         DType dtype, ReduceOp op, Stream stream) {
  state_->check_usable();
  check_dtype(dtype, "reduce_scatter");
  const std::size_t element = size_of(dtype);
  const std::size_t world = static_cast<std::size_t>(size_);
  const auto* in_place = static_cast<const unsigned char*>(send) + rank_ * count * element;
  ZERO_CHECK(recv == in_place || !overlaps(send, count * world * element, recv, count * element),
             "reduce_scatter: recv overlaps send without being its rank's slice (send + rank * count)");
  if (count == 0) return std::make_unique<CompletedWork>();
  DeviceGuard guard(device_);
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  if (size_ == 1) return one_rank_copy(recv, send, count * element, stream);
  if (widen(dtype, op)) {
    float* wide = fp32_scratch(count * world + count, stream);
    gpu::convert(send, dtype, wide, DType::fp32, count * world, stream);
    ZERO_CHECK_NCCL(ncclReduceScatter(wide, wide + count * world, count, ncclFloat32, nccl_op(op),
                                      state_->comm, cuda_stream));
    gpu::convert(wide + count * world, DType::fp32, recv, dtype, count, stream);
    release_scratch(stream);
  } else {
    ZERO_CHECK_NCCL(ncclReduceScatter(send, recv, count, nccl_type(dtype), nccl_op(op),
                                      state_->comm, cuda_stream));
  }
  return finish(stream);
}

WorkPtr NcclCommunicator::all_gather(const void* send, void* recv, std::size_t count, DType dtype,
                                     Stream stream) {
  state_->check_usable();
  check_dtype(dtype, "all_gather");
  const std::size_t element = size_of(dtype);
  const std::size_t world = static_cast<std::size_t>(size_);
  const auto* in_place = static_cast<const unsigned char*>(recv) + rank_ * count * element;
  ZERO_CHECK(send == in_place || !overlaps(send, count * element, recv, count * world * element),
             "all_gather: send overlaps recv without being its rank's slice (recv + rank * count)");
  if (count == 0) return std::make_unique<CompletedWork>();
  DeviceGuard guard(device_);
  if (size_ == 1) return one_rank_copy(recv, send, count * element, stream);
  ZERO_CHECK_NCCL(ncclAllGather(send, recv, count, nccl_type(dtype), state_->comm,
                                static_cast<cudaStream_t>(stream)));
  return finish(stream);
}

WorkPtr NcclCommunicator::all_reduce(void* buffer, std::size_t count, DType dtype, ReduceOp op,
                                     Stream stream) {
  state_->check_usable();
  check_dtype(dtype, "all_reduce");
  if (count == 0) return std::make_unique<CompletedWork>();
  DeviceGuard guard(device_);
  if (size_ == 1) return finish(stream);  // in place: nothing moves
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  if (widen(dtype, op)) {
    float* wide = fp32_scratch(count, stream);
    gpu::convert(buffer, dtype, wide, DType::fp32, count, stream);
    ZERO_CHECK_NCCL(
        ncclAllReduce(wide, wide, count, ncclFloat32, nccl_op(op), state_->comm, cuda_stream));
    gpu::convert(wide, DType::fp32, buffer, dtype, count, stream);
    release_scratch(stream);
  } else {
    ZERO_CHECK_NCCL(ncclAllReduce(buffer, buffer, count, nccl_type(dtype), nccl_op(op),
                                  state_->comm, cuda_stream));
  }
  return finish(stream);
}

WorkPtr NcclCommunicator::broadcast(void* buffer, std::size_t count, DType dtype, int root,
                                    Stream stream) {
  state_->check_usable();
  check_dtype(dtype, "broadcast");
  ZERO_CHECK(root >= 0 && root < size_, "broadcast: root ", root, " outside [0, ", size_, ")");
  if (count == 0) return std::make_unique<CompletedWork>();
  DeviceGuard guard(device_);
  ZERO_CHECK_NCCL(ncclBroadcast(buffer, buffer, count, nccl_type(dtype), root, state_->comm,
                                static_cast<cudaStream_t>(stream)));
  return finish(stream);
}

void NcclCommunicator::barrier() {
  state_->check_usable();
  if (host_comm_ != MPI_COMM_NULL) {
    ZERO_NCCL_CHECK_MPI(MPI_Barrier(host_comm_));
    return;
  }
  // Without MPI: an all-reduce of one value, waited for on the host.
  DeviceGuard guard(device_);
  float* token = fp32_scratch(1, state_->internal);
  ZERO_CHECK_CUDA(cudaMemsetAsync(token, 0, sizeof(float), state_->internal));
  ZERO_CHECK_NCCL(
      ncclAllReduce(token, token, 1, ncclFloat32, ncclSum, state_->comm, state_->internal));
  release_scratch(state_->internal);
  finish(state_->internal)->wait();
}

void NcclCommunicator::all_reduce_host_f64(double* values, std::size_t count, ReduceOp op) {
  state_->check_usable();
  if (count == 0) return;
  const std::size_t world = static_cast<std::size_t>(size_);
  std::vector<double> gathered(count * world);
  if (host_comm_ != MPI_COMM_NULL) {
    ZERO_CHECK(count <= static_cast<std::size_t>(std::numeric_limits<int>::max()),
               "all_reduce_host_f64: ", count, " values exceed MPI's int count");
    ZERO_NCCL_CHECK_MPI(MPI_Allgather(values, static_cast<int>(count), MPI_DOUBLE, gathered.data(),
                                      static_cast<int>(count), MPI_DOUBLE, host_comm_));
  } else {
    // Gather every rank's values through NCCL (doubles are moved, not reduced,
    // so the reduction below stays in rank order).
    DeviceGuard guard(device_);
    const std::size_t floats = (count * world * sizeof(double) + sizeof(float) - 1) / sizeof(float);
    auto* device_values = reinterpret_cast<double*>(fp32_scratch(floats, state_->internal));
    ZERO_CHECK_CUDA(cudaMemcpyAsync(device_values + rank_ * count, values, count * sizeof(double),
                                    cudaMemcpyHostToDevice, state_->internal));
    ZERO_CHECK_NCCL(ncclAllGather(device_values + rank_ * count, device_values, count, ncclFloat64,
                                  state_->comm, state_->internal));
    ZERO_CHECK_CUDA(cudaMemcpyAsync(gathered.data(), device_values, count * world * sizeof(double),
                                    cudaMemcpyDeviceToHost, state_->internal));
    release_scratch(state_->internal);
    finish(state_->internal)->wait();
  }
  for (std::size_t i = 0; i < count; ++i) {
    double result = gathered[i];
    for (std::size_t r = 1; r < world; ++r) {
      const double x = gathered[r * count + i];
      switch (op) {
        case ReduceOp::sum:
        case ReduceOp::avg: result += x; break;
        case ReduceOp::max: result = std::max(result, x); break;
        case ReduceOp::min: result = std::min(result, x); break;
      }
    }
    if (op == ReduceOp::avg) result /= static_cast<double>(world);
    values[i] = result;
  }
}

}  // namespace zero
