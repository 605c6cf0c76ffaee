// Flat-buffer layout and shard math: pure functions, no allocation of data.
//
// Parameters are packed, in the order given, into buckets. A bucket is the
// unit of every collective: its gradients are reduce-scattered together, its
// parameters all-gathered together (under stage 3 a bucket is a "unit", e.g.
// one UNet block, gathered before its forward). Each bucket is padded so that
// its length is a multiple of world_size * alignment; rank r owns the r-th of
// world_size equal slices of every bucket. A rank's shard is the concatenation
// of its slices, bucket after bucket, so shard buffers are contiguous.
//
// Sizes never have to divide: padding is added, never refused, and a bucket
// may be all padding for some ranks (a tiny bucket at a large world size).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "zero/core/error.hpp"

namespace zero {

/// [offset, offset + size) in elements.
struct ShardRange {
  std::size_t offset = 0;
  std::size_t size = 0;
  std::size_t end() const { return offset + size; }
  friend bool operator==(const ShardRange&, const ShardRange&) = default;
};

/// Rounds value up to a multiple of multiple (multiple > 0); throws on overflow.
inline std::size_t round_up(std::size_t value, std::size_t multiple) {
  ZERO_CHECK(multiple > 0, "round_up: multiple must be positive");
  const std::size_t remainder = value % multiple;
  if (remainder == 0) return value;
  ZERO_CHECK(value <= std::numeric_limits<std::size_t>::max() - (multiple - remainder),
             "round_up: ", value, " rounded to a multiple of ", multiple, " overflows");
  return value + (multiple - remainder);
}

/// The slice of a padded length that rank owns when padded_length is divided
/// into world_size equal parts. padded_length must be a multiple of world_size.
inline ShardRange even_shard(std::size_t padded_length, int world_size, int rank) {
  ZERO_CHECK(world_size >= 1, "world_size must be >= 1, got ", world_size);
  ZERO_CHECK(rank >= 0 && rank < world_size, "rank ", rank, " outside [0, ", world_size, ")");
  ZERO_CHECK(padded_length % static_cast<std::size_t>(world_size) == 0, "length ", padded_length,
             " is not a multiple of world_size ", world_size, " (pad it first)");
  const std::size_t part = padded_length / static_cast<std::size_t>(world_size);
  return {part * static_cast<std::size_t>(rank), part};
}

/// The part of [0, valid_length) that a shard covers: the shard's elements past
/// valid_length are padding.
inline ShardRange clip_to(ShardRange shard, std::size_t valid_length) {
  if (shard.offset >= valid_length) return {valid_length, 0};
  return {shard.offset, std::min(shard.size, valid_length - shard.offset)};
}

/// One named parameter tensor, by element count (shape kept for the user).
struct ParamSpec {
  std::string name;
  std::size_t numel = 0;
  std::vector<std::int64_t> shape;  // optional; product must equal numel when given
  /// The parameter group (EngineOptions::param_groups) whose optimizer
  /// hyperparameters update it; 0 with no groups.
  int group = 0;
  /// Frozen: never trained. The engine keeps its model-dtype values only (no
  /// gradient, master, optimizer state or EMA) in a layout of its own.
  bool frozen = false;
};

struct LayoutOptions {
  int world_size = 1;
  /// Every parameter starts at a multiple of this many elements, and every
  /// rank's slice of a bucket is a multiple of it (vector loads on the GPU,
  /// cache lines on the CPU). Must be >= 1.
  std::size_t alignment = 64;
  /// Target bucket size in elements when parameters are grouped automatically.
  /// A parameter larger than this gets a bucket of its own.
  std::size_t bucket_elements = std::size_t{1} << 22;
  void validate() const;
};

/// Where one parameter lives in the flat buffer.
struct ParamSlot {
  std::size_t bucket = 0;
  std::size_t offset = 0;  // in the full flat buffer
  std::size_t numel = 0;
};

/// One bucket: [offset, offset + padded) of the full buffer, of which
/// [offset, offset + used) holds parameters (with alignment gaps).
struct Bucket {
  std::size_t offset = 0;          // in the full flat buffer
  std::size_t used = 0;            // up to the end of its last parameter
  std::size_t padded = 0;          // multiple of world_size * alignment
  std::size_t shard_size = 0;      // padded / world_size: every rank's slice
  std::size_t shard_offset = 0;    // this bucket's slice in a rank's contiguous shard
  std::size_t first_param = 0;
  std::size_t param_count = 0;
};

/// The complete placement of a model's parameters for one world size.
class FlatLayout {
 public:
  /// Groups consecutive parameters into buckets of about bucket_elements.
  static FlatLayout build(const std::vector<ParamSpec>& params, const LayoutOptions& options);
  /// One bucket per group, as given (stage-3 units). Empty groups are errors
  /// unless allowed; an empty group's bucket is all padding (one aligned
  /// slice per rank), used where a unit has no parameter of one kind (a unit
  /// all frozen has an empty trainable bucket).
  static FlatLayout build_grouped(const std::vector<std::vector<ParamSpec>>& groups,
                                  const LayoutOptions& options, bool allow_empty_groups = false);
  /// How build() packs consecutive parameters: the number in each bucket.
  static std::vector<std::size_t> bucket_sizes(const std::vector<ParamSpec>& params, const LayoutOptions& options);

