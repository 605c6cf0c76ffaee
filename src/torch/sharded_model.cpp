#include "zero/torch/sharded_model.hpp"

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cmath>

namespace zero::adapter {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

torch::ScalarType scalar_type_of(DType dtype) {
  switch (dtype) {
    case DType::fp32: return torch::kFloat32;
    case DType::bf16: return torch::kBFloat16;
    case DType::fp16: return torch::kFloat16;
  }
  ZERO_THROW(InvalidArgument, "unknown dtype value ", static_cast<int>(dtype));
}

torch::Device device_of(const Backend& backend) {
  if (backend.memory_kind() == MemoryKind::host) return torch::kCPU;
  return {torch::kCUDA, static_cast<c10::DeviceIndex>(std::max(0, backend.device_index()))};
}

std::vector<UnitSpec> units_by_child(torch::nn::Module& module) {
  std::vector<UnitSpec> units;
  UnitSpec own{"(root)", {}};
  for (auto& item : module.named_parameters(/*recurse=*/false)) own.params.emplace_back(item.key(), item.value());
  if (!own.params.empty()) units.push_back(std::move(own));
  for (auto& child : module.named_children()) {
    UnitSpec unit{child.key(), {}};
    for (auto& item : child.value()->named_parameters(/*recurse=*/true))
      unit.params.emplace_back(child.key() + "." + item.key(), item.value());
    if (!unit.params.empty()) units.push_back(std::move(unit));
  }
  return units;
}

namespace {

// Runs after autograd has accumulated a parameter's gradient into .grad.
class GradientReady final : public torch::autograd::FunctionPostHook {
 public:
  GradientReady(ShardedModel* model, std::size_t param) : model_(model), param_(param) {}
  variable_list operator()(const variable_list& outputs, const variable_list& /*inputs*/) override {
    model_->on_gradient(param_);
    return outputs;
  }

