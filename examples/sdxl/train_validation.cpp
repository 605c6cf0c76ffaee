#include "train_validation.hpp"

#include <cctype>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <span>
#include <utility>

#include <nlohmann/json.hpp>

#include "zero/core/error.hpp"
#include "zero/io/atomic_file.hpp"

#if SDXL_VALIDATION_IMAGES
#include "pipeline_source.hpp"
#include "png_output.hpp"
#include "sampling.hpp"
#include "train_export.hpp"
#include "train_lora.hpp"
#include "zero/torch/sharded_model.hpp"
#endif

namespace sdxl {

namespace fs = std::filesystem;

#if SDXL_VALIDATION_IMAGES

namespace {

/// A file name for the prompt: its index, then its first words in lower
/// case with anything but letters and digits as single dashes.
std::string file_name(std::size_t index, const std::string& prompt) {
  char number[16];
  std::snprintf(number, sizeof number, "%02zu", index);
  std::string slug;
  for (const char ch : prompt) {
    if (slug.size() >= 48) break;
    const auto c = static_cast<unsigned char>(ch);
    if (std::isalnum(c) != 0 && c < 128) slug += static_cast<char>(std::tolower(c));
    else if (!slug.empty() && slug.back() != '-') slug += '-';
  }
  while (!slug.empty() && slug.back() == '-') slug.pop_back();
  std::string name = number;
  if (!slug.empty()) name.append("-").append(slug);
  return name.append(".png");
}

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  ZERO_CHECK(in.good(), "validation: cannot read '", path.string(), "' (written by another rank: is output_dir on a "
                        "file system all ranks share?)");
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace

/// One prompt this rank draws: its index in the list and its conditioning,
/// float32 on the CPU ([1, T, W], [1, P]).
struct DrawnPrompt {
  std::size_t index = 0;
  std::string text;
  torch::Tensor embeds, pooled;
};

struct ValidationImages::State {
  const TrainConfig& config;
  ValidatedModel model;
  PipelineSource source;
  std::vector<std::string> prompts;  // all of them, for the index and TensorBoard
  std::vector<DrawnPrompt> mine;
  torch::Tensor negative_embeds, negative_pooled;  // [1, T, W], [1, P]; undefined without guidance
  SchedulerConfig scheduler;
  double scaling_factor = 0;
  std::int64_t vae_factor = 8;
};

namespace {

/// Where the validation's models come from, for messages.
std::string models_of(const TrainConfig& c) {
  return c.validation_single_file.empty() ? "[validation] pipeline '" + c.validation_pipeline + "'"
                                          : "[validation] single_file '" + c.validation_single_file + "'";
}

/// Rank `rank`'s prompts with their conditioning, from the cache where the
/// text matches, the rest (and the negative prompt, when it is not zeros)
/// from the pipeline's text encoders.
void condition_prompts(ValidationImages::State& s, const data::ValidationPrompts* cached, const data::TextDims& text,
                       int rank, int world) {
  const TrainConfig& c = s.config;
  std::map<std::string, std::size_t> in_cache;
  std::int64_t cached_length = 0;
  if (cached != nullptr && !cached->prompts.empty()) {
    const auto p = static_cast<std::int64_t>(cached->prompts.size());
    ZERO_CHECK(static_cast<std::int64_t>(cached->pooled_prompt_embeds.size()) == p * text.pooled_width &&
                   cached->prompt_embeds.size() % static_cast<std::size_t>(p * text.width) == 0,
               "[validation]: the dataset's cached validation prompts are not ", text.width, " and ", text.pooled_width,
               " wide (the UNet's text widths)");
    cached_length = static_cast<std::int64_t>(cached->prompt_embeds.size()) / (p * text.width);
    for (std::size_t i = 0; i < cached->prompts.size(); ++i) in_cache.emplace(cached->prompts[i], i);
  }
  const bool guided = c.validation_guidance > 1.0;
  const bool zeros_negative = c.validation_negative_prompt.empty() && force_zeros_for_empty_prompt(s.source);
  std::vector<std::size_t> to_encode;
  for (std::size_t i = static_cast<std::size_t>(rank); i < s.prompts.size(); i += static_cast<std::size_t>(world)) {
    DrawnPrompt d{.index = i, .text = s.prompts[i]};
    if (const auto it = in_cache.find(d.text); it != in_cache.end()) {
      const auto row = static_cast<std::int64_t>(it->second);
      const std::int64_t numel = cached_length * text.width;
      d.embeds = torch::from_blob(const_cast<float*>(cached->prompt_embeds.data()) + row * numel,
                                  {1, cached_length, text.width}, torch::kFloat32).clone();
      d.pooled = torch::from_blob(const_cast<float*>(cached->pooled_prompt_embeds.data()) + row * text.pooled_width,
                                  {1, text.pooled_width}, torch::kFloat32).clone();
    } else {
      to_encode.push_back(s.mine.size());
    }
    s.mine.push_back(std::move(d));
  }
  const bool encode_negative = guided && !zeros_negative && !s.mine.empty();
  if (!to_encode.empty() || encode_negative) {
    ZERO_CHECK(!s.source.tokenizer.empty() && !s.source.tokenizer_2.empty(), "[validation]: ",
               to_encode.empty() ? "the negative prompt" : "prompt '" + s.mine[to_encode.front()].text + "'",
               " is not in the dataset's cache and ", models_of(c), " holds no tokenizers: give [validation] "
               "tokenizer and tokenizer_2, or single_file_config with them");
    const auto options = torch::TensorOptions().dtype(s.model.dtype).device(s.model.device);
    PromptEncoder encoder(s.source, options);
    // One prompt at a time, as the pipeline (and the sample tool) encodes them.
    for (const std::size_t k : to_encode) std::tie(s.mine[k].embeds, s.mine[k].pooled) = encoder.encode({s.mine[k].text});
    if (encode_negative) std::tie(s.negative_embeds, s.negative_pooled) = encoder.encode({c.validation_negative_prompt});
  }
  if (guided && zeros_negative && !s.mine.empty()) {
    s.negative_embeds = torch::zeros_like(s.mine.front().embeds);
    s.negative_pooled = torch::zeros_like(s.mine.front().pooled);
  }
  for (const DrawnPrompt& d : s.mine)
    ZERO_CHECK(d.embeds.size(2) == text.width && d.pooled.size(1) == text.pooled_width,
               "[validation] prompt '", d.text, "': its conditioning is ", d.embeds.size(2), " wide with a pooled width of ",
               d.pooled.size(1), ", the UNet takes ", text.width, " and ", text.pooled_width,
               ": the text encoders of ", models_of(c), " do not belong to this UNet");
}

}  // namespace

std::unique_ptr<ValidationImages> ValidationImages::create(const TrainConfig& c, const data::ValidationPrompts* cached,
                                                           const data::TextDims& text, const ValidatedModel& model,
                                                           const zero::MpiCommunicator& host_comm) {
  if (c.validation_every == 0) return nullptr;
  auto s = std::make_unique<State>(State{.config = c, .model = model, .source = {}, .prompts = {}, .mine = {},
                                         .negative_embeds = {}, .negative_pooled = {}, .scheduler = {}});
  s->source.pipeline = c.validation_pipeline;
  s->source.single_file = c.validation_single_file;
  s->source.single_file_config = c.validation_single_file_config;
  s->source.tokenizer = c.validation_tokenizer;
  s->source.tokenizer_2 = c.validation_tokenizer_2;
  s->source.option_prefix = "[validation] ";
  s->source.resolve(/*needs_tokenizers=*/false);
  s->prompts = !c.validation_prompts.empty() ? c.validation_prompts
               : cached != nullptr           ? cached->prompts
                                             : std::vector<std::string>{};
  ZERO_CHECK(!s->prompts.empty(), "[validation] every = ", c.validation_every,
             " but there are no prompts: set [validation] prompts (--validation_prompt TEXT), or train on a dataset "
             "that caches them (examples/sdxl/prepare --validation_prompts FILE)");
  {
    torch::NoGradGuard no_grad;
    const AutoencoderKL vae = load_source_vae(s->source, torch::TensorOptions().dtype(torch::kFloat32));
    s->scaling_factor = vae->config().scaling_factor;
    s->vae_factor = std::int64_t{1} << (vae->config().block_out_channels.size() - 1);
  }
  // The UNet halves the latents once per level but the last.
  const std::int64_t grid = s->vae_factor << (model.config.block_out_channels.size() - 1);
  for (const auto& [side, value] : {std::pair{"height", c.validation_height}, std::pair{"width", c.validation_width}})
    ZERO_CHECK(value % grid == 0, "[validation] ", side, " = ", value, " does not fit this UNet's grid: it must be a "
               "multiple of ", grid, " pixels (the VAE's ", s->vae_factor, " times 2 per UNet down-sampling)");
  s->scheduler = source_scheduler(s->source, "", parse_sampler(c.validation_sampler, "[validation] sampler"), "");
  torch::NoGradGuard no_grad;
  condition_prompts(*s, cached, text, host_comm.rank(), host_comm.size());
  if (host_comm.rank() == 0) {
    std::printf("validation: %zu prompt(s), %lldx%lld, %lld %s steps, guidance %g, every %lld steps and after the last, "
                "with the %s weights -> %s/samples/\n",
                s->prompts.size(), static_cast<long long>(c.validation_width), static_cast<long long>(c.validation_height),
                static_cast<long long>(c.validation_steps), c.validation_sampler.c_str(), c.validation_guidance,
                static_cast<long long>(c.validation_every), c.ema_decay > 0 ? "EMA" : "trained", c.output_dir.c_str());
    std::fflush(stdout);
  }
  return std::unique_ptr<ValidationImages>(new ValidationImages(std::move(s)));
}

double ValidationImages::generate(std::int64_t done, zero::Engine& engine, zero::MpiCommunicator& host_comm,
                                  metrics::TensorBoardWriter* tensorboard) {
  const State& s = *state_;
  const TrainConfig& c = s.config;
  const auto start = std::chrono::steady_clock::now();
  const fs::path folder = folder_of(done);
  fs::create_directories(folder);
  const auto since = [](std::chrono::steady_clock::time_point from) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - from).count();
  };
  // Where the time goes, per phase (the slowest rank's): the UNet built and
  // the weights gathered into it, the VAE loaded, drawing and decoding.
  double phases[3] = {0, 0, 0};
  // The UNet is built first and the weights copied into it straight from the
  // engine's gathered buckets (on the GPU: no trip through host memory).
  std::optional<UNetInOrder> unet;
  const auto options = torch::TensorOptions().dtype(s.model.dtype).device(s.model.device);
  if (!s.mine.empty()) {
    const LoraOptions lora = lora_options(c);
    unet.emplace(unet_in_order(s.model.config, s.model.parameter_names, options, lora_enabled(c) ? &lora : nullptr));
  }
  const bool on_gpu = s.model.device.is_cuda();
  torch::NoGradGuard no_grad;
  // Collective: every rank takes part, with or without prompts of its own.
  engine.visit_params(c.ema_decay > 0 ? zero::Engine::Weights::ema : zero::Engine::Weights::master,
                      [&](std::size_t p, const void* values, zero::DType dtype, std::size_t numel) {
                        if (!unet) return;
                        torch::Tensor& target = unet->parameters[p];
                        ZERO_CHECK(static_cast<std::int64_t>(numel) == target.numel(), "validation: parameter '",
                                   s.model.parameter_names[p], "' has ", target.numel(), " elements, the engine ",
                                   numel);
                        target.copy_(torch::from_blob(const_cast<void*>(values), target.sizes(),
                                                      torch::TensorOptions()
                                                          .dtype(zero::adapter::scalar_type_of(dtype))
                                                          .device(s.model.device)));
                        // The engine reuses the buffer once this returns.
                        if (on_gpu) torch::cuda::synchronize();
                      });
  phases[0] = since(start);
  if (unet) {
    const auto build_start = std::chrono::steady_clock::now();
    unet->unet->eval();
    AutoencoderKL vae = load_source_vae(s.source, options);
    SamplingOptions sampling;
    sampling.scheduler = s.scheduler;
    sampling.steps = c.validation_steps;
    sampling.guidance_scale = c.validation_guidance;
    sampling.height = c.validation_height;
    sampling.width = c.validation_width;
    sampling.vae_scale_factor = s.vae_factor;
    phases[1] = since(build_start);
    const auto draw_start = std::chrono::steady_clock::now();
    for (const DrawnPrompt& d : s.mine) {
      sampling.seed = static_cast<std::uint64_t>(c.validation_seed) + d.index;
      const TextConditioning text{.prompt_embeds = d.embeds, .pooled_prompt_embeds = d.pooled,
                                  .negative_prompt_embeds = s.negative_embeds,
                                  .negative_pooled_prompt_embeds = s.negative_pooled};
      const SamplingResult result = sample_latents(*unet->unet, text, sampling);
      const torch::Tensor image = vae->decode(result.latents / s.scaling_factor);
      write_png(folder / file_name(d.index, d.text), to_uint8_hwc(image[0]));
    }
    phases[2] = since(draw_start);
  }
  unet.reset();
  double seconds = since(start);
  // Also the barrier after which rank 0 finds every rank's images on disk.
  host_comm.all_reduce_host_f64(&seconds, 1, zero::ReduceOp::max);
  host_comm.all_reduce_host_f64(phases, 3, zero::ReduceOp::max);
  if (tensorboard == nullptr) return seconds;
  nlohmann::json images = nlohmann::json::array();
  for (std::size_t i = 0; i < s.prompts.size(); ++i) {
    const std::string name = file_name(i, s.prompts[i]);
    const std::string png = read_bytes(folder / name);
    char tag[32];
    std::snprintf(tag, sizeof tag, "validation/%02zu", i);
    tensorboard->add_image({.tag = tag, .height = static_cast<std::int32_t>(c.validation_height),
                            .width = static_cast<std::int32_t>(c.validation_width), .colorspace = 3, .encoded = png},
                           done);
    images.push_back({{"file", name}, {"prompt", s.prompts[i]},
                      {"seed", static_cast<std::uint64_t>(c.validation_seed) + i},
                      {"rank", static_cast<int>(i % static_cast<std::size_t>(host_comm.size()))}});
  }
  tensorboard->add_scalar("validation/seconds", seconds, done);
  tensorboard->flush();
  const nlohmann::json index = {
      {"step", done}, {"weights", c.ema_decay > 0 ? "ema" : "trained"}, {"height", c.validation_height},
      {"width", c.validation_width}, {"steps", c.validation_steps}, {"guidance", c.validation_guidance},
      {"sampler", c.validation_sampler}, {"negative_prompt", c.validation_negative_prompt},
      {"pipeline", c.validation_pipeline}, {"single_file", c.validation_single_file}, {"seconds", seconds},
      {"seconds_by_phase", {{"unet_and_weights", phases[0]}, {"vae", phases[1]}, {"draw", phases[2]}}},
      {"images", images}};
  const std::string text = index.dump(2) + "\n";
  zero::io::write_file_atomically(folder / "index.json",
                                  std::span<const std::byte>(reinterpret_cast<const std::byte*>(text.data()), text.size()));
  std::printf("step %lld: validation: %zu image(s) in %.2f s (slowest rank: UNet and weights %.2f s, VAE %.2f s, draw %.2f s) "
              "-> %s\n",
              static_cast<long long>(done), s.prompts.size(), seconds, phases[0], phases[1], phases[2], folder.c_str());
  std::fflush(stdout);
  return seconds;
}

