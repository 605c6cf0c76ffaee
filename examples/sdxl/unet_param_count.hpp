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
  /// Per sample at the latent size asked for (estimates from the layer
  /// shapes, for partial checkpointing's choice of units): the activation
  /// elements autograd keeps for the unit when it is not recomputed, those
  /// of its input (which a recomputed unit keeps: checkpointing frees the
  /// difference), and the FLOPs of its forward (the recompute).
  double saved_elements = 0;
  double input_elements = 0;
  double forward_flops = 0;
  /// What recomputing the unit frees: saved - input, at least 0.
  double freed_elements() const;
  std::int64_t total() const;
};

/// Text tokens the estimates assume (CLIP's 77).
inline constexpr std::int64_t kEstimateTextTokens = 77;

/// One entry per unit of UNet2DConditionModelImpl::units() at that
/// granularity, in that order.
/// latent_size: the latent height = width the activation and FLOP estimates
/// are for (128 for 1024x1024 images).
std::vector<UnitParameterCount> count_unit_parameters(const UNetConfig& config,
                                                      UnitGranularity units = UnitGranularity::layers,
                                                      std::int64_t latent_size = 128);

/// Sum over all units: 2,567,463,684 for UNetConfig::sdxl_base().
std::int64_t count_parameters(const UNetConfig& config);

/// The memory planner's units for this config (the model's units, tensor
/// sizes for the exact padding, embed and head not checkpointed), with the
/// saved elements and forward FLOPs at latent_size as the weights of
/// partial checkpointing (freed_elements(), forward_flops).
std::vector<zero::plan::PlanUnit> plan_units(const UNetConfig& config,
                                             UnitGranularity units = UnitGranularity::layers,
                                             std::int64_t latent_size = 128);

/// The units the model recomputes with checkpoint_units = count (0: every
/// checkpointable unit): a mask over units() for
/// UNet2DConditionModelImpl::set_recomputed_units (empty for 0), in
/// zero::plan::recompute_order of plan_units(config, units, latent_size).
/// zero::InvalidArgument naming checkpoint_units when count is above the
/// number of checkpointable units.
std::vector<bool> recomputed_unit_mask(const UNetConfig& config, UnitGranularity units, std::int64_t latent_size,
                                       std::int64_t count);

/// The planner's activation model: calibrated for sdxl_base(), scaled by
/// parameter count (and marked extrapolated) for other configs; latent_size
/// is the latent height = width (128 for 1024x1024 images).
zero::plan::ActivationModel plan_activations(const UNetConfig& config, std::int64_t latent_size);

}  // namespace sdxl
