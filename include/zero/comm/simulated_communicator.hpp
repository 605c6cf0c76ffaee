// SimulatedCommunicator: one rank of a world of any size whose collectives
// complete at once and move nothing. With a counting backend it lets the
// planner run the real engine's schedule for N ranks in one process; no
// data is ever read or written.
#pragma once

#include "zero/comm/communicator.hpp"
#include "zero/core/error.hpp"

namespace zero {

class SimulatedCommunicator final : public Communicator {
 public:
  SimulatedCommunicator(int world_size, int rank = 0, MemoryKind kind = MemoryKind::device)
      : size_(world_size), rank_(rank), kind_(kind) {
    ZERO_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "SimulatedCommunicator: rank ", rank,
               " of world size ", world_size);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int local_rank() const override { return rank_; }
  int local_size() const override { return size_; }
  MemoryKind memory_kind() const override { return kind_; }
  std::string backend_name() const override { return "simulated"; }

  WorkPtr reduce_scatter(const void*, void*, std::size_t, DType, ReduceOp, Stream) override { return done(); }
  WorkPtr all_gather(const void*, void*, std::size_t, DType, Stream) override { return done(); }
  WorkPtr all_reduce(void*, std::size_t, DType, ReduceOp, Stream) override { return done(); }
  WorkPtr broadcast(void*, std::size_t, DType, int, Stream) override { return done(); }
  void barrier() override {}
  /// Every rank is taken to hold the same values: min and max leave them,
  /// and so does a sum (the engine's agreement checks pass).
  void all_reduce_host_f64(double*, std::size_t, ReduceOp) override {}

 private:
  static WorkPtr done() { return std::make_unique<CompletedWork>(); }
  int size_, rank_;
  MemoryKind kind_;
};

}  // namespace zero
