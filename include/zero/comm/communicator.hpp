// The Communicator interface: the collectives the engine needs, nothing more.
// Backends: MpiCommunicator (host memory; device memory staged through the
// host) and, in CUDA builds, NcclCommunicator (device memory).
//
// Conventions, shared by every backend:
// - counts are in elements of the given dtype;
// - reduce_scatter: send holds count * size() elements, recv gets count; the
//   call may be in place when recv == send + rank() * count (NCCL's rule);
// - all_gather: send holds count, recv gets count * size(); in place when
//   send == recv + rank() * count;
// - reductions of bf16/fp16 accumulate in fp32 and round once;
// - every call returns a Work handle; the result may be read only after
//   wait() (or synchronize() for device streams); calls are issued in the
//   same order on every rank (the MPI rule), from one thread;
// - `stream` is last and ignored by host backends (opaque cudaStream_t);
// - split() and split_hybrid() are collectives like the others; the
//   communicators they return are independent of their parent (either may be
//   destroyed first) and keep the parent's local_rank()/local_size().
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

#include "zero/core/dtype.hpp"

namespace zero {

enum class ReduceOp { sum, avg, max, min };

constexpr std::string_view name_of(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::max: return "max";
    case ReduceOp::min: return "min";
  }
  return "unknown";
}

/// Opaque stream handle (cudaStream_t in CUDA builds; null = default stream).
using Stream = void*;

/// An issued collective. wait() blocks until the result is in place and
/// rethrows its error, if any. Destroying an unwaited Work waits for it.
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;
  /// Non-blocking: true once wait() would return at once.
  virtual bool test() = 0;
  /// For a caller that orders every use of the result after the work on the
  /// device (stream order), as inside a CUDA graph capture, where the host
  /// cannot wait: drops the need to wait, so that destroying the handle does
  /// not block. Host backends' work is not stream-ordered: they finish it here.
  virtual void detach() { wait(); }
};
using WorkPtr = std::unique_ptr<Work>;

/// A Work that is already complete (for synchronous paths and world size 1).
class CompletedWork final : public Work {
 public:
  void wait() override {}
  bool test() override { return true; }
};

/// Which kind of memory a backend's buffers live in.
enum class MemoryKind { host, device };

class Communicator;

/// The two communicators of hybrid sharding (HSDP) over a world of N = R x S
/// ranks: parameters are sharded over a shard group of S ranks and replicated
/// over R replica groups. See Communicator::split_hybrid.
struct HybridGroups {
  /// This rank's shard group: world ranks [g*S, (g+1)*S) with g = rank / S,
  /// ordered by world rank (rank() = world rank % S). One node when the
  /// launcher places consecutive ranks on a node (docs/hsdp-launch.md).
  std::unique_ptr<Communicator> shard;
  /// The R ranks with the same world rank % S, ordered by world rank
  /// (rank() = world rank / S): the ranks holding the same shard.
  std::unique_ptr<Communicator> replica;
};

/// Throws zero::InvalidArgument unless 1 <= shard_group_size <= world_size and
/// shard_group_size divides world_size. Local arithmetic on values every rank
/// shares, so every rank throws the same error and none is left waiting in a
/// collective.
void check_shard_group_size(int shard_group_size, int world_size);

/// For implementations of Communicator::split: collective over `parent`.
/// Throws zero::InvalidArgument on every rank when any rank passed a negative
/// color (MPI_UNDEFINED and NCCL_SPLIT_NOCOLOR are negative: such a rank would
/// get no communicator, which split()'s return type cannot say), so a bad
/// color on one rank cannot leave the others waiting inside the split.
void agree_on_split_color(Communicator& parent, int color);

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// Rank among the processes on this node (selects the GPU).
  virtual int local_rank() const = 0;
  virtual int local_size() const = 0;
  virtual MemoryKind memory_kind() const = 0;
  virtual std::string backend_name() const = 0;

  virtual WorkPtr reduce_scatter(const void* send, void* recv, std::size_t count, DType dtype,
                                 ReduceOp op, Stream stream = nullptr) = 0;
  virtual WorkPtr all_gather(const void* send, void* recv, std::size_t count, DType dtype,
                             Stream stream = nullptr) = 0;
  /// In place: buffer holds count elements on every rank and gets the reduction.
  virtual WorkPtr all_reduce(void* buffer, std::size_t count, DType dtype, ReduceOp op,
                             Stream stream = nullptr) = 0;
  virtual WorkPtr broadcast(void* buffer, std::size_t count, DType dtype, int root,
                            Stream stream = nullptr) = 0;
  virtual void barrier() = 0;

  /// Sums host doubles across ranks in rank order, so every rank gets the same
  /// bits and the result does not depend on the backend's reduction tree
  /// (grad norms, overflow flags, loss averages).
  virtual void all_reduce_host_f64(double* values, std::size_t count, ReduceOp op) = 0;

  /// Whether collectives on device streams can be captured in a CUDA graph
  /// (NCCL's can; a host-staged path waits on the host, which a capture forbids).
  virtual bool graph_capturable() const { return false; }
  /// Scratch bytes the backend holds now and at most (counted as engine buffers).
  virtual std::size_t workspace_bytes() const { return 0; }
  virtual std::size_t peak_workspace_bytes() const { return 0; }

  /// MPI_Comm_split's semantics, collective over every rank of this
  /// communicator: the ranks passing the same color form a new communicator
  /// of the same backend, ranked by key, ties by rank here. Colors must be
  /// >= 0 on every rank (a negative one throws zero::InvalidArgument on every
  /// rank). The default throws zero::InvalidArgument naming backend_name():
  /// a backend that cannot form sub-groups says so instead of guessing.
  virtual std::unique_ptr<Communicator> split(int color, int key);

  /// Splits a world of N = R x S ranks for hybrid sharding (see HybridGroups):
  /// shard group color rank / S, replica group color rank % S, both keyed by
  /// rank. S == N gives a shard group holding the whole world (still a new
  /// communicator) and replica groups of one rank. Throws
  /// zero::InvalidArgument on every rank (check_shard_group_size) unless
  /// 1 <= S <= N and S divides N. The default calls split() twice, shard
  /// group first.
  virtual HybridGroups split_hybrid(int shard_group_size);
};

}  // namespace zero
