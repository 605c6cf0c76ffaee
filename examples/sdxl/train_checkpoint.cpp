#include "train_checkpoint.hpp"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iterator>
#include <optional>
#include <string>
#include <utility>
#include <vector>

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
                     zero::Communicator& comm, const data::SamplerState& sampler, zero::MpiCommunicator& host) {
  const fs::path dir = zero::io::checkpoint_folder(checkpoints_root(c), step);
  // One file per rank of a shard group (all ranks without hybrid sharding),
  // written by the first replica: the others hold the same state. Shard
  // groups are consecutive ranks, so world ranks 0..S-1 are the writers.
  const zero::Engine& engine = model.engine();
  const int files = engine.world_size();
  const bool writes = engine.replica() == 0;
  const std::string own = zero::io::rank_file_name(engine.rank());
  if (comm.rank() == 0) {
    fs::create_directories(dir);
    std::error_code ec;
    fs::remove(dir / zero::io::kManifestName, ec);
  }
  host.barrier();
  std::vector<std::pair<std::string, std::string>> metadata = {{"train.config", c.to_toml()}};
  for (auto& [k, v] : sampler.to_metadata()) metadata.emplace_back(k, v);
  if (writes) model.engine().save_state((dir / own).string(), metadata);
  // Every writer checksums its own file; rank 0 lists them all in the manifest.
  std::uint32_t crc = writes ? zero::io::file_crc32c(dir / own) : 0;
  std::vector<std::uint32_t> crcs(static_cast<std::size_t>(comm.size()));
  MPI_Request gather = MPI_REQUEST_NULL;
  ZERO_CHECK_MPI(MPI_Igather(&crc, 1, MPI_UINT32_T, crcs.data(), 1, MPI_UINT32_T, 0, host.mpi_comm(), &gather));
  host.wait_request(&gather, "checkpoint checksum gather");
  host.barrier();
  if (comm.rank() == 0) {
    zero::io::CheckpointManifest manifest;
    zero::io::describe_engine(model.engine(), manifest);
    manifest.step = step;
    manifest.world_size = files;
    manifest.data_position = sampler.to_metadata();
    manifest.seed = static_cast<std::uint64_t>(c.seed);  // noise and timesteps derive from (seed, step)
    manifest.config = c.to_toml();
    for (int r = 0; r < files; ++r) {
      const std::string name = zero::io::rank_file_name(r);
      manifest.files.push_back({name, fs::file_size(dir / name), crcs[static_cast<std::size_t>(r)]});
    }
    zero::io::write_manifest(dir, manifest);
    zero::io::rotate_checkpoints(checkpoints_root(c), static_cast<std::size_t>(c.keep_checkpoints));
  }
  host.barrier();
}

Resumed maybe_resume(const TrainConfig& c, zero::adapter::ShardedModel& model, zero::Communicator& comm) {
  if (c.resume.empty()) return {};
  fs::path dir = c.resume;
  if (c.resume == "latest") {
    auto all = zero::io::list_complete_checkpoints(checkpoints_root(c));
    if (all.empty()) {
      if (comm.rank() == 0) std::printf("resume: no complete checkpoint under %s; starting fresh\n", c.output_dir.c_str());
      return {};
    }
    dir = all.back().path;
  }
  const fs::path manifest_path = dir / zero::io::kManifestName;
  ZERO_CHECK(fs::exists(manifest_path), "resume: ", manifest_path.string(),
             " is missing (an interrupted save, or not a checkpoint folder)");
  const zero::io::CheckpointManifest manifest = zero::io::read_manifest(manifest_path);
  // Files per shard group then and now (the world size without hybrid sharding).
  const int old_world = manifest.world_size, now = model.engine().world_size(), own = model.engine().rank();
  const fs::path shard = dir / zero::io::rank_file_name(std::min(own, old_world - 1));
  if (old_world == now) {
    zero::io::verify_checkpoint_file(dir, manifest, static_cast<std::size_t>(own));
    check_same_freeze(c, model.engine(), shard, manifest);
    model.engine().load_state((dir / zero::io::rank_file_name(own)).string());
  } else {
    // Another number of ranks: every rank reads its new slices from the old shards.
    std::vector<std::string> files;
    for (int r = 0; r < old_world; ++r) {
      zero::io::verify_checkpoint_file(dir, manifest, static_cast<std::size_t>(r));
      files.push_back((dir / zero::io::rank_file_name(r)).string());
    }
    check_same_freeze(c, model.engine(), shard, manifest);
    model.engine().load_state_resharded(files);
    if (comm.rank() == 0)
      std::printf("resharded the checkpoint from %d to %d ranks per shard group (keep the global batch: "
                  "batch_size x ranks)\n", old_world, now);
  }
  Resumed r;
  r.step = manifest.step;
  const zero::io::SafeTensorsFile file = zero::io::SafeTensorsFile::open(shard);
  r.sampler = data::SamplerState::from_metadata(file.metadata());
  if (comm.rank() == 0) std::printf("resumed from %s at step %lld\n", dir.string().c_str(), static_cast<long long>(r.step));
  return r;
}

}  // namespace sdxl
