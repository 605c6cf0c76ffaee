// Tests of the SDXL UNet against diffusers: parameter names and shapes of the
// full SDXL model, numerics of a tiny model against diffusers' float64 output,
// activation checkpointing, strict loading and the file formats.
#include <ftw.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numeric>
#include <set>
#include <sstream>

#include "unet.hpp"
#include "unet_config.hpp"
#include "unet_io.hpp"
#include "unet_param_count.hpp"
#include "zero/core/error.hpp"

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include "../doctest_after_torch.hpp"  // after LibTorch: doctest's CHECK, not glog's

namespace fs = std::filesystem;
using torch::Tensor;

namespace {

const fs::path kFixtures = fs::path(ZERO_TEST_FIXTURES) / "sdxl";
const fs::path kTinyWeights = kFixtures / "tiny_a_weights.safetensors";
const fs::path kTinyIo = kFixtures / "tiny_a_io.safetensors";

// A fresh folder removed when the test ends. Made and removed with POSIX
// calls, not std::filesystem: the pip LibTorch 2.x libraries export their own
// (older) std::filesystem symbols, and fs::remove_all crashes through them in
// any program that links LibTorch.
struct TempDir {
  fs::path path;
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "zero_sdxl_test_XXXXXX").string();
    REQUIRE(::mkdtemp(pattern.data()) != nullptr);
    path = pattern;
  }
  ~TempDir() {
    ::nftw(path.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); }, 16,
           FTW_DEPTH | FTW_PHYS);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
};

// ||a - b|| / ||b|| in float64.
double relative_l2(const Tensor& a, const Tensor& b) {
  Tensor x = a.to(torch::kFloat64), y = b.to(torch::kFloat64);
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

struct TinyInputs {
  Tensor sample, timestep, context, text_embeds, time_ids, expected, expected_f64;
};

TinyInputs tiny_inputs() {
  auto t = sdxl::read_tensors(kTinyIo);
  return {t.at("sample"), t.at("timestep"), t.at("encoder_hidden_states"), t.at("text_embeds"),
          t.at("time_ids"), t.at("expected"), t.at("expected_f64")};
}

// "320x4x3x3", as in sdxl_unet_keys.tsv.
std::string shape_text(torch::IntArrayRef sizes) {
  std::ostringstream out;
  for (std::size_t i = 0; i < sizes.size(); ++i) out << (i ? "x" : "") << sizes[i];
  return out.str();
}

// SDXL 1.0 base unet/config.json as published (diffusers 0.19 era), verbatim keys.
const char* kSdxlConfigJson = R"({
  "_class_name": "UNet2DConditionModel",
  "_diffusers_version": "0.19.0.dev0",
  "act_fn": "silu",
  "addition_embed_type": "text_time",
  "addition_embed_type_num_heads": 64,
  "addition_time_embed_dim": 256,
  "attention_head_dim": [5, 10, 20],
  "block_out_channels": [320, 640, 1280],
  "center_input_sample": false,
  "class_embed_type": null,
  "class_embeddings_concat": false,
  "conv_in_kernel": 3,
  "conv_out_kernel": 3,
  "cross_attention_dim": 2048,
  "cross_attention_norm": null,
  "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
  "downsample_padding": 1,
  "dual_cross_attention": false,
  "encoder_hid_dim": null,
  "encoder_hid_dim_type": null,
  "flip_sin_to_cos": true,
  "freq_shift": 0,
  "in_channels": 4,
  "layers_per_block": 2,
  "mid_block_only_cross_attention": null,
  "mid_block_scale_factor": 1,
  "mid_block_type": "UNetMidBlock2DCrossAttn",
  "norm_eps": 1e-05,
  "norm_num_groups": 32,
  "num_attention_heads": null,
  "num_class_embeds": null,
  "only_cross_attention": false,
  "out_channels": 4,
  "projection_class_embeddings_input_dim": 2816,
  "resnet_out_scale_factor": 1.0,
  "resnet_skip_time_act": false,
  "resnet_time_scale_shift": "default",
  "sample_size": 128,
  "time_cond_proj_dim": null,
  "time_embedding_act_fn": null,
  "time_embedding_dim": null,
  "time_embedding_type": "positional",
  "timestep_post_act": null,
  "transformer_layers_per_block": [1, 2, 10],
  "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
  "upcast_attention": null,
  "use_linear_projection": true
})";

}  // namespace

