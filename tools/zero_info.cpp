// zero-info: what a zero job would run on. Run it the way the trainer runs,
// e.g. `mpirun -np 8 zero-info`: every rank prints its GPU and versions, rank
// 0 prints the rank -> GPU map, peer access between its visible GPUs and a
// verdict. Exit status: 0 fine, 2 no GPU visible, 3 driver older than the
// CUDA runtime, 4 more ranks on a node than GPUs (they would share GPUs: use
// the staged communicator, NCCL refuses two ranks on one GPU), 1 other errors.

#include <cuda_runtime_api.h>
#include <mpi.h>
#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

namespace {

// ---------------------------------------------------------------- per-rank facts

enum Status : int { kOk = 0, kFailure = 1, kNoGpu = 2, kOldDriver = 3, kSharedGpu = 4 };

// Fixed size and trivially copyable: gathered to rank 0 as bytes.
struct RankReport {
  int rank = 0;
  int local_rank = 0;
  int local_size = 1;
  int device_count = 0;
  int device = -1;  // local_rank % device_count
  int cc_major = 0, cc_minor = 0;
  int multiprocessors = 0;
  int runtime_version = 0, driver_version = 0, nccl_version = 0;
  int status = kOk;
  unsigned long long total_bytes = 0, free_bytes = 0;
  char host[64] = {};
  char gpu_name[96] = {};
  char bus_id[32] = {};
  char problem[160] = {};
};

void copy_text(char* dst, std::size_t size, const std::string& text) {
  std::snprintf(dst, size, "%s", text.c_str());
}

std::string cuda_version_text(int version) {
  return std::to_string(version / 1000) + "." + std::to_string((version % 1000) / 10);
}

std::string nccl_version_text(int version) {
  // NCCL >= 2.9 encodes MAJOR*10000 + MINOR*100 + PATCH.
  return std::to_string(version / 10000) + "." + std::to_string((version % 10000) / 100) + "." +
         std::to_string(version % 100);
}

double gib(unsigned long long bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0); }

RankReport probe(int rank, int local_rank, int local_size) {
  RankReport r;
  r.rank = rank;
  r.local_rank = local_rank;
  r.local_size = local_size;
  char host[sizeof(r.host)] = {};
  gethostname(host, sizeof(host) - 1);
  copy_text(r.host, sizeof(r.host), host);
  cudaRuntimeGetVersion(&r.runtime_version);
  cudaDriverGetVersion(&r.driver_version);  // 0 when no driver is installed
  ncclGetVersion(&r.nccl_version);

  const cudaError_t count_status = cudaGetDeviceCount(&r.device_count);
  if (count_status != cudaSuccess || r.device_count == 0) {
    r.device_count = 0;
    if (r.driver_version != 0 && r.driver_version < r.runtime_version) {
      r.status = kOldDriver;
      copy_text(r.problem, sizeof(r.problem),
                "the driver supports CUDA " + cuda_version_text(r.driver_version) +
                    " but zero was built with runtime " + cuda_version_text(r.runtime_version) +
                    ": update the driver");
    } else {
      r.status = kNoGpu;
      copy_text(r.problem, sizeof(r.problem),
                std::string("no CUDA device visible (") +
                    (count_status == cudaSuccess ? "0 devices" : cudaGetErrorString(count_status)) +
                    "; check CUDA_VISIBLE_DEVICES and the driver)");
    }
    return r;
  }
  if (r.driver_version < r.runtime_version) {
    r.status = kOldDriver;
    copy_text(r.problem, sizeof(r.problem),
              "driver CUDA " + cuda_version_text(r.driver_version) + " is older than runtime " +
                  cuda_version_text(r.runtime_version));
  }
  r.device = local_rank % r.device_count;
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, r.device) == cudaSuccess) {
    copy_text(r.gpu_name, sizeof(r.gpu_name), prop.name);
    r.cc_major = prop.major;
    r.cc_minor = prop.minor;
    r.multiprocessors = prop.multiProcessorCount;
    r.total_bytes = prop.totalGlobalMem;
  }
  cudaDeviceGetPCIBusId(r.bus_id, sizeof(r.bus_id), r.device);
  if (cudaSetDevice(r.device) == cudaSuccess) {
    std::size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
      r.free_bytes = free_bytes;
      r.total_bytes = total_bytes;
    }
  }
  if (r.status == kOk && local_size > r.device_count) {
    r.status = kSharedGpu;
    copy_text(r.problem, sizeof(r.problem),
              std::to_string(local_size) + " ranks on this node but " +
                  std::to_string(r.device_count) +
                  " GPU(s): ranks will share GPUs; NCCL refuses that, use the staged path "
                  "(zero::StagedCommunicator over MPI)");
  }
  return r;
}

// ---------------------------------------------------------------- rank 0's summary

void print_peer_matrix(int device_count) {
  if (device_count < 2) {
    std::printf("peer access: only %d GPU visible to rank 0, nothing to pair\n", device_count);
    return;
  }
  std::printf("peer access between the GPUs rank 0 sees (P = peer access, A = also native "
              "atomics, which on current systems means NVLink; - = none):\n      ");
  for (int j = 0; j < device_count; ++j) std::printf("%4d", j);
  std::printf("\n");
  for (int i = 0; i < device_count; ++i) {
    std::printf("  %3d ", i);
    for (int j = 0; j < device_count; ++j) {
      if (i == j) {
        std::printf("   X");
        continue;
      }
      int access = 0, atomics = 0;
      cudaDeviceCanAccessPeer(&access, i, j);
      cudaDeviceGetP2PAttribute(&atomics, cudaDevP2PAttrNativeAtomicSupported, i, j);
      std::printf("   %s", !access ? "-" : (atomics ? "A" : "P"));
    }
    std::printf("\n");
  }
}

