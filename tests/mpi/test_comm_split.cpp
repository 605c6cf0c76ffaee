// Communicator::split and split_hybrid on the MPI backend, at whatever world
// size mpirun gives. Every group is checked the same way: each rank draws
// fresh random inputs, the whole world exchanges them with a plain
// MPI_Allgather on MPI_COMM_WORLD, and every rank computes what its group's
// collective must return from the members the split semantics predict (a
// reference written here, independent of the backend). A rank placed in the
// wrong group, or in the right group at the wrong position, changes the sums.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "zero/comm/mpi_communicator.hpp"

using namespace zero;

namespace {

int world_rank() {
  int rank = 0;
  ZERO_CHECK_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  return rank;
}

int world_size() {
  int size = 0;
  ZERO_CHECK_MPI(MPI_Comm_size(MPI_COMM_WORLD, &size));
  return size;
}

/// MPI_Comm_split's rule, as the reference: the world ranks sharing `me`'s
/// color, ordered by key, ties by world rank.
std::vector<int> predicted_members(int world, int me, const std::function<int(int)>& color_of,
                                   const std::function<int(int)>& key_of) {
  std::vector<int> members;
  for (int r = 0; r < world; ++r)
    if (color_of(r) == color_of(me)) members.push_back(r);
  std::stable_sort(members.begin(), members.end(),
                   [&](int a, int b) { return key_of(a) < key_of(b); });
  return members;
}

/// A fresh seed per test run, the same on every rank (rank 0 draws it), so a
/// failure can be replayed from the seed printed with it.
std::uint32_t shared_seed() {
  std::uint32_t seed = world_rank() == 0 ? std::random_device{}() : 0;
  ZERO_CHECK_MPI(MPI_Bcast(&seed, 1, MPI_UINT32_T, 0, MPI_COMM_WORLD));
  return seed;
}

/// Each rank's `bytes` of random data, gathered over the whole world:
/// result[r] is world rank r's.
std::vector<std::vector<std::byte>> exchange(const std::vector<std::byte>& mine) {
  const int world = world_size();
  std::vector<std::byte> all(mine.size() * static_cast<std::size_t>(world));
  ZERO_CHECK_MPI(MPI_Allgather(mine.data(), static_cast<int>(mine.size()), MPI_BYTE, all.data(),
                               static_cast<int>(mine.size()), MPI_BYTE, MPI_COMM_WORLD));
  std::vector<std::vector<std::byte>> by_rank;
  for (int r = 0; r < world; ++r)
    by_rank.emplace_back(all.begin() + static_cast<std::ptrdiff_t>(r * mine.size()),
                         all.begin() + static_cast<std::ptrdiff_t>((r + 1) * mine.size()));
  return by_rank;
}

std::vector<std::byte> random_elements(std::mt19937& rng, std::size_t count, DType dtype) {
  std::normal_distribution<float> normal(0.0f, 4.0f);
  std::vector<std::byte> data(count * size_of(dtype));
  for (std::size_t i = 0; i < count; ++i) store_from_float(data.data(), i, dtype, normal(rng));
  return data;
}

/// Element i of the members' inputs summed in group order with fp32
/// accumulation, rounded once: the contract every backend meets.
float group_sum(const std::vector<std::vector<std::byte>>& inputs, const std::vector<int>& members,
                std::size_t i, DType dtype) {
  float acc = load_as_float(inputs[members[0]].data(), i, dtype);
  for (std::size_t m = 1; m < members.size(); ++m) acc = acc + load_as_float(inputs[members[m]].data(), i, dtype);
  return round_to(dtype, acc);
}

/// Checks `group` (this rank's group, predicted to hold `members`, world
/// ranks in group order) with every collective against the world exchange.
void check_group(Communicator& group, const std::vector<int>& members, std::mt19937& rng) {
  const int me = world_rank();
  const auto position = std::find(members.begin(), members.end(), me);
  REQUIRE(position != members.end());
  const int g = static_cast<int>(members.size());
  const int gr = static_cast<int>(position - members.begin());
  REQUIRE(group.size() == g);
  REQUIRE(group.rank() == gr);

  // Who is where: gather the world ranks through the group.
  std::vector<float> seen(static_cast<std::size_t>(g), -1.0f);
  const float mine_id = static_cast<float>(me);
  group.all_gather(&mine_id, seen.data(), 1, DType::fp32)->wait();
  for (int j = 0; j < g; ++j) CHECK(seen[static_cast<std::size_t>(j)] == static_cast<float>(members[static_cast<std::size_t>(j)]));

  for (DType dtype : kAllDTypes) {
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1000}}) {
      CAPTURE(dtype);
      CAPTURE(count);
      const std::size_t e = size_of(dtype);
      const std::size_t G = static_cast<std::size_t>(g);

      // all_reduce (sum), in place.
      {
        const auto inputs = exchange(random_elements(rng, count, dtype));
        std::vector<std::byte> buffer = inputs[me];
        group.all_reduce(buffer.data(), count, dtype, ReduceOp::sum)->wait();
        std::size_t wrong = 0;
        for (std::size_t i = 0; i < count; ++i)
          if (load_as_float(buffer.data(), i, dtype) != group_sum(inputs, members, i, dtype)) ++wrong;
        CHECK(wrong == 0);
      }
      // reduce_scatter (sum): this rank gets slice gr of the members' sums.
      // Groups may differ in size, and the world exchange needs one size:
      // everyone draws for the largest group (the world), sends count * G.
      {
        const auto inputs = exchange(random_elements(rng, count * static_cast<std::size_t>(world_size()), dtype));
        std::vector<std::byte> recv(count * e, std::byte{0x7f});
        group.reduce_scatter(inputs[me].data(), recv.data(), count, dtype, ReduceOp::sum)->wait();
        std::size_t wrong = 0;
        for (std::size_t i = 0; i < count; ++i)
          if (load_as_float(recv.data(), i, dtype) !=
              group_sum(inputs, members, static_cast<std::size_t>(gr) * count + i, dtype))
            ++wrong;
        CHECK(wrong == 0);
      }
      // all_gather: the members' inputs, in group order.
      {
        const auto inputs = exchange(random_elements(rng, count, dtype));
        std::vector<std::byte> recv(count * e * G, std::byte{0x55});
        group.all_gather(inputs[me].data(), recv.data(), count, dtype)->wait();
        std::vector<std::byte> expected;
        for (int m : members) expected.insert(expected.end(), inputs[m].begin(), inputs[m].end());
        CHECK(recv == expected);
      }
      // broadcast from the last member.
      {
        const auto inputs = exchange(random_elements(rng, count, dtype));
        std::vector<std::byte> buffer = inputs[me];
        group.broadcast(buffer.data(), count, dtype, g - 1)->wait();
        CHECK(buffer == inputs[members.back()]);
      }
    }
  }

  // Host doubles: summed in group order, so the bits are predictable too.
  {
    std::uniform_real_distribution<double> uniform(-1e3, 1e3);
    std::vector<double> mine(5);
    for (double& x : mine) x = uniform(rng);
    std::vector<std::byte> bytes(mine.size() * sizeof(double));
    std::memcpy(bytes.data(), mine.data(), bytes.size());
    const auto inputs = exchange(bytes);
    group.all_reduce_host_f64(mine.data(), mine.size(), ReduceOp::sum);
    for (std::size_t i = 0; i < mine.size(); ++i) {
      double expected = 0;
      for (std::size_t m = 0; m < members.size(); ++m) {
        double x = 0;
        std::memcpy(&x, inputs[members[m]].data() + i * sizeof(double), sizeof(double));
        expected = m == 0 ? x : expected + x;
      }
      CHECK(mine[i] == expected);
    }
  }
  group.barrier();
}

