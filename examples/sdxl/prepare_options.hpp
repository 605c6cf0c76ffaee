// prepare's command line (the options and their defaults: README.md, "prepare").
#pragma once

#include <cstdint>
#include <string>

#include "pipeline_source.hpp"

namespace sdxl::prepare {

struct Options {
  sdxl::PipelineSource models;
  std::string images, output;
  std::int64_t resolution = 1024;
  std::int64_t bucket_step = 64;
  double max_aspect_ratio = 4.0;
  std::string buckets;  // explicit "HxW,..." list, replaces the generated ones
  bool flip = false;
  std::string bad_images = "skip";
  std::int64_t max_image_pixels = 100'000'000;
  std::string device = "cpu";
  std::string dtype = "fp32";
  std::string save_dtype = "fp16";
  std::int64_t batch_size = 4;
  std::int64_t shard_size = 256;
  std::string validation_prompts;
  bool overwrite = false;
  int threads = 0;  // 0: the host's cores / ranks on it
};

/// Reads argv into `o` and resolves the model folders; false when --help was
/// printed (by rank 0). A bad command line ends the process with CLI11's
/// message and exit code.
bool parse_options(int argc, char** argv, Options& o, int rank);

}  // namespace sdxl::prepare