// ---------------------------------------------------------------- config

TEST_CASE("config: the published SDXL config parses to sdxl_base()") {
  const sdxl::UNetConfig parsed = sdxl::UNetConfig::from_json(kSdxlConfigJson);
  CHECK(parsed == sdxl::UNetConfig::sdxl_base());
  CHECK(sdxl::UNetConfig::from_json(parsed.to_json()) == parsed);
  const sdxl::LevelSpec up0 = parsed.up_level(0);
  CHECK(up0.channels == 1280);
  CHECK(up0.num_layers == 3);
  CHECK(up0.num_heads == 20);
  CHECK(up0.transformer_layers == 10);
  CHECK(parsed.time_embed_dim() == 1280);
}

TEST_CASE("config: the tiny fixture's config") {
  const sdxl::UNetConfig c = sdxl::read_unet_config(kTinyWeights);
  CHECK(c.block_out_channels == std::vector<std::int64_t>{32, 64});
  CHECK(c.attention_head_dim == std::vector<std::int64_t>{2, 4});
  CHECK(c.transformer_layers_per_block == std::vector<std::int64_t>{1, 2});
  CHECK(c.cross_attention_dim == std::vector<std::int64_t>{64, 64});
  CHECK(c.addition_embed_text_time);
  CHECK(c.has_mid_block);  // diffusers' default mid_block_type
  CHECK(c.use_linear_projection);
}

TEST_CASE("config: unsupported or unknown values are errors naming the key") {
  auto with = [](const std::string& key, const std::string& value) {
    std::string text = kSdxlConfigJson;
    const std::string needle = "\"" + key + "\": ";
    auto pos = text.find(needle);
    if (pos == std::string::npos) return text.substr(0, text.size() - 1) + ", " + needle + value + "}";
    auto end = text.find_first_of(",\n}", pos + needle.size());
    if (text[pos + needle.size()] == '[') end = text.find(']', pos) + 1;
    return text.substr(0, pos + needle.size()) + value + text.substr(end);
  };
  auto error_of = [&](const std::string& key, const std::string& value) {
    return message_of([&] { sdxl::UNetConfig::from_json(with(key, value)); });
  };
  CHECK(error_of("resnet_time_scale_shift", "\"scale_shift\"").find("resnet_time_scale_shift") != std::string::npos);
  CHECK(error_of("class_embed_type", "\"timestep\"").find("class_embed_type") != std::string::npos);
  CHECK(error_of("attention_head_dim", "[5, 10]").find("attention_head_dim") != std::string::npos);
  CHECK(error_of("mid_block_type", "\"UNetMidBlock2D\"").find("mid_block_type") != std::string::npos);
  CHECK(error_of("down_block_types", "[\"DownBlock2D\", \"AttnDownBlock2D\", \"CrossAttnDownBlock2D\"]")
            .find("down_block_types") != std::string::npos);
  CHECK(error_of("some_future_key", "1").find("some_future_key") != std::string::npos);
  CHECK(error_of("transformer_layers_per_block", "[[1], [2], [10]]").find("transformer_layers_per_block") !=
        std::string::npos);
  CHECK(error_of("block_out_channels", "[320, 640, 1000]").find("block_out_channels") != std::string::npos);
  CHECK_THROWS_AS(sdxl::UNetConfig::from_json("{not json"), zero::InvalidArgument);
  // With its source, the error names it (a file, or a file's metadata).
  const std::string named =
      message_of([&] { sdxl::UNetConfig::from_json(with("num_attention_heads", "\"x\""), "models/unet/config.json"); });
  CHECK(named.find("models/unet/config.json: ") != std::string::npos);
  CHECK(named.find("num_attention_heads") > named.find("models/unet/config.json: "));
  // num_attention_heads, when given, is the head count.
  const auto heads = sdxl::UNetConfig::from_json(with("num_attention_heads", "[4, 8, 16]"));
  CHECK(heads.heads_of_level(2) == 16);
}

// ---------------------------------------------------------------- full SDXL structure

