#include "zero/comm/mpi_communicator.hpp"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <cstring>
#include <iostream>
#include <thread>
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
  // While an exception unwinds, MPI_Finalize (a collective) could wait forever
  // for a rank that died or hung; leave MPI to run_or_abort's MPI_Abort.
  if (std::uncaught_exceptions() > 0) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (owns_ && !finalized) MPI_Finalize();
}

// ---------------------------------------------------------------- MpiWork

class MpiWork final : public Work {
 public:
  MpiWork(MpiCommunicator* owner, std::vector<std::byte> scratch, const char* what = "collective")
      : owner_(owner), scratch_(std::move(scratch)), what_(what) {
    owner_->track_workspace(static_cast<std::ptrdiff_t>(scratch_.size()));
  }
  ~MpiWork() override {
    try {
      // After a timeout the communicator is broken: the process is on its
      // way out (run_or_abort), and waiting on every other request would only
      // delay that by one timeout each.
      if (!owner_->broken()) wait();
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
    owner_->wait_request(&request_, what_);
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
  const char* what_;
  bool done_ = false;
};

// ---------------------------------------------------------------- MpiCommunicator

std::chrono::milliseconds MpiCommunicator::default_timeout() {
  // The range keeps the conversion to milliseconds exact and defined: below
  // 1 ms the timeout would round to 0, and inf, nan or 1e300 do not fit an
  // integer at all (a float-to-integer conversion out of range is undefined).
  constexpr double kMinSeconds = 0.001, kMaxSeconds = 1e6;
  if (const char* text = std::getenv("ZERO_COMM_TIMEOUT_S")) {
    char* end = nullptr;
    const double seconds = std::strtod(text, &end);
    const bool number = end != text && *end == '\0';
    if (!number || !std::isfinite(seconds) || !(seconds >= kMinSeconds && seconds <= kMaxSeconds))
      ZERO_THROW(InvalidArgument, "ZERO_COMM_TIMEOUT_S='", text,
                 "': expected a finite number of seconds in [0.001, 1e6] (e.g. 60), ",
                 number ? "and this is outside that range" : "and this is not a number");
    return std::chrono::milliseconds(std::llround(seconds * 1000));
  }
  return std::chrono::seconds(60);
}

void MpiCommunicator::wait_request(MPI_Request* request, const char* what) const {
  // Spin for the first millisecond (small collectives finish in
  // microseconds), then poll every 200 us so a waiting rank leaves its core
  // to others. A rank that died or stopped never completes the request: after
  // the timeout this rank gives up loudly instead of waiting forever.
  using clock = std::chrono::steady_clock;
  ZERO_CHECK(!broken_, what, ": the communicator is broken by an earlier timeout");
  const auto start = clock::now();
  int flag = 0;
  for (int spin = 0;; ++spin) {
    ZERO_CHECK_MPI(MPI_Test(request, &flag, MPI_STATUS_IGNORE));
    if (flag) return;
    const auto waited = clock::now() - start;
    if (waited > timeout_) {
      broken_ = true;
      ZERO_THROW(CommError, what, " did not complete within ", timeout_.count() / 1000.0,
                 " s: another rank died, hung or is far behind (set ZERO_COMM_TIMEOUT_S to wait longer)");
    }
    if (waited > std::chrono::milliseconds(1)) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

MpiCommunicator::MpiCommunicator(MPI_Comm comm, std::chrono::milliseconds timeout) : timeout_(timeout) {
  ZERO_CHECK(timeout.count() > 0, "MpiCommunicator: timeout must be positive");
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

MpiCommunicator::MpiCommunicator(Adopt, MPI_Comm comm, std::chrono::milliseconds timeout,
                                 int local_rank, int local_size)
    : timeout_(timeout), comm_(comm), local_rank_(local_rank), local_size_(local_size) {
  // MPI_Comm_split passes the parent's error handler on; set it anyway, so
  // that this communicator returns codes whatever the parent was given.
  ZERO_CHECK_MPI(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
  ZERO_CHECK_MPI(MPI_Comm_rank(comm_, &rank_));
  ZERO_CHECK_MPI(MPI_Comm_size(comm_, &size_));
  // node_comm_ stays null: the node-local values are the parent's.
}

std::unique_ptr<Communicator> MpiCommunicator::split(int color, int key) {
  // The agreement is a collective waited for with the timeout, so a rank
  // that died or hung is reported here instead of leaving MPI_Comm_split
  // (which has no non-blocking form) waiting forever.
  agree_on_split_color(*this, color);
  MPI_Comm child = MPI_COMM_NULL;
  ZERO_CHECK_MPI(MPI_Comm_split(comm_, color, key, &child));
  ZERO_ASSERT(child != MPI_COMM_NULL, "MPI_Comm_split gave no communicator for color ", color);
  return std::unique_ptr<Communicator>(new MpiCommunicator(Adopt{}, child, timeout_, local_rank_, local_size_));
}

MpiCommunicator::~MpiCommunicator() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  // Freeing a communicator with requests still pending (after a timeout, or
  // while an exception unwinds) can block; the process is ending anyway.
  if (finalized || broken_ || std::uncaught_exceptions() > 0) return;
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
  auto work = std::make_unique<MpiWork>(this, std::vector<std::byte>(count * element * size_), "reduce_scatter");
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
  auto work = std::make_unique<MpiWork>(this, std::vector<std::byte>(), "all_gather");
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
  auto work = std::make_unique<MpiWork>(this, std::vector<std::byte>(count * size_of(dtype) * size_), "all_reduce");
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
  auto work = std::make_unique<MpiWork>(this, std::vector<std::byte>(), "broadcast");
  ZERO_CHECK_MPI(MPI_Ibcast(buffer, checked_count(count, "broadcast"), mpi_type_of(dtype), root, comm_,
                            work->request()));
  return work;
}

void MpiCommunicator::barrier() {
  MPI_Request request = MPI_REQUEST_NULL;
  ZERO_CHECK_MPI(MPI_Ibarrier(comm_, &request));
  wait_request(&request, "barrier");
}

void MpiCommunicator::all_reduce_host_f64(double* values, std::size_t count, ReduceOp op) {
  if (size_ == 1 || count == 0) return;
  std::vector<double> stacked(count * static_cast<std::size_t>(size_));
  MPI_Request request = MPI_REQUEST_NULL;
  ZERO_CHECK_MPI(MPI_Iallgather(values, checked_count(count, "all_reduce_host_f64"), MPI_DOUBLE, stacked.data(),
                                static_cast<int>(count), MPI_DOUBLE, comm_, &request));
  wait_request(&request, "all_reduce_host_f64");
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
