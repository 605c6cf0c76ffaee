// sample: text -> image with the SDXL pipeline in C++ (no Python): both CLIP
// text encoders and tokenizers, a UNet (the base's, or a zero export), the
// Euler or DPM++ 2M (Karras) sampler with classifier-free guidance and SDXL's
// micro-conditioning (sampling.hpp), the VAE decoder, and PNG files.
//
//   sample --pipeline DIR [--unet PATH] --prompt "..." [--steps 30] [--guidance 5] [--seed S] --output x.png
//   sample --single_file sd_xl_base_1.0.safetensors --tokenizer DIR --tokenizer_2 DIR --prompt "..." --output x.png
//
// Each image i draws its initial noise from a CPU generator seeded with
// seed + i, exactly as diffusers' pipeline does for
// generator=torch.Generator("cpu").manual_seed(seed + i) and one image: the
// same seed gives the same image. The empty negative prompt is zeros when the
// pipeline says force_zeros_for_empty_prompt (SDXL's model_index.json does),
// as diffusers' encode_prompt does. docs/sampling.md.
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <optional>
#include <tuple>
#include <string>
#include <vector>

#include "pipeline_source.hpp"
#include "png_output.hpp"
#include "sampling.hpp"
#include "schedulers.hpp"
#include "torch_errors.hpp"
#include "unet_io.hpp"
#include "vae.hpp"
#include "zero/core/error.hpp"

namespace fs = std::filesystem;

