// The offloaded optimizer's host memory: does the CPU update (AdamW + EMA,
// bf16 gradient in, bf16 copy out: the delayed update's pass) run faster on
// memory other than what the engine allocates today (cudaHostAlloc: pinned,
// 4 KiB pages, zeroed by one thread)?
//
//   pinned        cudaHostAlloc, as BufferPool::allocate_host
//   pageable-4k   mmap + MADV_NOHUGEPAGE, first touched by the update's threads
//   pageable-thp  mmap + MADV_HUGEPAGE (transparent huge pages), the same
//   thp-pinned    pageable-thp, then cudaHostRegister (pinned, huge pages kept)
//
// Each variant holds master, m, v and EMA (fp32), a bf16 gradient and a bf16
// copy for --elements parameters and runs --reps updates, in slices of
// --slice elements as the engine does per bucket. Prints a table and writes
// JSON (--json): median seconds, GB/s at 36 bytes a parameter, and how much
// of the state the kernel reports backed by huge pages (AnonHugePages).
//   gpu_bench_host_state --elements 805306368 --json bench/results/host-state.json
#include <cuda_runtime.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "zero/core/error.hpp"
#include "zero/optim/optimizer.hpp"

using namespace zero;

namespace {

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) ZERO_THROW(Error, what, ": ", cudaGetErrorString(status));
}

std::string read_first_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// AnonHugePages of this process, in bytes (smaps_rollup).
std::size_t anon_huge_bytes() {
  std::ifstream in("/proc/self/smaps_rollup");
  std::string key;
  std::size_t kib = 0;
  while (in >> key) {
    if (key == "AnonHugePages:") {
      in >> kib;
      return kib * 1024;
    }
    std::string rest;
    std::getline(in, rest);
  }
  return 0;
}

enum class Kind { pinned, pageable_4k, pageable_thp, thp_pinned };
const char* name_of(Kind k) {
  switch (k) {
    case Kind::pinned: return "pinned";
    case Kind::pageable_4k: return "pageable-4k";
    case Kind::pageable_thp: return "pageable-thp";
    case Kind::thp_pinned: return "thp-pinned";
  }
  return "?";
}

