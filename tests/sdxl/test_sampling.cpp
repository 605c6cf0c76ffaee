// The schedulers and the SDXL sampling loop against diffusers
// (tests/fixtures/sampling, made by make_sampling_fixture.py there):
// timesteps and sigmas of EulerDiscreteScheduler and DPMSolverMultistepScheduler
// for several configs and step counts, 10-step trajectories of the tiny UNet
// through StableDiffusionXLPipeline, and the errors for configs not supported.
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "sampling.hpp"
#include "schedulers.hpp"
#include "unet_io.hpp"
#include "zero/core/error.hpp"
#include "zero/io/safetensors.hpp"

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include "../doctest_after_torch.hpp"  // after LibTorch: doctest's CHECK, not glog's

namespace fs = std::filesystem;
using nlohmann::json;
using torch::Tensor;

namespace {

const fs::path kFixtures = fs::path(ZERO_TEST_FIXTURES);
const fs::path kSampling = kFixtures / "sampling";
const fs::path kSchedules = kSampling / "schedules.safetensors";
const fs::path kTrajectories = kSampling / "trajectories.safetensors";
const fs::path kSdxlSchedulerConfig = kSampling / "scheduler_config.json";
const fs::path kTinyWeights = kFixtures / "sdxl" / "tiny_a_weights.safetensors";

std::map<std::string, std::string> metadata_of(const fs::path& path) {
  return zero::io::SafeTensorsFile::open(path).metadata();
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

sdxl::Sampler sampler_of_variant(const std::string& name) {
  if (name.rfind("euler", 0) == 0) return sdxl::Sampler::kEuler;
  if (name.rfind("dpmpp_2m_karras", 0) == 0) return sdxl::Sampler::kDpmpp2mKarras;
  return sdxl::Sampler::kDpmpp2m;
}

// The largest |a - b| / max(1, |b|): an absolute error for values below 1
// (sigmas near 0, timestep 0), a relative one above.
double max_error(const Tensor& a, const Tensor& b) {
  const Tensor x = a.to(torch::kFloat64), y = b.to(torch::kFloat64);
  return ((x - y).abs() / y.abs().clamp_min(1.0)).max().item<double>();
}

double relative_l2(const Tensor& a, const Tensor& b) {
  const Tensor x = a.to(torch::kFloat64), y = b.to(torch::kFloat64);
  return (x - y).norm().item<double>() / y.norm().item<double>();
}

std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no exception)";
}

// SDXL's scheduler config with `overrides` merged in.
std::string sdxl_config_with(const json& overrides) {
  json doc = json::parse(read_text(kSdxlSchedulerConfig));
  for (auto it = overrides.begin(); it != overrides.end(); ++it) doc[it.key()] = it.value();
  return doc.dump();
}

struct TempDir {
  fs::path path;
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "zero_sampling_test_XXXXXX").string();
    REQUIRE(::mkdtemp(pattern.data()) != nullptr);
    path = pattern;
  }
  ~TempDir() {
    ::nftw(path.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); }, 16,
           FTW_DEPTH | FTW_PHYS);
  }
};

}  // namespace

TEST_CASE("timesteps, sigmas and init_noise_sigma equal diffusers' (1e-6, abs below 1, rel above)") {
  const auto tensors = sdxl::read_tensors(kSchedules);
  const auto meta = metadata_of(kSchedules);
  const std::vector<std::int64_t> step_counts = json::parse(meta.at("step_counts")).get<std::vector<std::int64_t>>();
  int variants = 0;
  double worst = 0;
  for (const auto& [key, config_json] : meta) {
    if (key.rfind("config/", 0) != 0) continue;
    const std::string name = key.substr(7);
    if (!tensors.count(name + "/1/timesteps")) continue;  // a trajectory run's config
    ++variants;
    const auto scheduler =
        sdxl::make_scheduler(sdxl::parse_scheduler_config(config_json, sampler_of_variant(name), name));
    double variant_t = 0, variant_s = 0;
    for (std::int64_t steps : step_counts) {
      CAPTURE(name);
      CAPTURE(steps);
      const std::string prefix = name + "/" + std::to_string(steps) + "/";
      scheduler->set_timesteps(steps);
      const Tensor& want_t = tensors.at(prefix + "timesteps");
      REQUIRE(scheduler->timesteps().sizes() == want_t.sizes());
      CHECK((scheduler->timesteps().scalar_type() == want_t.scalar_type()));
      if (want_t.scalar_type() == torch::kInt64) {
        CHECK(torch::equal(scheduler->timesteps(), want_t));
      } else {
        const double e = max_error(scheduler->timesteps(), want_t);
        variant_t = std::max(variant_t, e);
        worst = std::max(worst, e);
        CHECK(e <= 1e-6);
      }
      const Tensor& want_s = tensors.at(prefix + "sigmas");
      REQUIRE(scheduler->sigmas().sizes() == want_s.sizes());
      const double es = max_error(scheduler->sigmas(), want_s);
      variant_s = std::max(variant_s, es);
      worst = std::max(worst, es);
      CHECK(es <= 1e-6);
      const double en = max_error(scheduler->init_noise_sigma().reshape({1}), tensors.at(prefix + "init_noise_sigma"));
      CHECK(en <= 1e-6);
    }
    MESSAGE(name, ": largest timestep error ", variant_t, ", sigma error ", variant_s);
  }
  CHECK(variants == 8);
  MESSAGE("largest timestep/sigma error over ", variants, " configs: ", worst);
}

