#include "zero/comm/mpi_communicator.hpp"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <iostream>
#include <vector>

namespace zero {

namespace {

MPI_Datatype mpi_type_of(DType dtype) {
  switch (dtype) {
    case DType::fp32: return MPI_FLOAT;
    case DType::bf16:
    case DType::fp16: return MPI_UINT16_T;  // moved as bits; reduced by zero
  }
  ZERO_THROW(InvalidArgument, "unknown dtype value ", static_cast<int>(dtype));
}

int checked_count(std::size_t count, const char* what) {
  ZERO_CHECK(count <= static_cast<std::size_t>(INT_MAX), what, ": ", count,
             " elements exceed MPI's int count limit; use smaller buckets");
  return static_cast<int>(count);
}

template <typename Combine>
void reduce_loop(const void* stacked, int ranks, std::size_t count, DType dtype, void* out,
                 Combine combine, bool average) {
  const float inverse_ranks = 1.0f / static_cast<float>(ranks);
  (void)inverse_ranks;
  for (std::size_t i = 0; i < count; ++i) {
    float acc = load_as_float(stacked, i, dtype);
    for (int r = 1; r < ranks; ++r)
      acc = combine(acc, load_as_float(stacked, static_cast<std::size_t>(r) * count + i, dtype));
    if (average) acc = acc / static_cast<float>(ranks);
    store_from_float(out, i, dtype, acc);
  }
}

}  // namespace

void reduce_in_rank_order(const void* stacked, int ranks, std::size_t count, DType dtype,
                          ReduceOp op, void* out) {
  check_dtype(dtype, "reduce");
  ZERO_CHECK(ranks >= 1, "reduce over ", ranks, " ranks");
  switch (op) {
    case ReduceOp::sum:
      reduce_loop(stacked, ranks, count, dtype, out, [](float a, float b) { return a + b; }, false);
      return;
    case ReduceOp::avg:
      reduce_loop(stacked, ranks, count, dtype, out, [](float a, float b) { return a + b; }, true);
      return;
    // NaN wins in max/min so that an overflow anywhere is seen everywhere.
    case ReduceOp::max:
      reduce_loop(stacked, ranks, count, dtype, out,
                  [](float a, float b) { return (std::isnan(a) || a >= b) ? a : b; }, false);
      return;
    case ReduceOp::min:
      reduce_loop(stacked, ranks, count, dtype, out,
                  [](float a, float b) { return (std::isnan(a) || a <= b) ? a : b; }, false);
      return;
  }
  ZERO_THROW(InvalidArgument, "unknown reduce op ", static_cast<int>(op));
}

// ---------------------------------------------------------------- MpiSession

MpiSession::MpiSession(int* argc, char*** argv) {
  int initialized = 0;
  ZERO_CHECK_MPI(MPI_Initialized(&initialized));
  if (!initialized) {
    int provided = 0;
    ZERO_CHECK_MPI(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided));
    owns_ = true;
  }
}

MpiSession::~MpiSession() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (owns_ && !finalized) MPI_Finalize();
}

// ---------------------------------------------------------------- MpiWork

class MpiWork final : public Work {
 public:
  MpiWork(MpiCommunicator* owner, std::vector<std::byte> scratch)
      : owner_(owner), scratch_(std::move(scratch)) {
    owner_->track_workspace(static_cast<std::ptrdiff_t>(scratch_.size()));
  }
  ~MpiWork() override {
    try {
      wait();
    } catch (const std::exception& error) {
      std::cerr << "zero: a collective failed while its handle was destroyed: " << error.what()
                << "\n";
    }
    owner_->track_workspace(-static_cast<std::ptrdiff_t>(scratch_.size()));
  }

  MPI_Request* request() { return &request_; }
  std::byte* scratch() { return scratch_.data(); }
  void on_complete(std::function<void()> finish) { finish_ = std::move(finish); }

  void wait() override {
    if (done_) return;
    done_ = true;
    ZERO_CHECK_MPI(MPI_Wait(&request_, MPI_STATUS_IGNORE));
    if (finish_) finish_();
  }
  bool test() override {
    if (done_) return true;
    int flag = 0;
    ZERO_CHECK_MPI(MPI_Test(&request_, &flag, MPI_STATUS_IGNORE));
    return flag != 0;
  }

 private:
  MpiCommunicator* owner_;
  std::vector<std::byte> scratch_;
  MPI_Request request_ = MPI_REQUEST_NULL;
  std::function<void()> finish_;
  bool done_ = false;
};

// ---------------------------------------------------------------- MpiCommunicator

MpiCommunicator::MpiCommunicator(MPI_Comm comm) {
  int initialized = 0;
  ZERO_CHECK_MPI(MPI_Initialized(&initialized));
  ZERO_CHECK(initialized, "MpiCommunicator: MPI is not initialized (create a zero::MpiSession first)");
  ZERO_CHECK_MPI(MPI_Comm_dup(comm, &comm_));
  ZERO_CHECK_MPI(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
  ZERO_CHECK_MPI(MPI_Comm_rank(comm_, &rank_));
  ZERO_CHECK_MPI(MPI_Comm_size(comm_, &size_));
  ZERO_CHECK_MPI(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node_comm_));
  ZERO_CHECK_MPI(MPI_Comm_rank(node_comm_, &local_rank_));
  ZERO_CHECK_MPI(MPI_Comm_size(node_comm_, &local_size_));
  set_process_rank(rank_);
}

MpiCommunicator::~MpiCommunicator() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  if (node_comm_ != MPI_COMM_NULL) MPI_Comm_free(&node_comm_);
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

