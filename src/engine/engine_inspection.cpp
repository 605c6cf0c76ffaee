// Engine inspection: the weights, optimizer state and frozen parameters
// gathered to the host (collective), bucket by bucket through one
// bucket-sized device buffer, and visit_params for exports.
#include <algorithm>
#include <functional>

#include "engine_impl.hpp"

namespace zero {

namespace {
std::vector<std::vector<float>> split_params(const FlatLayout& layout, const std::vector<float>& full) {
  std::vector<std::vector<float>> out(layout.params().size());
  for (std::size_t p = 0; p < out.size(); ++p) {
    const ParamSlot& slot = layout.slots()[p];
    out[p].assign(full.begin() + static_cast<std::ptrdiff_t>(slot.offset),
                  full.begin() + static_cast<std::ptrdiff_t>(slot.offset + slot.numel));
  }
  return out;
}
}  // namespace

std::vector<std::vector<float>> Engine::gather_master_params() {
  Impl& m = *impl_;
  return in_engine_order(gather_fp32_slices([&m](std::size_t b) -> const float* { return m.master_slice(b); }));
}

std::vector<std::vector<float>> Engine::gather_ema_params() {
  Impl& m = *impl_;
  ZERO_CHECK(m.ema != nullptr, "gather_ema_params: EMA is off (EngineOptions.ema_decay is 0)");
  if (!m.ema_initialized) return gather_master_params();  // no step yet: the average is the weights
  return in_engine_order(
      gather_fp32_slices([&m](std::size_t b) -> const float* { return m.optimizer_slice(m.ema, b); }));
}

void Engine::visit_params(Weights which, const ParamVisitor& visit) {
  Impl& m = *impl_;
  ZERO_CHECK(which == Weights::master || m.ema != nullptr, "visit_params: EMA is off (EngineOptions.ema_decay is 0)");
  m.settle_for_reading();
  Backend& be = m.backend;
  be.synchronize(be.compute_stream());
  // Engine index of each parameter of either layout.
  std::vector<std::size_t> trained_param(layout_.params().size()), frozen_param(frozen_layout_.params().size());
  for (std::size_t p = 0; p < params_.size(); ++p)
    (params_[p].frozen ? frozen_param : trained_param)[index_in_layout_[p]] = p;
  // Before the first step the average is the weights (gather_ema_params).
  const bool ema = which == Weights::ema && m.ema_initialized;
  // Each bucket of `layout` into one bucket-sized buffer (or read in place
  // from `full`), then its parameters handed out.
  auto visit_layout = [&](const FlatLayout& layout, const std::vector<std::size_t>& engine_param, DType dtype,
                          const std::byte* full, const std::function<WorkPtr(std::size_t, void*)>& gather) {
    const std::size_t element = size_of(dtype);
    std::size_t largest = 0;
    for (const Bucket& bucket : layout.buckets()) largest = std::max(largest, bucket.padded * element);
    std::byte* buffer = full != nullptr || largest == 0 ? nullptr : static_cast<std::byte*>(be.allocate(largest));
    try {
      for (std::size_t b = 0; b < layout.buckets().size(); ++b) {
        const Bucket& bucket = layout.buckets()[b];
        const std::byte* values = full != nullptr ? full + bucket.offset * element : buffer;
        if (full == nullptr) {
          gather(b, buffer)->wait();
          be.synchronize(be.comm_stream());
        }
        for (std::size_t t = bucket.first_param; t < bucket.first_param + bucket.param_count; ++t) {
          const ParamSlot& slot = layout.slots()[t];
          visit(engine_param[t], values + (slot.offset - bucket.offset) * element, dtype, slot.numel);
        }
      }
    } catch (...) {
      if (buffer) be.deallocate(buffer, largest);
      throw;
    }
    if (buffer) be.deallocate(buffer, largest);
  };
  visit_layout(layout_, trained_param, DType::fp32, nullptr, [&](std::size_t b, void* buffer) {
    const float* own = ema ? m.optimizer_slice(m.ema, b) : m.master_slice(b);
    return m.gather_bucket(b, buffer, DType::fp32, own, m.state_on_host(own));
  });
  visit_layout(frozen_layout_, frozen_param, m.pdt, m.frozen_full, [&](std::size_t b, void* buffer) {
    const std::byte* own = m.frozen_shard + frozen_layout_.buckets()[b].shard_offset * m.p_size;
    return m.gather_bucket_of(frozen_layout_, b, buffer, m.pdt, own, m.plan.params_on_host);
  });
}

std::vector<std::vector<float>> Engine::gather_optimizer_state(int slot) {
  Impl& m = *impl_;
  std::byte* base = slot == 0 ? m.state0 : slot == 1 ? m.state1 : nullptr;
  ZERO_CHECK(base != nullptr, "gather_optimizer_state: the optimizer has no state tensor ", slot);
  std::vector<std::vector<float>> trainable =
      gather_slices([&m, base](std::size_t b) -> const void* { return m.state_slice(base, b); }, m.sdt);
  std::vector<std::vector<float>> out(params_.size());
  for (std::size_t p = 0; p < params_.size(); ++p)
    if (!params_[p].frozen) out[p] = std::move(trainable[index_in_layout_[p]]);
  return out;
}

std::vector<std::vector<float>> Engine::in_engine_order(std::vector<std::vector<float>> trainable) {
  if (frozen_layout_.buckets().empty()) return trainable;  // the layout's order is the engine's
  std::vector<std::vector<float>> frozen = gather_frozen_params();
  std::vector<std::vector<float>> out(params_.size());
  for (std::size_t p = 0; p < params_.size(); ++p)
    out[p] = std::move(params_[p].frozen ? frozen[index_in_layout_[p]] : trainable[index_in_layout_[p]]);
  return out;
}

std::vector<std::vector<float>> Engine::gather_fp32_slices(const std::function<const float*(std::size_t)>& slice) {
  return gather_slices([&slice](std::size_t b) -> const void* { return slice(b); }, DType::fp32);
}

std::vector<std::vector<float>> Engine::gather_slices(const std::function<const void*(std::size_t)>& slice,
                                                      DType dtype) {
  Impl& m = *impl_;
  m.settle_for_reading();
  Backend& be = m.backend;
  const std::vector<Bucket>& buckets = layout_.buckets();
  std::vector<float> host(layout_.padded_numel());
  std::size_t largest = 0;
  for (const Bucket& bucket : buckets) largest = std::max(largest, bucket.padded);
  if (largest == 0) return split_params(layout_, host);
  be.synchronize(be.compute_stream());
  // One bucket at a time through one bucket-sized device buffer: exports and
  // validation images read the weights mid-run, beside the training state,
  // and must not need a full fp32 copy of the model on the device.
  // (bf16 optimizer state: gathered as bf16, widened on the host.)
  const std::size_t size = size_of(dtype);
  void* gathered = be.allocate(largest * size);
  std::vector<std::byte> narrow(dtype == DType::fp32 ? 0 : largest * size);
  try {
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      const void* own = slice(b);
      m.gather_bucket(b, gathered, dtype, own, m.state_on_host(own))->wait();
      be.synchronize(be.comm_stream());
      if (dtype == DType::fp32) {
        be.copy_to_host(host.data() + buckets[b].offset, gathered, buckets[b].padded * 4);
      } else {
        be.copy_to_host(narrow.data(), gathered, buckets[b].padded * size);
        cpu_convert(narrow.data(), dtype, host.data() + buckets[b].offset, DType::fp32, buckets[b].padded);
      }
    }
  } catch (...) {
    be.deallocate(gathered, largest * size);
    throw;
  }
  be.deallocate(gathered, largest * size);
  return split_params(layout_, host);
}

