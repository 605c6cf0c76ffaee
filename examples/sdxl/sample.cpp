// sample: text -> image with the SDXL pipeline in C++ (no Python): both CLIP
// text encoders and tokenizers, a UNet (the base's, or a zero export), the
// Euler or DPM++ 2M (Karras) sampler with classifier-free guidance and SDXL's
// micro-conditioning (sampling.hpp), the VAE decoder, and PNG files.
//
//   sample --pipeline DIR [--unet PATH] --prompt "..." [--steps 30] [--guidance 5] [--seed S] --output x.png
//
// Each image i draws its initial noise from a CPU generator seeded with
// seed + i, exactly as diffusers' pipeline does for
// generator=torch.Generator("cpu").manual_seed(seed + i) and one image: the
// same seed gives the same image. The empty negative prompt is zeros when the
// pipeline says force_zeros_for_empty_prompt (SDXL's model_index.json does),
// as diffusers' encode_prompt does. docs/sampling.md.
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#define STB_IMAGE_WRITE_IMPLEMENTATION
#define STB_IMAGE_WRITE_STATIC
#include <stb_image_write.h>

#include "clip_text.hpp"
#include "clip_tokenizer.hpp"
#include "pipeline_folder.hpp"
#include "sampling.hpp"
#include "schedulers.hpp"
#include "torch_errors.hpp"
#include "unet_io.hpp"
#include "vae.hpp"
#include "zero/core/error.hpp"
#include "zero/io/atomic_file.hpp"

namespace fs = std::filesystem;

namespace {

struct Options {
  std::string pipeline, single_file, tokenizer, tokenizer_2, unet, scheduler_config;
  std::string prompt, negative_prompt, output, save_latents;
  std::int64_t steps = 30;
  double guidance = 5.0;
  std::uint64_t seed = 0;
  std::string sampler = "euler";
  std::int64_t height = 1024, width = 1024, num_images = 1;
  std::string device = "cpu", dtype = "fp32";
};

torch::Tensor token_ids(const sdxl::ClipTokenizer& tokenizer, const std::string& prompt) {
  const sdxl::ClipEncoding encoding = tokenizer.encode(prompt);
  torch::Tensor ids = torch::empty({1, static_cast<std::int64_t>(encoding.input_ids.size())}, torch::kInt64);
  std::copy(encoding.input_ids.begin(), encoding.input_ids.end(), ids.data_ptr<std::int64_t>());
  return ids;
}

// The output file of image i: x.png, or x-0.png, x-1.png, ... for several.
fs::path image_path(const Options& o, std::int64_t i) {
  if (o.num_images == 1) return o.output;
  const fs::path out(o.output);
  return out.parent_path() / (out.stem().string() + "-" + std::to_string(i) + out.extension().string());
}

// diffusers' VaeImageProcessor.postprocess + numpy_to_pil: [-1, 1] ->
// (x / 2 + 0.5).clamp(0, 1) -> x * 255 rounded -> uint8, HWC.
torch::Tensor to_uint8_hwc(const torch::Tensor& image) {
  torch::Tensor x = (image.to(torch::kCPU, torch::kFloat32) / 2 + 0.5).clamp(0, 1);
  return (x * 255).round().to(torch::kUInt8).permute({1, 2, 0}).contiguous();
}

void write_png(const fs::path& path, const torch::Tensor& hwc) {
  int length = 0;
  const int h = static_cast<int>(hwc.size(0)), w = static_cast<int>(hwc.size(1)), c = static_cast<int>(hwc.size(2));
  unsigned char* png = stbi_write_png_to_mem(hwc.data_ptr<std::uint8_t>(), w * c, w, h, c, &length);
  ZERO_CHECK(png != nullptr && length > 0, "could not encode the PNG for '", path.string(), "'");
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(png), static_cast<std::size_t>(length));
  try {
    zero::io::write_file_atomically(path, bytes);
  } catch (...) {
    STBIW_FREE(png);
    throw;
  }
  STBIW_FREE(png);
}

