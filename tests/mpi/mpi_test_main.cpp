// doctest under mpirun: every rank runs every test case (collectives need
// all ranks); rank 0 reports in full, the others only their failures. The
// exit code is the worst over ranks so CTest sees a failure on any rank.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <vector>

#include "zero/comm/mpi_communicator.hpp"

int main(int argc, char** argv) {
  return zero::run_or_abort([&] {
    zero::MpiSession session(&argc, &argv);
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    doctest::Context context;
    context.applyCommandLine(argc, argv);
    if (rank != 0) context.setOption("minimal", true);
    int failed = context.run();
    int worst = 0;
    ZERO_CHECK_MPI(MPI_Allreduce(&failed, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD));
    return worst;
  });
}
