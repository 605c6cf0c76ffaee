#include "zero/comm/mpi_communicator.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
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

// ---------------------------------------------------------------- run_or_abort

namespace {

// Failure reports travel on MPI_COMM_WORLD under this tag, apart from every
// collective (those run on duplicated communicators).
constexpr int kFailureReportTag = 0x7a65;
// How long rank 0 collects the other ranks' reports, and how long another
// failing rank waits for rank 0 to take its report over.
constexpr auto kFailureReportWait = std::chrono::milliseconds(1500);
constexpr std::size_t kMaxReportBytes = 8192;

// One write(2) per line: lines from several ranks, relayed by mpirun, never
// run together.
void write_line(std::string line) {
  line += '\n';
  const char* next = line.data();
  std::size_t left = line.size();
  while (left > 0) {
    const ssize_t written = ::write(STDERR_FILENO, next, left);
    if (written < 0) {
      if (errno == EINTR) continue;
      return;
    }
    next += written;
    left -= static_cast<std::size_t>(written);
  }
}

// What went wrong, for the user, without the "[zero rank R]" prefix (the
// caller adds the rank it knows from MPI): zero's own message, and its
// source location only in debug mode.
std::string failure_text(const std::exception_ptr& failure, const FailureDescriber& describe) {
  try {
    std::rethrow_exception(failure);
  } catch (const Error& error) {
    return debug_mode() ? error.location() + ": " + error.message() : error.message();
  } catch (const std::bad_alloc&) {
    return "out of host memory: an allocation failed (std::bad_alloc); a size in the configuration (batch_size, "
           "latent_size, the model, the dataset) is more than this machine's memory holds";
  } catch (const std::exception& error) {
    if (describe) {
      if (std::optional<std::string> text = describe(error)) return *text;
    }
    return error.what();
  } catch (...) {
    return "unknown exception";
  }
}

bool mpi_usable() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized;
}

std::string rank_prefix(int rank, int size) {
  return size > 1 ? "[zero rank " + std::to_string(rank) + "] " : std::string("[zero] ");
}

// Rank 0 prints its own failure, then, for a short while, takes over the
// reports of other ranks that fail too: each is printed only when it says
// something else; the ranks that failed the same way are named in one line.
void report_as_rank_zero(const std::string& text, int size) {
  write_line(rank_prefix(0, size) + text);
  std::vector<int> same;
  int reports = 0;
  const auto deadline = std::chrono::steady_clock::now() + kFailureReportWait;
  while (reports < size - 1 && std::chrono::steady_clock::now() < deadline) {
    int arrived = 0;
    MPI_Status status;
    if (MPI_Iprobe(MPI_ANY_SOURCE, kFailureReportTag, MPI_COMM_WORLD, &arrived, &status) != MPI_SUCCESS) break;
    if (!arrived) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      continue;
    }
    int bytes = 0;
    MPI_Get_count(&status, MPI_CHAR, &bytes);
    std::string other(static_cast<std::size_t>(std::max(bytes, 0)), '\0');
    MPI_Recv(other.data(), bytes, MPI_CHAR, status.MPI_SOURCE, kFailureReportTag, MPI_COMM_WORLD,
             MPI_STATUS_IGNORE);
    static const int taken = 1;
    MPI_Request ack = MPI_REQUEST_NULL;
    MPI_Isend(&taken, 1, MPI_INT, status.MPI_SOURCE, kFailureReportTag, MPI_COMM_WORLD, &ack);
    MPI_Request_free(&ack);
    ++reports;
    if (other == text.substr(0, kMaxReportBytes)) {
      same.push_back(status.MPI_SOURCE);
    } else {
      write_line(rank_prefix(status.MPI_SOURCE, size) + other);
    }
  }
  if (!same.empty()) {
    std::sort(same.begin(), same.end());
    std::string ranks;
    for (int r : same) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    write_line(std::string("[zero] rank") + (same.size() > 1 ? "s " : " ") + ranks + " failed the same way");
  }
}

// Another rank sends its report to rank 0 and prints it itself only when
// rank 0 does not take it over in time (rank 0 is still working, or waiting
// in a collective).
void report_as_other_rank(const std::string& text, int rank, int size) {
  const std::string report = text.substr(0, kMaxReportBytes);
  MPI_Request sent = MPI_REQUEST_NULL;
  MPI_Isend(report.data(), static_cast<int>(report.size()), MPI_CHAR, 0, kFailureReportTag, MPI_COMM_WORLD, &sent);
  const auto deadline = std::chrono::steady_clock::now() + kFailureReportWait;
  while (std::chrono::steady_clock::now() < deadline) {
    int answered = 0;
    MPI_Status status;
    if (MPI_Iprobe(0, kFailureReportTag, MPI_COMM_WORLD, &answered, &status) != MPI_SUCCESS) break;
    if (answered) return;  // rank 0 prints it
    int unused = 0;
    MPI_Test(&sent, &unused, MPI_STATUS_IGNORE);  // progress a large report
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  write_line(rank_prefix(rank, size) + text);
}

void report_failure(const std::exception_ptr& failure, const FailureDescriber& describe) {
  const std::string text = failure_text(failure, describe);
  if (!mpi_usable()) {
    write_line(rank_prefix(0, 1) + text);
    return;
  }
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size == 1) {
    write_line(rank_prefix(0, 1) + text);
  } else if (rank == 0) {
    report_as_rank_zero(text, size);
  } else {
    report_as_other_rank(text, rank, size);
  }
}

}  // namespace

int run_or_abort(const std::function<int()>& main_body, const FailureDescriber& describe) {
  try {
    return main_body();
  } catch (...) {
    report_failure(std::current_exception(), describe);
  }
  if (mpi_usable()) MPI_Abort(MPI_COMM_WORLD, 1);
  return 1;
}

}  // namespace zero