TEST_CASE("SDXL's scheduler_config.json, from a file and from a pipeline folder") {
  const sdxl::SchedulerConfig euler = sdxl::read_scheduler_config(kSdxlSchedulerConfig, sdxl::Sampler::kEuler);
  CHECK(euler.sampler == sdxl::Sampler::kEuler);
  CHECK(euler.num_train_timesteps == 1000);
  CHECK(euler.beta_start == 0.00085);
  CHECK(euler.beta_end == 0.012);
  CHECK(euler.beta_schedule == sdxl::BetaSchedule::kScaledLinear);
  CHECK(euler.prediction_type == sdxl::PredictionType::kEpsilon);
  CHECK(euler.timestep_spacing == sdxl::TimestepSpacing::kLeading);
  CHECK(euler.steps_offset == 1);
  CHECK_FALSE(euler.use_karras_sigmas);

  TempDir pipeline;
  // POSIX mkdir, not std::filesystem's (see test_unet.cpp's TempDir).
  REQUIRE(::mkdir((pipeline.path / "scheduler").c_str(), 0755) == 0);
  std::ofstream(pipeline.path / "scheduler" / "scheduler_config.json") << read_text(kSdxlSchedulerConfig);
  const sdxl::SchedulerConfig karras = sdxl::read_scheduler_config(pipeline.path, sdxl::Sampler::kDpmpp2mKarras);
  CHECK(karras.sampler == sdxl::Sampler::kDpmpp2mKarras);
  CHECK(karras.use_karras_sigmas);
  CHECK(karras.timestep_spacing == sdxl::TimestepSpacing::kLeading);
  CHECK_FALSE(sdxl::read_scheduler_config(pipeline.path, sdxl::Sampler::kDpmpp2m).use_karras_sigmas);
  CHECK(message_of([&] { sdxl::read_scheduler_config(pipeline.path / "missing", sdxl::Sampler::kEuler); })
            .find("cannot read the scheduler config") != std::string::npos);

  CHECK(sdxl::parse_sampler("dpmpp_2m_karras", "--sampler") == sdxl::Sampler::kDpmpp2mKarras);
  CHECK(sdxl::name_of(sdxl::Sampler::kDpmpp2m) == "dpmpp_2m");
  const std::string bad = message_of([] { sdxl::parse_sampler("dpm++", "--sampler"); });
  CHECK(bad.find("--sampler") != std::string::npos);
  CHECK(bad.find("euler, dpmpp_2m, dpmpp_2m_karras") != std::string::npos);
}

