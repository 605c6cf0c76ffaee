// StagedCommunicator: lets a host-memory Communicator (the MPI one) serve
// device buffers. Each collective copies the device data to pinned host
// memory on the caller's stream, waits for that copy, runs the host
// collective, and copies the result back on the same stream.
//
// Slower than NCCL (two PCIe crossings and a host reduction per call) but it
// works wherever MPI does: several ranks sharing one GPU (tests, small
// machines), or GPUs without NCCL. The host collective completes inside the
// call; the returned Work covers the copy back, so the result is ready for
// kernels enqueued on the same stream and for the host after wait().
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "zero/comm/communicator.hpp"

namespace zero {

class StagedCommunicator final : public Communicator {
 public:
  /// Uses `host` (not owned: it must outlive this object). Its memory_kind()
  /// must be MemoryKind::host.
  explicit StagedCommunicator(Communicator& host);
  /// Owns `host`.
  explicit StagedCommunicator(std::unique_ptr<Communicator> host);
  ~StagedCommunicator() override;
  StagedCommunicator(const StagedCommunicator&) = delete;
  StagedCommunicator& operator=(const StagedCommunicator&) = delete;

  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  int local_rank() const override { return host_->local_rank(); }
  int local_size() const override { return host_->local_size(); }
  MemoryKind memory_kind() const override { return MemoryKind::device; }
  std::string backend_name() const override { return "staged(" + host_->backend_name() + ")"; }

  WorkPtr reduce_scatter(const void* send, void* recv, std::size_t count, DType dtype,
                         ReduceOp op, Stream stream = nullptr) override;
  WorkPtr all_gather(const void* send, void* recv, std::size_t count, DType dtype,
                     Stream stream = nullptr) override;
  WorkPtr all_reduce(void* buffer, std::size_t count, DType dtype, ReduceOp op,
                     Stream stream = nullptr) override;
  WorkPtr broadcast(void* buffer, std::size_t count, DType dtype, int root,
                    Stream stream = nullptr) override;
  void barrier() override { host_->barrier(); }
  void all_reduce_host_f64(double* values, std::size_t count, ReduceOp op) override {
    host_->all_reduce_host_f64(values, count, op);
  }

  /// Pinned staging bytes held now / at most, plus the host backend's own.
  std::size_t workspace_bytes() const override;
  std::size_t peak_workspace_bytes() const override;

  Communicator& host() { return *host_; }

  /// Splits the host communicator (collective over its ranks) and stages the
  /// result: an owning StagedCommunicator with its own pinned buffers.
  std::unique_ptr<Communicator> split(int color, int key) override;

 private:
  struct Staging;
  unsigned char* stage(std::size_t bytes);
  void before_staging();
  WorkPtr after_copy_back(Stream stream);

  std::unique_ptr<Communicator> owned_;
  Communicator* host_;
  std::unique_ptr<Staging> staging_;
};

}  // namespace zero
