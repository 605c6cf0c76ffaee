// The MPI backend's collectives against a naive reference, for every dtype,
// op and size, in place and not, at whatever world size mpirun gives.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "zero/comm/mpi_communicator.hpp"

using namespace zero;

namespace {

// Every rank can regenerate every other rank's input from its seed.
std::vector<std::byte> rank_data(int rank, std::size_t count, DType dtype, std::uint32_t salt) {
  std::mt19937 rng(1000 * static_cast<std::uint32_t>(rank) + salt);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<std::byte> data(count * size_of(dtype));
  for (std::size_t i = 0; i < count; ++i) store_from_float(data.data(), i, dtype, normal(rng));
  return data;
}

// Naive: element by element, ranks in order, fp32 accumulation, one rounding.
float naive_reduce(const std::vector<std::vector<std::byte>>& inputs, std::size_t i, DType dtype, ReduceOp op) {
  float acc = load_as_float(inputs[0].data(), i, dtype);
  for (std::size_t r = 1; r < inputs.size(); ++r) {
    const float x = load_as_float(inputs[r].data(), i, dtype);
    if (op == ReduceOp::sum || op == ReduceOp::avg) acc = acc + x;
    if (op == ReduceOp::max) acc = acc >= x ? acc : x;
    if (op == ReduceOp::min) acc = acc <= x ? acc : x;
  }
  if (op == ReduceOp::avg) acc = acc / static_cast<float>(inputs.size());
  return round_to(dtype, acc);
}

const std::size_t kCounts[] = {0, 1, 2, 3, 7, 64, 1000, 65537};
const ReduceOp kOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min};

}  // namespace

TEST_CASE("reduce_scatter equals the naive reference (every dtype, op, size; in place too)") {
  MpiCommunicator comm;
  const int n = comm.size(), me = comm.rank();
  std::uint32_t salt = 0;
  for (DType dtype : kAllDTypes) {
    for (ReduceOp op : kOps) {
      for (std::size_t count : kCounts) {
        for (bool in_place : {false, true}) {
          CAPTURE(dtype);
          CAPTURE(name_of(op));
          CAPTURE(count);
          CAPTURE(in_place);
          ++salt;
          std::vector<std::vector<std::byte>> inputs;
          for (int r = 0; r < n; ++r) inputs.push_back(rank_data(r, count * n, dtype, salt));
          std::vector<std::byte> send = inputs[me];
          std::vector<std::byte> recv(count * size_of(dtype), std::byte{0x7f});
          void* out = in_place ? send.data() + static_cast<std::size_t>(me) * count * size_of(dtype) : recv.data();
          comm.reduce_scatter(send.data(), out, count, dtype, op)->wait();
          std::size_t wrong = 0;
          for (std::size_t i = 0; i < count; ++i) {
            const float expected = naive_reduce(inputs, static_cast<std::size_t>(me) * count + i, dtype, op);
            if (load_as_float(out, i, dtype) != expected) ++wrong;
          }
          CHECK(wrong == 0);
        }
      }
    }
  }
}