int summarize(const std::vector<RankReport>& reports) {
  std::printf("\n==== zero-info summary: %zu rank(s)\n", reports.size());
  std::printf("%5s  %-20s %6s  %4s  %-14s %-22s %10s %10s %5s\n", "rank", "host", "local", "gpu",
              "bus id", "name", "total GiB", "free GiB", "cc");
  int worst = kOk;
  // Ranks sharing one GPU: same host and same PCI bus id.
  std::map<std::string, std::vector<int>> by_gpu;
  for (const RankReport& r : reports) {
    std::printf("%5d  %-20s %2d/%-3d  %4d  %-14s %-22s %10.1f %10.1f %2d.%d\n", r.rank, r.host,
                r.local_rank, r.local_size, r.device, r.bus_id, r.gpu_name, gib(r.total_bytes),
                gib(r.free_bytes), r.cc_major, r.cc_minor);
    if (r.device >= 0) by_gpu[std::string(r.host) + " " + r.bus_id].push_back(r.rank);
    worst = std::max(worst, r.status);
  }
  const RankReport& first = reports.front();
  char mpi_version[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int length = 0;
  MPI_Get_library_version(mpi_version, &length);
  std::string mpi_text(mpi_version, static_cast<std::size_t>(length));
  if (auto end = mpi_text.find_first_of("\n,"); end != std::string::npos) mpi_text.resize(end);
  std::printf("versions (rank 0): CUDA runtime %s, driver supports CUDA %s, NCCL %s, MPI: %s\n",
              cuda_version_text(first.runtime_version).c_str(),
              cuda_version_text(first.driver_version).c_str(),
              nccl_version_text(first.nccl_version).c_str(), mpi_text.c_str());
  for (const RankReport& r : reports) {
    if (r.nccl_version != first.nccl_version || r.runtime_version != first.runtime_version)
      std::printf("warning: rank %d has CUDA runtime %s / NCCL %s, unlike rank 0\n", r.rank,
                  cuda_version_text(r.runtime_version).c_str(),
                  nccl_version_text(r.nccl_version).c_str());
  }
  print_peer_matrix(first.device_count);
  bool shared = false;
  for (const auto& [gpu, ranks] : by_gpu) {
    if (ranks.size() < 2) continue;
    shared = true;
    std::printf("shared GPU %s: ranks", gpu.c_str());
    for (int rank : ranks) std::printf(" %d", rank);
    std::printf("\n");
  }
  for (const RankReport& r : reports)
    if (r.status != kOk) std::printf("problem on rank %d (%s): %s\n", r.rank, r.host, r.problem);
  if (worst == kOk && shared) worst = kSharedGpu;
  switch (worst) {
    case kOk:
      std::printf("verdict: OK, one GPU per rank; NcclCommunicator will work\n");
      break;
    case kSharedGpu:
      std::printf("verdict: ranks share GPUs; NCCL cannot run two ranks on one GPU. Use "
                  "zero::StagedCommunicator (MPI through pinned host memory), or start no more "
                  "ranks per node than GPUs\n");
      break;
    case kNoGpu:
      std::printf("verdict: no GPU visible on some rank; zero can only run its host backend there\n");
      break;
    case kOldDriver:
      std::printf("verdict: the NVIDIA driver is older than the CUDA runtime zero was built with\n");
      break;
    default:
      std::printf("verdict: failed\n");
  }
  return worst;
}

}  // namespace

int main(int argc, char** argv) {
  if (MPI_Init(&argc, &argv) != MPI_SUCCESS) {
    std::fprintf(stderr, "zero-info: MPI_Init failed\n");
    return kFailure;
  }
  int rank = 0, size = 1, local_rank = 0, local_size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm node = MPI_COMM_NULL;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
  MPI_Comm_rank(node, &local_rank);
  MPI_Comm_size(node, &local_size);
  MPI_Comm_free(&node);

  const RankReport mine = probe(rank, local_rank, local_size);
  if (mine.device >= 0) {
    std::printf("rank %d (%s, local %d of %d): GPU %d of %d, %s, %.1f GiB (%.1f free), cc %d.%d, "
                "%d SMs, bus %s\n",
                rank, mine.host, local_rank, local_size, mine.device, mine.device_count,
                mine.gpu_name, gib(mine.total_bytes), gib(mine.free_bytes), mine.cc_major,
                mine.cc_minor, mine.multiprocessors, mine.bus_id);
  } else {
    std::printf("rank %d (%s, local %d of %d): %s\n", rank, mine.host, local_rank, local_size,
                mine.problem);
  }
  std::fflush(stdout);

  std::vector<RankReport> all(rank == 0 ? static_cast<std::size_t>(size) : 0);
  MPI_Gather(&mine, sizeof(RankReport), MPI_BYTE, all.data(), sizeof(RankReport), MPI_BYTE, 0,
             MPI_COMM_WORLD);
  int status = kOk;
  if (rank == 0) status = summarize(all);
  std::fflush(stdout);
  MPI_Bcast(&status, 1, MPI_INT, 0, MPI_COMM_WORLD);
  MPI_Finalize();
  return status;
}