bool ValidationImages::due_after(std::int64_t done, std::int64_t last) const {
  const std::int64_t every = state_->config.validation_every;
  return every > 0 && (done % every == 0 || done == last);
}

std::string ValidationImages::folder_of(std::int64_t done) const {
  char name[32];
  std::snprintf(name, sizeof name, "step-%08lld", static_cast<long long>(done));
  return (fs::path(state_->config.output_dir) / "samples" / name).string();
}

#else  // no PNG writer in this build (stb or the tokenizer not found when it was configured)

struct ValidationImages::State {};

std::unique_ptr<ValidationImages> ValidationImages::create(const TrainConfig& c, const data::ValidationPrompts*,
                                                           const data::TextDims&, const ValidatedModel&,
                                                           const zero::MpiCommunicator&) {
  ZERO_CHECK(c.validation_every == 0, "[validation] every = ", c.validation_every,
             ": this build of the trainer cannot write images (stb and the CLIP tokenizer were not found when it was "
             "configured; tools/install-deps.sh installs them); set [validation] every = 0");
  return nullptr;
}

double ValidationImages::generate(std::int64_t, zero::Engine&, zero::MpiCommunicator&, metrics::TensorBoardWriter*) {
  return 0;
}
bool ValidationImages::due_after(std::int64_t, std::int64_t) const { return false; }
std::string ValidationImages::folder_of(std::int64_t) const { return {}; }

#endif

ValidationImages::ValidationImages(std::unique_ptr<State> state) : state_(std::move(state)) {}
ValidationImages::~ValidationImages() = default;

}  // namespace sdxl
