#include "pipeline_source.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>

#include "pipeline_folder.hpp"
#include "unet_io.hpp"
#include "zero/core/error.hpp"

namespace fs = std::filesystem;

namespace sdxl {

void PipelineSource::resolve(bool needs_tokenizers) {
  ZERO_CHECK(!pipeline.empty() || !single_file.empty(), "give the models: ", option("pipeline"), " DIR or ",
             option("single_file"), " FILE");
  ZERO_CHECK(pipeline.empty() || single_file.empty(), option("pipeline"), " and ", option("single_file"),
             " exclude each other");
  ZERO_CHECK(single_file_config.empty() || !single_file.empty(), option("single_file_config"), " goes with ",
             option("single_file"), " (a pipeline folder has its own configs)");
  if (!pipeline.empty()) {
    ZERO_CHECK(fs::is_directory(pipeline), option("pipeline"), " '", pipeline,
               "' is not a folder (a diffusers SDXL pipeline: vae/, text_encoder/, text_encoder_2/, tokenizer/, "
               "tokenizer_2/)");
    if (tokenizer.empty()) tokenizer = (fs::path(pipeline) / "tokenizer").string();
    if (tokenizer_2.empty()) tokenizer_2 = (fs::path(pipeline) / "tokenizer_2").string();
  } else {
    ZERO_CHECK(fs::is_regular_file(single_file), option("single_file"), " '", single_file, "' is not a file");
    if (!single_file_config.empty()) {
      ZERO_CHECK(fs::is_directory(single_file_config), option("single_file_config"), " '", single_file_config,
                 "' is not a folder (a diffusers pipeline folder whose configs describe the single file's models)");
      for (auto [name, folder] : {std::pair{&tokenizer, "tokenizer"}, std::pair{&tokenizer_2, "tokenizer_2"}})
        if (name->empty() && fs::is_directory(fs::path(single_file_config) / folder))
          *name = (fs::path(single_file_config) / folder).string();
    }
    if (needs_tokenizers)
      ZERO_CHECK(!tokenizer.empty() && !tokenizer_2.empty(), option("single_file"), " holds no tokenizers: give ",
                 option("tokenizer"), " and ", option("tokenizer_2"),
                 " (the tokenizer/ and tokenizer_2/ folders of an SDXL pipeline), or ", option("single_file_config"),
                 " with them");
  }
}

std::optional<std::pair<std::string, std::string>> PipelineSource::single_file_component_config(
    const char* component) const {
  if (single_file.empty() || single_file_config.empty()) return std::nullopt;
  const fs::path file = fs::path(single_file_config) / component / "config.json";
  if (!fs::is_regular_file(file))
    ZERO_THROW(zero::IoError, option("single_file_config"), " '", single_file_config, "' has no ", component,
               "/config.json (the architecture of the single file's ", component, ")");
  return std::pair{read_config_text(file), file.string()};
}

namespace {

// A single file whose tensors do not fit SDXL 1.0's architectures is most
// likely another model's: the loaders' mismatch list gets the way out.
template <class Load>
auto load_single_file_model(const PipelineSource& source, Load&& load) {
  try {
    return load();
  } catch (const zero::IoError& e) {
    if (!source.single_file_config.empty()) throw;
    ZERO_THROW(zero::IoError, e.message(), "\n(these are SDXL 1.0's architectures; for another model give ",
               source.option("single_file_config"), " DIR: a diffusers pipeline folder whose configs describe it)");
  }
}

}  // namespace

AutoencoderKL load_source_vae(const PipelineSource& source, torch::TensorOptions options) {
  AutoencoderKL vae = nullptr;
  if (!source.pipeline.empty()) {
    vae = load_vae(source.pipeline, options);
  } else {
    const auto config = source.single_file_component_config("vae");
    vae = load_single_file_model(source, [&] {
      return load_vae_from_single_file(
          source.single_file, options, config ? VaeConfig::from_json(config->first, config->second) : VaeConfig::sdxl());
    });
  }
  vae->eval();
  return vae;
}

UNet2DConditionModel load_source_unet(const PipelineSource& source, const std::string& path,
                                      torch::TensorOptions options) {
  if (path != source.single_file) return load_unet(path, options);
  const auto config = source.single_file_component_config("unet");
  return load_single_file_model(source, [&] {
    return config ? load_unet(path, options, UNetConfig::from_json(config->first, config->second))
                  : load_unet(path, options);
  });
}

bool force_zeros_for_empty_prompt(const PipelineSource& source) {
  if (source.config_root().empty()) return true;
  const fs::path index_file = fs::path(source.config_root()) / "model_index.json";
  if (!fs::exists(index_file)) return true;
  const auto index = nlohmann::json::parse(read_config_text(index_file));
  const auto it = index.find("force_zeros_for_empty_prompt");
  return it == index.end() || !it->is_boolean() || it->get<bool>();
}

SchedulerConfig source_scheduler(const PipelineSource& source, const std::string& explicit_file, Sampler sampler,
                                 const std::string& explicit_option) {
  fs::path file = explicit_file;
  if (!file.empty()) {
    ZERO_CHECK(fs::exists(file), explicit_option, " '", explicit_file, "' does not exist");
    return read_scheduler_config(file, sampler);
  }
  if (!source.config_root().empty()) {
    file = fs::path(source.config_root()) / "scheduler" / "scheduler_config.json";
    if (fs::exists(file)) return read_scheduler_config(file, sampler);
  }
  SchedulerConfig config;  // SDXL 1.0's scheduler/scheduler_config.json
  config.sampler = sampler;
  config.beta_start = 0.00085;
  config.beta_end = 0.012;
  config.beta_schedule = BetaSchedule::kScaledLinear;
  config.timestep_spacing = TimestepSpacing::kLeading;
  config.steps_offset = 1;
  config.use_karras_sigmas = sampler == Sampler::kDpmpp2mKarras;
  return config;
}

PromptEncoder::PromptEncoder(const PipelineSource& source, torch::TensorOptions options) : device_(options.device()) {
  if (!source.pipeline.empty()) {
    text_ = load_sdxl_text_encoders(source.pipeline, options);
  } else {
    const auto config = source.single_file_component_config("text_encoder");
    const auto config_2 = source.single_file_component_config("text_encoder_2");
    text_ = load_single_file_model(source, [&] {
      return load_sdxl_text_encoders_from_single_file(
          source.single_file, options,
          config ? ClipTextConfig::from_json(config->first, config->second) : ClipTextConfig::sdxl_text_encoder(),
          config_2 ? ClipTextConfig::from_json(config_2->first, config_2->second)
                   : ClipTextConfig::sdxl_text_encoder_2());
    });
  }
  text_.text_encoder->eval();
  text_.text_encoder_2->eval();
  tokenizer_.emplace(ClipTokenizer::load(source.tokenizer));
  tokenizer_2_.emplace(ClipTokenizer::load(source.tokenizer_2));
  ZERO_CHECK(tokenizer_->max_length() == tokenizer_2_->max_length(), "the tokenizers' max lengths differ: ",
             tokenizer_->max_length(), " (", source.tokenizer, ") and ", tokenizer_2_->max_length(), " (",
             source.tokenizer_2, ")");
  const auto& c1 = text_.text_encoder->config();
  const auto& c2 = text_.text_encoder_2->config();
  for (const ClipTokenizer* tok : {&*tokenizer_, &*tokenizer_2_})
    ZERO_CHECK(static_cast<std::int64_t>(tok->vocab_size()) <= std::min(c1.vocab_size, c2.vocab_size),
               "a tokenizer's vocabulary (", tok->vocab_size(), " tokens) is larger than the text encoders' (",
               std::min(c1.vocab_size, c2.vocab_size), "): tokenizer and models do not belong together");
}

data::TextDims PromptEncoder::text_dims() const {
  return {static_cast<std::int64_t>(tokenizer_->max_length()),
          text_.text_encoder->config().hidden_size + text_.text_encoder_2->config().hidden_size,
          text_.text_encoder_2->config().projection_dim};
}

torch::Tensor PromptEncoder::token_ids(const ClipTokenizer& tokenizer, const std::vector<std::string>& prompts) const {
  const auto length = static_cast<std::int64_t>(tokenizer.max_length());
  torch::Tensor ids = torch::empty({static_cast<std::int64_t>(prompts.size()), length}, torch::kInt64);
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    const ClipEncoding encoding = tokenizer.encode(prompts[i]);
    std::copy(encoding.input_ids.begin(), encoding.input_ids.end(),
              ids[static_cast<std::int64_t>(i)].data_ptr<std::int64_t>());
  }
  return ids;
}

std::pair<torch::Tensor, torch::Tensor> PromptEncoder::encode(const std::vector<std::string>& prompts) {
  torch::NoGradGuard no_grad;
  const SdxlTextConditioning c =
      sdxl_text_conditioning(*text_.text_encoder, token_ids(*tokenizer_, prompts).to(device_),
                             *text_.text_encoder_2, token_ids(*tokenizer_2_, prompts).to(device_));
  return {c.prompt_embeds.to(torch::kCPU, torch::kFloat32).contiguous(),
          c.pooled_prompt_embeds.to(torch::kCPU, torch::kFloat32).contiguous()};
}

}  // namespace sdxl