TEST_CASE("unsupported scheduler config values are refused, naming the key and the supported values") {
  struct Case {
    sdxl::Sampler sampler;
    json overrides;
    std::vector<std::string> expected;  // substrings of the message
  };
  const std::vector<Case> cases = {
      {sdxl::Sampler::kEuler, {{"timestep_spacing", "uniform"}}, {"'timestep_spacing'", "\"leading\"", "\"trailing\""}},
      {sdxl::Sampler::kEuler, {{"prediction_type", "sample"}}, {"'prediction_type'", "\"epsilon\", \"v_prediction\""}},
      {sdxl::Sampler::kEuler, {{"beta_schedule", "squaredcos_cap_v2"}}, {"'beta_schedule'", "\"scaled_linear\""}},
      {sdxl::Sampler::kEuler, {{"trained_betas", {0.1, 0.2}}}, {"'trained_betas'", "null"}},
      {sdxl::Sampler::kEuler, {{"interpolation_type", "log_linear"}}, {"'interpolation_type'", "\"linear\""}},
      {sdxl::Sampler::kEuler, {{"use_exponential_sigmas", true}}, {"'use_exponential_sigmas'", "false"}},
      {sdxl::Sampler::kEuler, {{"rescale_betas_zero_snr", true}}, {"'rescale_betas_zero_snr'"}},
      {sdxl::Sampler::kEuler, {{"timestep_type", "continuous"}}, {"'timestep_type'", "\"discrete\""}},
      {sdxl::Sampler::kEuler, {{"num_train_timesteps", "1000"}}, {"'num_train_timesteps'", "an integer"}},
      {sdxl::Sampler::kEuler, {{"steps_offset", -1}}, {"'steps_offset'"}},
      {sdxl::Sampler::kEuler, {{"beta_end", 1.5}}, {"'beta_end'", "(0, 1)"}},
      {sdxl::Sampler::kEuler, {{"use_karras_sigmas", "yes"}}, {"'use_karras_sigmas'", "true, false"}},
      {sdxl::Sampler::kDpmpp2mKarras, {{"solver_type", "heun"}}, {"'solver_type'", "\"midpoint\""}},
      {sdxl::Sampler::kDpmpp2m, {{"thresholding", true}}, {"'thresholding'", "false"}},
      {sdxl::Sampler::kDpmpp2m, {{"final_sigmas_type", "sigma_min"}}, {"'final_sigmas_type'", "\"zero\""}},
      {sdxl::Sampler::kDpmpp2m, {{"lambda_min_clipped", -5.1}}, {"'lambda_min_clipped'", "-Infinity"}},
      {sdxl::Sampler::kDpmpp2m, {{"variance_type", "learned_range"}}, {"'variance_type'", "null"}},
      {sdxl::Sampler::kDpmpp2m, {{"use_lu_lambdas", true}}, {"'use_lu_lambdas'"}},
  };
  for (const Case& c : cases) {
    CAPTURE(c.overrides.dump());
    const std::string message =
        message_of([&] { sdxl::parse_scheduler_config(sdxl_config_with(c.overrides), c.sampler, "cfg.json"); });
    CHECK(message.find("cfg.json") != std::string::npos);
    for (const std::string& part : c.expected) CHECK_MESSAGE(message.find(part) != std::string::npos, message);
  }
  // Keys the chosen class does not read are ignored, as diffusers does.
  CHECK_NOTHROW(sdxl::parse_scheduler_config(sdxl_config_with({{"solver_type", "heun"}}), sdxl::Sampler::kEuler, "x"));
  CHECK_NOTHROW(sdxl::parse_scheduler_config(sdxl_config_with({{"interpolation_type", "log_linear"}}),
                                             sdxl::Sampler::kDpmpp2m, "x"));
  // What the sampler's name fixes overrides the file.
  CHECK_NOTHROW(sdxl::parse_scheduler_config(sdxl_config_with({{"algorithm_type", "sde-dpmsolver++"},
                                                               {"solver_order", 3}}),
                                             sdxl::Sampler::kDpmpp2m, "x"));
  // Python's json writes -Infinity; it is the default and accepted.
  const std::string with_infinity = R"({"beta_schedule": "scaled_linear", "lambda_min_clipped": -Infinity,
                                        "note": "NaN and -Infinity in a string stay text"})";
  CHECK(sdxl::parse_scheduler_config(with_infinity, sdxl::Sampler::kDpmpp2m, "x").beta_schedule ==
        sdxl::BetaSchedule::kScaledLinear);
  CHECK(message_of([] { sdxl::parse_scheduler_config("{\"steps_offset\": 1", sdxl::Sampler::kEuler, "x.json"); })
            .find("x.json: not valid JSON") != std::string::npos);
  CHECK(message_of([] { sdxl::parse_scheduler_config("[1, 2]", sdxl::Sampler::kEuler, "x.json"); })
            .find("expected a JSON object") != std::string::npos);

  const auto scheduler = sdxl::make_scheduler(sdxl::SchedulerConfig{});
  CHECK(message_of([&] { scheduler->set_timesteps(0); }).find("sampling steps = 0") != std::string::npos);
  CHECK(message_of([&] { scheduler->scale_model_input(torch::zeros({1}), 0); }).find("set_timesteps") !=
        std::string::npos);
  const auto dpm = sdxl::make_scheduler(sdxl::SchedulerConfig{.sampler = sdxl::Sampler::kDpmpp2m});
  dpm->set_timesteps(4);
  CHECK(message_of([&] { dpm->step(torch::zeros({1}), 1, torch::zeros({1})); }).find("out of order") !=
        std::string::npos);
}