 private:
  ShardedModel* model_;
  std::size_t param_;
};

ShardedModel* model_from(AutogradContext* ctx) {
  return reinterpret_cast<ShardedModel*>(ctx->saved_data["model"].toInt());
}

// Identity on the unit's outputs whose backward gathers the unit's
// parameters again before autograd reaches the unit's own backward.
struct GatherBeforeBackward : torch::autograd::Function<GatherBeforeBackward> {
  static variable_list forward(AutogradContext* ctx, ShardedModel* model, std::int64_t unit, at::TensorList outputs) {
    ctx->saved_data["model"] = reinterpret_cast<std::int64_t>(model);
    ctx->saved_data["unit"] = unit;
    return outputs.vec();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    model_from(ctx)->gather_for_backward(static_cast<std::size_t>(ctx->saved_data["unit"].toInt()));
    variable_list out = {torch::Tensor(), torch::Tensor()};
    out.insert(out.end(), grads.begin(), grads.end());
    return out;
  }
};

// Identity on the inputs of a unit with nothing to train: its backward runs
// once the unit's backward has produced their gradients, and releases the
// unit (a unit with trainable parameters is released when their gradients
// are in).
struct ReleaseAfterBackward : torch::autograd::Function<ReleaseAfterBackward> {
  static variable_list forward(AutogradContext* ctx, ShardedModel* model, std::int64_t unit, at::TensorList inputs) {
    ctx->saved_data["model"] = reinterpret_cast<std::int64_t>(model);
    ctx->saved_data["unit"] = unit;
    return inputs.vec();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    model_from(ctx)->release_after_backward(static_cast<std::size_t>(ctx->saved_data["unit"].toInt()));
    variable_list out = {torch::Tensor(), torch::Tensor()};
    out.insert(out.end(), grads.begin(), grads.end());
    return out;
  }
};

// Activation checkpointing of one unit: forward without saving anything,
// backward gathers, re-runs the forward with grad and backpropagates through it.
struct RecomputeUnit : torch::autograd::Function<RecomputeUnit> {
  // `anchor` requires grad so that the outputs do even when no input does:
  // the parameters the unit trains are not inputs of this function.
  static variable_list forward(AutogradContext* ctx, ShardedModel* model, std::int64_t unit, const UnitBody* body,
                               torch::Tensor anchor, at::TensorList inputs) {
    (void)anchor;
    ctx->saved_data["model"] = reinterpret_cast<std::int64_t>(model);
    ctx->saved_data["unit"] = unit;
    ctx->saved_data["body"] = reinterpret_cast<std::int64_t>(body);
    ctx->save_for_backward(inputs.vec());
    model->gather(static_cast<std::size_t>(unit), Pass::forward);
    variable_list outputs = (*body)(inputs.vec());
    model->release(static_cast<std::size_t>(unit));
    return outputs;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    ShardedModel* model = model_from(ctx);
    const auto unit = static_cast<std::size_t>(ctx->saved_data["unit"].toInt());
    const auto* body = reinterpret_cast<const UnitBody*>(ctx->saved_data["body"].toInt());
    variable_list saved = ctx->get_saved_variables();
    variable_list inputs;
    for (const auto& t : saved) inputs.push_back(t.defined() ? t.detach().requires_grad_(t.requires_grad()) : t);
    model->gather(unit, Pass::backward);  // the recompute: backward's schedule
    variable_list outputs;
    {
      torch::AutoGradMode enable(true);
      outputs = (*body)(inputs);
    }
    variable_list roots, root_grads;
    for (std::size_t i = 0; i < outputs.size() && i < grads.size(); ++i) {
      if (outputs[i].defined() && outputs[i].requires_grad() && grads[i].defined()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grads[i]);
      }
    }
    if (!roots.empty()) torch::autograd::backward(roots, root_grads);
    model->release(unit);
    variable_list out = {torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
    for (const auto& t : inputs) out.push_back(t.defined() && t.requires_grad() ? t.grad() : torch::Tensor());
    return out;
  }
};

}  // namespace

ShardedModel::ShardedModel(std::vector<UnitSpec> units, const EngineOptions& options, Communicator& comm,
                           Backend& backend, const GroupOf& group_of)
    : backend_(backend),
      device_(device_of(backend)),
      param_type_(scalar_type_of(options.param_dtype)),
      grad_type_(scalar_type_of(options.effective_grad_dtype())) {
  ZERO_CHECK(!units.empty(), "ShardedModel: no units (no parameters to train)");
  std::vector<std::vector<ParamSpec>> groups;
  for (UnitSpec& unit : units) {
    ZERO_CHECK(!unit.params.empty(), "ShardedModel: unit '", unit.name, "' has no parameters");
    std::vector<int> group_ids;
    for (const auto& named : unit.params) group_ids.push_back(group_of ? group_of(named.first) : 0);
    if (group_of) {  // ordered by group, stable: each group's parameters together
      std::vector<std::size_t> order(unit.params.size());
      for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
      std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return group_ids[a] < group_ids[b]; });
      std::vector<std::pair<std::string, torch::Tensor>> sorted;
      std::vector<int> sorted_ids;
      for (std::size_t i : order) {
        sorted.push_back(unit.params[i]);
        sorted_ids.push_back(group_ids[i]);
      }
      unit.params = std::move(sorted);
      group_ids = std::move(sorted_ids);
    }
    Unit u;
    u.name = unit.name;
    u.first_param = params_.size();
    u.param_count = unit.params.size();
    std::vector<ParamSpec> group;
    for (const auto& [name, tensor] : unit.params) {
      ZERO_CHECK(tensor.defined(), "ShardedModel: parameter '", name, "' is undefined");
      for (const torch::Tensor& seen : params_)
        ZERO_CHECK(!seen.is_same(tensor), "ShardedModel: parameter '", name, "' appears in more than one unit");
      const bool frozen = !tensor.requires_grad();
      group.push_back({name, static_cast<std::size_t>(tensor.numel()), tensor.sizes().vec(),
                       group_ids[group.size()], frozen});
      auto& first_of_kind = frozen ? u.first_frozen : u.first_trainable;
      if (!first_of_kind) first_of_kind = params_.size();
      if (!frozen) ++u.trainable;
      params_.push_back(tensor);
    }
    groups.push_back(std::move(group));
    units_.push_back(std::move(u));
  }
  engine_ = std::make_unique<Engine>(std::move(groups), options, comm, backend);
  // on_gradient writes the first gradient of a micro-step (grad_slot_is_clear).
  engine_->set_gradient_writes(Engine::GradientWrites::write_when_clear);
  anchor_ = torch::zeros({1}, torch::TensorOptions().requires_grad(true));

  // Every rank must start from the same weights: compare a checksum.
  double sums[2] = {0, 0};
  std::vector<torch::Tensor> host_values;
  for (const torch::Tensor& p : params_) {
    host_values.push_back(p.detach().to(torch::kCPU, torch::kFloat32).contiguous());
    sums[0] += host_values.back().sum().item<double>();
    sums[1] += host_values.back().square().sum().item<double>();
  }
  double low[2] = {sums[0], sums[1]}, high[2] = {sums[0], sums[1]};
  comm.all_reduce_host_f64(low, 2, ReduceOp::min);
  comm.all_reduce_host_f64(high, 2, ReduceOp::max);
  ZERO_CHECK(low[0] == high[0] && low[1] == high[1],
             "ShardedModel: ranks hold different initial weights (checksums differ); seed the model the same "
             "way on every rank or load the same checkpoint");
  for (std::size_t i = 0; i < params_.size(); ++i) engine_->set_param(i, host_values[i].data_ptr<float>());
  host_values.clear();

  const auto tensor_options = torch::TensorOptions().device(device_).dtype(param_type_);
  const bool stage3 = engine_->plan().gathers_units;
  const std::size_t p_size = size_of(engine_->options().param_dtype);
  // The storage has the unit's full size from the start and only its data
  // pointer changes; views into it never need a resize.
  auto unit_storage = [&](std::size_t bytes) {
    return c10::Storage(c10::Storage::use_byte_size_t(), bytes, at::DataPtr(nullptr, device_), /*allocator=*/nullptr,
                        /*resizable=*/false);
  };
  for (std::size_t u = 0; u < units_.size(); ++u) {
    Unit& unit = units_[u];
    if (stage3) {
      unit.storage = unit_storage(engine_->layout().buckets()[u].padded * p_size);
      if (unit.first_frozen) unit.frozen_storage = unit_storage(engine_->frozen_layout().buckets()[u].padded * p_size);
    }
    for (std::size_t i = unit.first_param; i < unit.first_param + unit.param_count; ++i) {
      torch::Tensor& p = params_[i];
      const bool frozen = engine_->frozen(i);
      torch::Tensor view;
      if (stage3) {
        const FlatLayout& where = frozen ? engine_->frozen_layout() : engine_->layout();
        const ParamSlot& slot = where.slots()[engine_->layout_index(i)];
        view = torch::empty({0}, tensor_options);
        view.set_(frozen ? unit.frozen_storage : unit.storage,
                  static_cast<std::int64_t>(slot.offset - where.buckets()[u].offset), p.sizes(), {});
      } else {
        view = torch::from_blob(const_cast<void*>(engine_->param_data(i)), p.sizes(), tensor_options);
      }
      torch::NoGradGuard no_grad;
      p.set_data(view);
      if (frozen) continue;  // no gradient, no hook
      auto accumulator = torch::autograd::impl::grad_accumulator(p);
      ZERO_CHECK(accumulator != nullptr, "ShardedModel: parameter '", engine_->params()[i].name,
                 "' has no gradient accumulator (a non-leaf tensor?)");
      accumulator->add_post_hook(std::make_unique<GradientReady>(this, i));
      accumulators_.push_back(std::move(accumulator));
    }
  }
}

