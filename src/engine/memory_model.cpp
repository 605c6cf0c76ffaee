#include "zero/engine/memory_model.hpp"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <string>
#include <sstream>

namespace zero {

MemoryByCategory model_state_bytes(const StagePlan& plan, std::size_t padded_numel, std::size_t frozen_padded_numel) {
  const auto world = static_cast<std::size_t>(plan.world_size);
  ZERO_CHECK(padded_numel % world == 0 && frozen_padded_numel % world == 0, "numel ", padded_numel, " (frozen ",
             frozen_padded_numel, ") is not a multiple of world_size ", world, " (pass the padded length)");
  const std::size_t full = padded_numel, shard = padded_numel / world;
  const std::size_t p = plan.param_bytes(), g = plan.grad_bytes();
  const std::size_t optimizer = plan.optimizer_elements(padded_numel) * 4;
  const std::size_t all_params = full + frozen_padded_numel;
  MemoryByCategory m;
  m.params = plan.params_on_host ? 0 : (plan.params_full ? all_params : all_params / world) * p;
  m.grads = (plan.full_grads ? full * g : 0) + (plan.grad_shard_on_device() ? shard * g : 0);
  if (!plan.optimizer_on_host) {
    m.master = plan.has_master ? optimizer : 0;
    m.optimizer_state =
        static_cast<std::size_t>(plan.state_slots) * plan.optimizer_elements(padded_numel) * plan.state_bytes();
  }
  if (plan.ema && !plan.ema_on_host) m.ema = optimizer;
  return m;
}

MemoryByCategory model_state_bytes(const EngineOptions& options, std::size_t padded_numel, int world_size) {
  return model_state_bytes(StagePlan::of(options, world_size), padded_numel);
}

MemoryByCategory host_model_state_bytes(const StagePlan& plan, std::size_t padded_numel,
                                        std::size_t frozen_padded_numel) {
  MemoryByCategory h;
  if (!plan.optimizer_on_host) return h;
  const std::size_t shard = padded_numel / static_cast<std::size_t>(plan.world_size);
  const std::size_t frozen_shard = frozen_padded_numel / static_cast<std::size_t>(plan.world_size);
  h.master = shard * 4;
  h.optimizer_state = static_cast<std::size_t>(plan.state_slots) * shard * plan.state_bytes();
  h.ema = plan.ema && plan.ema_on_host ? shard * 4 : 0;
  h.params = plan.params_on_host ? (shard + frozen_shard) * plan.param_bytes() : 0;
  // The gradient shard copied down, and (unless the CPU writes offloaded
  // parameters in place) the updated model-dtype shard copied back up. The
  // delayed update reads one gradient shard while backward streams into a
  // second (one micro-step; with several, they go down after the join into
  // the one), and writes one parameter copy while the other goes up or, with
  // offloaded parameters, a second host parameter shard while the gathers read the first.
  // Accumulating on the host, the micro-steps after the first land in a
  // staging shard that the CPU adds from.
  const std::size_t grad_shards =
      (plan.delayed_update && plan.streams_grads_to_host ? 2 : 1) + (plan.accumulates_on_host ? 1 : 0);
  // Sending the master up (uploads_master), the update writes no copy.
  const std::size_t param_copies =
      plan.uploads_master ? 0 : (plan.params_on_host ? 0 : 1) + (plan.delayed_update ? 1 : 0);
  h.buffers = shard * (grad_shards * plan.grad_bytes() + param_copies * plan.param_bytes());
  return h;
}

MemoryByCategory host_model_state_bytes(const EngineOptions& options, std::size_t padded_numel, int world_size) {
  return host_model_state_bytes(StagePlan::of(options, world_size), padded_numel);
}

std::size_t parse_bytes(const std::string& text, const std::string& what) {
  auto fail = [&]() -> std::size_t {
    ZERO_THROW(InvalidArgument, what, ": expected a size such as 24GiB, 12G, 500MiB or a byte count, got \"", text,
               "\"");
  };
  std::size_t pos = 0;
  double value = 0;
  try {
    value = std::stod(text, &pos);
  } catch (const std::exception&) {
    return fail();
  }
  std::string unit = text.substr(pos);
  unit.erase(0, unit.find_first_not_of(' '));
  for (char& ch : unit) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  double scale = 0;
  if (unit.empty() || unit == "B") scale = 1;
  else if (unit == "K" || unit == "KIB" || unit == "KB") scale = 1024.0;
  else if (unit == "M" || unit == "MIB" || unit == "MB") scale = 1024.0 * 1024;
  else if (unit == "G" || unit == "GIB" || unit == "GB") scale = 1024.0 * 1024 * 1024;
  else if (unit == "T" || unit == "TIB" || unit == "TB") scale = 1024.0 * 1024 * 1024 * 1024;
  if (scale == 0 || !std::isfinite(value) || value < 0 || value * scale > 1.8e19) return fail();
  return static_cast<std::size_t>(value * scale);
}

std::string format_bytes(std::size_t bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 4) {
    value /= 1024.0;
    ++unit;
  }
  char text[32];
  std::snprintf(text, sizeof text, unit == 0 ? "%.0f %s" : "%.2f %s", value, units[unit]);
  return text;
}

std::string format_memory(const MemoryByCategory& m) {
  std::ostringstream out;
  out << "params " << format_bytes(m.params) << ", grads " << format_bytes(m.grads) << ", master "
      << format_bytes(m.master) << ", optimizer " << format_bytes(m.optimizer_state) << ", ema " << format_bytes(m.ema) << ", buffers "
      << format_bytes(m.buffers) << ", total " << format_bytes(m.total());
  return out.str();
}

}  // namespace zero
