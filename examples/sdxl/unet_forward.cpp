// unet_forward: one forward pass of the SDXL UNet from safetensors files.
//
//   unet_forward --model M --inputs I --output O [--device cpu|cuda] [--dtype fp32|bf16|fp16] [--tf32]
//
//   --model   a .safetensors file with the diffusers config in its "config"
//             metadata, or a diffusers folder (see unet_io.hpp)
//   --inputs  safetensors with sample [B,4,H,W], timestep [B], encoder_hidden_states
//             [B,T,C] and, for SDXL, text_embeds [B,P] and time_ids [B,6]
//   --output  safetensors receiving "sample" [B,4,H,W] as float32
//   --device  cpu (default) or cuda / cuda:N
//   --dtype   compute dtype of weights and activations: fp32 (default), bf16, fp16
//   --tf32    on CUDA, let fp32 matmuls and convolutions use TF32 tensor cores;
//             without it fp32 is strict (cuDNN's TF32 default is turned off)
//   --lora    a LoRA file (diffusers/PEFT or kohya naming, lora_io.hpp) applied
//             on top of the model as adapters, unmerged

#include <CLI/CLI.hpp>

#include <chrono>
#include <exception>
#include <iostream>

#include "torch_errors.hpp"
#include "tf32.hpp"
#include "lora_io.hpp"
#include "unet_io.hpp"
#include "zero/core/dtype.hpp"
#include "zero/core/error.hpp"

namespace {

torch::ScalarType scalar_type_of(zero::DType dtype) {
  switch (dtype) {
    case zero::DType::fp32: return torch::kFloat32;
    case zero::DType::bf16: return torch::kBFloat16;
    case zero::DType::fp16: return torch::kFloat16;
  }
  return torch::kFloat32;
}

const torch::Tensor& require(const std::map<std::string, torch::Tensor>& tensors, const std::string& name,
                             const std::string& path) {
  auto it = tensors.find(name);
  if (it == tensors.end()) ZERO_THROW(zero::IoError, "inputs '", path, "' have no tensor '", name, "'");
  return it->second;
}

int run(int argc, char** argv) {
  CLI::App app{"One forward pass of the SDXL UNet2DConditionModel (diffusers-compatible) from safetensors"};
  std::string model_path, inputs_path, output_path, device_name = "cpu", dtype_name = "fp32", lora_path;
  app.add_option("--model", model_path, "safetensors file with config metadata, or a diffusers folder")->required();
  app.add_option("--inputs", inputs_path, "safetensors with sample, timestep, encoder_hidden_states, "
                                          "text_embeds, time_ids")->required();
  app.add_option("--output", output_path, "safetensors file to write 'sample' (float32) to")->required();
  app.add_option("--device", device_name, "cpu or cuda[:N]")->capture_default_str();
  app.add_option("--dtype", dtype_name, "fp32, bf16 or fp16")->capture_default_str();
  bool tf32 = false;
  app.add_flag("--tf32", tf32, "CUDA: let fp32 matmuls and convolutions use TF32 tensor cores (default: strict fp32)");
  app.add_option("--lora", lora_path, "LoRA file (diffusers/PEFT or kohya naming) to apply as adapters");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  const torch::Device device(device_name);
  ZERO_CHECK(device.is_cpu() || device.is_cuda(), "--device: expected cpu or cuda[:N], got '", device_name, "'");
  ZERO_CHECK(!device.is_cuda() || torch::cuda::is_available(), "--device ", device_name,
             ": this LibTorch build or machine has no CUDA device");
  const torch::ScalarType dtype = scalar_type_of(zero::parse_dtype(dtype_name, "--dtype"));
  sdxl::allow_tf32(tf32);

  const auto start = std::chrono::steady_clock::now();
  sdxl::UNet2DConditionModel model =
      sdxl::load_unet(model_path, torch::TensorOptions().dtype(dtype).device(device));
  model->eval();
  if (!lora_path.empty()) {
    const sdxl::LoraWeights lora = sdxl::read_lora_file(lora_path, *model);
    // Exactly the file's layers (their names are the patterns); A is then overwritten.
    torch::Generator unused = at::detail::createCPUGenerator(0);
    model->add_lora({.rank = lora.rank, .alpha = lora.alpha, .dropout = 0, .targets = lora.modules}, unused);
    sdxl::load_lora_into(*model, lora, lora.alpha, "--lora '" + lora_path + "'");
    std::cout << "unet_forward: LoRA rank " << lora.rank << ", alpha " << lora.alpha << " on " << lora.modules.size()
              << " layers from " << lora_path << "\n";
  }

  const auto inputs = sdxl::read_tensors(inputs_path);
  auto activation = [&](const char* name) { return require(inputs, name, inputs_path).to(device, dtype); };
  const torch::Tensor sample = activation("sample");
  ZERO_CHECK(sample.dim() == 4 && sample.size(0) >= 1, "inputs '", inputs_path, "': 'sample' has shape ",
             sample.sizes(), "; expected [batch >= 1, channels, height, width]");
  const torch::Tensor context = activation("encoder_hidden_states");
  // Timesteps and time_ids feed the float32 sinusoidal embedding: keep their precision.
  const torch::Tensor timestep = require(inputs, "timestep", inputs_path).to(device);
  torch::Tensor text_embeds, time_ids;
  if (model->config().addition_embed_text_time) {
    text_embeds = activation("text_embeds");
    time_ids = require(inputs, "time_ids", inputs_path).to(device);
  }

  torch::Tensor out;
  {
    torch::NoGradGuard no_grad;
    out = sdxl::with_torch_errors("the forward pass of a batch of " + std::to_string(sample.size(0)) + " at " +
                                      std::to_string(sample.size(2)) + "x" + std::to_string(sample.size(3)) +
                                      " latent pixels",
                                  "pass fewer or smaller samples, or --dtype bf16",
                                  [&] { return model->forward(sample, timestep, context, text_embeds, time_ids); });
  }
  sdxl::write_tensors(output_path, {{"sample", out.to(torch::kCPU, torch::kFloat32)}});
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "unet_forward: sample " << out.sizes() << " (" << dtype_name << " on " << device
            << (device.is_cuda() && dtype == torch::kFloat32 ? (tf32 ? ", TF32" : ", strict fp32") : "") << ") -> "
            << output_path << " in " << seconds << " s\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    const std::optional<std::string> torch_text = sdxl::describe_torch_failure(e);
    std::cerr << "unet_forward: " << (torch_text ? *torch_text : std::string(e.what())) << "\n";
    return 1;
  }
}
