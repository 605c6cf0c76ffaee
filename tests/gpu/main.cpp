// Entry point of zero_gpu_tests. Without a CUDA device it exits with 77,
// which CTest reports as skipped (SKIP_RETURN_CODE), so CI machines without a
// GPU pass. Under mpirun every rank runs the same test cases in the same
// order (the collectives need that); only rank 0 prints the full report, and
// the exit code is the worst of all ranks.

#define DOCTEST_CONFIG_IMPLEMENT
#include <cuda_runtime_api.h>
#include <doctest/doctest.h>
#include <mpi.h>

#include <algorithm>
#include <cstdio>

int main(int argc, char** argv) {
  int devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  if (status != cudaSuccess || devices == 0) {
    std::printf("skipped: no CUDA device (%s)\n",
                status == cudaSuccess ? "0 devices visible" : cudaGetErrorString(status));
    return 77;
  }
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);

  doctest::Context context(argc, argv);
  if (rank != 0) context.setOption("minimal", true);  // failures only
  int result = context.run();
  int worst = 0;
  MPI_Allreduce(&result, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  if (context.shouldExit()) return result;
  return worst;
}
