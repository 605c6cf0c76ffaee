// The SDXL UNet's leaf layers (Linear with its LoRA adapter, Conv2d,
// GroupNorm, LayerNorm) and the helpers the blocks build their units with.
// Included by the UNet's own files only (unet.cpp, unet_transformer.hpp).
//
// The leaf layers are our own (not torch::nn::Linear & co.) so that parameters
// are created directly with the requested dtype/device, including the meta
// device, and without paying for an initialisation that a weight load would
// overwrite.
#pragma once

#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fused_linear.hpp"
#include "group_norm_nhwc.hpp"
#include "unet.hpp"
#include "zero/core/error.hpp"

namespace sdxl {

using torch::Tensor;
using torch::autograd::variable_list;

struct ParamFactory {
  torch::TensorOptions options;
  bool initialize = true;

  bool should_init() const { return initialize && options.device().type() != torch::kMeta; }

  // PyTorch's default for Linear/Conv weights and biases: kaiming_uniform with
  // a = sqrt(5) reduces to U(-1/sqrt(fan_in), 1/sqrt(fan_in)), the bias bound too.
  Tensor uniform(torch::IntArrayRef shape, std::int64_t fan_in) const {
    Tensor t = torch::empty(shape, options);
    if (should_init()) {
      torch::NoGradGuard no_grad;
      const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
      t.uniform_(-bound, bound);
    }
    return t;
  }
  Tensor filled(torch::IntArrayRef shape, double value) const {
    Tensor t = torch::empty(shape, options);
    if (should_init()) {
      torch::NoGradGuard no_grad;
      t.fill_(value);
    }
    return t;
  }
};

// A plain container whose children are registered under explicit names
// ("0", "2", ...), to reproduce diffusers' nn.ModuleList / nn.Sequential paths
// including indices that hold parameterless modules (dropout).
inline std::shared_ptr<torch::nn::Module> make_container() { return std::make_shared<torch::nn::Module>(); }

// A unit's computation (its tensor inputs -> its outputs), and what runs one
// as a stage-3 unit of layer granularity: the model's run() (gathers,
// recomputation). Null: the layer runs directly, inside its block's unit.
using Body = std::function<variable_list(const variable_list&)>;
using LayerRunner = std::function<variable_list(const variable_list&, const Body&)>;

inline Tensor run_layer(const LayerRunner* run, const variable_list& inputs, const Body& body) {
  return (run ? (*run)(inputs, body) : body(inputs))[0];
}

// (full module name, module) of the modules one unit is made of, in order.
using NamedModules = std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>;

inline void add_unit(std::vector<ParameterUnit>& units, std::string name, const NamedModules& parts) {
  ParameterUnit unit;
  unit.name = std::move(name);
  for (const auto& [prefix, module] : parts) {
    unit.modules.push_back(module);
    for (const auto& item : module->named_parameters(/*recurse=*/true))
      unit.parameters.emplace_back(prefix + "." + item.key(), item.value());
  }
  units.push_back(std::move(unit));
}

class Linear : public torch::nn::Module {
 public:
  Linear(std::int64_t in, std::int64_t out, bool bias, const ParamFactory& f) {
    weight_ = register_parameter("weight", f.uniform({out, in}, in));
    if (bias) bias_ = register_parameter("bias", f.uniform({out}, in));
  }
  Tensor forward(const Tensor& x) const {
    Tensor y = sdxl::linear(x, weight_, bias_);  // the bias gradient in the weight gradient's GEMM on CUDA
    if (!lora_a_.defined()) return y;
    // base + scale * B(A(dropout(x))), PEFT's result, with B's product accumulated into the base output by
    // one GEMM (beta = 1, alpha = scale): no separate scale and add passes over the output, which is the
    // layer's largest tensor (8x the input for ff.net.0.proj), in the forward, its recomputation and the
    // backward. In place is safe: linear does not keep its output for its backward.
    const Tensor in = lora_dropout_ > 0 && torch::GradMode::is_enabled() ? torch::dropout(x, lora_dropout_, true) : x;
    const Tensor down = torch::linear(in, lora_a_);
    Tensor flat = y.view({-1, y.size(-1)});  // linear's output is contiguous
    flat.addmm_(down.reshape({-1, down.size(-1)}), lora_b_.t(), /*beta=*/1, /*alpha=*/lora_scale_);
    return flat.view(y.sizes());
  }

