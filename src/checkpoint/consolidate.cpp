// The engine-aware half of checkpoint folders: what a manifest records of an
// engine, the consistency of a folder's rank files, and consolidation of the
// shards into one file of full tensors.
#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <system_error>
#include <vector>

#include "zero/engine/engine.hpp"
#include "zero/engine/engine_state.hpp"
#include "zero/checkpoint/checkpoint.hpp"

namespace zero::io {
namespace fs = std::filesystem;

void describe_engine(const Engine& engine, CheckpointManifest& m) {
  const EngineOptions& o = engine.options();
  m.stage = o.stage;
  m.param_dtype = std::string(name_of(o.param_dtype));
  m.optimizer = {.name = std::string(name_of(o.optimizer.kind)),
                 .lr = engine.lr(),
                 .beta1 = o.optimizer.beta1,
                 .beta2 = o.optimizer.beta2,
                 .eps = o.optimizer.eps,
                 .weight_decay = o.optimizer.weight_decay,
                 .momentum = o.optimizer.momentum,
                 .dampening = o.optimizer.dampening,
                 .nesterov = o.optimizer.nesterov,
                 .state_slots = o.optimizer.state_slots()};
  m.loss_scale = engine.loss_scale();
  const FlatLayout& l = engine.layout();
  m.layout = {.param_count = l.params().size(),
              .param_numel = l.param_numel(),
              .padded_numel = l.padded_numel(),
              .alignment = l.alignment(),
              .bucket_count = l.buckets().size()};
}

namespace {

struct OpenShards {
  std::vector<SafeTensorsFile> files;
  std::vector<SavedShard> saved;
};

// Opens every rank file and checks that they belong together and to the manifest.
OpenShards open_shards(const fs::path& folder, const CheckpointManifest& manifest) {
  OpenShards out;
  for (std::size_t r = 0; r < manifest.files.size(); ++r) {
    const fs::path path = folder / manifest.files[r].file;
    out.files.push_back(SafeTensorsFile::open(path));
    out.saved.push_back(read_saved_shard(out.files.back()));
    const SavedShard& s = out.saved.back();
    const SavedShard& first = out.saved.front();
    if (s.rank != static_cast<int>(r))
      ZERO_THROW(IoError, "checkpoint shard '", path.string(), "' says it is rank ", s.rank, ", expected ", r,
                 " (files out of rank order or swapped)");
    if (s.world_size != manifest.world_size)
      ZERO_THROW(IoError, "checkpoint shard '", path.string(), "' was written by ", s.world_size,
                 " ranks, the manifest says ", manifest.world_size);
    if (r > 0 && (s.layout_text != first.layout_text || s.step != first.step || s.stage != first.stage ||
                  s.optimizer != first.optimizer || s.state_slots != first.state_slots))
      ZERO_THROW(IoError, "checkpoint shard '", path.string(), "' does not belong with '",
                 out.files.front().path().string(), "' (another layout, step, stage or optimizer)");
    // Every version: the step decides where a resumed run continues, and a
    // manifest edited by hand (or copied from another save) must not move it.
    // The manifest counts skipped steps too (the trainer's step number).
    const bool step_fits = s.skipped_steps <= std::numeric_limits<std::int64_t>::max() - s.step;
    if (!step_fits || s.step + s.skipped_steps != manifest.step)
      ZERO_THROW(IoError, "checkpoint shard '", path.string(), "' holds step ",
                 step_fits ? std::to_string(s.step + s.skipped_steps) : std::string("(out of range)"), " (",
                 s.step, " applied, ", s.skipped_steps, " skipped), the manifest '",
                 (folder / kManifestName).string(), "' says step ", manifest.step);
    if (manifest.version >= 2) {
      if (s.layout.params().size() != manifest.layout.param_count ||
          s.layout.padded_numel() != manifest.layout.padded_numel)
        ZERO_THROW(IoError, "checkpoint shard '", path.string(), "' has ", s.layout.params().size(),
                   " parameters in ", s.layout.padded_numel(), " padded elements, the manifest says ",
                   manifest.layout.param_count, " in ", manifest.layout.padded_numel);
    }
    // The state tensors: F32, one shard long; master always, the optimizer's slots as recorded.
    const std::uint64_t shard = s.layout.shard_numel();
    for (const char* name : {"master", "state0", "state1", "ema"}) {
      const TensorInfo* info = out.files.back().find(name);
      const bool required = std::strcmp(name, "master") == 0 || (std::strcmp(name, "state0") == 0 && s.state_slots >= 1) ||
                            (std::strcmp(name, "state1") == 0 && s.state_slots >= 2);
      if (!info) {
        if (required) ZERO_THROW(IoError, "checkpoint shard '", path.string(), "': tensor '", name, "' is missing");
        continue;
      }
      if (info->dtype != TensorDType::F32 || info->shape != std::vector<std::int64_t>{static_cast<std::int64_t>(shard)})
        ZERO_THROW(IoError, "checkpoint shard '", path.string(), "': tensor '", name, "' should be F32 [", shard,
                   "]");
    }
    // Frozen parameters: their values once, in a layout of their own.
    if (!s.frozen_layout.buckets().empty()) {
      const TensorInfo* info = out.files.back().find("frozen");
      const std::int64_t frozen_shard = static_cast<std::int64_t>(s.frozen_layout.shard_numel());
      if (!info || info->dtype != TensorDType::F32 || info->shape != std::vector<std::int64_t>{frozen_shard})
        ZERO_THROW(IoError, "checkpoint shard '", path.string(), "': tensor 'frozen' should be F32 [", frozen_shard,
                   "] (the shard records frozen parameters)", info ? "" : " but is missing");
    }
    if ((out.files.back().find("ema") != nullptr) != (out.files.front().find("ema") != nullptr))
      ZERO_THROW(IoError, "checkpoint shard '", path.string(), "': holds an 'ema' tensor where rank 0's does not, or "
                 "the other way round");
  }
  return out;
}

// fp32 -> bf16, round to nearest even; NaN stays NaN (quiet).
std::uint16_t to_bf16(float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, 4);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<std::uint16_t>(bits >> 16);
}

// True when `path` is `dir` or lies below it (both absolute and canonical).
bool is_within(const fs::path& path, const fs::path& dir) {
  const auto [in_dir, in_path] = std::mismatch(dir.begin(), dir.end(), path.begin(), path.end());
  (void)in_path;
  return in_dir == dir.end();
}

// The output is renamed over `out` at the end: inside the folder it would
// replace a rank file or the manifest (the checkpoint then fails verify) or
// add a file that rotation deletes with the folder. Links are resolved, so a
// link to an input, or a path through a link to the folder, is refused too.
void check_output_outside(const fs::path& folder, const CheckpointManifest& manifest, const fs::path& out) {
  std::error_code ec;
  const fs::path real_folder = fs::weakly_canonical(fs::absolute(folder), ec);
  ZERO_CHECK(!ec, "consolidate: cannot resolve the checkpoint folder '", folder.string(), "': ", ec.message());
  // Where the rename lands: the real directory of `out`, and `out` resolved itself.
  const fs::path real_out = fs::weakly_canonical(fs::absolute(out), ec);
  ZERO_CHECK(!ec, "consolidate: cannot resolve the output path '", out.string(), "': ", ec.message());
  const fs::path real_out_dir = fs::weakly_canonical(fs::absolute(out).parent_path(), ec);
  ZERO_CHECK(!ec, "consolidate: cannot resolve the folder of the output '", out.string(), "': ", ec.message());
  std::vector<fs::path> inputs = {folder / kManifestName};
  for (const ManifestFile& f : manifest.files) inputs.push_back(folder / f.file);
  for (const fs::path& input : inputs)
    if (fs::equivalent(out, input, ec))
      ZERO_THROW(InvalidArgument, "consolidate: the output '", out.string(), "' is the checkpoint's own file '",
                 input.string(), "' that it reads; choose an output path outside '", folder.string(), "'");
  if (is_within(real_out, real_folder) || is_within(real_out_dir, real_folder))
    ZERO_THROW(InvalidArgument, "consolidate: the output '", out.string(), "' lies inside the checkpoint folder '",
               folder.string(), "' that it reads (it would replace or add to the checkpoint's files); choose an "
               "output path outside it");
}

std::vector<std::string> state_names(const std::string& optimizer, int slots) {
  if (optimizer == "adamw") return {"exp_avg", "exp_avg_sq"};
  if (optimizer == "lion") return {"exp_avg"};
  if (optimizer == "sgd" && slots >= 1) return {"momentum_buffer"};
  std::vector<std::string> names;
  for (int k = 0; k < slots; ++k) names.push_back("state" + std::to_string(k));
  return names;
}

}  // namespace

