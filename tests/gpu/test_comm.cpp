// Device communicators against a naive reference. Every rank can compute
// every other rank's input (value(rank, i) below), so each rank checks its own
// result alone. Values are small multiples of 1/4, exact in bf16 and fp16, so
// sums over a few ranks are exact in every dtype and results compare exactly.
//
// NcclCommunicator needs one GPU per rank; where ranks outnumber GPUs (the
// usual `mpirun -np K` on a one-GPU machine) its test says so and passes, and
// StagedCommunicator (MPI through pinned memory) is tested at any K.

#include <cuda_runtime_api.h>
#include <doctest/doctest.h>
#include <mpi.h>

#include <cmath>
#include <chrono>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gpu_test_util.hpp"
#include "zero/comm/mpi_communicator.hpp"
#include "zero/comm/nccl_communicator.hpp"
#include "zero/comm/staged_communicator.hpp"

namespace zero::test {
namespace {

float value(int rank, std::size_t i) {
  return static_cast<float>(static_cast<int>((rank * 7 + i * 3) % 17) - 8) * 0.25f;
}

/// A non-blocking stream for the collectives, as the engine's comm stream is.
struct TestStream {
  cudaStream_t stream = nullptr;
  TestStream() { ZERO_CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking)); }
  ~TestStream() { (void)cudaStreamDestroy(stream); }
};

HostArray rank_data(DType dtype, int rank, std::size_t count, std::size_t first = 0) {
  HostArray a(dtype, count);
  for (std::size_t i = 0; i < count; ++i) a.set(i, value(rank, first + i));
  return a;
}

float reduce_reference(ReduceOp op, int world, std::size_t i, DType dtype) {
  float acc = value(0, i);
  for (int r = 1; r < world; ++r) {
    const float x = value(r, i);
    switch (op) {
      case ReduceOp::sum:
      case ReduceOp::avg: acc += x; break;
      case ReduceOp::max: acc = std::max(acc, x); break;
      case ReduceOp::min: acc = std::min(acc, x); break;
    }
  }
  if (op == ReduceOp::avg) acc /= static_cast<float>(world);
  return round_to(dtype, acc);
}

std::size_t count_wrong(const HostArray& got, const std::vector<float>& expect) {
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < expect.size(); ++i) {
    const float g = got.get(i);
    if (!(g == expect[i])) ++wrong;
  }
  return wrong;
}