namespace {
// Model-dtype values of every parameter of `layout` widened to float, from a
// full buffer (stages 0-2) or gathered from the shards (collective).
std::vector<std::vector<float>> gather_model_values(Engine::Impl& m, const FlatLayout& layout, const std::byte* full_buffer,
                                                    const std::byte* shard) {
  Backend& be = m.backend;
  const std::size_t full = layout.padded_numel();
  std::vector<std::byte> raw(full * m.p_size);
  be.synchronize(be.compute_stream());
  if (full_buffer) {
    be.copy_to_host(raw.data(), full_buffer, raw.size());
  } else {
    // Bucket by bucket, as gather_fp32_slices does (no full copy on the device).
    std::size_t largest = 0;
    for (const Bucket& bucket : layout.buckets()) largest = std::max(largest, bucket.padded * m.p_size);
    std::byte* gathered = largest == 0 ? nullptr : static_cast<std::byte*>(be.allocate(largest));
    try {
      for (std::size_t b = 0; b < layout.buckets().size(); ++b) {
        const Bucket& bucket = layout.buckets()[b];
        m.gather_bucket_of(layout, b, gathered, m.pdt, shard + bucket.shard_offset * m.p_size, m.plan.params_on_host)
            ->wait();
        be.synchronize(be.comm_stream());
        be.copy_to_host(raw.data() + bucket.offset * m.p_size, gathered, bucket.padded * m.p_size);
      }
    } catch (...) {
      if (gathered) be.deallocate(gathered, largest);
      throw;
    }
    if (gathered) be.deallocate(gathered, largest);
  }
  std::vector<float> host(full);
  for (std::size_t i = 0; i < full; ++i) host[i] = load_as_float(raw.data(), i, m.pdt);
  return split_params(layout, host);
}
}  // namespace

std::vector<std::vector<float>> Engine::gather_model_params() {
  Impl& m = *impl_;
  m.settle();
  return in_engine_order(gather_model_values(m, layout_, m.params_full, m.param_shard));
}

std::vector<std::vector<float>> Engine::gather_frozen_params() {
  Impl& m = *impl_;
  m.settle_for_reading();  // frozen values never change: nothing to send up first
  return gather_model_values(m, frozen_layout_, m.frozen_full, m.frozen_shard);
}

}  // namespace zero