void MpiCommunicator::track_workspace(std::ptrdiff_t delta) {
  workspace_bytes_ = static_cast<std::size_t>(static_cast<std::ptrdiff_t>(workspace_bytes_) + delta);
  peak_workspace_bytes_ = std::max(peak_workspace_bytes_, workspace_bytes_);
}

WorkPtr MpiCommunicator::reduce_scatter(const void* send, void* recv, std::size_t count,
                                        DType dtype, ReduceOp op, Stream) {
  check_dtype(dtype, "reduce_scatter");
  ZERO_CHECK(count == 0 || (send != nullptr && recv != nullptr), "reduce_scatter: null buffer");
  const std::size_t element = size_of(dtype);
  if (size_ == 1) {
    if (recv != send && count > 0) std::memmove(recv, send, count * element);
    return std::make_unique<CompletedWork>();
  }
  const int n = checked_count(count, "reduce_scatter");
  auto work = std::make_unique<MpiWork>(this, std::vector<std::byte>(count * element * size_));
  const MPI_Datatype type = mpi_type_of(dtype);
  ZERO_CHECK_MPI(MPI_Ialltoall(send, n, type, work->scratch(), n, type, comm_, work->request()));
  std::byte* stacked = work->scratch();
  const int ranks = size_;
  work->on_complete([=] { reduce_in_rank_order(stacked, ranks, count, dtype, op, recv); });
  return work;
}

WorkPtr MpiCommunicator::all_gather(const void* send, void* recv, std::size_t count, DType dtype,
                                    Stream) {
  check_dtype(dtype, "all_gather");
  ZERO_CHECK(count == 0 || (send != nullptr && recv != nullptr), "all_gather: null buffer");
  const std::size_t bytes = count * size_of(dtype);
  std::byte* own_slot = static_cast<std::byte*>(recv) + static_cast<std::size_t>(rank_) * bytes;
  if (size_ == 1) {
    if (own_slot != send && count > 0) std::memmove(own_slot, send, bytes);
    return std::make_unique<CompletedWork>();
  }
  const int n = checked_count(count, "all_gather");
  auto work = std::make_unique<MpiWork>(this, std::vector<std::byte>());
  const void* source = send == own_slot ? MPI_IN_PLACE : send;
  ZERO_CHECK_MPI(MPI_Iallgather(source, n, mpi_type_of(dtype), recv, n, mpi_type_of(dtype), comm_,
                                work->request()));
  return work;
}

WorkPtr MpiCommunicator::all_reduce(void* buffer, std::size_t count, DType dtype, ReduceOp op,
                                    Stream) {
  check_dtype(dtype, "all_reduce");
  if (size_ == 1 || count == 0) return std::make_unique<CompletedWork>();
  const int n = checked_count(count * static_cast<std::size_t>(size_), "all_reduce");
  (void)n;
  // Gather everything, reduce in rank order: deterministic and identical on
  // every rank. Costs N x the data of a ring all-reduce, which is fine for the
  // small buffers the engine all-reduces (norms, flags, losses).
  auto work = std::make_unique<MpiWork>(this, std::vector<std::byte>(count * size_of(dtype) * size_));
  ZERO_CHECK_MPI(MPI_Iallgather(buffer, static_cast<int>(count), mpi_type_of(dtype), work->scratch(),
                                static_cast<int>(count), mpi_type_of(dtype), comm_, work->request()));
  std::byte* stacked = work->scratch();
  const int ranks = size_;
  work->on_complete([=] { reduce_in_rank_order(stacked, ranks, count, dtype, op, buffer); });
  return work;
}

WorkPtr MpiCommunicator::broadcast(void* buffer, std::size_t count, DType dtype, int root, Stream) {
  check_dtype(dtype, "broadcast");
  ZERO_CHECK(root >= 0 && root < size_, "broadcast: root ", root, " outside [0, ", size_, ")");
  if (size_ == 1 || count == 0) return std::make_unique<CompletedWork>();
  auto work = std::make_unique<MpiWork>(this, std::vector<std::byte>());
  ZERO_CHECK_MPI(MPI_Ibcast(buffer, checked_count(count, "broadcast"), mpi_type_of(dtype), root, comm_,
                            work->request()));
  return work;
}

void MpiCommunicator::barrier() { ZERO_CHECK_MPI(MPI_Barrier(comm_)); }

void MpiCommunicator::all_reduce_host_f64(double* values, std::size_t count, ReduceOp op) {
  if (size_ == 1 || count == 0) return;
  std::vector<double> stacked(count * static_cast<std::size_t>(size_));
  ZERO_CHECK_MPI(MPI_Allgather(values, checked_count(count, "all_reduce_host_f64"), MPI_DOUBLE,
                               stacked.data(), static_cast<int>(count), MPI_DOUBLE, comm_));
  for (std::size_t i = 0; i < count; ++i) {
    double acc = stacked[i];
    for (int r = 1; r < size_; ++r) {
      const double x = stacked[static_cast<std::size_t>(r) * count + i];
      switch (op) {
        case ReduceOp::sum:
        case ReduceOp::avg: acc += x; break;
        case ReduceOp::max: acc = (std::isnan(acc) || acc >= x) ? acc : x; break;
        case ReduceOp::min: acc = (std::isnan(acc) || acc <= x) ? acc : x; break;
      }
    }
    if (op == ReduceOp::avg) acc /= size_;
    values[i] = acc;
  }
}

int run_or_abort(const std::function<int()>& main_body) {
  try {
    return main_body();
  } catch (const std::exception& error) {
    std::cerr << error.what() << std::endl;
  } catch (...) {
    std::cerr << "[zero] unknown exception" << std::endl;
  }
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, 1);
  return 1;
}

}  // namespace zero
