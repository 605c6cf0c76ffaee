#include "prepare_options.hpp"

#include <CLI/CLI.hpp>
#include <cstdlib>

namespace sdxl::prepare {

bool parse_options(int argc, char** argv, Options& o, int rank) {
  CLI::App app{"prepare: images + .txt captions -> the cached SDXL dataset (docs/dataset.md)"};
  auto* pipeline = app.add_option("--pipeline", o.models.pipeline, "diffusers SDXL pipeline folder (vae/, text_encoder/, "
                                                            "text_encoder_2/, tokenizer/, tokenizer_2/)");
  auto* single = app.add_option("--single_file", o.models.single_file, "original single-file SDXL checkpoint (.safetensors); "
                                                                "needs --tokenizer and --tokenizer_2");
  pipeline->excludes(single);
  app.add_option("--single_file_config", o.models.single_file_config,
                 "with --single_file: a diffusers pipeline folder whose vae/, text_encoder/ and text_encoder_2/ "
                 "config.json describe the file's models (default: SDXL 1.0's); its tokenizers serve as defaults")
      ->needs(single);
  app.add_option("--tokenizer", o.models.tokenizer, "tokenizer folder (default: PIPELINE/tokenizer)");
  app.add_option("--tokenizer_2", o.models.tokenizer_2, "second tokenizer folder (default: PIPELINE/tokenizer_2)");
  app.add_option("--images", o.images, "folder of images (.jpg .jpeg .png .webp, searched recursively) with "
                                       "same-named .txt captions")->required();
  app.add_option("--output", o.output, "dataset folder to write")->required();
  app.add_option("--resolution", o.resolution, "bucket area is about resolution^2 pixels")->capture_default_str();
  app.add_option("--bucket_step", o.bucket_step, "bucket sides are multiples of this (pixels)")->capture_default_str();
  app.add_option("--max_aspect_ratio", o.max_aspect_ratio, "longest over shortest bucket side at most")
      ->capture_default_str();
  app.add_option("--buckets", o.buckets, "explicit buckets HxW,HxW,... (replaces the generated ones)");
  app.add_flag("--flip", o.flip, "also write a horizontally flipped copy of every image");
  app.add_option("--bad_images", o.bad_images, "skip (report and go on) or refuse (stop at the first)")
      ->check(CLI::IsMember({"skip", "refuse"}))->capture_default_str();
  app.add_option("--max_image_pixels", o.max_image_pixels, "larger images are bad images")->capture_default_str();
  app.add_option("--device", o.device, "cpu or cuda (rank r uses GPU local_rank)")
      ->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  app.add_option("--dtype", o.dtype, "compute dtype of the VAE and text encoders")
      ->check(CLI::IsMember({"fp32", "bf16"}))->capture_default_str();
  app.add_option("--save_dtype", o.save_dtype, "storage dtype of latents and embeddings")
      ->check(CLI::IsMember({"fp16", "bf16", "fp32"}))->capture_default_str();
  app.add_option("--batch_size", o.batch_size, "images per VAE / text-encoder call")->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--shard_size", o.shard_size, "images per shard (the unit of work, of resume and of files)")
      ->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--validation_prompts", o.validation_prompts, "text file, one prompt per line: their embeddings "
                                                               "are cached too (validation_prompts.safetensors)");
  app.add_option("--threads", o.threads, "LibTorch CPU threads per rank (0: the host's cores / ranks on it); "
                                       "the same count on every run gives byte-identical shards")
      ->capture_default_str();
  app.add_flag("--overwrite", o.overwrite, "replace a finished dataset in --output (finished shards of an "
                                           "interrupted run are kept without it)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (rank == 0 || e.get_exit_code() != 0) app.exit(e);
    if (e.get_exit_code() == 0) return false;
    std::exit(e.get_exit_code());
  }
  o.models.resolve(/*needs_tokenizers=*/true);
  return true;
}

}  // namespace sdxl::prepare
