// The Communicator defaults: split() refuses, split_hybrid() is two split()s.

#include "zero/comm/communicator.hpp"

#include "zero/core/error.hpp"

namespace zero {

void check_shard_group_size(int shard_group_size, int world_size) {
  ZERO_CHECK(shard_group_size >= 1 && shard_group_size <= world_size &&
                 world_size % shard_group_size == 0,
             "shard_group_size S=", shard_group_size, " does not fit a world of N=", world_size,
             " ranks: hybrid sharding needs 1 <= S <= N and N = R x S (S must divide N)");
}

void agree_on_split_color(Communicator& parent, int color) {
  // Every int is exact in a double, so the minimum is the lowest color itself.
  double lowest = color;
  parent.all_reduce_host_f64(&lowest, 1, ReduceOp::min);
  ZERO_CHECK(lowest >= 0, "split: color ", static_cast<long long>(lowest), " (the lowest any of the ",
             parent.size(), " ranks of '", parent.backend_name(),
             "' passed) is negative; every rank must pass a color >= 0 (a rank in no group is not "
             "supported)");
}

std::unique_ptr<Communicator> Communicator::split(int, int) {
  ZERO_THROW(InvalidArgument, "communicator '", backend_name(),
             "' cannot be split: it does not implement Communicator::split");
}

HybridGroups Communicator::split_hybrid(int shard_group_size) {
  const int world = size(), me = rank(), s = shard_group_size;
  check_shard_group_size(s, world);
  HybridGroups groups;
  // Keyed by the world rank so that both groups keep the world's order.
  groups.shard = split(me / s, me);
  groups.replica = split(me % s, me);
  // A backend whose split orders ranks otherwise would shard by the wrong
  // slices without any error later; catch it here, where it is cheap.
  ZERO_ASSERT(groups.shard->size() == s && groups.shard->rank() == me % s,
              "shard group of '", backend_name(), "': rank ", groups.shard->rank(), " of ",
              groups.shard->size(), ", expected ", me % s, " of ", s);
  ZERO_ASSERT(groups.replica->size() == world / s && groups.replica->rank() == me / s,
              "replica group of '", backend_name(), "': rank ", groups.replica->rank(), " of ",
              groups.replica->size(), ", expected ", me / s, " of ", world / s);
  return groups;
}

}  // namespace zero
