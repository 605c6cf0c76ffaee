// The SDXL UNet's attention side, as diffusers builds it: Attention,
// FeedForward (GEGLU), BasicTransformerBlock and Transformer2DModel, whose
// layers are the units of layer granularity. Included by unet.cpp only.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "geglu.hpp"
#include "unet_layers.hpp"

namespace sdxl {

/// diffusers' Attention (as used by BasicTransformerBlock): bias-free q/k/v
/// projections, output projection with bias at "to_out.0".
class Attention : public torch::nn::Module {
 public:
  Attention(std::int64_t query_dim, std::int64_t context_dim, std::int64_t heads, bool upcast, const ParamFactory& f)
      : heads_(heads), upcast_(upcast) {
    to_q_ = register_module("to_q", std::make_shared<Linear>(query_dim, query_dim, false, f));
    to_k_ = register_module("to_k", std::make_shared<Linear>(context_dim, query_dim, false, f));
    to_v_ = register_module("to_v", std::make_shared<Linear>(context_dim, query_dim, false, f));
    auto to_out = register_module("to_out", make_container());
    to_out_0_ = to_out->register_module("0", std::make_shared<Linear>(query_dim, query_dim, true, f));
  }
  // context undefined = self-attention.
  Tensor forward(const Tensor& x, const Tensor& context) const {
    const Tensor& kv = context.defined() ? context : x;
    Tensor out = multi_head_attention(to_q_->forward(x), to_k_->forward(kv), to_v_->forward(kv), heads_, upcast_);
    return to_out_0_->forward(out);
  }

 private:
  std::int64_t heads_;
  bool upcast_;
  std::shared_ptr<Linear> to_q_, to_k_, to_v_, to_out_0_;
};

/// diffusers' FeedForward with GEGLU: net.0.proj (dim -> 2*4*dim), value * gelu(gate), net.2 (4*dim -> dim).
class FeedForward : public torch::nn::Module {
 public:
  FeedForward(std::int64_t dim, const ParamFactory& f) {
    const std::int64_t inner = 4 * dim;
    auto net = register_module("net", make_container());
    auto geglu = net->register_module("0", make_container());
    proj_ = geglu->register_module("proj", std::make_shared<Linear>(dim, 2 * inner, true, f));
    // net.1 is diffusers' Dropout (no parameters).
    out_ = net->register_module("2", std::make_shared<Linear>(inner, dim, true, f));
  }
  Tensor forward(const Tensor& x) const {
    // value * gelu(gate) over proj's two halves, exact (erf) GELU as F.gelu;
    // fused on CUDA (geglu.hpp).
    return out_->forward(geglu(proj_->forward(x)));
  }

 private:
  std::shared_ptr<Linear> proj_, out_;
};

/// diffusers' BasicTransformerBlock (layer_norm variant): self-attention,
/// cross-attention, GEGLU feed-forward, each pre-normed and residual.
class BasicTransformerBlock : public torch::nn::Module {
 public:
  BasicTransformerBlock(std::int64_t dim, std::int64_t heads, std::int64_t cross_dim, bool upcast,
                        const ParamFactory& f) {
    // BasicTransformerBlock's LayerNorms use diffusers' default norm_eps 1e-5,
    // independent of the UNet's norm_eps.
    norm1_ = register_module("norm1", std::make_shared<LayerNorm>(dim, 1e-5, f));
    attn1_ = register_module("attn1", std::make_shared<Attention>(dim, dim, heads, upcast, f));
    norm2_ = register_module("norm2", std::make_shared<LayerNorm>(dim, 1e-5, f));
    attn2_ = register_module("attn2", std::make_shared<Attention>(dim, cross_dim, heads, upcast, f));
    norm3_ = register_module("norm3", std::make_shared<LayerNorm>(dim, 1e-5, f));
    ff_ = register_module("ff", std::make_shared<FeedForward>(dim, f));
  }
  Tensor forward(Tensor x, const Tensor& context) const {
    x = attn1_->forward(norm1_->forward(x), Tensor()) + x;
    x = attn2_->forward(norm2_->forward(x), context) + x;
    return ff_->forward(norm3_->forward(x)) + x;
  }