std::vector<int> shard_members(int world, int me, int s) {
  return predicted_members(world, me, [s](int r) { return r / s; }, [](int r) { return r; });
}
std::vector<int> replica_members(int world, int me, int s) {
  return predicted_members(world, me, [s](int r) { return r % s; }, [](int r) { return r; });
}

}  // namespace

TEST_CASE("split_hybrid: shard and replica groups for every S dividing N") {
  MpiCommunicator world;
  const int n = world.size(), me = world.rank();
  const std::uint32_t seed = shared_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed + 7919u * static_cast<std::uint32_t>(me));
  for (int s = 1; s <= n; ++s) {
    if (n % s != 0) continue;
    CAPTURE(s);
    HybridGroups groups = world.split_hybrid(s);
    REQUIRE(groups.shard);
    REQUIRE(groups.replica);
    CHECK(groups.shard->size() == s);
    CHECK(groups.shard->rank() == me % s);
    CHECK(groups.replica->size() == n / s);
    CHECK(groups.replica->rank() == me / s);
    for (Communicator* group : {groups.shard.get(), groups.replica.get()}) {
      CHECK(group->backend_name() == "mpi");
      CHECK(group->memory_kind() == MemoryKind::host);
      // Node-local values pick the GPU: a group keeps the world's.
      CHECK(group->local_rank() == world.local_rank());
      CHECK(group->local_size() == world.local_size());
      CHECK(dynamic_cast<MpiCommunicator&>(*group).timeout() == world.timeout());
    }
    // S == N: the shard group is the whole world but a communicator of its own.
    CHECK(dynamic_cast<MpiCommunicator&>(*groups.shard).mpi_comm() != world.mpi_comm());
    check_group(*groups.shard, shard_members(n, me, s), rng);
    check_group(*groups.replica, replica_members(n, me, s), rng);
  }
}