TEST_CASE("sdxl: parameter names and shapes equal diffusers' state dict, in order") {
  sdxl::UNetBuildOptions options;
  options.tensor_options = torch::TensorOptions().dtype(torch::kFloat32).device(torch::kMeta);  // no storage
  sdxl::UNet2DConditionModel model(sdxl::UNetConfig::sdxl_base(), options);

  std::ifstream keys(kFixtures / "sdxl_unet_keys.tsv");
  REQUIRE(keys);
  std::vector<std::pair<std::string, std::string>> expected;
  std::string line;
  while (std::getline(keys, line)) {
    if (line.empty()) continue;
    const auto tab = line.find('\t');
    expected.emplace_back(line.substr(0, tab), line.substr(tab + 1));
  }
  const auto params = model->named_parameters(true);
  REQUIRE(params.size() == expected.size());
  std::int64_t total = 0, mismatches = 0;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const std::string shape = shape_text(params[i].value().sizes());
    if (params[i].key() != expected[i].first || shape != expected[i].second) {
      if (++mismatches <= 10) {
        FAIL_CHECK("row ", i, ": model ", params[i].key(), " ", shape, ", diffusers ", expected[i].first, " ",
                   expected[i].second);
      }
    }
    total += params[i].value().numel();
  }
  CHECK(mismatches == 0);
  CHECK(total == 2'567'463'684);

  // Units: execution order, every parameter exactly once.
  const auto units = model->units();
  std::vector<std::string> names;
  std::map<std::string, int> seen;
  for (const auto& unit : units) {
    names.push_back(unit.name);
    for (const auto& [name, tensor] : unit.parameters) ++seen[name];
  }
  REQUIRE(names.size() == 93);  // per layer (the default)
  CHECK(std::vector<std::string>(names.begin(), names.begin() + 6) ==
        std::vector<std::string>{"embed", "down_blocks.0.resnets.0", "down_blocks.0.resnets.1",
                                 "down_blocks.0.downsamplers.0", "down_blocks.1.resnets.0",
                                 "down_blocks.1.attentions.0.transformer_blocks.0"});
  CHECK(names[names.size() - 2] == "up_blocks.2.resnets.2");
  CHECK(names.back() == "head");
  CHECK(seen.size() == params.size());
  for (const auto& item : params) CHECK(seen[item.key()] == 1);
  CHECK(units.front().parameters.front().first == "conv_in.weight");
  CHECK(units.back().parameters.back().first == "conv_out.bias");

  // The original (Stability AI) single-file names: one per parameter, distinct,
  // and a few spot checks against sd_xl_base_1.0.safetensors.
  const auto original = sdxl::original_checkpoint_names(*model);
  std::set<std::string> distinct;
  for (const auto& [diffusers, name] : original) distinct.insert(name);
  CHECK(distinct.size() == params.size());
  for (const char* known : {"model.diffusion_model.input_blocks.0.0.weight",
                            "model.diffusion_model.time_embed.2.bias",
                            "model.diffusion_model.label_emb.0.0.weight",
                            "model.diffusion_model.input_blocks.3.0.op.weight",
                            "model.diffusion_model.input_blocks.4.0.skip_connection.weight",
                            "model.diffusion_model.input_blocks.8.1.transformer_blocks.9.ff.net.2.weight",
                            "model.diffusion_model.middle_block.1.transformer_blocks.0.attn2.to_k.weight",
                            "model.diffusion_model.middle_block.2.emb_layers.1.weight",
                            "model.diffusion_model.output_blocks.2.2.conv.weight",
                            "model.diffusion_model.output_blocks.5.2.conv.bias",
                            "model.diffusion_model.output_blocks.8.0.out_layers.3.weight",
                            "model.diffusion_model.out.2.weight"}) {
    CHECK_MESSAGE(distinct.count(known) == 1, known);
  }
}

// ---------------------------------------------------------------- numerics

TEST_CASE("tiny: fp32 forward matches diffusers' float64 reference") {
  sdxl::UNet2DConditionModel model = sdxl::load_unet(kTinyWeights);
  const TinyInputs in = tiny_inputs();
  torch::NoGradGuard no_grad;
  const Tensor out = model->forward(in.sample, in.timestep, in.context, in.text_embeds, in.time_ids);
  REQUIRE(out.sizes() == in.expected_f64.sizes());
  const double err64 = relative_l2(out, in.expected_f64);
  const double err32 = relative_l2(out, in.expected);
  MESSAGE("relative L2 error vs expected_f64: ", err64, ", vs expected (float32): ", err32);
  CHECK(err64 <= 1e-5);

  // An integer timestep, and a scalar one broadcast over the batch, behave as floats do.
  const Tensor int_t = in.timestep.to(torch::kInt64);
  if (torch::equal(int_t.to(torch::kFloat32), in.timestep)) {
    CHECK(torch::allclose(model->forward(in.sample, int_t, in.context, in.text_embeds, in.time_ids), out));
  }
  const Tensor first = model->forward(in.sample, in.timestep[0], in.context, in.text_embeds, in.time_ids);
  const Tensor one = model->forward(in.sample, in.timestep[0].expand({2}), in.context, in.text_embeds, in.time_ids);
  CHECK(torch::allclose(first, one));
}