 private:
  std::shared_ptr<LayerNorm> norm1_, norm2_, norm3_;
  std::shared_ptr<Attention> attn1_, attn2_;
  std::shared_ptr<FeedForward> ff_;
};

/// diffusers' Transformer2DModel for continuous input: GroupNorm (eps 1e-6),
/// proj_in (linear on tokens, or 1x1 conv), transformer blocks, proj_out, residual.
class Transformer2DModel : public torch::nn::Module {
 public:
  Transformer2DModel(std::int64_t channels, std::int64_t heads, std::int64_t layers, std::int64_t cross_dim,
                     std::int64_t groups, bool linear_projection, bool upcast, const ParamFactory& f)
      : linear_projection_(linear_projection) {
    norm_ = register_module("norm", std::make_shared<GroupNorm>(groups, channels, 1e-6, f));
    if (linear_projection) {
      proj_in_linear_ = register_module("proj_in", std::make_shared<Linear>(channels, channels, true, f));
    } else {
      proj_in_conv_ = register_module("proj_in", std::make_shared<Conv2d>(channels, channels, 1, 1, 0, f));
    }
    auto list = register_module("transformer_blocks", make_container());
    for (std::int64_t i = 0; i < layers; ++i) {
      blocks_.push_back(list->register_module(
          std::to_string(i), std::make_shared<BasicTransformerBlock>(channels, heads, cross_dim, upcast, f)));
    }
    if (linear_projection) {
      proj_out_linear_ = register_module("proj_out", std::make_shared<Linear>(channels, channels, true, f));
    } else {
      proj_out_conv_ = register_module("proj_out", std::make_shared<Conv2d>(channels, channels, 1, 1, 0, f));
    }
  }

  /// run: each transformer layer as its own unit (layer granularity), the
  /// first with norm and proj_in, the last with proj_out and the residual.
  Tensor forward(const Tensor& x, const Tensor& context, const LayerRunner* run = nullptr) const {
    if (!run) {
      Tensor t = tokens_in(x);
      for (const auto& block : blocks_) t = block->forward(t, context);
      return tokens_out(t, x);
    }
    const std::size_t n = unit_count();
    Tensor t;
    for (std::size_t k = 0; k < n; ++k) {
      const bool first = k == 0, last = k + 1 == n;
      variable_list inputs{first ? x : t, context};
      if (last && !first) inputs.push_back(x);  // for the residual
      t = (*run)(inputs, [this, k, first, last](const variable_list& in) {
            Tensor h = first ? tokens_in(in[0]) : in[0];
            if (k < blocks_.size()) h = blocks_[k]->forward(h, in[1]);
            return variable_list{last ? tokens_out(h, first ? in[0] : in[2]) : h};
          })[0];
    }
    return t;
  }

  /// The units forward(x, context, run) runs, in that order.
  void add_units(const std::string& prefix, std::vector<ParameterUnit>& units) const {
    const std::size_t n = unit_count();
    for (std::size_t k = 0; k < n; ++k) {
      NamedModules parts;
      if (k == 0) {
        parts.emplace_back(prefix + ".norm", norm_);
        parts.emplace_back(prefix + ".proj_in", either(proj_in_linear_, proj_in_conv_));
      }
      const std::string layer = prefix + ".transformer_blocks." + std::to_string(k);
      if (k < blocks_.size()) parts.emplace_back(layer, blocks_[k]);
      if (k + 1 == n) parts.emplace_back(prefix + ".proj_out", either(proj_out_linear_, proj_out_conv_));
      add_unit(units, blocks_.empty() ? prefix : layer, parts);
    }
  }

 private:
  std::size_t unit_count() const { return std::max<std::size_t>(1, blocks_.size()); }
  // proj_in/proj_out: the linear layer or the 1x1 convolution, whichever exists.
  static std::shared_ptr<torch::nn::Module> either(const std::shared_ptr<Linear>& linear,
                                                   const std::shared_ptr<Conv2d>& conv) {
    if (linear) return linear;
    return conv;
  }

  // GroupNorm and proj_in: [B, C, H, W] -> tokens [B, H*W, C].
  Tensor tokens_in(const Tensor& x) const {
    const std::int64_t b = x.size(0), c = x.size(1), h = x.size(2), w = x.size(3);
    Tensor t = norm_->forward(x);
    if (linear_projection_) return proj_in_linear_->forward(t.permute({0, 2, 3, 1}).reshape({b, h * w, c}));
    return proj_in_conv_->forward(t).permute({0, 2, 3, 1}).reshape({b, h * w, c});
  }

  // proj_out back to x's shape and memory format, plus the residual x.
  Tensor tokens_out(const Tensor& t, const Tensor& x) const {
    const std::int64_t b = x.size(0), c = x.size(1), h = x.size(2), w = x.size(3);
    Tensor out;
    if (linear_projection_) {
      // Channels-last input: the permuted tokens already are NHWC, no copy.
      out = proj_out_linear_->forward(t).reshape({b, h, w, c}).permute({0, 3, 1, 2}).contiguous(x.suggest_memory_format());
    } else {
      out = proj_out_conv_->forward(t.reshape({b, h, w, c}).permute({0, 3, 1, 2}).contiguous(x.suggest_memory_format()));
    }
    return out + x;
  }

  bool linear_projection_;
  std::shared_ptr<GroupNorm> norm_;
  std::shared_ptr<Linear> proj_in_linear_, proj_out_linear_;
  std::shared_ptr<Conv2d> proj_in_conv_, proj_out_conv_;
  std::vector<std::shared_ptr<BasicTransformerBlock>> blocks_;
};

}  // namespace sdxl