void exercise(Communicator& comm) {
  const int rank = comm.rank(), world = comm.size();
  const std::size_t W = static_cast<std::size_t>(world);
  TestStream s;
  CHECK(comm.memory_kind() == MemoryKind::device);
  for (DType dtype : kAllDTypes) {
    const std::size_t e = size_of(dtype);
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1024},
                              std::size_t{100003}}) {
      INFO("backend ", comm.backend_name(), ", dtype ", std::string(name_of(dtype)), ", count ", count,
           ", rank ", rank, " of ", world);
      DeviceBuffer send(count * W * e + 64), recv(count * W * e + 64);
      const HostArray mine_full = rank_data(dtype, rank, count * W);

      // reduce_scatter, out of place and in place, every op.
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min}) {
        for (bool in_place : {false, true}) {
          INFO("reduce_scatter ", std::string(name_of(op)), std::string(in_place ? " in place" : ""));
          send.upload(mine_full.bytes.data(), mine_full.bytes.size());
          auto* send_ptr = static_cast<unsigned char*>(send.data());
          void* out = in_place ? send_ptr + rank * count * e : recv.data();
          comm.reduce_scatter(send_ptr, out, count, dtype, op, s.stream)->wait();
          HostArray got(dtype, count);
          ZERO_CHECK_CUDA(cudaMemcpy(got.data(), out, count * e, cudaMemcpyDeviceToHost));
          std::vector<float> expect(count);
          for (std::size_t i = 0; i < count; ++i)
            expect[i] = reduce_reference(op, world, rank * count + i, dtype);
          CHECK(count_wrong(got, expect) == 0);
        }
      }

      // all_gather, out of place and in place.
      for (bool in_place : {false, true}) {
        INFO("all_gather", std::string(in_place ? " in place" : ""));
        const HostArray part = rank_data(dtype, rank, count, rank * count);
        auto* recv_ptr = static_cast<unsigned char*>(recv.data());
        void* in = in_place ? recv_ptr + rank * count * e : send.data();
        ZERO_CHECK_CUDA(cudaMemcpy(in, part.bytes.data(), count * e, cudaMemcpyHostToDevice));
        ZERO_CHECK_CUDA(cudaDeviceSynchronize());  // see DeviceBuffer::upload
        comm.all_gather(in, recv_ptr, count, dtype, s.stream)->wait();
        HostArray got(dtype, count * W);
        recv.download(got.data(), count * W * e);
        std::vector<float> expect(count * W);
        for (int r = 0; r < world; ++r)
          for (std::size_t i = 0; i < count; ++i)
            expect[r * count + i] = round_to(dtype, value(r, r * count + i));
        CHECK(count_wrong(got, expect) == 0);
        CHECK(recv.guards_intact(0, count * W * e));
      }

      // all_reduce and broadcast.
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::max}) {
        INFO("all_reduce ", std::string(name_of(op)));
        const HostArray part = rank_data(dtype, rank, count);
        send.upload(part.bytes.data(), count * e);
        comm.all_reduce(send.data(), count, dtype, op, s.stream)->wait();
        HostArray got(dtype, count);
        send.download(got.data(), count * e);
        std::vector<float> expect(count);
        for (std::size_t i = 0; i < count; ++i) expect[i] = reduce_reference(op, world, i, dtype);
        CHECK(count_wrong(got, expect) == 0);
      }
      {
        const int root = world - 1;
        const HostArray part = rank_data(dtype, rank, count);
        send.upload(part.bytes.data(), count * e);
        comm.broadcast(send.data(), count, dtype, root, s.stream)->wait();
        HostArray got(dtype, count);
        send.download(got.data(), count * e);
        std::vector<float> expect(count);
        for (std::size_t i = 0; i < count; ++i) expect[i] = round_to(dtype, value(root, i));
        CHECK(count_wrong(got, expect) == 0);
      }
    }
  }

  // Host doubles: summed in rank order, the same bits everywhere.
  std::vector<double> values = {0.1 * (rank + 1), -1e300, 3.0, static_cast<double>(rank)};
  comm.all_reduce_host_f64(values.data(), 1, ReduceOp::sum);
  double expect = 0.1;
  for (int r = 1; r < world; ++r) expect += 0.1 * (r + 1);
  CHECK(values[0] == expect);
  std::vector<double> extremes = {static_cast<double>(rank), static_cast<double>(-rank)};
  comm.all_reduce_host_f64(extremes.data(), 2, ReduceOp::max);
  CHECK(extremes[0] == world - 1);
  CHECK(extremes[1] == 0);
  comm.barrier();
}

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) return 0;
  return count;
}

}  // namespace

TEST_CASE("comm: NcclCommunicator bootstrapped over MPI") {
  int local_size = 1;
  {
    MPI_Comm node;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    MPI_Comm_size(node, &local_size);
    MPI_Comm_free(&node);
  }
  if (local_size > device_count()) {
    MESSAGE("skipped NCCL at this world size: ", local_size, " ranks share ", device_count(),
            " GPU(s) on this node and NCCL needs one GPU per rank (StagedCommunicator is "
            "tested instead)");
    // All ranks must agree that the constructor refuses, and say why.
    CHECK_THROWS_AS(NcclCommunicator(MPI_COMM_WORLD), InvalidArgument);
    return;
  }
  NcclCommunicator comm(MPI_COMM_WORLD);
  CHECK(comm.backend_name() == "nccl");
  int world = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  CHECK(comm.size() == world);
  exercise(comm);
  CHECK(comm.workspace_bytes() == 0);  // native half reductions need no scratch

  // Buffers that overlap other than in NCCL's in-place layout are refused.
  if (comm.rank() != 0) {
    DeviceBuffer buffer(4096);
    CHECK_THROWS_AS(comm.reduce_scatter(buffer.data(), buffer.data(), 16, DType::fp32,
                                        ReduceOp::sum, nullptr),
                    InvalidArgument);
  }

  NcclOptions fp32_options;
  fp32_options.half_reduction = HalfReduction::fp32_accumulate;
  NcclCommunicator wide(MPI_COMM_WORLD, fp32_options);
  exercise(wide);
  // fp32 accumulation widens into scratch; one rank reduces nothing (every
  // collective is a copy or nothing at all), so it needs none.
  if (world > 1) CHECK(wide.peak_workspace_bytes() > 0);
  else CHECK(wide.peak_workspace_bytes() == 0);
}

