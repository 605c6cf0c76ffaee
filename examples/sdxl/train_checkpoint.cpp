#include "train_checkpoint.hpp"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iterator>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "train_epochs.hpp"
#include "zero/checkpoint/checkpoint.hpp"
#include "zero/engine/engine_state.hpp"
#include "zero/io/crc32c.hpp"
#include "zero/io/safetensors.hpp"

namespace sdxl {

namespace fs = std::filesystem;

namespace {
fs::path checkpoints_root(const TrainConfig& c) { return fs::path(c.output_dir) / "checkpoints"; }

// A checkpoint holds no master weights or optimizer state for the parameters
// it froze, and only model-dtype values of those, so the engine refuses one
// whose frozen set differs ("belongs to another model"). Said first here in
// the config's terms: which parameter, and the two [model] freeze lists.
void check_same_freeze(const TrainConfig& c, const zero::Engine& engine, const fs::path& shard,
                       const zero::io::CheckpointManifest& manifest) {
  const zero::SavedShard saved = zero::read_saved_shard(zero::io::SafeTensorsFile::open(shard));
  std::vector<std::string> theirs, ours;
  for (const zero::ParamSpec& p : saved.frozen_layout.params()) theirs.push_back(p.name);
  for (std::size_t p = 0; p < engine.param_count(); ++p)
    if (engine.frozen(p)) ours.push_back(engine.params()[p].name);
  std::sort(theirs.begin(), theirs.end());
  std::sort(ours.begin(), ours.end());
  if (theirs == ours) return;
  std::vector<std::string> only_theirs, only_ours;
  std::set_difference(theirs.begin(), theirs.end(), ours.begin(), ours.end(), std::back_inserter(only_theirs));
  std::set_difference(ours.begin(), ours.end(), theirs.begin(), theirs.end(), std::back_inserter(only_ours));
  const std::optional<std::vector<std::string>> saved_patterns = saved_freeze(manifest.config);
  const std::string example = !only_theirs.empty() ? "'" + only_theirs.front() + "' was frozen there and is trained here"
                                                   : "'" + only_ours.front() + "' was trained there and is frozen here";
  ZERO_THROW(zero::InvalidArgument, "resume: ", shard.parent_path().string(), " was saved by a run that froze ",
             theirs.size(), " parameters ([model] freeze = ",
             saved_patterns ? pattern_list(*saved_patterns) : std::string("? (its saved configuration does not say)"),
             "), this run freezes ", ours.size(), " ([model] freeze = ", pattern_list(c.freeze), "); ", example, " (",
             only_theirs.size() + only_ours.size(), " differ). Resume with the [model] freeze of the run that saved.");
}
}  // namespace

void save_checkpoint(const TrainConfig& c, std::int64_t step, zero::adapter::ShardedModel& model,
                     zero::Communicator& comm, const data::SamplerState& sampler,
                     const std::map<std::string, std::string>& schedule, zero::MpiCommunicator& host) {
  const fs::path root = checkpoints_root(c);
  // One file per rank of a shard group (all ranks without hybrid sharding),
  // written by the first replica: the others hold the same state. Shard
  // groups are consecutive ranks, so world ranks 0..S-1 are the writers.
  const zero::Engine& engine = model.engine();
  const int files = engine.world_size();
  const bool writes = engine.replica() == 0;
  const std::string own = zero::io::rank_file_name(engine.rank());
  // Everything goes into a staging folder beside the checkpoints (rank 0
  // draws its name), moved into place only once the manifest is in it: an
  // existing checkpoint of this step stays whole until its replacement is.
  std::uint64_t nonce = 0;
  if (host.rank() == 0) nonce = (std::uint64_t{std::random_device{}()} << 32) ^ std::random_device{}();
  MPI_Request request = MPI_REQUEST_NULL;
  ZERO_CHECK_MPI(MPI_Ibcast(&nonce, 1, MPI_UINT64_T, 0, host.mpi_comm(), &request));
  host.wait_request(&request, "checkpoint folder name broadcast");
  const fs::path staging = zero::io::checkpoint_staging_folder(root, step, nonce);
  if (host.rank() == 0) (void)zero::io::begin_checkpoint(root, step, nonce);
  host.barrier();
  std::vector<std::pair<std::string, std::string>> metadata = {{"train.config", c.to_toml()}};
  for (auto& [k, v] : sampler.to_metadata()) metadata.emplace_back(k, v);
  for (const auto& [k, v] : schedule) metadata.emplace_back(k, v);
  if (writes) model.engine().save_state((staging / own).string(), metadata);
  // Every writer checksums its own file; rank 0 lists them all in the manifest.
  std::uint32_t crc = writes ? zero::io::file_crc32c(staging / own) : 0;
  std::vector<std::uint32_t> crcs(static_cast<std::size_t>(comm.size()));
  MPI_Request gather = MPI_REQUEST_NULL;
  ZERO_CHECK_MPI(MPI_Igather(&crc, 1, MPI_UINT32_T, crcs.data(), 1, MPI_UINT32_T, 0, host.mpi_comm(), &gather));
  host.wait_request(&gather, "checkpoint checksum gather");
  host.barrier();
  if (host.rank() == 0) {
    zero::io::CheckpointManifest manifest;
    zero::io::describe_engine(model.engine(), manifest);
    manifest.step = step;
    manifest.world_size = files;
    manifest.data_position = sampler.to_metadata();
    manifest.data_position.insert(schedule.begin(), schedule.end());
    manifest.seed = static_cast<std::uint64_t>(c.seed);  // noise and timesteps derive from (seed, step)
    manifest.config = c.to_toml();
    for (int r = 0; r < files; ++r) {
      const std::string name = zero::io::rank_file_name(r);
      manifest.files.push_back({name, fs::file_size(staging / name), crcs[static_cast<std::size_t>(r)]});
    }
    zero::io::write_manifest(staging, manifest);
    zero::io::commit_checkpoint(staging, root, step);
    zero::io::rotate_checkpoints(root, static_cast<std::size_t>(c.keep_checkpoints));
  }
  host.barrier();
}

namespace {

/// The manifest of `dir` and every check that needs no engine: checksums
/// present (or accepted absent), this rank's files' sizes and CRCs, and the
/// manifest against the shards' own metadata (step, world size, layout), the
/// code `zero-ckpt verify` runs.
zero::io::CheckpointManifest checked_manifest(const TrainConfig& c, const fs::path& dir, int own, int now) {
  const fs::path manifest_path = dir / zero::io::kManifestName;
  ZERO_CHECK(fs::exists(manifest_path), "resume: ", manifest_path.string(),
             " is missing (an interrupted save, or not a checkpoint folder)");
  const zero::io::CheckpointManifest manifest = zero::io::read_manifest(manifest_path);
  for (const zero::io::ManifestFile& f : manifest.files)
    if (!f.crc32c && !c.accept_unchecksummed_checkpoint)
      ZERO_THROW(zero::InvalidArgument, "resume: ", manifest_path.string(), " (version ", manifest.version,
                 ") lists no CRC32C for ", f.file, ": a damaged shard would load unnoticed. Check the files "
                 "(zero-ckpt verify ", dir.string(), " checks sizes and shard metadata) and pass "
                 "--accept_unchecksummed_checkpoint ([output]) to resume from it anyway; its next save has checksums");
  // Same number of ranks: each its own file; another: every rank reads them all.
  if (manifest.world_size == now) {
    zero::io::verify_checkpoint_file(dir, manifest, static_cast<std::size_t>(own));
  } else {
    for (std::size_t r = 0; r < manifest.files.size(); ++r) zero::io::verify_checkpoint_file(dir, manifest, r);
  }
  zero::io::verify_checkpoint_shards(dir, manifest);
  return manifest;
}

}  // namespace

Resumed maybe_resume(const TrainConfig& c, const data::EpochSchedule& schedule, zero::adapter::ShardedModel& model,
                     zero::Communicator& comm) {
  if (c.resume.empty()) return {};
  fs::path dir = c.resume;
  std::vector<zero::io::CheckpointFolder> older;  // complete ones before the newest, for --resume latest
  if (c.resume == "latest") {
    older = zero::io::list_complete_checkpoints(checkpoints_root(c));
    if (older.empty()) {
      // claim_output_dir refused a folder of only incomplete checkpoints.
      if (comm.rank() == 0) std::printf("resume: no complete checkpoint under %s; starting fresh\n", c.output_dir.c_str());
      return {};
    }
    dir = older.back().path;
    older.pop_back();
  }
  // Files per shard group then and now (the world size without hybrid sharding).
  const int now = model.engine().world_size(), own = model.engine().rank();
  zero::io::CheckpointManifest manifest;
  try {
    manifest = checked_manifest(c, dir, own, now);
  } catch (const zero::IoError& e) {
    if (older.empty()) throw;
    const fs::path& previous = older.back().path;
    ZERO_THROW(zero::IoError, e.message(), ". The newest checkpoint is damaged; an older complete one is ",
               previous.string(), " (step ", older.back().step, "): resume from it with --resume ", previous.string());
  }
  check_resumed_schedule(c, schedule, manifest.data_position, dir.string());
  const std::int64_t total_steps = run_length(c, schedule);
  if (c.epochs > 0)
    ZERO_CHECK(manifest.step <= total_steps, "resume: ", dir.string(), " is at step ", manifest.step, ", beyond --epochs ",
               c.epochs, " ([train] epochs, ", total_steps, " steps): nothing to train, and the export would be the "
               "checkpoint's model. Set more --epochs to train on from it");
  ZERO_CHECK(manifest.step <= total_steps, "resume: ", dir.string(), " is at step ", manifest.step, ", beyond --steps ",
             total_steps, " ([train] steps): nothing to train, and the export would be the checkpoint's model. Set "
             "--steps above ", manifest.step, " to train on from it");
  const int old_world = manifest.world_size;
  const fs::path shard = dir / zero::io::rank_file_name(std::min(own, old_world - 1));
  check_same_freeze(c, model.engine(), shard, manifest);
  // Every rank asks about the same file (rank 0's), so all take the same path.
  const bool same_placement =
      old_world == now && model.engine().saved_layout_matches((dir / zero::io::rank_file_name(0)).string());
  if (same_placement) {
    model.engine().load_state((dir / zero::io::rank_file_name(own)).string());
  } else {
    // Another number of ranks, or the parameters grouped into other units (or
    // listed in another order): every rank reads its new slices from the old
    // shards, parameters matched by name. checked_manifest verified only this
    // rank's file at the same world size: the others are read now too.
    if (old_world == now)
      for (std::size_t r = 0; r < manifest.files.size(); ++r)
        if (r != static_cast<std::size_t>(own)) zero::io::verify_checkpoint_file(dir, manifest, r);
    std::vector<std::string> files;
    for (int r = 0; r < old_world; ++r) files.push_back((dir / zero::io::rank_file_name(r)).string());
    model.engine().load_state_resharded(files);
    if (comm.rank() == 0 && old_world != now)
      std::printf("resharded the checkpoint from %d to %d ranks per shard group (keep the global batch: "
                  "batch_size x ranks)\n", old_world, now);
    else if (comm.rank() == 0)
      std::printf("regrouped the checkpoint's parameters into this run's units\n");
  }
  Resumed r;
  r.step = manifest.step;
  r.folder = dir;
  r.data_position = manifest.data_position;
  const zero::io::SafeTensorsFile file = zero::io::SafeTensorsFile::open(shard);
  r.sampler = data::SamplerState::from_metadata(file.metadata());
  return r;
}

std::optional<std::string> saved_config_to_resume(const TrainConfig& c) {
  if (c.resume.empty()) return std::nullopt;
  fs::path dir = c.resume;
  if (c.resume == "latest") {
    const std::vector<zero::io::CheckpointFolder> complete = zero::io::list_complete_checkpoints(checkpoints_root(c));
    if (complete.empty()) return std::nullopt;
    dir = complete.back().path;
  }
  zero::io::CheckpointManifest manifest;
  try {
    manifest = zero::io::read_manifest(dir / zero::io::kManifestName);
  } catch (const zero::Error&) {
    return std::nullopt;  // maybe_resume refuses it with the reason
  }
  ZERO_CHECK(!manifest.config.empty(), "fit = ", c.fit, " with resume = \"", c.resume, "\": ", dir.string(),
             " records no configuration, so the settings it trained with are unknown; resume without fit, with its "
             "batch_size, accumulation, stage and offload options given explicitly");
  return manifest.config;
}

}  // namespace sdxl
