// Activation checkpointing for the UNet's units (declared in
// activation_checkpoint.hpp).
//
// Reentrant checkpointing as torch.utils.checkpoint(use_reentrant=True) does
// it: forward runs the block with grad mode off (autograd::Function::apply
// does that) and saves only the inputs; backward re-runs the block with grad
// mode on from detached copies of the inputs and back-propagates through the
// recomputed graph, which accumulates the parameters' gradients directly and
// yields the inputs' gradients to return.

#include "activation_checkpoint.hpp"

namespace sdxl {

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

struct RecomputeClosure : torch::CustomClassHolder {
  std::function<variable_list(const variable_list&)> fn;
};

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<RecomputeClosure> closure,
                               at::TensorList inputs) {
    ctx->set_materialize_grads(false);
    variable_list saved(inputs.begin(), inputs.end());
    c10::List<bool> flags;
    for (const Tensor& t : saved) flags.push_back(t.defined() && t.requires_grad());
    ctx->save_for_backward(saved);
    ctx->saved_data["requires_grad"] = flags;
    ctx->saved_data["closure"] = c10::IValue::make_capsule(closure);
    variable_list outputs = closure->fn(saved);
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto closure = c10::static_intrusive_pointer_cast<RecomputeClosure>(ctx->saved_data["closure"].toCapsule());
    c10::List<bool> flags = ctx->saved_data["requires_grad"].toBoolList();
    variable_list saved = ctx->get_saved_variables();
    variable_list inputs;
    inputs.reserve(saved.size());
    for (std::size_t i = 0; i < saved.size(); ++i) {
      Tensor t = saved[i].defined() ? saved[i].detach() : Tensor();
      if (t.defined()) t.requires_grad_(flags.get(i));
      inputs.push_back(t);
    }
    variable_list outputs;
    {
      // The engine runs backward functions with grad mode off (unless create_graph).
      torch::AutoGradMode enable_grad(true);
      outputs = closure->fn(inputs);
    }
    variable_list roots, grads;
    for (std::size_t i = 0; i < outputs.size() && i < grad_outputs.size(); ++i) {
      if (grad_outputs[i].defined() && outputs[i].defined() && outputs[i].requires_grad()) {
        roots.push_back(outputs[i]);
        grads.push_back(grad_outputs[i]);
      }
    }
    if (!roots.empty()) torch::autograd::backward(roots, grads);
    variable_list result;
    result.reserve(inputs.size() + 1);
    result.emplace_back();  // the closure argument
    for (const Tensor& t : inputs) result.push_back(t.defined() && t.requires_grad() ? t.grad() : Tensor());
    return result;
  }
};

}  // namespace

variable_list checkpoint(std::function<variable_list(const variable_list&)> fn, const variable_list& inputs) {
  if (!torch::GradMode::is_enabled()) return fn(inputs);
  auto closure = c10::make_intrusive<RecomputeClosure>();
  // The closure sees only the caller's inputs, not the dummy appended below.
  closure->fn = [fn = std::move(fn)](const variable_list& all) {
    return fn(variable_list(all.begin(), all.end() - 1));
  };
  // A requires-grad dummy input keeps the node in the graph even when no real
  // input requires grad (e.g. a frozen stem), so parameter grads still flow.
  variable_list all = inputs;
  const torch::Device device = inputs.empty() || !inputs[0].defined() ? torch::Device(torch::kCPU) : inputs[0].device();
  all.push_back(torch::empty({0}, torch::TensorOptions().device(device).requires_grad(true)));
  variable_list outputs = CheckpointFunction::apply(closure, at::TensorList(all));
  return outputs;
}

}  // namespace sdxl
