// The trainer's validation images ([validation], docs/sampling.md): every
// `every` steps and after the last one, the prompts are drawn with the
// weights being trained (the EMA weights when ema_decay > 0), prompt i by
// rank i mod N, decoded by the pipeline's VAE, written as PNG under
// output_dir/samples/step-NNNNNNNN/ with an index.json, and shown in
// TensorBoard (tags validation/NN) by rank 0.
//
// Training does not notice: the weights are read with Engine::visit_params
// (which, with offload_delayed_update, waits for the running update but
// leaves its upload to the next step as before), straight from the gathered
// buckets on the device into a separate UNet in the model dtype, built for
// the occasion and freed after, and the initial noise comes from a CPU
// generator of its own (seed + i, the same at every validation, so the
// images of successive steps compare). Memory: one UNet in the model dtype
// on each rank that has a prompt (SDXL in bf16: 5.1 GB), one gather bucket,
// and the sampling's activations, for the duration; nothing on the host.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "data/dataset.hpp"
#include "metrics/tensorboard_writer.hpp"
#include "train_config.hpp"
#include "unet_config.hpp"
#include "zero/comm/mpi_communicator.hpp"
#include "zero/engine/engine.hpp"

namespace sdxl {

/// The UNet being trained, as the validation rebuilds it.
struct ValidatedModel {
  const UNetConfig& config;
  const std::vector<std::string>& parameter_names;  // the engine's order (what Engine::gather_* return)
  torch::Device device;
  torch::ScalarType dtype;  // the model dtype: the images are drawn in it
};

class ValidationImages {
 public:
  /// nullptr when [validation] every is 0. Otherwise checks, before
  /// training, what can fail later: the pipeline's VAE loads, the image size
  /// fits the UNet's grid, and every prompt has its conditioning, of the
  /// right widths: from the dataset's cache (`cached`, may be null) when the
  /// text matches, else from the pipeline's text encoders, loaded on the
  /// ranks that need them and freed at once. zero::InvalidArgument naming
  /// the [validation] key otherwise.
  static std::unique_ptr<ValidationImages> create(const TrainConfig& c, const data::ValidationPrompts* cached,
                                                  const data::TextDims& text, const ValidatedModel& model,
                                                  const zero::MpiCommunicator& host_comm);
  ~ValidationImages();
  ValidationImages(const ValidationImages&) = delete;
  ValidationImages& operator=(const ValidationImages&) = delete;

  /// Whether the step `done` (1-based) of a run of `last` steps gets images.
  bool due_after(std::int64_t done, std::int64_t last) const;

  /// Draws and writes the images of step `done`. Collective (the weights'
  /// gather, then every rank's images are on disk before it returns).
  /// `tensorboard`: rank 0's writer, null elsewhere. Returns the seconds it
  /// took on the slowest rank.
  double generate(std::int64_t done, zero::Engine& engine, zero::MpiCommunicator& host_comm,
                  metrics::TensorBoardWriter* tensorboard);

  /// The folder of step `done`'s images.
  std::string folder_of(std::int64_t done) const;

  /// What create() prepared (train_validation.cpp).
  struct State;

 private:
  explicit ValidationImages(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace sdxl