void verify_checkpoint_shards(const fs::path& folder, const CheckpointManifest& manifest) {
  (void)open_shards(folder, manifest);
}

ConsolidateResult consolidate_checkpoint(const fs::path& folder, const fs::path& out,
                                         const ConsolidateOptions& options) {
  ZERO_CHECK(options.dtype == TensorDType::F32 || options.dtype == TensorDType::BF16,
             "consolidate: dtype must be F32 or BF16, got ", options.dtype);
  ZERO_CHECK(options.what == "master" || options.what == "ema", "consolidate: what must be \"master\" or \"ema\", got \"",
             options.what, "\"");
  const CheckpointManifest manifest = read_manifest(folder);
  check_output_outside(folder, manifest, out);
  // Sizes and checksums before a byte is used: a flipped bit in a shard
  // must stop consolidation, not become a weight. (A v1 manifest without
  // checksums gets the size check only.)
  verify_checkpoint_files(folder, manifest);
  const OpenShards shards = open_shards(folder, manifest);
  // The files mapped are the files checked (not replaced since, by size).
  for (std::size_t r = 0; r < shards.files.size(); ++r)
    if (shards.files[r].file_size() != manifest.files[r].bytes)
      ZERO_THROW(IoError, "checkpoint file ", shards.files[r].path().string(), " changed while being read: ",
                 shards.files[r].file_size(), " bytes, the manifest says ", manifest.files[r].bytes);
  const SavedShard& info = shards.saved.front();
  const FlatLayout& layout = info.layout;
  if (options.what == "ema" && !shards.files.front().find("ema"))
    ZERO_THROW(IoError, (folder / manifest.files[0].file).string(),
               ": no 'ema' tensor (the run had no EMA, or saved before its first step)");

  // What goes in: the weights, then (optionally) each optimizer state of every parameter.
  struct Source {
    std::string tensor;  // in the shards
    std::string suffix;  // appended to the parameter name
    const FlatLayout* layout;
  };
  // Frozen parameters are the same under master and EMA, and have no optimizer state.
  std::vector<Source> sources = {{options.what, "", &layout}};
  if (!info.frozen_layout.buckets().empty()) sources.push_back({"frozen", "", &info.frozen_layout});
  if (options.optimizer_state) {
    const auto names = state_names(info.optimizer, info.state_slots);
    for (int k = 0; k < info.state_slots; ++k)
      sources.push_back({"state" + std::to_string(k), "." + names[static_cast<std::size_t>(k)], &layout});
  }
  std::vector<TensorSpec> specs;
  for (const Source& source : sources)
    for (const ParamSpec& p : source.layout->params())
      specs.push_back({p.name + source.suffix, options.dtype,
                       p.shape.empty() ? std::vector<std::int64_t>{static_cast<std::int64_t>(p.numel)} : p.shape});
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"},
      {"zero.consolidated_from", fs::absolute(folder).lexically_normal().string()},
      {"zero.step", std::to_string(manifest.step)},
      {"zero.what", options.what},
  };
  SafeTensorsStreamWriter writer(out, specs, metadata);

  // One piece of a parameter at a time: memory stays bounded whatever the model.
  constexpr std::size_t kPiece = std::size_t{1} << 20;
  std::vector<float> values;
  std::vector<std::uint16_t> halves;
  std::vector<const float*> base(shards.files.size());
  for (const Source& source : sources) {
    for (std::size_t r = 0; r < shards.files.size(); ++r)
      base[r] = reinterpret_cast<const float*>(shards.files[r].data(shards.files[r].at(source.tensor)).data());
    const FlatLayout& from = *source.layout;
    for (std::size_t p = 0; p < from.params().size(); ++p) {
      const std::size_t numel = from.params()[p].numel;
      for (std::size_t first = 0; first < numel; first += kPiece) {
        const std::size_t count = std::min(kPiece, numel - first);
        values.resize(count);
        for_each_shard_run(from, p, first, count,
                           [&](int owner, std::size_t index, std::size_t element, std::size_t run) {
                             std::memcpy(values.data() + (element - first),
                                         base[static_cast<std::size_t>(owner)] + index, run * sizeof(float));
                           });
        if (options.dtype == TensorDType::F32) {
          writer.append(std::as_bytes(std::span<const float>(values)));
        } else {
          halves.resize(count);
          std::transform(values.begin(), values.end(), halves.begin(), to_bf16);
          writer.append(std::as_bytes(std::span<const std::uint16_t>(halves)));
        }
      }
    }
  }
  writer.commit();
  return {specs.size(), writer.file_size()};
}

}  // namespace zero::io
