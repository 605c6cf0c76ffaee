// gpu_bench_collectives: zero's device collectives in nccl-tests' format.
//
//   mpirun -np K gpu_bench_collectives [--staged] [--json out.json]
//
// For reduce_scatter, all_gather and all_reduce through zero::Communicator
// (NcclCommunicator, or StagedCommunicator over MpiCommunicator with
// --staged), at sizes from --min-bytes to --max-bytes by --factor:
//   size   total bytes of the collective, as nccl-tests counts it (the full
//          buffer: all_reduce's buffer, reduce_scatter's input, all_gather's output)
//   count  elements in that buffer
//   time   average microseconds per call over --iters back-to-back calls
//          after --warmup untimed ones (host clock, stream synchronized)
//   algbw  size / time, GB/s (1e9 bytes)
//   busbw  algbw * (n-1)/n for reduce_scatter and all_gather, * 2(n-1)/n for
//          all_reduce: the bandwidth each link sees, comparable across n
//   #wrong elements that differ from the expected result (inputs are small
//          multiples of 1/4, so sums are exact in every dtype)

#include <cuda_runtime_api.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "zero/comm/mpi_communicator.hpp"
#include "zero/comm/nccl_communicator.hpp"
#include "zero/comm/staged_communicator.hpp"
#include "zero/cuda/check.hpp"

namespace {

struct Options {
  bool staged = false;
  std::size_t min_bytes = 8;
  std::size_t max_bytes = std::size_t{1} << 30;
  std::size_t factor = 2;
  int iters = 20;
  int warmup = 5;
  zero::DType dtype = zero::DType::fp32;
  std::string json_path;
  bool check = true;
};

void usage() {
  std::printf(
      "usage: [mpirun -np K] gpu_bench_collectives [options]\n"
      "  --staged          StagedCommunicator over MPI instead of NCCL\n"
      "  --min-bytes N     smallest size (default 8)\n"
      "  --max-bytes N     largest size (default 1073741824 = 1 GiB; K/M/G suffixes work)\n"
      "  --factor N        size multiplier between rows (default 2)\n"
      "  --iters N         timed calls per size (default 20; fewer for slow sizes, at least 3)\n"
      "  --warmup N        untimed calls per size (default 5)\n"
      "  --dtype T         fp32, bf16 or fp16 (default fp32)\n"
      "  --no-check        skip the data check (#wrong prints -1)\n"
      "  --json PATH       write the rows as JSON (rank 0)\n");
}

std::size_t parse_size(const std::string& text) {
  std::size_t used = 0;
  double value = std::stod(text, &used);
  const std::string suffix = text.substr(used);
  if (suffix == "K" || suffix == "k") value *= 1024;
  else if (suffix == "M" || suffix == "m") value *= 1024 * 1024;
  else if (suffix == "G" || suffix == "g") value *= 1024.0 * 1024 * 1024;
  else if (!suffix.empty()) throw std::invalid_argument("bad size " + text);
  return static_cast<std::size_t>(value);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        usage();
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--staged") o.staged = true;
    else if (arg == "--min-bytes") o.min_bytes = parse_size(next());
    else if (arg == "--max-bytes") o.max_bytes = parse_size(next());
    else if (arg == "--factor") o.factor = std::max<std::size_t>(2, parse_size(next()));
    else if (arg == "--iters") o.iters = std::max(3, std::stoi(next()));
    else if (arg == "--warmup") o.warmup = std::max(0, std::stoi(next()));
    else if (arg == "--dtype") o.dtype = zero::parse_dtype(next(), "--dtype");
    else if (arg == "--no-check") o.check = false;
    else if (arg == "--json") o.json_path = next();
    else if (arg == "--help" || arg == "-h") {
      usage();
      std::exit(0);
    } else {
      std::fprintf(stderr, "unknown option %s\n", arg.c_str());
      usage();
      std::exit(2);
    }
  }
  return o;
}

float pattern(int rank, std::size_t i) {
  return static_cast<float>(static_cast<int>((rank * 7 + i * 3) % 17) - 8) * 0.25f;
}

enum class Op { reduce_scatter, all_gather, all_reduce };
const char* name_of(Op op) {
  switch (op) {
    case Op::reduce_scatter: return "reduce_scatter";
    case Op::all_gather: return "all_gather";
    case Op::all_reduce: return "all_reduce";
  }
  return "?";
}

