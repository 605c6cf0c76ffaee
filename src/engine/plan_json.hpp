// One Plan as JSON (Plan::to_json), shared by the fit report
// (FitResult::to_json, planner_fit.cpp) without a text round trip.
#pragma once

#include <nlohmann/json.hpp>

#include "zero/engine/planner.hpp"

namespace zero::plan::detail {

nlohmann::json plan_json(const Plan& p);

}  // namespace zero::plan::detail
