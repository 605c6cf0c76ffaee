// Stage 3's unit gathers and the unit schedule: gather, prefetch (how many
// units ahead: buckets.prefetch_units), release, and dropping prefetches the
// state has outlived. Split from engine.cpp by concern.
#include <utility>
#include <vector>

#include "engine_impl.hpp"
#include "zero/engine/engine.hpp"

namespace zero {

void Engine::Impl::drop_unused_prefetches() {
  // A unit prefetched but not gathered (the prefetch for a backward that
  // did not need the unit) holds the parameters of now: served after the
  // state changes (an update, set_param, a load) it would be stale.
  for (std::size_t u = 0; u < unit_buffer.size(); ++u) {
    const bool held = unit_buffer[u] || (has_frozen() && frozen_unit_buffer[u]);
    if (!held || unit_refs[u] > 0) continue;
    for (WorkPtr* work : {&unit_work[u], has_frozen() ? &frozen_unit_work[u] : nullptr}) {
      if (!work || !*work) continue;
      wait_for_collective(**work);  // its error, if any, surfaces here
      work->reset();
    }
    backend.release_event(std::exchange(unit_ready[u], nullptr));
    // Only the comm stream (the gather) wrote them.
    if (unit_buffer[u]) pool.give_back(kParams, unit_buffer[u], layout.buckets()[u].padded * p_size, backend.comm_stream());
    unit_buffer[u] = nullptr;
    if (has_frozen() && frozen_unit_buffer[u]) {
      pool.give_back(kParams, frozen_unit_buffer[u], frozen_layout.buckets()[u].padded * p_size, backend.comm_stream());
      frozen_unit_buffer[u] = nullptr;
    }
  }
}

void Engine::prefetch_unit(std::size_t unit) {
  ZERO_CHECK(unit < unit_count(), "prefetch_unit: unit ", unit, " of ", unit_count());
  Impl& m = *impl_;
  if (!m.plan.gathers_units || m.plan.units_in_place || m.unit_buffer[unit]) return;
  const Bucket& bucket = layout_.buckets()[unit];
  m.unit_buffer[unit] = m.pool.acquire(kParams, bucket.padded * m.p_size, m.backend.comm_stream());
  // The shard may have just been written by the optimizer on the compute stream.
  m.order_after(m.backend.comm_stream(), m.backend.compute_stream());
  m.unit_work[unit] = m.gather_bucket(unit, m.unit_buffer[unit], m.pdt, m.param_shard + bucket.shard_offset * m.p_size,
                                      m.plan.params_on_host);
  // The unit's frozen parameters, where it has any (they are never written:
  // no ordering after the optimizer needed).
  if (m.has_frozen() && frozen_layout_.buckets()[unit].param_count > 0) {
    const Bucket& frozen = frozen_layout_.buckets()[unit];
    m.frozen_unit_buffer[unit] = m.pool.acquire(kParams, frozen.padded * m.p_size, m.backend.comm_stream());
    m.frozen_unit_work[unit] =
        m.gather_bucket_of(frozen_layout_, unit, m.frozen_unit_buffer[unit], m.pdt,
                           m.frozen_shard + frozen.shard_offset * m.p_size, m.plan.params_on_host);
  }
  m.unit_ready[unit] = m.backend.record_event(m.backend.comm_stream());
}

void Engine::gather_unit(std::size_t unit) {
  ZERO_CHECK(unit < unit_count(), "gather_unit: unit ", unit, " of ", unit_count());
  Impl& m = *impl_;
  if (!m.plan.gathers_units) {
    m.finish_param_gather(unit);
    return;
  }
  prefetch_unit(unit);
  bool issued = false;
  for (WorkPtr* work : {&m.unit_work[unit], m.has_frozen() ? &m.frozen_unit_work[unit] : nullptr}) {
    if (!work || !*work) continue;
    m.check_gather_later(std::move(*work));
    issued = true;
  }
  if (issued) {
    // An event recorded before a capture began cannot be waited on inside
    // it: there the compute stream waits on the comm stream's tail.
    if (m.capturing) m.order_after(m.backend.compute_stream(), m.backend.comm_stream());
    else m.backend.stream_wait(m.backend.compute_stream(), m.unit_ready[unit]);
  }
  m.backend.release_event(std::exchange(m.unit_ready[unit], nullptr));
  ++m.unit_refs[unit];
}

void Engine::release_unit(std::size_t unit) {
  ZERO_CHECK(unit < unit_count(), "release_unit: unit ", unit, " of ", unit_count());
  Impl& m = *impl_;
  if (!m.plan.gathers_units) return;
  ZERO_CHECK(m.unit_refs[unit] > 0, "release_unit: unit ", unit, " is not gathered");
  if (--m.unit_refs[unit] > 0 || m.plan.units_in_place) return;
  m.pool.give_back(kParams, m.unit_buffer[unit], layout_.buckets()[unit].padded * m.p_size, m.backend.compute_stream());
  m.unit_buffer[unit] = nullptr;
  if (m.has_frozen() && m.frozen_unit_buffer[unit]) {
    m.pool.give_back(kParams, m.frozen_unit_buffer[unit], frozen_layout_.buckets()[unit].padded * m.p_size,
                     m.backend.compute_stream());
    m.frozen_unit_buffer[unit] = nullptr;
  }
}

bool Engine::unit_gathered(std::size_t unit) const {
  return !impl_->plan.gathers_units || impl_->unit_refs.at(unit) > 0;
}

std::size_t Engine::units_on_device() const {
  std::size_t n = 0;
  for (std::size_t u = 0; u < impl_->unit_buffer.size(); ++u)
    n += impl_->unit_buffer[u] || (impl_->has_frozen() && impl_->frozen_unit_buffer[u]);
  return n;
}

// ---------------------------------------------------------------- unit schedule

std::vector<std::size_t> Engine::units_to_prefetch(std::size_t unit, Pass pass) const {
  std::vector<std::size_t> units;
  if (!impl_->plan.gathers_units) return units;
  const auto depth = static_cast<std::size_t>(options_.buckets.prefetch_units);
  for (std::size_t k = 1; k <= depth; ++k) {
    if (pass == Pass::forward) {
      if (unit + k >= unit_count()) break;
      units.push_back(unit + k);
    } else {
      if (k > unit) break;  // backward runs the units in reverse
      units.push_back(unit - k);
    }
  }
  return units;
}

void Engine::enter_unit(std::size_t unit, Pass pass) {
  gather_unit(unit);
  for (std::size_t next : units_to_prefetch(unit, pass)) prefetch_unit(next);
}

}  // namespace zero