TEST_CASE("tiny: channels-last matches diffusers' reference, returns NCHW, same gradients up to rounding") {
  sdxl::UNet2DConditionModel model = sdxl::load_unet(kTinyWeights);
  const TinyInputs in = tiny_inputs();
  model->set_channels_last(true);
  {
    torch::NoGradGuard no_grad;
    const Tensor out = model->forward(in.sample, in.timestep, in.context, in.text_embeds, in.time_ids);
    CHECK(out.is_contiguous());
    const double err64 = relative_l2(out, in.expected_f64);
    MESSAGE("channels-last: relative L2 error vs expected_f64: ", err64);
    CHECK(err64 <= 1e-5);
  }
  // Gradients, in float64 so that only the summation order differs.
  model->to(torch::kFloat64);
  torch::manual_seed(11);
  const Tensor weight = torch::randn(in.sample.sizes(), torch::kFloat64);
  auto grads = [&](bool channels_last) {
    model->set_channels_last(channels_last);
    model->zero_grad();
    Tensor sample = in.sample.to(torch::kFloat64).requires_grad_(true);
    Tensor out = model->forward(sample, in.timestep, in.context.to(torch::kFloat64), in.text_embeds.to(torch::kFloat64),
                                in.time_ids);
    (out * weight).sum().backward();
    std::vector<Tensor> g{sample.grad().clone()};
    for (const auto& p : model->parameters()) g.push_back(p.grad().clone());
    return g;
  };
  const auto nchw = grads(false), nhwc = grads(true);
  // Relative to each tensor, or to the largest gradient for tensors whose
  // gradient is mathematically zero (tiny's GroupNorms have one channel per group).
  double global = 0;
  for (std::size_t i = 1; i < nchw.size(); ++i) global = std::max(global, nchw[i].abs().max().item<double>());
  double worst = 0;
  for (std::size_t i = 0; i < nchw.size(); ++i) {
    const double scale = std::max(nchw[i].abs().max().item<double>(), 1e-6 * global);
    worst = std::max(worst, (nchw[i] - nhwc[i]).abs().max().item<double>() / scale);
  }
  MESSAGE("channels-last: largest relative gradient difference (float64): ", worst);
  CHECK(worst <= 1e-8);
}

TEST_CASE("tiny: sizes that are not a multiple of the downsampling factor") {
  sdxl::UNet2DConditionModel model = sdxl::load_unet(kTinyWeights);
  const TinyInputs in = tiny_inputs();
  torch::NoGradGuard no_grad;
  const Tensor sample = in.sample.index({torch::indexing::Slice(), torch::indexing::Slice(),
                                         torch::indexing::Slice(0, 17), torch::indexing::Slice(0, 13)});
  const Tensor out = model->forward(sample, in.timestep, in.context, in.text_embeds, in.time_ids);
  CHECK(out.sizes() == sample.sizes());
}