struct Block {
  Kind kind;
  void* p = nullptr;
  std::size_t bytes = 0;
  Block(Kind k, std::size_t n) : kind(k), bytes(n) {
    if (k == Kind::pinned) {
      check_cuda(cudaHostAlloc(&p, n, cudaHostAllocDefault), "cudaHostAlloc");
      std::memset(p, 0, n);  // as the pool does: zeroed by one thread
      return;
    }
    p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) ZERO_THROW(Error, "mmap of ", n, " bytes failed");
    madvise(p, n, k == Kind::pageable_4k ? MADV_NOHUGEPAGE : MADV_HUGEPAGE);
    // First touch by many threads, as the update's own team will use it.
    const std::size_t chunk = std::size_t{1} << 21;
    const std::size_t chunks = (n + chunk - 1) / chunk;
#pragma omp parallel for schedule(static)
    for (std::size_t c = 0; c < chunks; ++c)
      std::memset(static_cast<char*>(p) + c * chunk, 0, std::min(chunk, n - c * chunk));
    if (k == Kind::thp_pinned) check_cuda(cudaHostRegister(p, n, cudaHostRegisterDefault), "cudaHostRegister");
  }
  ~Block() {
    if (kind == Kind::pinned) cudaFreeHost(p);
    else {
      if (kind == Kind::thp_pinned) cudaHostUnregister(p);
      munmap(p, bytes);
    }
  }
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t elements = std::size_t{768} << 20, slice = std::size_t{32} << 20;
  int reps = 5;
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) ZERO_THROW(Error, a, " needs a value");
      return argv[++i];
    };
    if (a == "--elements") elements = std::stoull(next());
    else if (a == "--slice") slice = std::stoull(next());
    else if (a == "--reps") reps = std::stoi(next());
    else if (a == "--json") json_path = next();
    else ZERO_THROW(Error, "unknown option ", a, " (--elements N --slice N --reps N --json PATH)");
  }
  ZERO_CHECK(elements > 0 && slice > 0 && reps > 0, "--elements, --slice and --reps must be positive");
  OptimizerOptions o;
  nlohmann::json out;
  out["elements"] = elements;
  out["slice"] = slice;
  out["threads"] = omp_get_max_threads();  // the update's team (OMP_NUM_THREADS), not the cores
  out["thp_enabled"] = read_first_line("/sys/kernel/mm/transparent_hugepage/enabled");
  out["thp_defrag"] = read_first_line("/sys/kernel/mm/transparent_hugepage/defrag");
  std::printf("%zu elements (%.1f GB of state), slices of %zu, %d reps, THP: %s\n", elements,
              elements * 20.0 / 1e9, slice, reps, out["thp_enabled"].get<std::string>().c_str());
  std::printf("%-13s %10s %10s %12s\n", "memory", "median s", "GB/s", "huge pages");
  for (Kind k : {Kind::pinned, Kind::pageable_4k, Kind::pageable_thp, Kind::thp_pinned}) {
    const std::size_t huge_before = anon_huge_bytes();
    Block master(k, elements * 4), m(k, elements * 4), v(k, elements * 4), ema(k, elements * 4),
        grad(k, elements * 2), copy(k, elements * 2);
    const std::size_t huge_after = anon_huge_bytes();
    const std::size_t huge = huge_after - std::min(huge_after, huge_before);
    // Values that are not zeros: gradients of a few magnitudes, master ~1.
    auto* g = static_cast<std::uint16_t*>(grad.p);
    auto* w = static_cast<float*>(master.p);
#pragma omp parallel for schedule(static)
    for (std::size_t i = 0; i < elements; ++i) {
      g[i] = float_to_bf16_bits(static_cast<float>((i * 2654435761u) % 1000) * 1e-3f - 0.5f);
      w[i] = 1.0f + static_cast<float>(i % 97) * 1e-3f;
    }
    std::vector<double> seconds;
    for (int r = 0; r < reps + 1; ++r) {
      const StepScalars scalars = make_step_scalars(o, r + 1, 1e-4, 1.0);
      const auto t0 = std::chrono::steady_clock::now();
      for (std::size_t at = 0; at < elements; at += slice) {
        ShardUpdate u;
        const std::size_t n = std::min(slice, elements - at);
        u.master = w + at;
        u.state0 = static_cast<float*>(m.p) + at;
        u.state1 = static_cast<float*>(v.p) + at;
        u.ema = static_cast<float*>(ema.p) + at;
        u.ema_decay = 0.9999;
        u.grad = g + at;
        u.grad_dtype = DType::bf16;
        u.model_copy = static_cast<std::uint16_t*>(copy.p) + at;
        u.model_dtype = DType::bf16;
        u.count = n;
        cpu_optimizer_step(o, scalars, u);
      }
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (r > 0) seconds.push_back(s);  // the first touches the pages of the copy
    }
    const double med = median(seconds);
    const double gbps = elements * 36.0 / med / 1e9;
    const double huge_share = static_cast<double>(huge) / (elements * 20.0);
    std::printf("%-13s %10.4f %10.1f %11.0f%%\n", name_of(k), med, gbps, 100 * huge_share);
    out["variants"].push_back({{"memory", name_of(k)},
                               {"median_s", med},
                               {"seconds", seconds},
                               {"gb_per_s_at_36_bytes", gbps},
                               {"huge_page_share", huge_share}});
  }
  if (!json_path.empty()) {
    std::ofstream f(json_path);
    f << out.dump(1) << "\n";
    ZERO_CHECK(f.good(), "could not write ", json_path);
  }
  return 0;
}