TEST_CASE("split: colors and keys as MPI_Comm_split (ordered by key, ties by rank)") {
  MpiCommunicator world;
  const int n = world.size(), me = world.rank();
  const std::uint32_t seed = shared_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed + 104729u * static_cast<std::uint32_t>(me));
  struct Scheme {
    const char* name;
    std::function<int(int)> color, key;
  };
  const Scheme schemes[] = {
      {"odd and even, keys reversed", [](int r) { return r % 2; }, [](int r) { return -r; }},
      {"by three, equal keys", [](int r) { return r % 3; }, [](int) { return 0; }},
      {"one group, keys shuffled with ties", [](int) { return 5; }, [n](int r) { return (r * 5) % n / 2; }},
      {"every rank alone", [](int r) { return r; }, [](int r) { return r; }},
  };
  for (const Scheme& scheme : schemes) {
    CAPTURE(scheme.name);
    std::unique_ptr<Communicator> group = world.split(scheme.color(me), scheme.key(me));
    REQUIRE(group);
    check_group(*group, predicted_members(n, me, scheme.color, scheme.key), rng);
  }
}

TEST_CASE("split: a group splits again and outlives its parent") {
  const int n = world_size(), me = world_rank();
  const std::uint32_t seed = shared_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed + 15485863u * static_cast<std::uint32_t>(me));
  std::unique_ptr<Communicator> world_child;
  {
    MpiCommunicator world;
    world_child = world.split(0, n - me);  // the whole world, reversed
  }
  // The parent is gone; the child owns its own MPI communicator.
  std::vector<int> reversed(static_cast<std::size_t>(n));
  std::iota(reversed.rbegin(), reversed.rend(), 0);
  check_group(*world_child, reversed, rng);

  // Hybrid groups of the reversed world, then hybrid groups of its shard
  // group: members composed through both levels.
  for (int s = 1; s <= n; ++s) {
    if (n % s != 0) continue;
    CAPTURE(s);
    HybridGroups level1 = world_child->split_hybrid(s);
    const int r1 = world_child->rank();
    std::vector<int> shard1;  // world ranks, in shard-group order
    for (int j : shard_members(n, r1, s)) shard1.push_back(reversed[static_cast<std::size_t>(j)]);
    for (int s2 = 1; s2 <= s; ++s2) {
      if (s % s2 != 0) continue;
      CAPTURE(s2);
      HybridGroups level2 = level1.shard->split_hybrid(s2);
      const int r2 = level1.shard->rank();
      std::vector<int> shard2, replica2;
      for (int j : shard_members(s, r2, s2)) shard2.push_back(shard1[static_cast<std::size_t>(j)]);
      for (int j : replica_members(s, r2, s2)) replica2.push_back(shard1[static_cast<std::size_t>(j)]);
      check_group(*level2.shard, shard2, rng);
      check_group(*level2.replica, replica2, rng);
    }
  }
  world_child->barrier();
}

TEST_CASE("split_hybrid and split refuse bad arguments on every rank, and nobody hangs") {
  MpiCommunicator world;
  const int n = world.size(), me = world.rank();
  std::vector<int> bad = {0, -1, n + 1, 2 * n};
  for (int s = 2; s < n; ++s)
    if (n % s != 0) bad.push_back(s);
  for (int s : bad) {
    CAPTURE(s);
    std::string message;
    try {
      (void)world.split_hybrid(s);
    } catch (const InvalidArgument& error) {
      message = error.message();
    }
    CHECK(message.find("shard_group_size S=" + std::to_string(s)) != std::string::npos);
    CHECK(message.find("N=" + std::to_string(n)) != std::string::npos);
    // Every rank threw and came here: a barrier with the communicator's
    // timeout would throw CommError if one were stuck in a split.
    world.barrier();
  }
  // One rank's negative color is refused on every rank, before any split.
  for (int culprit : {0, n - 1}) {
    CAPTURE(culprit);
    std::string message;
    try {
      (void)world.split(me == culprit ? -1 : 0, me);
    } catch (const InvalidArgument& error) {
      message = error.message();
    }
    CHECK(message.find("color -1") != std::string::npos);
    world.barrier();
  }
  // Still usable afterwards.
  HybridGroups groups = world.split_hybrid(n);
  CHECK(groups.shard->size() == n);
  CHECK(groups.replica->size() == 1);
}