struct Buffers {
  void* send = nullptr;
  void* recv = nullptr;
  explicit Buffers(std::size_t bytes) {
    ZERO_CHECK_CUDA(cudaMalloc(&send, std::max<std::size_t>(bytes, 256)));
    ZERO_CHECK_CUDA(cudaMalloc(&recv, std::max<std::size_t>(bytes, 256)));
  }
  ~Buffers() {
    (void)cudaFree(send);
    (void)cudaFree(recv);
  }
};

/// Fills `count` elements of dst with pattern(rank, first + i) in dtype.
void upload_pattern(void* dst, std::size_t count, std::size_t first, int rank, zero::DType dtype,
                    std::vector<unsigned char>& scratch) {
  scratch.resize(count * zero::size_of(dtype));
  for (std::size_t i = 0; i < count; ++i)
    zero::store_from_float(scratch.data(), i, dtype, pattern(rank, first + i));
  ZERO_CHECK_CUDA(cudaMemcpy(dst, scratch.data(), scratch.size(), cudaMemcpyHostToDevice));
  // A pageable upload may still be in flight when cudaMemcpy returns, and the
  // collectives run on a non-blocking stream that does not wait for it.
  ZERO_CHECK_CUDA(cudaDeviceSynchronize());
}

}  // namespace

