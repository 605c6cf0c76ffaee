// A user's trainer in miniature: two parameters, stage 3, two ranks.
#include <zero/comm/mpi_communicator.hpp>
#include <zero/engine/engine.hpp>

#include <cstdio>
#include <vector>

int main(int argc, char** argv) {
  return zero::run_or_abort([&] {
    zero::MpiSession session(&argc, &argv);
    zero::MpiCommunicator comm;
    auto backend = zero::make_host_backend();
    zero::EngineOptions options;
    options.stage = 3;
    options.optimizer.lr = 0.1;
    options.optimizer.weight_decay = 0;
    zero::Engine engine(std::vector<zero::ParamSpec>{{"w", 1000, {10, 100}}, {"b", 10, {10}}}, options, comm, *backend);
    std::vector<float> zeros(1000, 0.0f);
    engine.set_param(0, zeros.data());
    engine.set_param(1, zeros.data());
    for (std::size_t p = 0; p < 2; ++p) {
      void* g = engine.grad_data(p);
      for (std::size_t k = 0; k < engine.params()[p].numel; ++k) zero::store_from_float(g, k, zero::DType::bf16, -1.0f);
      engine.grad_ready(p);
    }
    engine.finish_micro_step();
    const zero::StepResult r = engine.step();
    const auto master = engine.gather_master_params();
    // AdamW's first step moves every weight by lr against the gradient's sign.
    const bool ok = r.applied && master[0][999] > 0.0999f && master[0][999] < 0.1001f;
    if (comm.rank() == 0) std::printf("consumer: step %s, w[999] = %.6f\n", ok ? "ok" : "WRONG", master[0][999]);
    return ok ? 0 : 1;
  });
}