TEST_CASE("tiny: activation checkpointing gives the same gradients") {
  // In float64, so that summation-order noise (gradients reach a tensor along
  // several paths, accumulated in a different order under recompute) stays far
  // below the tolerance even for gradients that are mathematically zero (tiny's
  // GroupNorms have one channel per group).
  sdxl::UNet2DConditionModel model = sdxl::load_unet(kTinyWeights);
  model->to(torch::kFloat64);
  const TinyInputs in = tiny_inputs();
  torch::manual_seed(7);
  const Tensor weight = torch::randn(in.sample.sizes(), torch::kFloat64);

  auto run = [&](bool checkpointing) {
    model->set_activation_checkpointing(checkpointing);
    model->zero_grad();
    Tensor sample = in.sample.to(torch::kFloat64).requires_grad_(true);
    Tensor context = in.context.to(torch::kFloat64).requires_grad_(true);
    Tensor out = model->forward(sample, in.timestep, context, in.text_embeds.to(torch::kFloat64), in.time_ids);
    (out * weight).sum().backward();
    std::vector<Tensor> grads{out.detach(), sample.grad().clone(), context.grad().clone()};
    for (const auto& p : model->parameters()) {
      REQUIRE(p.grad().defined());
      grads.push_back(p.grad().clone());
    }
    return grads;
  };
  const auto plain = run(false);
  const auto recomputed = run(true);
  // The same weights recomputed block by block (the coarser units).
  sdxl::UNet2DConditionModel by_block(
      model->config(), sdxl::UNetBuildOptions{.initialize = false, .units = sdxl::UnitGranularity::blocks});
  sdxl::load_unet_weights(*by_block, kTinyWeights);
  by_block->to(torch::kFloat64);
  std::swap(model, by_block);
  const auto recomputed_by_block = run(true);
  std::swap(model, by_block);
  REQUIRE(plain.size() == recomputed.size());
  REQUIRE(plain.size() == recomputed_by_block.size());
  double global = 0;
  for (std::size_t i = 3; i < plain.size(); ++i) global = std::max(global, plain[i].abs().max().item<double>());
  double worst = 0, worst_by_block = 0;
  for (std::size_t i = 0; i < plain.size(); ++i) {
    const double scale = std::max(plain[i].abs().max().item<double>(), 1e-6 * global);
    worst = std::max(worst, (plain[i] - recomputed[i]).abs().max().item<double>() / scale);
    worst_by_block = std::max(worst_by_block, (plain[i] - recomputed_by_block[i]).abs().max().item<double>() / scale);
  }
  MESSAGE("largest gradient difference with checkpointing (float64, relative): per layer ", worst, ", per block ",
          worst_by_block);
  CHECK(worst <= 1e-8);
  CHECK(worst_by_block <= 1e-8);

  // Under no-grad the switch changes nothing.
  torch::NoGradGuard no_grad;
  const Tensor a = model->forward(in.sample.to(torch::kFloat64), in.timestep, in.context.to(torch::kFloat64),
                                  in.text_embeds.to(torch::kFloat64), in.time_ids);
  model->set_activation_checkpointing(false);
  const Tensor b = model->forward(in.sample.to(torch::kFloat64), in.timestep, in.context.to(torch::kFloat64),
                                  in.text_embeds.to(torch::kFloat64), in.time_ids);
  CHECK(torch::equal(a, b));
}

TEST_CASE("tiny: partial checkpointing recomputes the chosen units only, with the same gradients") {
  // checkpoint_units = k: the k units of zero::plan::recompute_order run
  // through the recompute path, the others keep their activations; the
  // gradients are those of no checkpointing (float64, as above).
  sdxl::UNet2DConditionModel model = sdxl::load_unet(kTinyWeights);
  model->to(torch::kFloat64);
  const TinyInputs in = tiny_inputs();
  torch::manual_seed(11);
  const Tensor weight = torch::randn(in.sample.sizes(), torch::kFloat64);
  const std::size_t unit_count = model->units().size();
  std::vector<bool> recomputed_seen;
  model->set_unit_runner([&](std::size_t unit, const torch::autograd::variable_list& inputs,
                             const sdxl::UNet2DConditionModelImpl::UnitBody& body, bool recompute) {
    if (torch::GradMode::is_enabled() && recomputed_seen.size() == unit) recomputed_seen.push_back(recompute);
    return recompute ? sdxl::checkpoint(body, inputs) : body(inputs);
  });
  auto run = [&](bool checkpointing, std::int64_t units) {
    model->set_activation_checkpointing(checkpointing);
    model->set_recomputed_units(sdxl::recomputed_unit_mask(model->config(), model->unit_granularity(),
                                                           in.sample.size(2), units));
    model->zero_grad();
    recomputed_seen.clear();
    Tensor sample = in.sample.to(torch::kFloat64).requires_grad_(true);
    Tensor out = model->forward(sample, in.timestep, in.context.to(torch::kFloat64), in.text_embeds.to(torch::kFloat64),
                                in.time_ids);
    (out * weight).sum().backward();
    std::vector<Tensor> grads{out.detach(), sample.grad().clone()};
    for (const auto& p : model->parameters()) grads.push_back(p.grad().clone());
    return grads;
  };
  const auto plain = run(false, 0);
  const std::size_t checkpointable = unit_count - 2;  // all but embed and head
  const auto order = zero::plan::recompute_order(
      sdxl::plan_units(model->config(), model->unit_granularity(), in.sample.size(2)));
  REQUIRE(order.size() == checkpointable);
  for (std::int64_t k : {std::int64_t{1}, static_cast<std::int64_t>(checkpointable / 2),
                         static_cast<std::int64_t>(checkpointable - 1)}) {
    CAPTURE(k);
    const auto grads = run(true, k);
    REQUIRE(recomputed_seen.size() == unit_count);
    std::vector<bool> expected(unit_count, false);
    for (std::int64_t i = 0; i < k; ++i) expected[order[static_cast<std::size_t>(i)]] = true;
    CHECK(recomputed_seen == expected);
    // Relative to the tensor's largest gradient, or to a millionth of the
    // largest overall for gradients that are zero up to rounding (as above).
    double global = 0;
    for (std::size_t i = 2; i < plain.size(); ++i) global = std::max(global, plain[i].abs().max().item<double>());
    double worst = 0;
    for (std::size_t i = 0; i < plain.size(); ++i) {
      const double scale = std::max(plain[i].abs().max().item<double>(), 1e-6 * global);
      worst = std::max(worst, (plain[i] - grads[i]).abs().max().item<double>() / scale);
    }
    CHECK(worst <= 1e-8);
  }
  // 0: every checkpointable unit.
  (void)run(true, 0);
  std::vector<bool> every(unit_count, true);
  every.front() = every.back() = false;
  CHECK(recomputed_seen == every);
  CHECK_THROWS_WITH_AS(sdxl::recomputed_unit_mask(model->config(), model->unit_granularity(), in.sample.size(2),
                                                  static_cast<std::int64_t>(checkpointable + 1)),
                       doctest::Contains("checkpointable units"), zero::InvalidArgument);
  CHECK_THROWS_WITH_AS(model->set_recomputed_units(std::vector<bool>(3, true)),
                       doctest::Contains("given for 3 units"), zero::InvalidArgument);
}

