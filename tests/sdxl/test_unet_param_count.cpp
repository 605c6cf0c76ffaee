// The analytic parameter count (examples/sdxl/unet_param_count) equals the
// real model's, unit by unit and tensor by tensor: tiny configs of several
// shapes, and the full SDXL UNet built on the meta device (no storage).
#include "unet.hpp"
#include "unet_config.hpp"
#include "unet_param_count.hpp"

#undef CHECK
#undef CHECK_EQ
#undef CHECK_NE
#undef CHECK_LT
#undef CHECK_LE
#undef CHECK_GT
#undef CHECK_GE
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <tuple>

namespace {

void check_counts_equal_model(const sdxl::UNetConfig& config, sdxl::UnitGranularity granularity) {
  sdxl::UNetBuildOptions options;
  options.tensor_options = torch::TensorOptions().dtype(torch::kFloat32).device(torch::kMeta);
  options.initialize = false;
  options.units = granularity;
  sdxl::UNet2DConditionModel model(config, options);
  const std::vector<sdxl::ParameterUnit> units = model->units();
  const std::vector<sdxl::UnitParameterCount> counted = sdxl::count_unit_parameters(config, granularity);
  REQUIRE(counted.size() == units.size());
  std::int64_t total = 0;
  for (std::size_t u = 0; u < units.size(); ++u) {
    CAPTURE(units[u].name);
    CHECK(counted[u].name == units[u].name);
    REQUIRE(counted[u].tensors.size() == units[u].parameters.size());
    for (std::size_t t = 0; t < units[u].parameters.size(); ++t) {
      CAPTURE(units[u].parameters[t].first);
      CHECK(counted[u].tensors[t] == units[u].parameters[t].second.numel());
      total += units[u].parameters[t].second.numel();
    }
    // embed and head run outside activation checkpointing (unet.cpp's forward).
    CHECK(counted[u].checkpointed == (units[u].name != "embed" && units[u].name != "head"));
  }
  CHECK(sdxl::count_parameters(config) == total);
}

void check_counts_equal_model(const sdxl::UNetConfig& config) {
  for (auto granularity : {sdxl::UnitGranularity::layers, sdxl::UnitGranularity::blocks}) {
    CAPTURE(granularity == sdxl::UnitGranularity::layers ? "layers" : "blocks");
    check_counts_equal_model(config, granularity);
  }
}

std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

TEST_CASE("param count: the tiny config (examples/sdxl/configs/tiny_unet.json, the trainer's \"tiny\")") {
  const auto config = sdxl::UNetConfig::from_json(read_text(std::filesystem::path(ZERO_SDXL_CONFIGS) / "tiny_unet.json"));
  check_counts_equal_model(config);
}

TEST_CASE("param count: tiny variants (conv projections, no text-time, no mid block, 3 levels, odd kernels)") {
  const auto base = sdxl::UNetConfig::from_json(read_text(std::filesystem::path(ZERO_SDXL_CONFIGS) / "tiny_unet.json"));
  sdxl::UNetConfig conv = base;
  conv.use_linear_projection = false;
  check_counts_equal_model(conv);
  sdxl::UNetConfig plain = base;
  plain.addition_embed_text_time = false;
  plain.addition_time_embed_dim = 0;
  plain.projection_class_embeddings_input_dim = 0;
  plain.time_embedding_dim = 96;
  check_counts_equal_model(plain);
  sdxl::UNetConfig no_mid = base;
  no_mid.has_mid_block = false;
  check_counts_equal_model(no_mid);
  const auto three = sdxl::UNetConfig::from_json(R"({"down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D", "CrossAttnDownBlock2D"],
    "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D", "CrossAttnUpBlock2D"], "block_out_channels": [32, 64, 96],
    "layers_per_block": [1, 2, 3], "cross_attention_dim": [48, 48, 48], "attention_head_dim": [2, 4, 4],
    "transformer_layers_per_block": [2, 1, 3], "norm_num_groups": 16, "in_channels": 5, "out_channels": 3,
    "conv_in_kernel": 5, "conv_out_kernel": 1})");
  check_counts_equal_model(three);
}

TEST_CASE("param count: the full SDXL UNet, 2,567,463,684 parameters in 93 layer units or 9 block units") {
  const auto config = sdxl::UNetConfig::sdxl_base();
  CHECK(sdxl::count_parameters(config) == 2567463684);
  const auto layers = sdxl::count_unit_parameters(config, sdxl::UnitGranularity::layers);
  CHECK(layers.size() == 93);
  std::int64_t largest = 0;
  std::string largest_name;
  for (const auto& unit : layers)
    if (unit.total() > largest) std::tie(largest, largest_name) = std::tuple(unit.total(), unit.name);
  // An up-path resnet of 2560 input channels: what bounds stage 3's gathered
  // units and gradient buckets (against 1,206,568,960 for up_blocks.0).
  CHECK(largest_name == "up_blocks.0.resnets.0");
  CHECK(largest == 49'164'800);
  CHECK(sdxl::count_unit_parameters(config, sdxl::UnitGranularity::blocks).size() == 9);
  check_counts_equal_model(config);  // meta device: names and shapes only
}
