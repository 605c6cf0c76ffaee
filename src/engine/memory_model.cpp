#include "zero/engine/memory_model.hpp"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <string>
#include <sstream>

namespace zero {

MemoryByCategory model_state_bytes(const ModelStateConfig& c) {
  ZERO_CHECK(c.world_size >= 1, "world_size must be >= 1, got ", c.world_size);
  ZERO_CHECK(c.stage >= 0 && c.stage <= 3, "stage must be 0, 1, 2 or 3, got ", c.stage);
  ZERO_CHECK(c.numel % static_cast<std::size_t>(c.world_size) == 0, "numel ", c.numel,
             " is not a multiple of world_size ", c.world_size, " (pass the padded length)");
  const std::size_t full = c.numel;
  const std::size_t shard = c.numel / static_cast<std::size_t>(c.world_size);
  const std::size_t p = size_of(c.param_dtype), g = size_of(c.grad_dtype);
  const bool multi = c.accumulation_steps > 1;
  MemoryByCategory m;
  m.params = (c.stage == 3 ? shard : full) * p;
  // Where reduced gradients live: stages 0-1 reduce in place into the full
  // buffer unless several micro-steps are each reduced (then a sharded
  // accumulator holds the running sum); stages 2-3 always keep the sharded
  // accumulator. Where backward writes: a full buffer at stages 0-1 and when
  // accumulating locally to the boundary over several micro-steps at 2-3;
  // otherwise transient bucket buffers (counted as buffers).
  const bool full_grads = c.stage <= 1 || (c.accumulation == GradAccumulation::reduce_at_boundary && multi);
  const bool shard_accumulator =
      c.stage >= 2 || (c.accumulation == GradAccumulation::reduce_each_micro_step && multi);
  m.grads = (full_grads ? full * g : 0) + (shard_accumulator ? shard * g : 0);
  const std::size_t optimizer_elements = c.stage == 0 ? full : shard;
  m.master = c.param_dtype == DType::fp32 ? 0 : optimizer_elements * 4;
  m.optimizer_state = static_cast<std::size_t>(c.optimizer.state_slots()) * optimizer_elements * 4;
  m.ema = c.ema ? optimizer_elements * 4 : 0;
  if (c.offload_optimizer) {
    ZERO_CHECK(c.stage >= 1, "offload_optimizer needs stage 1, 2 or 3 (stage 0 keeps a full optimizer on every rank)");
    m.master = m.optimizer_state = m.ema = 0;
    if (c.accumulation_steps == 1 && shard_accumulator) m.grads -= shard * g;  // streamed to the host
  }
  if (c.offload_params) {
    ZERO_CHECK(c.stage == 3 && c.offload_optimizer,
               "offload_params needs stage 3 with offload_optimizer (stage ", c.stage,
               c.offload_optimizer ? "" : ", optimizer not offloaded", ")");
    m.params = 0;
  }
  return m;
}

MemoryByCategory host_model_state_bytes(const ModelStateConfig& c) {
  MemoryByCategory h;
  if (!c.offload_optimizer) return h;
  (void)model_state_bytes(c);  // the same argument checks
  const std::size_t shard = c.numel / static_cast<std::size_t>(c.world_size);
  h.master = shard * 4;
  h.optimizer_state = static_cast<std::size_t>(c.optimizer.state_slots()) * shard * 4;
  h.ema = c.ema ? shard * 4 : 0;
  h.params = c.offload_params ? shard * size_of(c.param_dtype) : 0;
  h.buffers = shard * (size_of(c.grad_dtype) + (c.offload_params ? 0 : size_of(c.param_dtype)));
  if (c.offload_delayed_update) {
    ZERO_CHECK(!c.offload_params && c.accumulation_steps == 1,
               "offload_delayed_update needs offload_optimizer with one micro-step per step and no offload_params");
    h.buffers *= 2;  // the update reads and writes one pair while backward streams into the other
  }
  return h;
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