TEST_CASE("tiny: each unit's computation uses only its own unit's parameters, in units() order") {
  // What ZeRO stage 3 relies on: the runner gets unit i exactly when the
  // body needs unit i's parameters (and no other's). Here every parameter is
  // NaN except while its unit's body runs, as a gathered-then-freed unit.
  const TinyInputs in = tiny_inputs();
  torch::NoGradGuard no_grad;
  for (auto granularity : {sdxl::UnitGranularity::layers, sdxl::UnitGranularity::blocks}) {
    CAPTURE(sdxl::name_of(granularity));
    sdxl::UNet2DConditionModel model(sdxl::load_unet(kTinyWeights)->config(),
                                     sdxl::UNetBuildOptions{.initialize = false, .units = granularity});
    sdxl::load_unet_weights(*model, kTinyWeights);
    const Tensor expected = model->forward(in.sample, in.timestep, in.context, in.text_embeds, in.time_ids);
    const std::vector<sdxl::ParameterUnit> units = model->units();
    std::vector<std::vector<Tensor>> saved(units.size());
    for (std::size_t u = 0; u < units.size(); ++u)
      for (const auto& [name, p] : units[u].parameters) {
        saved[u].push_back(p.clone());
        p.fill_(std::numeric_limits<float>::quiet_NaN());
      }
    std::vector<std::size_t> order;
    model->set_unit_runner([&](std::size_t unit, const torch::autograd::variable_list& inputs,
                               const sdxl::UNet2DConditionModelImpl::UnitBody& body, bool) {
      order.push_back(unit);
      REQUIRE(unit < units.size());
      for (std::size_t t = 0; t < units[unit].parameters.size(); ++t) units[unit].parameters[t].second.copy_(saved[unit][t]);
      torch::autograd::variable_list out = body(inputs);
      for (const auto& [name, p] : units[unit].parameters) p.fill_(std::numeric_limits<float>::quiet_NaN());
      return out;
    });
    const Tensor out = model->forward(in.sample, in.timestep, in.context, in.text_embeds, in.time_ids);
    std::vector<std::size_t> expected_order(units.size());
    std::iota(expected_order.begin(), expected_order.end(), std::size_t{0});
    CHECK(order == expected_order);
    CHECK(torch::equal(out, expected));
  }
}