TEST_CASE("comm: NcclCommunicator wrapping a caller's ncclComm_t (world 1)") {
  int world = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (world != 1) {
    MESSAGE("skipped: single-process test");
    return;
  }
  ncclComm_t raw = nullptr;
  int device = 0;
  ZERO_CHECK_NCCL(ncclCommInitAll(&raw, 1, &device));
  {
    // No MPI communicator: barrier and host reductions go through NCCL.
    NcclCommunicator comm(raw, MPI_COMM_NULL, NcclOptions{}, 0, 1);
    CHECK(comm.nccl_comm() == raw);
    CHECK(comm.device() == 0);
    exercise(comm);
  }
  // Still ours: usable after the wrapper is gone.
  DeviceBuffer buffer(64);
  ZERO_CHECK_NCCL(ncclAllReduce(buffer.data(), buffer.data(), 4, ncclFloat32, ncclSum, raw, nullptr));
  ZERO_CHECK_CUDA(cudaDeviceSynchronize());
  ZERO_CHECK_NCCL(ncclCommDestroy(raw));
}

TEST_CASE("comm: StagedCommunicator over MPI at any world size") {
  MpiCommunicator host(MPI_COMM_WORLD);
  StagedCommunicator comm(host);
  CHECK(comm.backend_name() == "staged(mpi)");
  exercise(comm);
  CHECK(comm.peak_workspace_bytes() > 0);
}

// NCCL cannot put two ranks on one GPU: with one GPU this runs at world 1
// only (S = 1: shard and replica groups of one rank each), which still
// creates and destroys real child ncclComm_t's and runs NCCL through them.
TEST_CASE("comm: NcclCommunicator split_hybrid (one GPU per rank)") {
  int world = 0, local_size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  {
    MPI_Comm node;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    MPI_Comm_size(node, &local_size);
    MPI_Comm_free(&node);
  }
  if (local_size > device_count()) {
    MESSAGE("skipped NCCL split at this world size: ", local_size, " ranks share ", device_count(),
            " GPU(s) on this node (StagedCommunicator's split is tested instead)");
    return;
  }
  for (int s = 1; s <= world; ++s) {
    if (world % s != 0) continue;
    INFO("S = ", s, " of N = ", world);
    HybridGroups groups;
    int device = -1;
    {
      NcclCommunicator parent(MPI_COMM_WORLD);
      device = parent.device();
      groups = parent.split_hybrid(s);
      CHECK(groups.shard->size() == s);
      CHECK(groups.shard->rank() == parent.rank() % s);
      CHECK(groups.replica->size() == world / s);
      CHECK(groups.replica->rank() == parent.rank() / s);
      for (Communicator* group : {groups.shard.get(), groups.replica.get()}) {
        CHECK(group->backend_name() == "nccl");
        CHECK(group->local_rank() == parent.local_rank());
        CHECK(group->local_size() == parent.local_size());
        auto& nccl = dynamic_cast<NcclCommunicator&>(*group);
        CHECK(nccl.device() == device);
        CHECK(nccl.nccl_comm() != parent.nccl_comm());
      }
      // A negative color (NCCL_SPLIT_NOCOLOR: no communicator) is refused.
      CHECK_THROWS_AS((void)parent.split(-1, 0), InvalidArgument);
    }
    // The parent is gone; the groups own their NCCL communicators.
    for (Communicator* group : {groups.shard.get(), groups.replica.get()}) exercise(*group);
    {
      // Communicator::all_reduce skips NCCL at one rank; call NCCL itself on
      // the shard group's communicator, out of place, so its kernel runs.
      auto& shard = dynamic_cast<NcclCommunicator&>(*groups.shard);
      TestStream stream;
      const std::size_t count = 1000;
      const HostArray input = rank_data(DType::fp32, shard.rank(), count);
      DeviceBuffer in(count * 4), out(count * 4);
      in.upload(input.bytes.data(), count * 4);
      ZERO_CHECK_NCCL(ncclAllReduce(in.data(), out.data(), count, ncclFloat32, ncclSum,
                                    shard.nccl_comm(), stream.stream));
      ZERO_CHECK_CUDA(cudaStreamSynchronize(stream.stream));
      HostArray got(DType::fp32, count);
      out.download(got.data(), count * 4);
      std::vector<float> expect(count);
      for (std::size_t i = 0; i < count; ++i) expect[i] = reduce_reference(ReduceOp::sum, s, i, DType::fp32);
      CHECK(count_wrong(got, expect) == 0);
    }
    // A group splits again: S' = 1 inside the shard group.
    HybridGroups again = groups.shard->split_hybrid(1);
    CHECK(again.replica->size() == s);
    CHECK(dynamic_cast<NcclCommunicator&>(*again.replica).device() == device);
    exercise(*again.replica);
  }
}

