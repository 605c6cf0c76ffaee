// MPI backend on host memory. Reductions are computed by zero itself, in rank
// order with fp32 accumulation (reduce-scatter = one all-to-all, then a local
// sum), so results are deterministic, bf16/fp16 work without custom MPI types,
// and every stage that reduces the same bucket gets the same bits.
#pragma once

#include <mpi.h>

#include <chrono>
#include <functional>
#include <optional>
#include <memory>
#include <string>

#include "zero/comm/communicator.hpp"
#include "zero/core/error.hpp"

/// Throws zero::CommError with MPI's error string when an MPI call fails.
#define ZERO_CHECK_MPI(call)                                                         \
  do {                                                                               \
    const int zero_mpi_rc_ = (call);                                                 \
    if (zero_mpi_rc_ != MPI_SUCCESS) {                                               \
      char zero_mpi_text_[MPI_MAX_ERROR_STRING];                                     \
      int zero_mpi_len_ = 0;                                                         \
      MPI_Error_string(zero_mpi_rc_, zero_mpi_text_, &zero_mpi_len_);                \
      ZERO_THROW(::zero::CommError, #call " failed: ", std::string(zero_mpi_text_, zero_mpi_len_)); \
    }                                                                                \
  } while (0)

namespace zero {

/// Initializes MPI (thread level FUNNELED: only the main thread calls MPI) if
/// nobody has, and finalizes it on destruction if it did.
class MpiSession {
 public:
  MpiSession(int* argc, char*** argv);
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;

 private:
  bool owns_ = false;
};

class MpiCommunicator final : public Communicator {
 public:
  /// Duplicates `comm` (the caller keeps its own) and makes MPI errors return
  /// codes so that they become zero::CommError instead of aborting.
  ///
  /// `timeout`: how long any one collective may take before it is declared
  /// hung (a dead or stopped rank) and zero::CommError is thrown; under
  /// run_or_abort that ends every rank. Default: ZERO_COMM_TIMEOUT_S from the
  /// environment, else 60 s. Raise it where a step legitimately waits longer
  /// (slow checkpoint disks).
  explicit MpiCommunicator(MPI_Comm comm = MPI_COMM_WORLD, std::chrono::milliseconds timeout = default_timeout());
  static std::chrono::milliseconds default_timeout();
  std::chrono::milliseconds timeout() const { return timeout_; }
  /// Waits for a request with the communicator's timeout (spins briefly,
  /// then polls); throws zero::CommError naming `what` when it expires.
  void wait_request(MPI_Request* request, const char* what) const;
  /// True once a collective has timed out; every later wait throws at once.
  bool broken() const { return broken_; }
  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int local_rank() const override { return local_rank_; }
  int local_size() const override { return local_size_; }
  MemoryKind memory_kind() const override { return MemoryKind::host; }
  std::string backend_name() const override { return "mpi"; }
  MPI_Comm mpi_comm() const { return comm_; }

  WorkPtr reduce_scatter(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op,
                         Stream stream = nullptr) override;
  WorkPtr all_gather(const void* send, void* recv, std::size_t count, DType dtype,
                     Stream stream = nullptr) override;
  WorkPtr all_reduce(void* buffer, std::size_t count, DType dtype, ReduceOp op,
                     Stream stream = nullptr) override;
  WorkPtr broadcast(void* buffer, std::size_t count, DType dtype, int root,
                    Stream stream = nullptr) override;
  void barrier() override;
  void all_reduce_host_f64(double* values, std::size_t count, ReduceOp op) override;

  std::size_t workspace_bytes() const override { return workspace_bytes_; }
  std::size_t peak_workspace_bytes() const override { return peak_workspace_bytes_; }

  /// MPI_Comm_split of this communicator (see Communicator::split). The new
  /// MpiCommunicator owns and frees its MPI_Comm, returns MPI errors as codes
  /// and has this one's timeout. Its local_rank()/local_size() stay this
  /// one's (the rank among the node's processes, which picks the GPU), not
  /// the rank among the group's members on the node. Error messages keep
  /// naming the world rank: a child does not call set_process_rank.
  std::unique_ptr<Communicator> split(int color, int key) override;

 private:
  friend class MpiWork;
  struct Adopt {};
  /// Takes ownership of `comm` (a split's result); node-local values given.
  MpiCommunicator(Adopt, MPI_Comm comm, std::chrono::milliseconds timeout, int local_rank,
                  int local_size);
  void track_workspace(std::ptrdiff_t delta);

  std::chrono::milliseconds timeout_;
  mutable bool broken_ = false;
  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Comm node_comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1, local_rank_ = 0, local_size_ = 1;
  std::size_t workspace_bytes_ = 0, peak_workspace_bytes_ = 0;
};

/// Reduces `ranks` buffers of `count` elements laid out one after the other
/// (rank 0 first) into out, in rank order with fp32 accumulation, rounding
/// once. The definition every host collective uses; exposed for tests.
void reduce_in_rank_order(const void* stacked, int ranks, std::size_t count, DType dtype,
                          ReduceOp op, void* out);

/// The user's one-line text of an exception zero does not know (a LibTorch
/// error, say), or nothing to let run_or_abort describe it.
using FailureDescriber = std::function<std::optional<std::string>(const std::exception&)>;

/// Runs main_body; on any exception prints it to stderr and calls MPI_Abort
/// so that no other rank waits forever in a collective. The message is
/// printed once: by rank 0 with its rank when it failed too (then one line
/// for each other rank whose message differs, and one naming those that
/// failed the same way), else by the rank that failed. zero's errors show
/// their source location only in debug mode (ZERO_DEBUG=1).
int run_or_abort(const std::function<int()>& main_body, const FailureDescriber& describe = {});

}  // namespace zero