ShardedModel::~ShardedModel() = default;

void ShardedModel::bind_unit(std::size_t u) {
  Unit& unit = units_[u];
  const bool gathered = engine_->unit_gathered(u);
  // param_data of the first parameter of a kind is its bucket's first byte:
  // the layout puts a bucket's first parameter at its start.
  auto bind = [&](c10::Storage& storage, const std::optional<std::size_t>& first) {
    if (!first) return;
    void* data = gathered ? const_cast<void*>(engine_->param_data(*first)) : nullptr;
    storage.set_data_ptr_noswap(at::DataPtr(data, device_));
  };
  bind(unit.storage, unit.first_trainable);
  bind(unit.frozen_storage, unit.first_frozen);
}

void ShardedModel::gather(std::size_t u, Pass pass) {
  // Stages 1-2: waits for the unit's parameter all-gather of the last step;
  // stage 3: gathers it, prefetching what the engine's unit schedule says.
  engine_->enter_unit(u, pass);
  if (engine_->plan().gathers_units) bind_unit(u);
}

void ShardedModel::release(std::size_t u) {
  if (!engine_->plan().gathers_units) return;
  engine_->release_unit(u);
  bind_unit(u);
}

void ShardedModel::gather_for_backward(std::size_t u) {
  if (!engine_->plan().gathers_units || units_[u].backward_gathered) return;
  // Every gradient already in (its parameters were used outside the unit):
  // nothing of the unit's own backward needs them.
  // (A unit with nothing to train has no gradient to wait for: it still
  // needs its weights for the gradient of its inputs.)
  if (units_[u].trainable > 0 && units_[u].ready == units_[u].trainable) return;
  gather(u, Pass::backward);
  units_[u].backward_gathered = true;
}