namespace {

struct Options {
  sdxl::PipelineSource models;
  std::string unet, scheduler_config;
  std::string prompt, negative_prompt, output, save_latents;
  std::int64_t steps = 30;
  double guidance = 5.0;
  std::uint64_t seed = 0;
  std::string sampler = "euler";
  std::int64_t height = 1024, width = 1024, num_images = 1;
  std::string device = "cpu", dtype = "fp32";
};

// The output file of image i: x.png, or x-0.png, x-1.png, ... for several.
fs::path image_path(const Options& o, std::int64_t i) {
  if (o.num_images == 1) return o.output;
  const fs::path out(o.output);
  return out.parent_path() / (out.stem().string() + "-" + std::to_string(i) + out.extension().string());
}

int run(int argc, char** argv) {
  Options o;
  CLI::App app{"sample: SDXL text -> image in C++ (docs/sampling.md)"};
  auto* pipeline = app.add_option("--pipeline", o.models.pipeline, "diffusers SDXL pipeline folder (vae/, text_encoder/, "
                                                            "text_encoder_2/, tokenizer/, tokenizer_2/, unet/)");
  auto* single = app.add_option("--single_file", o.models.single_file, "original single-file SDXL checkpoint (A1111/"
                                                                "ComfyUI): VAE, text encoders and, unless --unet says "
                                                                "otherwise, the UNet (give --tokenizer, --tokenizer_2)");
  pipeline->excludes(single);
  app.add_option("--single_file_config", o.models.single_file_config,
                 "with --single_file: a diffusers pipeline folder whose vae/, text_encoder/, text_encoder_2/ and "
                 "unet/ config.json describe the file's models (default: SDXL 1.0's); its tokenizers and scheduler "
                 "serve as defaults")
      ->needs(single);
  app.add_option("--tokenizer", o.models.tokenizer, "tokenizer folder (default: PIPELINE/tokenizer)");
  app.add_option("--tokenizer_2", o.models.tokenizer_2, "second tokenizer folder (default: PIPELINE/tokenizer_2)");
  app.add_option("--unet", o.unet, "UNet: a diffusers folder, a zero export or an original single file (default: "
                                   "PIPELINE/unet, or the --single_file)");
  app.add_option("--scheduler_config", o.scheduler_config,
                 "scheduler_config.json (default: PIPELINE/scheduler/scheduler_config.json, else SDXL 1.0's)");
  app.add_option("--prompt", o.prompt, "the prompt")->required();
  app.add_option("--negative_prompt", o.negative_prompt, "the negative prompt (empty: zeros, as SDXL does)");
  app.add_option("--steps", o.steps, "denoising steps")->check(CLI::Range(1, 1000))->capture_default_str();
  app.add_option("--guidance", o.guidance, "classifier-free guidance scale (> 1 enables it)")->capture_default_str();
  app.add_option("--seed", o.seed, "seed of image 0's initial noise (image i: seed + i)")->capture_default_str();
  app.add_option("--sampler", o.sampler, "euler, dpmpp_2m or dpmpp_2m_karras")
      ->check(CLI::IsMember({"euler", "dpmpp_2m", "dpmpp_2m_karras"}))->capture_default_str();
  app.add_option("--height", o.height, "image height, pixels")->check(CLI::Range(8, 8192))->capture_default_str();
  app.add_option("--width", o.width, "image width, pixels")->check(CLI::Range(8, 8192))->capture_default_str();
  app.add_option("--num_images", o.num_images, "images (x-0.png, x-1.png, ...)")->check(CLI::Range(1, 10000))
      ->capture_default_str();
  app.add_option("--device", o.device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  app.add_option("--dtype", o.dtype, "fp32, bf16 or fp16 (the VAE upcasts fp16 as diffusers' force_upcast)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}))->capture_default_str();
  app.add_option("--output", o.output, "PNG file to write")->required();
  app.add_option("--save_latents", o.save_latents, "also write the final latents (safetensors, key 'latents')");
  CLI11_PARSE(app, argc, argv);

  o.models.resolve(/*needs_tokenizers=*/true);
  if (o.unet.empty())
    o.unet = o.models.single_file.empty() ? (fs::path(o.models.pipeline) / "unet").string() : o.models.single_file;
  ZERO_CHECK(fs::exists(o.unet), "--unet '", o.unet, "' does not exist (a diffusers UNet folder or a .safetensors "
                                                      "export)");
  const fs::path out_dir = fs::path(o.output).parent_path();
  ZERO_CHECK(out_dir.empty() || fs::is_directory(out_dir), "--output '", o.output, "': folder '", out_dir.string(),
             "' does not exist");

  torch::Device device(torch::kCPU);
  if (o.device == "cuda") {
    ZERO_CHECK(torch::cuda::is_available(), "--device cuda: LibTorch sees no CUDA device (this build or machine)");
    device = torch::Device(torch::kCUDA, 0);
  }
  const torch::ScalarType dtype =
      o.dtype == "bf16" ? torch::kBFloat16 : o.dtype == "fp16" ? torch::kFloat16 : torch::kFloat32;
  const auto options = torch::TensorOptions().dtype(dtype).device(device);
  torch::NoGradGuard no_grad;
  const auto start = std::chrono::steady_clock::now();

  // Text conditioning, then the text encoders are released before the UNet is built.
  // Each prompt is encoded alone, as the pipeline does.
  sdxl::TextConditioning text;
  {
    sdxl::PromptEncoder encoder(o.models, options);
    const auto encode = [&](const std::string& prompt) {
      auto [embeds, pooled] = encoder.encode({prompt});
      return std::pair{embeds.to(options), pooled.to(options)};
    };
    std::tie(text.prompt_embeds, text.pooled_prompt_embeds) = encode(o.prompt);
    if (o.guidance > 1.0) {
      if (o.negative_prompt.empty() && sdxl::force_zeros_for_empty_prompt(o.models)) {
        text.negative_prompt_embeds = torch::zeros_like(text.prompt_embeds);
        text.negative_pooled_prompt_embeds = torch::zeros_like(text.pooled_prompt_embeds);
      } else {
        std::tie(text.negative_prompt_embeds, text.negative_pooled_prompt_embeds) = encode(o.negative_prompt);
      }
    }
  }

  sdxl::UNet2DConditionModel unet = sdxl::load_source_unet(o.models, o.unet, options);
  unet->eval();
  sdxl::AutoencoderKL vae = sdxl::load_source_vae(o.models, options);

  sdxl::SamplingOptions sampling;
  sampling.scheduler = sdxl::source_scheduler(o.models, o.scheduler_config, sdxl::parse_sampler(o.sampler, "--sampler"),
                                              "--scheduler_config");
  sampling.steps = o.steps;
  sampling.guidance_scale = o.guidance;
  sampling.height = o.height;
  sampling.width = o.width;
  const std::int64_t factor = std::int64_t{1} << (vae->config().block_out_channels.size() - 1);
  sampling.vae_scale_factor = factor;
  const double scaling = vae->config().scaling_factor;

  const double load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "sample: models loaded in " << load_seconds << " s (" << o.device << ", " << o.dtype << ")\n";
  for (std::int64_t i = 0; i < o.num_images; ++i) {
    const auto image_start = std::chrono::steady_clock::now();
    sampling.seed = o.seed + static_cast<std::uint64_t>(i);
    const sdxl::SamplingResult result = sdxl::sample_latents(*unet, text, sampling);
    const torch::Tensor image = vae->decode(result.latents / scaling);
    if (device.is_cuda()) torch::cuda::synchronize();
    const fs::path path = image_path(o, i);
    sdxl::write_png(path, sdxl::to_uint8_hwc(image[0]));
    if (!o.save_latents.empty() && i == 0)
      sdxl::write_tensors(o.save_latents, {{"latents", result.latents.to(torch::kCPU, torch::kFloat32).contiguous()}});
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - image_start).count();
    std::cout << "sample: wrote " << path.string() << " (" << o.width << "x" << o.height << ", " << o.steps
              << " steps, seed " << sampling.seed << ") in " << seconds << " s\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    const std::optional<std::string> torch_text = sdxl::describe_torch_failure(e);
    std::cerr << "sample: " << (torch_text ? *torch_text : std::string(e.what())) << "\n";
    return 1;
  }
}