TEST_CASE("comm: NcclCommunicator split of a wrapped ncclComm_t (world 1)") {
  int world = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (world != 1) {
    MESSAGE("skipped: single-process test");
    return;
  }
  // Without MPI: the child's barrier and host reductions go through NCCL.
  // The child owns its communicator; the caller's stays the caller's.
  ncclComm_t raw = nullptr;
  int first = 0;
  ZERO_CHECK_NCCL(ncclCommInitAll(&raw, 1, &first));
  {
    NcclCommunicator wrapped(raw, MPI_COMM_NULL, NcclOptions{}, 0, 1);
    std::unique_ptr<Communicator> child = wrapped.split(3, 0);
    CHECK(dynamic_cast<NcclCommunicator&>(*child).nccl_comm() != raw);
    exercise(*child);
  }
  DeviceBuffer buffer(64);
  ZERO_CHECK_NCCL(ncclAllReduce(buffer.data(), buffer.data(), 4, ncclFloat32, ncclSum, raw, nullptr));
  ZERO_CHECK_CUDA(cudaDeviceSynchronize());
  ZERO_CHECK_NCCL(ncclCommDestroy(raw));
}

TEST_CASE("comm: StagedCommunicator split_hybrid at any world size") {
  MpiCommunicator host(MPI_COMM_WORLD);
  StagedCommunicator staged(host);
  const int n = staged.size(), me = staged.rank();
  for (int s = 1; s <= n; ++s) {
    if (n % s != 0) continue;
    INFO("S = ", s, " of N = ", n);
    HybridGroups groups = staged.split_hybrid(s);
    CHECK(groups.shard->size() == s);
    CHECK(groups.shard->rank() == me % s);
    CHECK(groups.replica->size() == n / s);
    CHECK(groups.replica->rank() == me / s);
    for (Communicator* group : {groups.shard.get(), groups.replica.get()}) {
      CHECK(group->backend_name() == "staged(mpi)");
      CHECK(group->memory_kind() == MemoryKind::device);
      // Each group's ranks are numbered 0..size-1, so exercise()'s
      // reference (values by group rank) holds in every group at once.
      exercise(*group);
    }
  }
}

TEST_CASE("comm: NcclOptions validation") {
  NcclOptions options;
  options.timeout = std::chrono::milliseconds(0);
  CHECK_THROWS_AS(options.validate(), InvalidArgument);
  options.timeout = std::chrono::seconds(1);
  options.device = -2;
  CHECK_THROWS_AS(options.validate(), InvalidArgument);
}

}  // namespace zero::test

namespace zero::test {

// Run as its own CTest entry (gpu.comm.timeout): it aborts an NCCL
// communicator with a collective still queued, which must not disturb the
// other tests' process.
TEST_CASE("comm-timeout: a collective that misses the timeout aborts and throws CommError") {
  int world = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (world != 1 || device_count() < 1) {
    MESSAGE("skipped: single-process test");
    return;
  }
  NcclOptions options;
  options.timeout = std::chrono::milliseconds(200);
  NcclCommunicator comm(MPI_COMM_WORLD, options);
  TestStream s;
  DeviceBuffer buffer(4096);
  // Hold the stream on the host for 1.5 s: the collective behind it cannot
  // finish within the 200 ms timeout, as if a peer never arrived.
  ZERO_CHECK_CUDA(cudaLaunchHostFunc(
      s.stream, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(1500)); },
      nullptr));
  WorkPtr work = comm.all_reduce(buffer.data(), 1024, DType::fp32, ReduceOp::sum, s.stream);
  const auto start = std::chrono::steady_clock::now();
  std::string message;
  try {
    work->wait();
  } catch (const CommError& e) {
    message = e.what();
  }
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // The timeout fired (not an error seen later); ncclCommAbort itself then
  // waits for the queued collective to drain, here until the host function
  // returns, so the total wait is not bounded by the timeout.
  CHECK(message.find("did not finish within 200 ms") != std::string::npos);
  CHECK(waited >= 0.2);
  CHECK(comm.aborted());
  CHECK_THROWS_AS(comm.all_reduce(buffer.data(), 16, DType::fp32, ReduceOp::sum, s.stream),
                  CommError);
}

}  // namespace zero::test