int main(int argc, char** argv) {
  zero::MpiSession session(&argc, &argv);
  return zero::run_or_abort([&]() -> int {
    const Options o = parse(argc, argv);
    std::unique_ptr<zero::MpiCommunicator> host;
    std::unique_ptr<zero::Communicator> comm;
    if (o.staged) {
      host = std::make_unique<zero::MpiCommunicator>(MPI_COMM_WORLD);
      int devices = 0;
      ZERO_CHECK_CUDA(cudaGetDeviceCount(&devices));
      ZERO_CHECK_CUDA(cudaSetDevice(host->local_rank() % devices));
      comm = std::make_unique<zero::StagedCommunicator>(*host);
    } else {
      comm = std::make_unique<zero::NcclCommunicator>(MPI_COMM_WORLD);
    }
    const int rank = comm->rank(), world = comm->size();
    const std::size_t W = static_cast<std::size_t>(world);
    const std::size_t e = zero::size_of(o.dtype);
    cudaStream_t stream = nullptr;
    ZERO_CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    Buffers buffers(o.max_bytes);
    std::vector<unsigned char> scratch;

    if (rank == 0) {
      std::printf("# zero collectives: %s, %d rank(s), dtype %s, GB = 1e9 bytes\n",
                  comm->backend_name().c_str(), world, std::string(zero::name_of(o.dtype)).c_str());
      std::printf("# %12s %12s %6s %8s %12s %8s %8s %7s\n", "size", "count", "type", "op",
                  "time(us)", "algbw", "busbw", "#wrong");
    }
    nlohmann::json rows = nlohmann::json::array();
    for (Op op : {Op::reduce_scatter, Op::all_gather, Op::all_reduce}) {
      for (std::size_t size = o.min_bytes; size <= o.max_bytes; size *= o.factor) {
        // Per-rank element count: the buffer of `size` bytes is split W ways
        // for reduce_scatter / all_gather (sizes that do not divide round down).
        const std::size_t total = size / e;
        const std::size_t count = op == Op::all_reduce ? total : total / W;
        if (count == 0) continue;
        const std::size_t bytes = (op == Op::all_reduce ? count : count * W) * e;
        auto call = [&] {
          switch (op) {
            case Op::reduce_scatter:
              return comm->reduce_scatter(buffers.send, buffers.recv, count, o.dtype,
                                          zero::ReduceOp::sum, stream);
            case Op::all_gather:
              return comm->all_gather(buffers.send, buffers.recv, count, o.dtype, stream);
            case Op::all_reduce:
              break;
          }
          return comm->all_reduce(buffers.send, count, o.dtype, zero::ReduceOp::sum, stream);
        };

        // Data check: one call on known inputs.
        long long wrong = -1;
        if (o.check) {
          const std::size_t in_count = op == Op::all_gather ? count : (op == Op::all_reduce ? count : count * W);
          upload_pattern(buffers.send, in_count, op == Op::all_gather ? rank * count : 0, rank,
                         o.dtype, scratch);
          call()->wait();
          ZERO_CHECK_CUDA(cudaStreamSynchronize(stream));
          const std::size_t out_count = op == Op::all_gather ? count * W : count;
          std::vector<unsigned char> got(out_count * e);
          ZERO_CHECK_CUDA(cudaMemcpy(got.data(), op == Op::all_reduce ? buffers.send : buffers.recv,
                                     got.size(), cudaMemcpyDeviceToHost));
          wrong = 0;
          for (std::size_t i = 0; i < out_count; ++i) {
            float expect = 0;
            if (op == Op::all_gather) {
              expect = pattern(static_cast<int>(i / count), i);
            } else {
              const std::size_t index = op == Op::reduce_scatter ? rank * count + i : i;
              for (int r = 0; r < world; ++r) expect += pattern(r, index);
            }
            if (zero::load_as_float(got.data(), i, o.dtype) != zero::round_to(o.dtype, expect)) ++wrong;
          }
        }

        for (int i = 0; i < o.warmup; ++i) call()->wait();
        // Slow sizes (the staged path at a GiB) get fewer timed calls: about
        // half a second per row, never fewer than 3.
        const auto probe_start = std::chrono::steady_clock::now();
        call()->wait();
        const double one = std::chrono::duration<double>(std::chrono::steady_clock::now() - probe_start).count();
        int iters = o.iters;
        if (one * iters > 0.5) iters = std::max(3, static_cast<int>(0.5 / std::max(one, 1e-9)));
        MPI_Allreduce(MPI_IN_PLACE, &iters, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
        comm->barrier();
        const auto start = std::chrono::steady_clock::now();
        std::vector<zero::WorkPtr> pending;
        for (int i = 0; i < iters; ++i) pending.push_back(call());
        for (auto& w : pending) w->wait();
        ZERO_CHECK_CUDA(cudaStreamSynchronize(stream));
        double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / iters;
        // The slowest rank's time is the collective's time.
        MPI_Allreduce(MPI_IN_PLACE, &seconds, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        long long all_wrong = wrong;
        MPI_Allreduce(MPI_IN_PLACE, &all_wrong, 1, MPI_LONG_LONG, o.check ? MPI_SUM : MPI_MAX, MPI_COMM_WORLD);

        const double algbw = static_cast<double>(bytes) / seconds / 1e9;
        const double factor = op == Op::all_reduce ? 2.0 * (world - 1) / world
                                                   : static_cast<double>(world - 1) / world;
        const double busbw = algbw * factor;
        if (rank == 0) {
          std::printf("  %12zu %12zu %6s %8s %12.2f %8.2f %8.2f %7lld\n", bytes, bytes / e,
                      std::string(zero::name_of(o.dtype)).c_str(),
                      op == Op::reduce_scatter ? "rs" : (op == Op::all_gather ? "ag" : "ar"),
                      seconds * 1e6, algbw, busbw, all_wrong);
          std::fflush(stdout);
        }
        rows.push_back({{"op", name_of(op)},
                        {"size", bytes},
                        {"count", bytes / e},
                        {"type", std::string(zero::name_of(o.dtype))},
                        {"time_us", seconds * 1e6},
                        {"algbw_gbps", algbw},
                        {"busbw_gbps", busbw},
                        {"wrong", all_wrong},
                        {"iters", iters}});
      }
    }
    ZERO_CHECK_CUDA(cudaStreamDestroy(stream));
    if (rank == 0 && !o.json_path.empty()) {
      cudaDeviceProp prop{};
      int device = 0;
      cudaGetDevice(&device);
      cudaGetDeviceProperties(&prop, device);
      int nccl_version = 0;
      ncclGetVersion(&nccl_version);
      nlohmann::json out = {{"backend", comm->backend_name()},
                            {"world_size", world},
                            {"device", prop.name},
                            {"nccl_version", nccl_version},
                            {"time", "average of back-to-back calls, host clock, slowest rank"},
                            {"rows", rows}};
      std::ofstream(o.json_path) << out.dump(2) << "\n";
      std::printf("# wrote %s\n", o.json_path.c_str());
    }
    return 0;
  });
}