  /// Registers "lora_A.weight" [rank, in] (uniform +-1/sqrt(in) from
  /// `generator`, as PEFT's default) and "lora_B.weight" [out, rank] (zero),
  /// with the dtype and device of the layer's weight.
  void add_lora(std::int64_t rank, double scale, double dropout, torch::Generator& generator) {
    ZERO_CHECK(!lora_a_.defined(), "LoRA: the layer already has an adapter");
    const std::int64_t out = weight_.size(0), in = weight_.size(1);
    Tensor a = torch::empty({rank, in}, torch::kFloat32);
    {
      torch::NoGradGuard no_grad;
      const double bound = 1.0 / std::sqrt(static_cast<double>(in));
      a.uniform_(-bound, bound, generator);
    }
    const auto options = weight_.options().requires_grad(false);
    lora_a_ = register_module("lora_A", make_container())->register_parameter("weight", a.to(options));
    lora_b_ = register_module("lora_B", make_container())->register_parameter("weight", torch::zeros({out, rank}, options));
    lora_scale_ = scale;
    lora_dropout_ = dropout;
  }

 private:
  Tensor weight_, bias_;
  Tensor lora_a_, lora_b_;  // undefined without an adapter
  double lora_scale_ = 0, lora_dropout_ = 0;
};

class Conv2d : public torch::nn::Module {
 public:
  Conv2d(std::int64_t in, std::int64_t out, std::int64_t kernel, std::int64_t stride, std::int64_t padding,
         const ParamFactory& f)
      : stride_(stride), padding_(padding) {
    weight_ = register_parameter("weight", f.uniform({out, in, kernel, kernel}, in * kernel * kernel));
    bias_ = register_parameter("bias", f.uniform({out}, in * kernel * kernel));
  }
  Tensor forward(const Tensor& x) const {
    return torch::conv2d(x, weight_, bias_, {stride_, stride_}, {padding_, padding_});
  }

 private:
  Tensor weight_, bias_;
  std::int64_t stride_, padding_;
};

class GroupNorm : public torch::nn::Module {
 public:
  GroupNorm(std::int64_t groups, std::int64_t channels, double eps, const ParamFactory& f)
      : groups_(groups), eps_(eps) {
    ZERO_CHECK(channels % groups == 0, "GroupNorm: ", channels, " channels are not divisible by ", groups,
               " groups (norm_num_groups)");
    weight_ = register_parameter("weight", f.filled({channels}, 1.0));
    bias_ = register_parameter("bias", f.filled({channels}, 0.0));
  }
  // torch::group_norm (+ torch::silu), or on channels-last CUDA activations
  // the fused NHWC kernels (group_norm_nhwc.hpp).
  Tensor forward(const Tensor& x) const { return group_norm_act(x, groups_, weight_, bias_, eps_, false); }
  /// silu(forward(x)), as the ResNet blocks and the head use it.
  Tensor forward_silu(const Tensor& x) const { return group_norm_act(x, groups_, weight_, bias_, eps_, true); }

 private:
  Tensor weight_, bias_;
  std::int64_t groups_;
  double eps_;
};

class LayerNorm : public torch::nn::Module {
 public:
  LayerNorm(std::int64_t dim, double eps, const ParamFactory& f) : dim_(dim), eps_(eps) {
    weight_ = register_parameter("weight", f.filled({dim}, 1.0));
    bias_ = register_parameter("bias", f.filled({dim}, 0.0));
  }
  Tensor forward(const Tensor& x) const { return torch::layer_norm(x, {dim_}, weight_, bias_, eps_); }

 private:
  Tensor weight_, bias_;
  std::int64_t dim_;
  double eps_;
};

}  // namespace sdxl
