// SimulatedCommunicator: one rank of a world of any size whose collectives
// complete at once and move nothing. With a counting backend it lets the
// planner run the real engine's schedule for N ranks in one process; no
// data is ever read or written.
#pragma once

#include <array>
#include <memory>

#include "zero/comm/communicator.hpp"
#include "zero/core/error.hpp"

namespace zero {

/// Bytes one rank sends per collective under the ring algorithms NCCL uses
/// (reduce-scatter and all-gather: (n-1) slices; all-reduce: 2 (n-1)/n of
/// the buffer), summed by the communicator that carried them: the world's
/// (flat), a shard group's or a replica group's (hybrid sharding). Shared by
/// a simulated communicator and the groups split from it.
struct SimulatedTraffic {
  enum Group { world, shard, replica };
  std::array<double, 3> bytes_sent{};
  void reset() { bytes_sent = {}; }
};

class SimulatedCommunicator final : public Communicator {
 public:
  SimulatedCommunicator(int world_size, int rank = 0, MemoryKind kind = MemoryKind::device)
      : size_(world_size), rank_(rank), local_rank_(rank), local_size_(world_size), kind_(kind) {
    ZERO_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "SimulatedCommunicator: rank ", rank,
               " of world size ", world_size);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int local_rank() const override { return local_rank_; }
  int local_size() const override { return local_size_; }
  MemoryKind memory_kind() const override { return kind_; }
  std::string backend_name() const override { return "simulated"; }

  WorkPtr reduce_scatter(const void*, void*, std::size_t count, DType dtype, ReduceOp, Stream) override {
    return sent(static_cast<double>(size_ - 1) * static_cast<double>(count * size_of(dtype)));
  }
  WorkPtr all_gather(const void*, void*, std::size_t count, DType dtype, Stream) override {
    return sent(static_cast<double>(size_ - 1) * static_cast<double>(count * size_of(dtype)));
  }
  WorkPtr all_reduce(void*, std::size_t count, DType dtype, ReduceOp, Stream) override {
    return sent(2.0 * (size_ - 1) / size_ * static_cast<double>(count * size_of(dtype)));
  }
  WorkPtr broadcast(void*, std::size_t count, DType dtype, int, Stream) override {
    return sent(size_ > 1 ? static_cast<double>(count * size_of(dtype)) : 0.0);
  }
  /// What this communicator and the groups split from it have sent (this rank).
  const SimulatedTraffic& traffic() const { return *traffic_; }
  void reset_traffic() { traffic_->reset(); }
  void barrier() override {}
  /// Every rank is taken to hold the same values: min and max leave them,
  /// and so does a sum (the engine's agreement checks pass).
  void all_reduce_host_f64(double*, std::size_t, ReduceOp) override {}

  /// Refuses, as the default does: a simulated rank stands for all N alone
  /// and never hears the other ranks' colors, so it cannot know who shares
  /// its group. split_hybrid's groups follow from (rank, N, S), so that works.
  std::unique_ptr<Communicator> split(int, int) override {
    ZERO_THROW(InvalidArgument, "communicator 'simulated' cannot be split: one simulated rank does "
               "not know the other ranks' colors (split_hybrid works)");
  }
  /// The groups a real split_hybrid would give this rank, simulated: a shard
  /// group of S ranks (rank % S) and a replica group of N / S (rank / S), on
  /// the same memory kind and this one's local rank and size (as every
  /// backend's split keeps them). Their collectives complete at once, as here.
  HybridGroups split_hybrid(int shard_group_size) override {
    check_shard_group_size(shard_group_size, size_);
    const int s = shard_group_size;
    auto shard = std::make_unique<SimulatedCommunicator>(s, rank_ % s, kind_);
    auto replica = std::make_unique<SimulatedCommunicator>(size_ / s, rank_ / s, kind_);
    for (SimulatedCommunicator* group : {shard.get(), replica.get()}) {
      group->local_rank_ = local_rank_;
      group->local_size_ = local_size_;
      group->traffic_ = traffic_;
    }
    shard->group_ = SimulatedTraffic::shard;
    replica->group_ = SimulatedTraffic::replica;
    return {std::move(shard), std::move(replica)};
  }

 private:
  WorkPtr sent(double bytes) {
    traffic_->bytes_sent[group_] += bytes;
    return std::make_unique<CompletedWork>();
  }
  int size_, rank_, local_rank_, local_size_;
  MemoryKind kind_;
  std::shared_ptr<SimulatedTraffic> traffic_ = std::make_shared<SimulatedTraffic>();
  SimulatedTraffic::Group group_ = SimulatedTraffic::world;
};

}  // namespace zero
