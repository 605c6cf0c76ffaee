// Writes an original-layout single file (as A1111 and ComfyUI load) from a
// diffusers pipeline folder's VAE and text encoders and, where given, a UNet
// (a diffusers folder or a zero export), with no "config" metadata, as Stability AI's
// files have none: the tools' --single_file and --single_file_config paths
// are then checked against --pipeline on the same weights.
//
//   make_single_file PIPELINE OUT.safetensors [UNET]
#include <torch/torch.h>

#include <iostream>

#include "original_layout.hpp"
#include "unet_io.hpp"

int main(int argc, char** argv) {
  if (argc != 3 && argc != 4) {
    std::cerr << "usage: make_single_file PIPELINE OUT.safetensors [UNET]\n";
    return 2;
  }
  try {
    torch::NoGradGuard no_grad;
    std::map<std::string, torch::Tensor> tensors = sdxl::testing::original_layout_vae_and_text(argv[1]);
    if (argc == 4) {
      sdxl::UNet2DConditionModel unet = sdxl::load_unet(argv[3]);
      const auto parameters = unet->named_parameters(/*recurse=*/true);
      for (const auto& [diffusers, original] : sdxl::original_checkpoint_names(*unet))
        tensors[original] = parameters[diffusers].detach().contiguous();
    }
    sdxl::write_tensors(argv[2], tensors);
    std::cout << tensors.size() << " tensors written to " << argv[2] << "\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "make_single_file: " << e.what() << "\n";
    return 1;
  }
}