TEST_CASE("all_gather, all_reduce and broadcast equal the naive reference") {
  MpiCommunicator comm;
  const int n = comm.size(), me = comm.rank();
  std::uint32_t salt = 500;
  for (DType dtype : kAllDTypes) {
    for (std::size_t count : kCounts) {
      CAPTURE(dtype);
      CAPTURE(count);
      const std::size_t bytes = count * size_of(dtype);
      for (bool in_place : {false, true}) {
        ++salt;
        std::vector<std::byte> expected;
        for (int r = 0; r < n; ++r) {
          auto part = rank_data(r, count, dtype, salt);
          expected.insert(expected.end(), part.begin(), part.end());
        }
        std::vector<std::byte> recv(bytes * n, std::byte{0x55});
        std::vector<std::byte> mine = rank_data(me, count, dtype, salt);
        const void* send = mine.data();
        if (in_place) {
          if (bytes > 0) std::memcpy(recv.data() + static_cast<std::size_t>(me) * bytes, mine.data(), bytes);
          send = recv.data() + static_cast<std::size_t>(me) * bytes;
        }
        comm.all_gather(send, recv.data(), count, dtype)->wait();
        CHECK(recv == expected);
      }
      for (ReduceOp op : kOps) {
        ++salt;
        std::vector<std::vector<std::byte>> inputs;
        for (int r = 0; r < n; ++r) inputs.push_back(rank_data(r, count, dtype, salt));
        std::vector<std::byte> buffer = inputs[me];
        comm.all_reduce(buffer.data(), count, dtype, op)->wait();
        std::size_t wrong = 0;
        for (std::size_t i = 0; i < count; ++i)
          if (load_as_float(buffer.data(), i, dtype) != naive_reduce(inputs, i, dtype, op)) ++wrong;
        CHECK(wrong == 0);
      }
      for (int root = 0; root < n; root += std::max(1, n - 1)) {
        ++salt;
        std::vector<std::byte> buffer = rank_data(me, count, dtype, salt);
        comm.broadcast(buffer.data(), count, dtype, root)->wait();
        CHECK(buffer == rank_data(root, count, dtype, salt));
      }
    }
  }
}

TEST_CASE("asynchronous handles: several collectives in flight complete in any wait order") {
  MpiCommunicator comm;
  const int n = comm.size(), me = comm.rank();
  std::vector<std::vector<float>> sends, recvs;
  std::vector<WorkPtr> works;
  for (int k = 0; k < 6; ++k) {
    sends.emplace_back(static_cast<std::size_t>(n) * 100);
    for (std::size_t i = 0; i < sends.back().size(); ++i) sends.back()[i] = static_cast<float>(k * 1000 + i + me);
    recvs.emplace_back(100);
  }
  for (int k = 0; k < 6; ++k)
    works.push_back(comm.reduce_scatter(sends[k].data(), recvs[k].data(), 100, DType::fp32, ReduceOp::sum));
  for (int k = 5; k >= 0; --k) works[k]->wait();
  for (int k = 0; k < 6; ++k)
    for (std::size_t i = 0; i < 100; ++i) {
      float expected = 0;
      for (int r = 0; r < n; ++r) expected += static_cast<float>(k * 1000 + me * 100 + i + r);
      REQUIRE(recvs[k][i] == expected);
    }
}

TEST_CASE("host float64 reductions are identical on every rank and summed in rank order") {
  MpiCommunicator comm;
  const int n = comm.size(), me = comm.rank();
  double values[3] = {0.1 * (me + 1), static_cast<double>(me), -static_cast<double>(me)};
  comm.all_reduce_host_f64(values, 3, ReduceOp::sum);
  double expected = 0;
  for (int r = 0; r < n; ++r) expected += 0.1 * (r + 1);
  CHECK(values[0] == expected);
  double mx = me;
  comm.all_reduce_host_f64(&mx, 1, ReduceOp::max);
  CHECK(mx == n - 1);
  double nan_somewhere = me == n - 1 ? std::nan("") : 1.0;
  comm.all_reduce_host_f64(&nan_somewhere, 1, ReduceOp::max);
  CHECK(std::isnan(nan_somewhere));
}

TEST_CASE("bad collective arguments are clear errors") {
  MpiCommunicator comm;
  CHECK_THROWS_WITH_AS(comm.broadcast(nullptr, 0, DType::fp32, comm.size()), doctest::Contains("root"),
                       InvalidArgument);
  CHECK_THROWS_WITH_AS(comm.reduce_scatter(nullptr, nullptr, 4, DType::fp32, ReduceOp::sum),
                       doctest::Contains("null buffer"), InvalidArgument);
  CHECK_THROWS_WITH_AS(comm.all_gather(nullptr, nullptr, 1, static_cast<DType>(7)),
                       doctest::Contains("unknown dtype value 7"), InvalidArgument);
}