torch::autograd::variable_list ShardedModel::run_unit(std::size_t u, const variable_list& inputs,
                                                      const UnitBody& body, bool recompute) {
  ZERO_CHECK(u < units_.size(), "run_unit: unit ", u, " of ", units_.size());
  if (recompute && torch::GradMode::is_enabled()) {
    // The body runs again in backward: keep a copy alive until then (the
    // caller's may be a temporary).
    recompute_bodies_.push_back(body);
    return RecomputeUnit::apply(this, static_cast<std::int64_t>(u), &recompute_bodies_.back(), anchor_,
                                at::TensorList(inputs));
  }
  // A unit with nothing to train whose inputs need no gradient needs no
  // backward at all: no graph, no saved activations.
  const bool inputs_need_grad = std::any_of(inputs.begin(), inputs.end(),
                                            [](const torch::Tensor& t) { return t.defined() && t.requires_grad(); });
  if (units_[u].trainable == 0 && !inputs_need_grad) {
    torch::NoGradGuard no_grad;
    gather(u, Pass::forward);
    variable_list outputs = body(inputs);
    release(u);
    return outputs;
  }
  gather(u, Pass::forward);
  // A unit with frozen parameters is released once its inputs' gradients are
  // out (and, when it trains some, their gradients are in): the identity on
  // its inputs says when. It goes in at every stage (releasing nothing below
  // stage 3): it changes the order in which autograd sums the inputs'
  // gradients, and every stage must sum in the same order to give the same bits.
  const bool guard_inputs = units_[u].first_frozen.has_value() && torch::GradMode::is_enabled();
  units_[u].inputs_pending = guard_inputs && inputs_need_grad;
  const variable_list unit_inputs =
      guard_inputs ? ReleaseAfterBackward::apply(this, static_cast<std::int64_t>(u), at::TensorList(inputs)) : inputs;
  if (!engine_->plan().gathers_units) return body(unit_inputs);
  variable_list outputs = body(unit_inputs);
  if (torch::GradMode::is_enabled())
    outputs = GatherBeforeBackward::apply(this, static_cast<std::int64_t>(u), at::TensorList(outputs));
  release(u);
  return outputs;
}

void ShardedModel::bind_gradients_to_engine() {
  const EngineOptions& o = engine_->options();
  ZERO_CHECK(engine_->plan().full_grads, "bind_gradients_to_engine: needs a full gradient buffer (ZeRO stage 0 or 1, "
             "or any stage on one rank with one micro-step and no offload), got stage ", o.stage, " on ",
             engine_->world_size(), " rank(s)");
  ZERO_CHECK(o.accumulation_steps == 1, "bind_gradients_to_engine: needs accumulation_steps = 1, got ",
                 o.accumulation_steps);
  ZERO_CHECK(!o.offload.optimizer, "bind_gradients_to_engine: not with offload_optimizer (gradients go to the host)");
  ZERO_CHECK(grad_type_ == param_type_, "bind_gradients_to_engine: gradients must have the parameters' dtype (",
                 c10::toString(param_type_), "), got ", c10::toString(grad_type_));
  if (gradients_bound_) return;
  // Autograd adds into .grad itself: the buffer must hold zeros again.
  engine_->set_gradient_writes(Engine::GradientWrites::add);
  torch::NoGradGuard no_grad;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (engine_->frozen(i)) continue;
    torch::Tensor& p = params_[i];
    p.mutable_grad() = torch::from_blob(engine_->grad_data(i), p.sizes(),
                                        torch::TensorOptions().device(device_).dtype(grad_type_));
  }
  gradients_bound_ = true;
}

void ShardedModel::on_gradient(std::size_t i) {
  if (gradients_bound_) return;  // autograd accumulated into the engine's buffer itself
  torch::Tensor& p = params_[i];
  torch::Tensor grad = p.grad();
  if (!grad.defined()) return;
  torch::Tensor target = torch::from_blob(engine_->grad_data(i), p.sizes(),
                                          torch::TensorOptions().device(device_).dtype(grad_type_));
  {
    torch::NoGradGuard no_grad;
    // The first gradient of a micro-step is written, not added to zeros
    // (the engine then never zeroes the buffer): one pass over it less.
    if (engine_->grad_slot_is_clear(i)) target.copy_(grad);
    else target.add_(grad);
  }
  p.mutable_grad().reset();  // the engine holds it now; free autograd's copy at once
  engine_->grad_ready(i);
  const std::size_t u = engine_->unit_of(i);
  Unit& unit = units_[u];
  ++unit.ready;
  if (unit.releasable() && unit.backward_gathered) {
    unit.backward_gathered = false;
    release(u);
  }
}

void ShardedModel::release_after_backward(std::size_t u) {
  Unit& unit = units_[u];
  unit.inputs_pending = false;
  if (!unit.releasable() || !unit.backward_gathered) return;
  unit.backward_gathered = false;
  release(u);
}

void ShardedModel::finish_micro_step() {
  for (std::size_t u = 0; u < units_.size(); ++u) {
    if (units_[u].backward_gathered) {
      units_[u].backward_gathered = false;
      release(u);
    }
    units_[u].ready = 0;
    units_[u].inputs_pending = false;
  }
  recompute_bodies_.clear();
  engine_->finish_micro_step();
}

}  // namespace zero::adapter
