// Parameter counts of the SDXL UNet from its config alone, without building
// the model (no LibTorch): per stage-3 unit, per tensor, in the order
// UNet2DConditionModelImpl::units() lists them. The memory planner (zero-plan)
// uses them for the engine's exact padded layout; tests/sdxl holds them equal
// to the real model's.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "unet_config.hpp"
#include "zero/engine/planner.hpp"

namespace sdxl {

struct UnitParameterCount {
  std::string name;                   // as ParameterUnit::name

  std::vector<std::int64_t> tensors;  // element counts in named_parameters() order
  /// Recomputed in backward under activation checkpointing (all units but
  /// embed and head).
  bool checkpointed = true;
  std::int64_t total() const;
};

/// One entry per unit of UNet2DConditionModelImpl::units() at that
/// granularity, in that order.
std::vector<UnitParameterCount> count_unit_parameters(const UNetConfig& config,
                                                      UnitGranularity units = UnitGranularity::layers);

/// Sum over all units: 2,567,463,684 for UNetConfig::sdxl_base().
std::int64_t count_parameters(const UNetConfig& config);

/// The memory planner's units for this config (the model's units, tensor
/// sizes for the exact padding, embed and head not checkpointed).
std::vector<zero::plan::PlanUnit> plan_units(const UNetConfig& config,
                                             UnitGranularity units = UnitGranularity::layers);

/// The planner's activation model: calibrated for sdxl_base(), scaled by
/// parameter count (and marked extrapolated) for other configs; latent_size
/// is the latent height = width (128 for 1024x1024 images).
zero::plan::ActivationModel plan_activations(const UNetConfig& config, std::int64_t latent_size);

}  // namespace sdxl