  int world_size() const { return world_size_; }
  std::size_t alignment() const { return alignment_; }
  /// Length of the full flat buffer (all buckets, padded).
  std::size_t padded_numel() const { return padded_numel_; }
  /// Number of real parameter elements (no padding).
  std::size_t param_numel() const { return param_numel_; }
  /// Length of every rank's contiguous shard: padded_numel() / world_size().
  std::size_t shard_numel() const { return padded_numel_ / static_cast<std::size_t>(world_size_); }

  const std::vector<Bucket>& buckets() const { return buckets_; }
  const std::vector<ParamSlot>& slots() const { return slots_; }
  const std::vector<ParamSpec>& params() const { return params_; }

  /// Rank's slice of bucket b in full-buffer coordinates.
  ShardRange bucket_slice(std::size_t bucket, int rank) const;
  /// How many elements of rank's slice of bucket b are real parameters (not padding).
  std::size_t valid_in_slice(std::size_t bucket, int rank) const;

 private:
  static FlatLayout assemble(std::vector<ParamSpec> params, std::vector<std::size_t> group_sizes,
                             const LayoutOptions& options);

  int world_size_ = 1;
  std::size_t alignment_ = 1;
  std::size_t padded_numel_ = 0;
  std::size_t param_numel_ = 0;
  std::vector<ParamSpec> params_;
  std::vector<ParamSlot> slots_;
  std::vector<Bucket> buckets_;
};

/// Visits where elements [first, first + count) of parameter `param` lie in
/// the ranks' shards, as contiguous runs in element order:
/// visit(owner_rank, index_in_owner_shard, element_of_param, run_length).
/// The one mapping from parameter elements to owners, used to reshard a
/// checkpoint and to consolidate one.
template <typename Visit>
void for_each_shard_run(const FlatLayout& layout, std::size_t param, std::size_t first, std::size_t count,
                        Visit&& visit) {
  ZERO_CHECK(param < layout.slots().size(), "parameter ", param, " of ", layout.slots().size());
  const ParamSlot& slot = layout.slots()[param];
  ZERO_CHECK(first <= slot.numel && count <= slot.numel - first, "elements [", first, ", ", first + count,
             ") of parameter ", param, " with ", slot.numel);
  const Bucket& bucket = layout.buckets()[slot.bucket];
  for (std::size_t e = first, end = first + count; e < end;) {
    const std::size_t in_bucket = slot.offset + e - bucket.offset;
    const std::size_t owner = in_bucket / bucket.shard_size, within = in_bucket % bucket.shard_size;
    const std::size_t run = std::min(end - e, bucket.shard_size - within);
    visit(static_cast<int>(owner), bucket.shard_offset + within, e, run);
    e += run;
  }
}

// ---------------------------------------------------------------------------

inline void LayoutOptions::validate() const {
  ZERO_CHECK(world_size >= 1, "LayoutOptions.world_size must be >= 1, got ", world_size);
  ZERO_CHECK(alignment >= 1, "LayoutOptions.alignment must be >= 1 element, got ", alignment);
  ZERO_CHECK(bucket_elements >= 1, "LayoutOptions.bucket_elements must be >= 1, got ",
             bucket_elements);
}

inline FlatLayout FlatLayout::build(const std::vector<ParamSpec>& params,
                                    const LayoutOptions& options) {
  return assemble(params, bucket_sizes(params, options), options);
}

inline std::vector<std::size_t> FlatLayout::bucket_sizes(const std::vector<ParamSpec>& params,
                                                         const LayoutOptions& options) {
  options.validate();
  std::vector<std::size_t> group_sizes;
  std::size_t in_group = 0, group_elements = 0;
  for (const ParamSpec& p : params) {
    const std::size_t aligned = round_up(p.numel, options.alignment);
    if (in_group > 0 && group_elements + aligned > options.bucket_elements) {
      group_sizes.push_back(in_group);
      in_group = 0;
      group_elements = 0;
    }
    ++in_group;
    group_elements += aligned;
  }
  if (in_group > 0) group_sizes.push_back(in_group);
  return group_sizes;
}

inline FlatLayout FlatLayout::build_grouped(const std::vector<std::vector<ParamSpec>>& groups,
                                            const LayoutOptions& options, bool allow_empty_groups) {
  options.validate();
  std::vector<ParamSpec> params;
  std::vector<std::size_t> group_sizes;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    ZERO_CHECK(allow_empty_groups || !groups[g].empty(), "parameter group ", g, " is empty");
    params.insert(params.end(), groups[g].begin(), groups[g].end());
    group_sizes.push_back(groups[g].size());
  }
  return assemble(std::move(params), std::move(group_sizes), options);
}