int run(int argc, char** argv) {
  Options o;
  CLI::App app{"sample: SDXL text -> image in C++ (docs/sampling.md)"};
  auto* pipeline = app.add_option("--pipeline", o.pipeline, "diffusers SDXL pipeline folder (vae/, text_encoder/, "
                                                            "text_encoder_2/, tokenizer/, tokenizer_2/, unet/)");
  auto* single = app.add_option("--single_file", o.single_file, "original single-file SDXL checkpoint: the VAE and "
                                                                "text encoders (give --unet, --tokenizer, --tokenizer_2)");
  pipeline->excludes(single);
  app.add_option("--tokenizer", o.tokenizer, "tokenizer folder (default: PIPELINE/tokenizer)");
  app.add_option("--tokenizer_2", o.tokenizer_2, "second tokenizer folder (default: PIPELINE/tokenizer_2)");
  app.add_option("--unet", o.unet, "UNet: a diffusers folder or a zero single-file export (default: PIPELINE/unet)");
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

  ZERO_CHECK(!o.pipeline.empty() || !o.single_file.empty(), "give the models: --pipeline DIR or --single_file FILE");
  if (!o.single_file.empty())
    ZERO_CHECK(!o.unet.empty() && !o.tokenizer.empty() && !o.tokenizer_2.empty(),
               "--single_file: give --unet, --tokenizer and --tokenizer_2 as well");
  if (!o.pipeline.empty())
    ZERO_CHECK(fs::is_directory(o.pipeline), "--pipeline '", o.pipeline, "' is not a folder");
  if (o.tokenizer.empty()) o.tokenizer = (fs::path(o.pipeline) / "tokenizer").string();
  if (o.tokenizer_2.empty()) o.tokenizer_2 = (fs::path(o.pipeline) / "tokenizer_2").string();
  if (o.unet.empty()) o.unet = (fs::path(o.pipeline) / "unet").string();
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
  bool force_zeros = true;
  if (!o.pipeline.empty() && fs::exists(fs::path(o.pipeline) / "model_index.json")) {
    const auto index = nlohmann::json::parse(sdxl::read_config_text(fs::path(o.pipeline) / "model_index.json"));
    if (index.contains("force_zeros_for_empty_prompt") && index["force_zeros_for_empty_prompt"].is_boolean())
      force_zeros = index["force_zeros_for_empty_prompt"].get<bool>();
  }
  sdxl::TextConditioning text;
  {
    sdxl::SdxlTextEncoders encoders = o.pipeline.empty()
                                          ? sdxl::load_sdxl_text_encoders_from_single_file(o.single_file, options)
                                          : sdxl::load_sdxl_text_encoders(o.pipeline, options);
    encoders.text_encoder->eval();
    encoders.text_encoder_2->eval();
    const sdxl::ClipTokenizer tokenizer = sdxl::ClipTokenizer::load(o.tokenizer);
    const sdxl::ClipTokenizer tokenizer_2 = sdxl::ClipTokenizer::load(o.tokenizer_2);
    const auto encode = [&](const std::string& prompt) {
      return sdxl::sdxl_text_conditioning(*encoders.text_encoder, token_ids(tokenizer, prompt).to(device),
                                          *encoders.text_encoder_2, token_ids(tokenizer_2, prompt).to(device));
    };
    const sdxl::SdxlTextConditioning positive = encode(o.prompt);
    text.prompt_embeds = positive.prompt_embeds;
    text.pooled_prompt_embeds = positive.pooled_prompt_embeds;
    if (o.guidance > 1.0) {
      if (o.negative_prompt.empty() && force_zeros) {
        text.negative_prompt_embeds = torch::zeros_like(positive.prompt_embeds);
        text.negative_pooled_prompt_embeds = torch::zeros_like(positive.pooled_prompt_embeds);
      } else {
        const sdxl::SdxlTextConditioning negative = encode(o.negative_prompt);
        text.negative_prompt_embeds = negative.prompt_embeds;
        text.negative_pooled_prompt_embeds = negative.pooled_prompt_embeds;
      }
    }
  }

  sdxl::UNet2DConditionModel unet = sdxl::load_unet(o.unet, options);
  unet->eval();
  sdxl::AutoencoderKL vae = o.pipeline.empty() ? sdxl::load_vae_from_single_file(o.single_file, options)
                                               : sdxl::load_vae(o.pipeline, options);
  vae->eval();

  sdxl::SamplingOptions sampling;
  const sdxl::Sampler sampler = sdxl::parse_sampler(o.sampler, "--sampler");
  fs::path scheduler_file = o.scheduler_config;
  if (scheduler_file.empty() && !o.pipeline.empty()) scheduler_file = fs::path(o.pipeline) / "scheduler" / "scheduler_config.json";
  if (!scheduler_file.empty() && fs::exists(scheduler_file)) {
    sampling.scheduler = sdxl::read_scheduler_config(scheduler_file, sampler);
  } else {
    ZERO_CHECK(o.scheduler_config.empty(), "--scheduler_config '", o.scheduler_config, "' does not exist");
    // SDXL 1.0's scheduler/scheduler_config.json.
    sampling.scheduler.sampler = sampler;
    sampling.scheduler.beta_start = 0.00085;
    sampling.scheduler.beta_end = 0.012;
    sampling.scheduler.beta_schedule = sdxl::BetaSchedule::kScaledLinear;
    sampling.scheduler.timestep_spacing = sdxl::TimestepSpacing::kLeading;
    sampling.scheduler.steps_offset = 1;
    sampling.scheduler.use_karras_sigmas = sampler == sdxl::Sampler::kDpmpp2mKarras;
  }
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
    write_png(path, to_uint8_hwc(image[0]));
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
