// Communicator splitting without MPI: the shard-group-size check, the
// defaults of Communicator::split / split_hybrid, and the planner's
// SimulatedCommunicator, whose split_hybrid must give the groups a real
// split would (tests/mpi/test_comm_split.cpp checks the real ones).
#include <doctest/doctest.h>

#include <string>

#include "zero/comm/simulated_communicator.hpp"

using namespace zero;

namespace {

std::string refusal_of_shape(int shard_group_size, int world_size) {
  try {
    check_shard_group_size(shard_group_size, world_size);
  } catch (const InvalidArgument& e) {
    return e.message();
  }
  return {};
}

/// A backend that implements only what it must: split() and split_hybrid()
/// are the base class's. Its collectives are never called here.
class FixedRankCommunicator final : public Communicator {
 public:
  FixedRankCommunicator(int rank, int size) : rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int local_rank() const override { return 0; }
  int local_size() const override { return 1; }
  MemoryKind memory_kind() const override { return MemoryKind::host; }
  std::string backend_name() const override { return "fixed-rank"; }
  WorkPtr reduce_scatter(const void*, void*, std::size_t, DType, ReduceOp, Stream) override { return unused(); }
  WorkPtr all_gather(const void*, void*, std::size_t, DType, Stream) override { return unused(); }
  WorkPtr all_reduce(void*, std::size_t, DType, ReduceOp, Stream) override { return unused(); }
  WorkPtr broadcast(void*, std::size_t, DType, int, Stream) override { return unused(); }
  void barrier() override { unused(); }
  void all_reduce_host_f64(double*, std::size_t, ReduceOp) override { unused(); }

 private:
  static WorkPtr unused() { ZERO_THROW(InternalError, "FixedRankCommunicator: no collectives in this test"); }
  int rank_, size_;
};

}  // namespace

TEST_CASE("check_shard_group_size: 1 <= S <= N and S divides N, else a message naming S and N") {
  for (int n = 1; n <= 16; ++n)
    for (int s = -2; s <= n + 2; ++s) {
      CAPTURE(n);
      CAPTURE(s);
      const bool fits = s >= 1 && s <= n && n % s == 0;
      const std::string message = refusal_of_shape(s, n);
      CHECK(message.empty() == fits);
      if (!fits) {
        CHECK(message.find("shard_group_size S=" + std::to_string(s)) != std::string::npos);
        CHECK(message.find("N=" + std::to_string(n)) != std::string::npos);
      }
    }
}

TEST_CASE("Communicator defaults: split refuses naming the backend; split_hybrid checks S first") {
  FixedRankCommunicator comm(1, 4);
  try {
    (void)comm.split(0, 0);
    FAIL("split did not throw");
  } catch (const InvalidArgument& e) {
    CHECK(e.message().find("'fixed-rank' cannot be split") != std::string::npos);
  }
  // A valid S reaches split(), which refuses.
  CHECK_THROWS_WITH_AS((void)comm.split_hybrid(2), doctest::Contains("'fixed-rank' cannot be split"),
                       InvalidArgument);
  // An invalid S is refused before any split (no collective is entered).
  CHECK_THROWS_WITH_AS((void)comm.split_hybrid(3), doctest::Contains("shard_group_size S=3"), InvalidArgument);
}

TEST_CASE("SimulatedCommunicator::split_hybrid: the groups a real split gives, for every rank") {
  for (MemoryKind kind : {MemoryKind::host, MemoryKind::device}) {
    for (int n = 1; n <= 12; ++n) {
      for (int s = 1; s <= n; ++s) {
        if (n % s != 0) continue;
        for (int r = 0; r < n; ++r) {
          CAPTURE(n);
          CAPTURE(s);
          CAPTURE(r);
          SimulatedCommunicator world(n, r, kind);
          HybridGroups groups = world.split_hybrid(s);
          REQUIRE(groups.shard);
          REQUIRE(groups.replica);
          CHECK(groups.shard->size() == s);
          CHECK(groups.shard->rank() == r % s);
          CHECK(groups.replica->size() == n / s);
          CHECK(groups.replica->rank() == r / s);
          for (Communicator* group : {groups.shard.get(), groups.replica.get()}) {
            CHECK(group->memory_kind() == kind);
            CHECK(group->backend_name() == "simulated");
            CHECK(group->local_rank() == world.local_rank());
            CHECK(group->local_size() == world.local_size());
          }
        }
      }
    }
  }
  SimulatedCommunicator world(6);
  CHECK_THROWS_WITH_AS((void)world.split_hybrid(4), doctest::Contains("shard_group_size S=4"), InvalidArgument);
  CHECK_THROWS_WITH_AS((void)world.split_hybrid(0), doctest::Contains("N=6"), InvalidArgument);
  // split() needs the other ranks' colors, which one simulated rank never sees.
  CHECK_THROWS_WITH_AS((void)world.split(0, 0), doctest::Contains("cannot be split"), InvalidArgument);
  // The groups' collectives complete at once, as the world's do.
  HybridGroups groups = world.split_hybrid(3);
  float x = 1.0f;
  CHECK(groups.shard->all_reduce(&x, 1, DType::fp32, ReduceOp::sum)->test());
  CHECK(groups.replica->all_gather(&x, &x, 1, DType::fp32)->test());
}
