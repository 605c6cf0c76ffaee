// Test helper: a diffusers pipeline's VAE and text encoders written in the
// original (Stability AI) single-file layout, for the single-file loaders'
// tests (tests/sdxl/test_vae_clip.cpp) and the tools' end-to-end tests
// (tests/sdxl_prepare/make_single_file.cpp).
#pragma once

#include <torch/torch.h>

#include <filesystem>
#include <map>
#include <regex>
#include <string>

#include "unet_io.hpp"

namespace sdxl::testing {

namespace fs = std::filesystem;
using torch::Tensor;

inline std::string replace_all(std::string text, const std::string& pattern, const std::string& with) {
  return std::regex_replace(text, std::regex(pattern), with);
}

// A diffusers pipeline's VAE and text encoders in the original single-file
// layout, written from the ldm and OpenCLIP module definitions (the inverse of
// the loaders' mapping, kept separate from them).
inline std::map<std::string, Tensor> original_layout_vae_and_text(const fs::path& pipeline) {
  std::map<std::string, Tensor> out;
  for (auto [name, t] : sdxl::read_tensors(pipeline / "vae" / "diffusion_pytorch_model.safetensors")) {
    std::string n = name;
    for (int level = 0; level < 2; ++level) {  // diffusers' up_blocks.i is ldm's up.(levels-1-i)
      const std::string i = std::to_string(level), ldm = std::to_string(1 - level);
      n = replace_all(n, "^decoder\\.up_blocks\\." + i + "\\.resnets\\.", "decoder.up." + ldm + ".block.");
      n = replace_all(n, "^decoder\\.up_blocks\\." + i + "\\.upsamplers\\.0\\.", "decoder.up." + ldm + ".upsample.");
    }
    n = replace_all(n, "^encoder\\.down_blocks\\.(\\d+)\\.resnets\\.", "encoder.down.$1.block.");
    n = replace_all(n, "^encoder\\.down_blocks\\.(\\d+)\\.downsamplers\\.0\\.", "encoder.down.$1.downsample.");
    n = replace_all(n, "mid_block\\.resnets\\.0\\.", "mid.block_1.");
    n = replace_all(n, "mid_block\\.resnets\\.1\\.", "mid.block_2.");
    n = replace_all(n, "conv_shortcut", "nin_shortcut");
    n = replace_all(n, "conv_norm_out", "norm_out");
    if (n.find("mid_block.attentions.0.") != std::string::npos) {
      n = replace_all(n, "mid_block\\.attentions\\.0\\.", "mid.attn_1.");
      n = replace_all(n, "\\.group_norm\\.", ".norm.");
      n = replace_all(n, "\\.to_q\\.", ".q.");
      n = replace_all(n, "\\.to_k\\.", ".k.");
      n = replace_all(n, "\\.to_v\\.", ".v.");
      n = replace_all(n, "\\.to_out\\.0\\.", ".proj_out.");
      if (t.dim() == 2) t = t.view({t.size(0), t.size(1), 1, 1});  // ldm: 1x1 convolutions
    }
    out["first_stage_model." + n] = t;
  }
  for (const auto& [name, t] : sdxl::read_tensors(pipeline / "text_encoder" / "model.safetensors"))
    out["conditioner.embedders.0.transformer.text_model." + name] = t;  // transformers 5 names lack text_model.
  out["conditioner.embedders.0.transformer.text_model.embeddings.position_ids"] =
      torch::arange(77, torch::kInt64).unsqueeze(0);
  std::map<std::string, Tensor> two;
  for (const auto& entry : fs::directory_iterator(pipeline / "text_encoder_2"))
    if (entry.path().extension() == ".safetensors")
      for (const auto& [name, t] : sdxl::read_tensors(entry.path())) two[name] = t;
  const std::string g = "conditioner.embedders.1.model.";
  for (const auto& [name, t] : two) {
    std::string n = name;
    std::smatch m;
    if (std::regex_match(n, m, std::regex("text_model\\.encoder\\.layers\\.(\\d+)\\.self_attn\\.q_proj\\.(weight|bias)"))) {
      const std::string layer = "text_model.encoder.layers." + m[1].str() + ".self_attn.";
      const std::string kind = m[2].str();
      out[g + "transformer.resblocks." + m[1].str() + ".attn.in_proj_" + kind] =
          torch::cat({t, two.at(layer + "k_proj." + kind), two.at(layer + "v_proj." + kind)}, 0);
      continue;
    }
    if (n.find(".k_proj.") != std::string::npos || n.find(".v_proj.") != std::string::npos) continue;
    if (n == "text_projection.weight") {
      out[g + "text_projection"] = t.t().contiguous();  // OpenCLIP: x @ text_projection
      continue;
    }
    n = replace_all(n, "^text_model\\.embeddings\\.token_embedding\\.", "token_embedding.");
    n = replace_all(n, "^text_model\\.embeddings\\.position_embedding\\.weight", "positional_embedding");
    n = replace_all(n, "^text_model\\.final_layer_norm\\.", "ln_final.");
    n = replace_all(n, "^text_model\\.encoder\\.layers\\.", "transformer.resblocks.");
    n = replace_all(n, "\\.layer_norm1\\.", ".ln_1.");
    n = replace_all(n, "\\.layer_norm2\\.", ".ln_2.");
    n = replace_all(n, "\\.self_attn\\.out_proj\\.", ".attn.out_proj.");
    n = replace_all(n, "\\.mlp\\.fc1\\.", ".mlp.c_fc.");
    n = replace_all(n, "\\.mlp\\.fc2\\.", ".mlp.c_proj.");
    out[g + n] = t;
  }
  out[g + "logit_scale"] = torch::tensor(4.6f);
  return out;
}

}  // namespace sdxl::testing
