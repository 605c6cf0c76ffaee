// CUDA graphs at every stage: a micro-step captured once and replayed. The
// engine's part is to keep the host out of the captured work (collectives
// waited for on the device, a stream-ordered pool) and to keep the blocks
// the graph has the addresses of. The capture itself (the stream, the
// graph) is the caller's: the engine knows no CUDA.
#include "engine_impl.hpp"

namespace zero {

void Engine::begin_graph_capture() {
  Impl& m = *impl_;
  ZERO_CHECK(!m.capturing && !m.captured, "begin_graph_capture: this engine has captured a micro-step already "
             "(one graph per engine)");
  ZERO_CHECK(options_.accumulation_steps == 1, "a CUDA graph of the micro-step needs accumulation_steps = 1, got ",
             options_.accumulation_steps);
  ZERO_CHECK(!m.plan.optimizer_on_host && !m.plan.params_on_host,
             "a CUDA graph of the micro-step does not work with offload (the gradients go to the host)");
  ZERO_CHECK(m.comm.graph_capturable() && (!m.replica_comm || m.replica_comm->graph_capturable()),
             "a CUDA graph of the micro-step needs collectives that can be captured (NCCL); the ",
             m.comm.backend_name(), " communicator waits on the host");
  ZERO_CHECK(m.micro_step == 0, "begin_graph_capture: call it at the start of a step (micro-step ", m.micro_step, ")");
  ZERO_CHECK(m.prepared_for_capture, "begin_graph_capture: call prepare_graph_replay() before the capture begins "
             "(the work outside the graph must be ordered before it)");
  m.prepared_for_capture = false;
  // prepare_graph_replay's finish_param_gathers checked every eager gather:
  // none is left to a check inside the capture.
  ZERO_ASSERT(m.gathers_to_check.empty(), m.gathers_to_check.size(), " gathers unchecked at the capture");
  m.capturing = true;
  m.pool.begin_capture();
  // The comm stream joins the capture: everything the micro-step queues on
  // it from here on is captured, and ordered after the capture's start.
  m.order_after(m.backend.comm_stream(), m.backend.compute_stream());
}

void Engine::end_graph_capture() {
  Impl& m = *impl_;
  ZERO_CHECK(m.capturing, "end_graph_capture without begin_graph_capture");
  ZERO_CHECK(m.micro_step == 1 && m.pending.empty(),
             "end_graph_capture: finish_micro_step() belongs in the captured micro-step");
  for (std::size_t u = 0; u < m.unit_refs.size(); ++u)
    ZERO_CHECK(m.unit_refs[u] == 0, "end_graph_capture: unit ", u, " is still gathered; release it in the capture");
  // The comm stream joins back (a capture ends only when every stream it
  // forked into has).
  m.order_after(m.backend.compute_stream(), m.backend.comm_stream());
  m.capturing = false;
  m.pool.end_capture();
  m.captured = true;
  m.captured_accumulator = m.accumulator_has_data;
}

bool Engine::graph_captured() const { return impl_->captured; }

void Engine::prepare_graph_replay() {
  Impl& m = *impl_;
  ZERO_CHECK(m.micro_step == 0, "prepare_graph_replay: call it at the start of a step (micro-step ", m.micro_step, ")");
  m.finish_param_gathers();
  // The accumulator's zeroing (reset_gradients) is on the comm stream; the
  // graph's reductions, captured there, replay on the compute stream.
  m.order_after(m.backend.compute_stream(), m.backend.comm_stream());
  m.prepared_for_capture = true;
}

void Engine::graph_replayed() {
  Impl& m = *impl_;
  ZERO_CHECK(m.captured, "graph_replayed: no micro-step was captured (begin_graph_capture/end_graph_capture)");
  ZERO_CHECK(m.micro_step == 0, "graph_replayed: the step has ", m.micro_step, " micro-step(s) already");
  m.accumulator_has_data = m.captured_accumulator;
  ++m.micro_step;
}

}  // namespace zero
