// The analytic parameter count (examples/sdxl/unet_param_count) equals the
// real model's, unit by unit and tensor by tensor: tiny configs of several
// shapes, and the full SDXL UNet built on the meta device (no storage).
#include "unet.hpp"
#include "sdxl_calibration.hpp"
#include "unet_config.hpp"
#include "unet_param_count.hpp"

#include "../doctest_after_torch.hpp"  // after LibTorch: doctest's CHECK, not glog's

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

TEST_CASE("activation and FLOP estimates: SDXL's forward FLOPs, blocks the sums of their layers, latent scaling") {
  // The weights partial checkpointing chooses units by (plan_units,
  // zero::plan::recompute_order).
  const auto config = sdxl::UNetConfig::sdxl_base();
  const auto layers = sdxl::count_unit_parameters(config, sdxl::UnitGranularity::layers, 128);
  const auto blocks = sdxl::count_unit_parameters(config, sdxl::UnitGranularity::blocks, 128);
  double flops = 0, saved = 0, freed = 0;
  for (const auto& unit : layers) {
    CAPTURE(unit.name);
    if (!unit.checkpointed) {
      CHECK(unit.saved_elements == 0);
      continue;
    }
    CHECK(unit.saved_elements > 0);
    CHECK(unit.forward_flops > 0);
    flops += unit.forward_flops;
    saved += unit.saved_elements;
    freed += unit.freed_elements();
    CHECK(unit.freed_elements() == doctest::Approx(unit.saved_elements - unit.input_elements));
  }
  // The UNet's forward at 1024 px is about a third of the 20.62 TFLOP of
  // forward + backward per image (bench/results/sdxl-gpu.md, from the layer shapes):
  // the estimate counts the convolutions, projections and attention.
  MESSAGE("SDXL forward, estimated: ", flops / 1e12, " TFLOP; activations kept without checkpointing: ",
          saved / 1e9, " G elements per sample, freed by recomputing every unit: ", freed / 1e9, " G");
  CHECK(flops == doctest::Approx(20.62e12 / 3).epsilon(0.1));
  // The calibrated activations freed by checkpointing every unit (the
  // trainer's peaks, sdxl_calibration.hpp: 5.691 - 0.561 GiB per sample in
  // bf16, 2.76 G elements). The estimate is a weighting, not that count (the
  // measured figures hold the allocator's rounding, the recompute of one unit
  // and autograd's transient gradients), yet it lands within 2% (2.72 G);
  // checked within 5%. (The first calibration, 2.24 G, was 25% off.)
  const zero::plan::ActivationModel calibrated = sdxl::calibration::activation_model();
  const double calibrated_freed =
      (calibrated.per_sample_bytes_full - calibrated.per_sample_bytes_checkpointed) / 2.0;
  CHECK(freed == doctest::Approx(calibrated_freed).epsilon(0.05));
  // A downsampler keeps only its input: recomputing it frees nothing.
  for (const auto& unit : layers)
    if (unit.name.find("downsamplers") != std::string::npos) CHECK(unit.freed_elements() == 0);
  // A block's estimate is the sum of its layers'.
  for (const auto& block : blocks) {
    if (!block.checkpointed) continue;
    double block_saved = 0, block_flops = 0;
    for (const auto& unit : layers)
      if (unit.name.rfind(block.name + ".", 0) == 0) {
        block_saved += unit.saved_elements;
        block_flops += unit.forward_flops;
      }
    CAPTURE(block.name);
    CHECK(block.saved_elements == doctest::Approx(block_saved).epsilon(1e-12));
    CHECK(block.forward_flops == doctest::Approx(block_flops).epsilon(1e-12));
  }
  // Half the latent side: a quarter of the positions, so a quarter of the
  // saved elements, but for the text's keys and values (77 tokens), which do
  // not shrink: up to 1.9% at 16 x 16 positions.
  const auto small = sdxl::count_unit_parameters(config, sdxl::UnitGranularity::layers, 64);
  for (std::size_t u = 0; u < layers.size(); ++u) {
    CAPTURE(layers[u].name);
    CHECK(small[u].saved_elements >= layers[u].saved_elements / 4);
    CHECK(small[u].saved_elements == doctest::Approx(layers[u].saved_elements / 4).epsilon(0.02));
  }
  // What partial checkpointing takes first: the highest bytes per FLOP.
  const auto units = sdxl::plan_units(config, sdxl::UnitGranularity::layers, 128);
  const auto order = zero::plan::recompute_order(units);
  REQUIRE(order.size() == 91);
  const auto ratio = [&](std::size_t u) { return units[u].activation_weight / units[u].recompute_weight; };
  for (std::size_t i = 1; i < order.size(); ++i) CHECK(ratio(order[i - 1]) >= ratio(order[i]));
  MESSAGE("first recomputed: ", units[order.front()].name, ", last: ", units[order.back()].name);
  CHECK(units[order.back()].name.find("downsamplers") != std::string::npos);
  CHECK_THROWS_WITH_AS(sdxl::recomputed_unit_mask(config, sdxl::UnitGranularity::layers, 128, 92),
                       doctest::Contains("checkpoint_units = 92: the UNet has 91 checkpointable units"),
                       zero::InvalidArgument);
  const std::vector<bool> mask = sdxl::recomputed_unit_mask(config, sdxl::UnitGranularity::layers, 128, 10);
  CHECK(std::count(mask.begin(), mask.end(), true) == 10);
  CHECK(sdxl::recomputed_unit_mask(config, sdxl::UnitGranularity::layers, 128, 0).empty());
}