inline FlatLayout FlatLayout::assemble(std::vector<ParamSpec> params,
                                       std::vector<std::size_t> group_sizes,
                                       const LayoutOptions& options) {
  FlatLayout layout;
  layout.world_size_ = options.world_size;
  layout.alignment_ = options.alignment;
  const std::size_t world = static_cast<std::size_t>(options.world_size);
  for (const ParamSpec& p : params) {
    if (!p.shape.empty()) {
      std::size_t product = 1;
      for (std::int64_t d : p.shape) {
        ZERO_CHECK(d >= 0, "parameter '", p.name, "': negative dimension ", d);
        product *= static_cast<std::size_t>(d);
      }
      ZERO_CHECK(product == p.numel, "parameter '", p.name, "': shape has ", product,
                 " elements but numel is ", p.numel);
    }
  }
  std::size_t offset = 0, shard_offset = 0, first = 0;
  layout.slots_.resize(params.size());
  for (std::size_t g = 0; g < group_sizes.size(); ++g) {
    Bucket bucket;
    bucket.offset = offset;
    bucket.first_param = first;
    bucket.param_count = group_sizes[g];
    std::size_t cursor = 0;
    for (std::size_t i = first; i < first + group_sizes[g]; ++i) {
      cursor = round_up(cursor, options.alignment);
      layout.slots_[i] = {g, offset + cursor, params[i].numel};
      cursor += params[i].numel;
      layout.param_numel_ += params[i].numel;
    }
    bucket.used = cursor;
    // At least one aligned element per rank so that every bucket takes part in
    // every collective with a non-empty slice (keeps schedules uniform).
    bucket.padded = round_up(std::max<std::size_t>(cursor, 1), world * options.alignment);
    bucket.shard_size = bucket.padded / world;
    bucket.shard_offset = shard_offset;
    offset += bucket.padded;
    shard_offset += bucket.shard_size;
    first += group_sizes[g];
    layout.buckets_.push_back(bucket);
  }
  layout.padded_numel_ = offset;
  layout.params_ = std::move(params);
  return layout;
}

inline ShardRange FlatLayout::bucket_slice(std::size_t bucket, int rank) const {
  ZERO_CHECK(bucket < buckets_.size(), "bucket ", bucket, " of ", buckets_.size());
  const Bucket& b = buckets_[bucket];
  ShardRange slice = even_shard(b.padded, world_size_, rank);
  slice.offset += b.offset;
  return slice;
}

inline std::size_t FlatLayout::valid_in_slice(std::size_t bucket, int rank) const {
  const Bucket& b = buckets_.at(bucket);
  const ShardRange local = even_shard(b.padded, world_size_, rank);
  return clip_to(local, b.used).size;
}

}  // namespace zero