TEST_CASE("checkpoint: frozen inputs still give parameter gradients") {
  auto linear = torch::nn::Linear(4, 3);
  Tensor x = torch::randn({2, 4});  // no requires_grad
  auto outs = sdxl::checkpoint([&](const torch::autograd::variable_list& in) {
    return torch::autograd::variable_list{linear(in[0]).tanh()};
  }, {x});
  outs[0].sum().backward();
  REQUIRE(linear->weight.grad().defined());
  Tensor expected_grad;
  {
    auto w = linear->weight.detach().clone().requires_grad_(true);
    torch::tanh(torch::linear(x, w, linear->bias.detach())).sum().backward();
    expected_grad = w.grad();
  }
  CHECK(torch::allclose(linear->weight.grad(), expected_grad));
}

// ---------------------------------------------------------------- loading and saving

TEST_CASE("loading: strict errors name the missing, unexpected and misshapen tensors") {
  TempDir dir;
  auto tensors = sdxl::read_tensors(kTinyWeights);
  const std::map<std::string, std::string> meta{{"config", sdxl::read_unet_config(kTinyWeights).to_json()}};
  auto model = sdxl::load_unet(kTinyWeights);
  const Tensor before = model->named_parameters()["conv_in.weight"].clone();

  auto attempt = [&](std::map<std::string, Tensor> variant) {
    const fs::path path = dir.path / "variant.safetensors";
    sdxl::write_tensors(path, variant, meta);
    return message_of([&] { sdxl::load_unet_weights(*model, path); });
  };
  SUBCASE("missing") {
    auto variant = tensors;
    variant.erase("mid_block.resnets.1.conv2.weight");
    const std::string msg = attempt(variant);
    CHECK(msg.find("1 missing") != std::string::npos);
    CHECK(msg.find("mid_block.resnets.1.conv2.weight") != std::string::npos);
  }
  SUBCASE("unexpected") {
    auto variant = tensors;
    variant["mid_block.extra.weight"] = torch::zeros({3});
    const std::string msg = attempt(variant);
    CHECK(msg.find("1 unexpected") != std::string::npos);
    CHECK(msg.find("mid_block.extra.weight") != std::string::npos);
  }
  SUBCASE("misshapen") {
    auto variant = tensors;
    variant["conv_out.weight"] = torch::zeros({4, 32, 1, 1});
    const std::string msg = attempt(variant);
    CHECK(msg.find("wrong shape") != std::string::npos);
    CHECK(msg.find("conv_out.weight: checkpoint [4, 32, 1, 1], model [4, 32, 3, 3]") != std::string::npos);
  }
  SUBCASE("many missing are counted") {
    std::map<std::string, Tensor> variant{{"conv_in.weight", tensors.at("conv_in.weight")}};
    const std::string msg = attempt(variant);
    CHECK(msg.find("427 missing") != std::string::npos);
    CHECK(msg.find("... and 407 more") != std::string::npos);
  }
  // A failed load changes nothing.
  CHECK(torch::equal(model->named_parameters()["conv_in.weight"], before));
}

TEST_CASE("loading: pickle checkpoints are refused") {
  auto model = sdxl::load_unet(kTinyWeights);
  for (const char* name : {"model.ckpt", "diffusion_pytorch_model.bin", "unet.pt", "unet.PTH"}) {
    const std::string msg = message_of([&] { sdxl::load_unet_weights(*model, name); });
    CHECK(msg.find("safetensors") != std::string::npos);
    CHECK(msg.find("pickle") != std::string::npos);
  }
  TempDir dir;
  std::ofstream(dir.path / "config.json") << sdxl::read_unet_config(kTinyWeights).to_json();
  std::ofstream(dir.path / "diffusion_pytorch_model.bin") << "not really";
  CHECK(message_of([&] { sdxl::load_unet_weights(*model, dir.path); }).find("pickle") != std::string::npos);
}