namespace {

struct Trajectory {
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::string> meta;
  sdxl::TextConditioning text;
  sdxl::SamplingOptions options_for(const std::string& run) const {
    sdxl::SamplingOptions o;
    o.scheduler = sdxl::parse_scheduler_config(meta.at("config/" + run), sampler_of_variant(run), run);
    o.steps = std::stoll(meta.at("steps"));
    o.guidance_scale = std::stod(meta.at("guidance_scale"));
    const json micro = json::parse(meta.at("micro_conditioning"));
    o.micro.original_size = micro.at("original_size").get<std::array<std::int64_t, 2>>();
    o.micro.crop_top_left = micro.at("crops_coords_top_left").get<std::array<std::int64_t, 2>>();
    o.micro.target_size = micro.at("target_size").get<std::array<std::int64_t, 2>>();
    // The pipeline ran without a VAE (scale factor 8): 16x16 latents are 128x128 pixels.
    o.height = o.width = 128;
    o.vae_scale_factor = 8;
    o.keep_steps = true;
    return o;
  }
};

Trajectory load_trajectory() {
  Trajectory t{sdxl::read_tensors(kTrajectories), metadata_of(kTrajectories), {}};
  t.text = {t.tensors.at("prompt_embeds"), t.tensors.at("pooled_prompt_embeds"), t.tensors.at("negative_prompt_embeds"),
            t.tensors.at("negative_pooled_prompt_embeds")};
  return t;
}

}  // namespace

TEST_CASE("10-step trajectories of the tiny UNet equal diffusers' pipeline (1e-5 rel. L2 per step)") {
  torch::set_num_threads(1);  // the tiny model gains nothing from threads on a shared 2-core machine
  const Trajectory fixture = load_trajectory();
  sdxl::UNet2DConditionModel unet = sdxl::load_unet(kTinyWeights);
  unet->eval();
  for (const std::string run : {"euler", "dpmpp_2m_karras", "euler_v", "dpmpp_2m_karras_v"}) {
    CAPTURE(run);
    sdxl::SamplingOptions options = fixture.options_for(run);
    options.initial_noise = fixture.tensors.at("noise");
    const sdxl::SamplingResult result = sdxl::sample_latents(*unet, fixture.text, options);
    const Tensor& want = fixture.tensors.at(run + "/steps");
    REQUIRE(static_cast<std::int64_t>(result.steps.size()) == want.size(0));
    double worst = 0;
    for (std::int64_t i = 0; i < want.size(0); ++i) {
      CAPTURE(i);
      const double e = relative_l2(result.steps[i], want[i]);
      worst = std::max(worst, e);
      CHECK(e <= 1e-5);
    }
    CHECK(relative_l2(result.latents, fixture.tensors.at(run + "/final")) <= 1e-5);
    MESSAGE(run, ": largest per-step rel. L2 ", worst);
  }
}

TEST_CASE("the seed's noise is diffusers' CPU generator's, and sampling leaves the global generator alone") {
  const Trajectory fixture = load_trajectory();
  const Tensor want = fixture.tensors.at("noise");
  const Tensor noise = sdxl::initial_noise(want.sizes(), 1234);
  CHECK(relative_l2(noise, want) <= 1e-6);

  sdxl::UNet2DConditionModel unet = sdxl::load_unet(kTinyWeights);
  unet->eval();
  sdxl::SamplingOptions options = fixture.options_for("euler");
  options.steps = 2;
  options.seed = 1234;
  torch::manual_seed(99);
  const Tensor before = torch::rand({4});
  torch::manual_seed(99);
  const sdxl::SamplingResult seeded = sdxl::sample_latents(*unet, fixture.text, options);
  CHECK(torch::equal(torch::rand({4}), before));
  options.initial_noise = noise;
  CHECK(torch::equal(sdxl::sample_latents(*unet, fixture.text, options).latents, seeded.latents));

  // Guidance needs the negative conditioning.
  sdxl::TextConditioning no_negative = fixture.text;
  no_negative.negative_prompt_embeds = Tensor();
  CHECK(message_of([&] { sdxl::sample_latents(*unet, no_negative, options); })
            .find("'negative_prompt_embeds' is missing") != std::string::npos);
  // ... and without guidance it is not used.
  options.guidance_scale = 1.0;
  CHECK_NOTHROW(sdxl::sample_latents(*unet, no_negative, options));
  sdxl::TextConditioning flat = fixture.text;
  flat.prompt_embeds = flat.prompt_embeds.reshape({2, -1});
  CHECK(message_of([&] { sdxl::sample_latents(*unet, flat, options); })
            .find("'prompt_embeds' has shape [2, 448]; expected [*, *, 64]") != std::string::npos);
  options.height = 100;
  CHECK(message_of([&] { sdxl::sample_latents(*unet, fixture.text, options); }).find("multiples of 8") !=
        std::string::npos);
}
