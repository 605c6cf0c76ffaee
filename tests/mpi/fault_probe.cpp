// fault_probe: ranks train a small engine in a loop; one rank fails on
// purpose, so that a test can check that every other rank stops, with a
// clear message and a non-zero exit, instead of waiting forever.
//   fault_probe --mode kill|hang|throw --victim 1 --after 5
#include <csignal>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "zero/comm/mpi_communicator.hpp"
#include "zero/engine/engine.hpp"

int main(int argc, char** argv) {
  return zero::run_or_abort([&]() -> int {
    zero::MpiSession session(&argc, &argv);
    std::string mode = "kill";
    int victim = 1, after = 5;
    for (int i = 1; i + 1 < argc; i += 2) {
      if (!std::strcmp(argv[i], "--mode")) mode = argv[i + 1];
      else if (!std::strcmp(argv[i], "--victim")) victim = std::stoi(argv[i + 1]);
      else if (!std::strcmp(argv[i], "--after")) after = std::stoi(argv[i + 1]);
    }
    zero::MpiCommunicator comm;
    auto backend = zero::make_host_backend();
    zero::EngineOptions options;
    options.stage = 2;
    zero::Engine engine(std::vector<zero::ParamSpec>{{"w", 100000, {}}, {"b", 1000, {}}}, options, comm, *backend);
    for (int step = 0;; ++step) {
      if (comm.rank() == victim && step == after) {
        std::fprintf(stderr, "fault_probe: rank %d fails now (%s)\n", victim, mode.c_str());
        std::fflush(stderr);
        if (mode == "kill") std::raise(SIGKILL);
        if (mode == "hang") std::this_thread::sleep_for(std::chrono::hours(1));
        if (mode == "throw") throw std::runtime_error("fault_probe: deliberate failure");
      }
      for (std::size_t p = 0; p < engine.param_count(); ++p) {
        zero::store_from_float(engine.grad_data(p), 0, zero::DType::bf16, 1.0f);
        engine.grad_ready(p);
      }
      engine.finish_micro_step();
      engine.step();
      if (comm.rank() == 0 && step % 10 == 0) std::printf("step %d\n", step), std::fflush(stdout);
    }
  });
}
