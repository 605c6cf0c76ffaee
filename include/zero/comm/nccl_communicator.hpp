// NcclCommunicator: zero's Communicator on device memory through NCCL.
//
// Made either collectively over an MPI communicator (MPI only bootstraps: rank
// 0's ncclUniqueId is broadcast, the GPU is picked from the node-local rank),
// or around an ncclComm_t the caller already has, which it keeps owning.
//
// Collectives are enqueued on the caller's stream and return at once; the
// Work holds an event recorded after the collective. Work::wait() blocks the
// host on that event while watching ncclCommGetAsyncError; past
// NcclOptions::timeout it aborts the communicator and throws zero::CommError
// (the communicator is unusable afterwards: recreate it on every rank).
// Only stream order is needed for device consumers: a kernel enqueued on the
// same stream after the collective sees its result without any wait().
#pragma once

#include <mpi.h>
#include <nccl.h>

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "zero/comm/communicator.hpp"

namespace zero {

/// How bf16/fp16 sum/avg reductions are carried out.
enum class HalfReduction {
  /// NCCL reduces in the 16-bit type: one rounding per hop of its ring or
  /// tree (world - 1 roundings at most). Half the bytes on the wire.
  native,
  /// Converted to fp32, reduced, rounded once (the Communicator contract's
  /// "accumulate in fp32, round once"), at twice the bytes on the wire and an
  /// fp32 scratch buffer of the message size.
  fp32_accumulate,
};

struct NcclOptions {
  /// How long Work::wait() lets one collective run before aborting.
  std::chrono::milliseconds timeout = std::chrono::seconds(600);
  /// GPU for this rank; -1 picks node-local rank % visible GPUs.
  int device = -1;
  HalfReduction half_reduction = HalfReduction::native;
  void validate() const;
};

class NcclCommunicator final : public Communicator {
 public:
  /// Collective over every rank of `comm` (which is duplicated, not kept).
  /// Makes the chosen GPU current. Throws zero::InvalidArgument on every rank
  /// when a node has more ranks than GPUs (NCCL cannot put two ranks on one
  /// GPU: use StagedCommunicator there).
  explicit NcclCommunicator(MPI_Comm comm, NcclOptions options = {});

  /// Wraps an existing communicator; it is neither finalized nor destroyed
  /// here (it is aborted if a collective times out). `host_comm`, when not
  /// MPI_COMM_NULL, must hold the same ranks in the same order and serves
  /// barrier() and all_reduce_host_f64(); otherwise NCCL does. local_rank and
  /// local_size of -1 are read from the launcher's environment.
  NcclCommunicator(ncclComm_t comm, MPI_Comm host_comm = MPI_COMM_NULL, NcclOptions options = {},
                   int local_rank = -1, int local_size = -1);

  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int local_rank() const override { return local_rank_; }
  int local_size() const override { return local_size_; }
  MemoryKind memory_kind() const override { return MemoryKind::device; }
  std::string backend_name() const override { return "nccl"; }
  /// NCCL's collectives are captured like kernels. (The fp32_accumulate
  /// scratch must have reached its size before: grown in a capture it would
  /// be freed under the graph.)
  bool graph_capturable() const override { return true; }

  WorkPtr reduce_scatter(const void* send, void* recv, std::size_t count, DType dtype,
                         ReduceOp op, Stream stream = nullptr) override;
  WorkPtr all_gather(const void* send, void* recv, std::size_t count, DType dtype,
                     Stream stream = nullptr) override;
  WorkPtr all_reduce(void* buffer, std::size_t count, DType dtype, ReduceOp op,
                     Stream stream = nullptr) override;
  WorkPtr broadcast(void* buffer, std::size_t count, DType dtype, int root,
                    Stream stream = nullptr) override;
  void barrier() override;
  void all_reduce_host_f64(double* values, std::size_t count, ReduceOp op) override;

  std::size_t workspace_bytes() const override;
  std::size_t peak_workspace_bytes() const override;

  /// The GPU this communicator runs on.
  int device() const { return device_; }
  /// The underlying NCCL communicator (still owned by whoever owned it).
  ncclComm_t nccl_comm() const;
  /// True once a timeout or an asynchronous NCCL error aborted the communicator.
  bool aborted() const;

  /// ncclCommSplit (NCCL >= 2.18; older NCCL throws zero::InvalidArgument),
  /// collective over every rank of this communicator; see Communicator::split.
  /// The child owns its ncclComm_t (finalized and destroyed with it, even
  /// when this one wraps a caller's), runs on the same GPU with the same
  /// NcclOptions and keeps this one's local_rank()/local_size() (they chose
  /// the GPU). When this one has a host MPI communicator, it is split with
  /// the same color and key for the child's barrier() and host reductions.
  /// Like the bootstrap, the split blocks until every rank has called it.
  std::unique_ptr<Communicator> split(int color, int key) override;

  struct State;  // shared with outstanding Work (public only for the .cpp's helpers)

 private:
  struct SplitTag {};
  /// A child of split() before its communicators exist: no NCCL or MPI calls.
  NcclCommunicator(SplitTag, NcclOptions options, int device, int local_rank, int local_size);
  void init_common();
  WorkPtr finish(Stream stream);
  WorkPtr one_rank_copy(void* dst, const void* src, std::size_t bytes, Stream stream);
  float* fp32_scratch(std::size_t elements, Stream stream);
  void release_scratch(Stream stream);
  bool widen(DType dtype, ReduceOp op) const;

  std::shared_ptr<State> state_;
  NcclOptions options_;
  MPI_Comm host_comm_ = MPI_COMM_NULL;
  bool owns_host_comm_ = false;
  int rank_ = 0, size_ = 1, local_rank_ = 0, local_size_ = 1, device_ = 0;
};

}  // namespace zero