TEST_CASE("saving: diffusers folder, single file, sharded, fp16 variant and original layout round-trip") {
  TempDir dir;
  auto model = sdxl::load_unet(kTinyWeights);
  auto same_as_model = [&](const sdxl::UNet2DConditionModel& other) {
    auto a = model->named_parameters(), b = other->named_parameters();
    if (a.size() != b.size()) return false;
    for (std::size_t i = 0; i < a.size(); ++i) {
      if (a[i].key() != b[i].key() || !torch::equal(a[i].value(), b[i].value())) return false;
    }
    return true;
  };

  sdxl::save_unet(*model, dir.path / "folder");
  CHECK(fs::exists(dir.path / "folder" / "config.json"));
  CHECK(same_as_model(sdxl::load_unet(dir.path / "folder")));
  CHECK(same_as_model(sdxl::load_unet(dir.path / "folder" / "diffusion_pytorch_model.safetensors")));

  sdxl::save_unet(*model, dir.path / "single.safetensors");
  CHECK(same_as_model(sdxl::load_unet(dir.path / "single.safetensors")));

  // Original single-file layout, and a file that also carries other components.
  sdxl::save_unet(*model, dir.path / "original.safetensors", std::nullopt, sdxl::CheckpointFormat::kOriginalSingleFile);
  auto original = sdxl::read_tensors(dir.path / "original.safetensors");
  CHECK(original.count("model.diffusion_model.input_blocks.0.0.weight") == 1);
  CHECK(original.count("model.diffusion_model.middle_block.1.proj_in.weight") == 1);
  CHECK(original.count("model.diffusion_model.output_blocks.2.2.conv.weight") == 1);  // after resnet, attention
  CHECK(original.count("model.diffusion_model.label_emb.0.0.weight") == 1);
  CHECK(same_as_model(sdxl::load_unet(dir.path / "original.safetensors")));
  original["first_stage_model.decoder.conv_in.weight"] = torch::zeros({2});
  sdxl::write_tensors(dir.path / "full.safetensors", original,
                      {{"config", model->config().to_json()}});
  CHECK(same_as_model(sdxl::load_unet(dir.path / "full.safetensors")));

  // Sharded diffusers folder (index.json), fp16 variant, pipeline root with unet/.
  auto tensors = sdxl::read_tensors(kTinyWeights);
  const fs::path sharded = dir.path / "pipeline" / "unet";
  fs::create_directories(sharded);
  std::map<std::string, Tensor> shard1, shard2;
  std::ostringstream index;
  index << "{\"metadata\": {}, \"weight_map\": {";
  bool first = true;
  for (const auto& [name, t] : tensors) {
    const bool one = name < "e";
    (one ? shard1 : shard2)[name] = t;
    index << (first ? "" : ",") << "\"" << name << "\": \"" << (one ? "a-00001.safetensors" : "a-00002.safetensors")
          << "\"";
    first = false;
  }
  index << "}}";
  sdxl::write_tensors(sharded / "a-00001.safetensors", shard1);
  sdxl::write_tensors(sharded / "a-00002.safetensors", shard2);
  std::ofstream(sharded / "diffusion_pytorch_model.safetensors.index.json") << index.str();
  std::ofstream(sharded / "config.json") << model->config().to_json();
  CHECK(same_as_model(sdxl::load_unet(dir.path / "pipeline")));

  const fs::path fp16 = dir.path / "fp16";
  fs::create_directories(fp16);
  std::ofstream(fp16 / "config.json") << model->config().to_json();
  std::map<std::string, Tensor> halves;
  for (const auto& [name, t] : tensors) halves[name] = t.to(torch::kFloat16);
  sdxl::write_tensors(fp16 / "diffusion_pytorch_model.fp16.safetensors", halves);
  auto from_fp16 = sdxl::load_unet(fp16);
  CHECK(torch::equal(from_fp16->named_parameters()["conv_in.weight"],
                     tensors.at("conv_in.weight").to(torch::kFloat16).to(torch::kFloat32)));

  // An index that points outside the folder is refused.
  std::ofstream(sharded / "diffusion_pytorch_model.safetensors.index.json")
      << "{\"weight_map\": {\"conv_in.weight\": \"../../single.safetensors\"}}";
  CHECK(message_of([&] { sdxl::load_unet(dir.path / "pipeline"); }).find("plain file name") != std::string::npos);
}

#ifdef ZERO_SDXL_FORWARD_OUTPUT
// Run by CTest after the unet_forward executable has written its output
// (test sdxl.unet_forward.compare); excluded from the main test run.
TEST_CASE("unet_forward output matches the reference") {
  const fs::path path = ZERO_SDXL_FORWARD_OUTPUT;
  REQUIRE(fs::exists(path));
  const auto out = sdxl::read_tensors(path);
  REQUIRE(out.count("sample") == 1);
  CHECK((out.at("sample").scalar_type() == torch::kFloat32));
  const double err = relative_l2(out.at("sample"), tiny_inputs().expected_f64);
  MESSAGE("unet_forward relative L2 error vs expected_f64: ", err);
  CHECK(err <= 1e-5);
}
#endif
