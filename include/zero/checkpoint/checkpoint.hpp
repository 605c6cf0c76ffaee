// Checkpoint folders: one folder per saved step, one safetensors file per rank
// (what Engine::save_state writes) and a manifest that makes the folder count.
//
//   <root>/step-00000100/rank-00000.safetensors
//                        rank-00001.safetensors ...
//                        manifest.json
//
// A save never writes into a final step folder: every file goes into a hidden
// staging folder beside it (<root>/.step-00000100.tmp-<nonce>), the manifest
// last, once every rank's file is complete; commit_checkpoint then moves the
// staging folder into place in one rename (exchanging it with an older folder
// of the same step), so a step folder is either the old complete checkpoint
// or the new complete one, never a mix. The manifest lists every file with
// its size and CRC-32C, so a truncated or corrupted shard is named before
// anything is loaded from it.
//
// Nothing here follows a symbolic link to delete: a step folder that is a
// link is refused by the listing and never removed through.
//
// The functions here are MPI-agnostic: who writes which file, and the gather
// of the checksums, is the caller's business (the example trainer shows
// one way). docs/checkpoints.md describes the format; the `zero-ckpt` tool
// inspects, verifies and consolidates folders with these functions.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "zero/io/safetensors.hpp"

namespace zero {
class Engine;
}

namespace zero::io {

inline constexpr std::string_view kCheckpointFormat = "zero.checkpoint";
inline constexpr int kCheckpointVersion = 2;
inline constexpr std::string_view kManifestName = "manifest.json";
/// Manifests larger than this are refused unread (the config text included,
/// real ones are a few kilobytes).
inline constexpr std::uint64_t kMaxManifestBytes = std::uint64_t{16} << 20;

// ---------------------------------------------------------------- names

/// "step-00000100" (at least 8 digits; steps must be >= 0).
std::string checkpoint_folder_name(std::int64_t step);
/// root / checkpoint_folder_name(step).
std::filesystem::path checkpoint_folder(const std::filesystem::path& root, std::int64_t step);
/// "rank-00003.safetensors".
std::string rank_file_name(int rank);

// ---------------------------------------------------------------- manifest

/// One rank's file as the manifest lists it.
struct ManifestFile {
  std::string file;  // a plain file name inside the folder, no separators
  std::uint64_t bytes = 0;
  /// Absent only in version-1 manifests written before checksums existed.
  std::optional<std::uint32_t> crc32c;
};

/// The optimizer and its settings (those its kind does not use are recorded too).
struct ManifestOptimizer {
  std::string name;  // adamw, sgd, lion
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0, momentum = 0, dampening = 0;
  bool nesterov = false;
  int state_slots = 0;  // fp32 state tensors per parameter (state0, state1)
};

/// A summary of the engine's flat layout (the full one is in every shard).
struct ManifestLayout {
  std::uint64_t param_count = 0;
  std::uint64_t param_numel = 0;
  std::uint64_t padded_numel = 0;
  std::uint64_t alignment = 1;
  std::uint64_t bucket_count = 0;
};

/// Everything manifest.json holds. Version 2 has every field; version 1
/// (the example trainer's first format) only step, world_size, stage, files and
/// config, the others are left at their defaults and `version` says so.
struct CheckpointManifest {
  int version = kCheckpointVersion;
  std::int64_t step = 0;
  int world_size = 1;
  int stage = 0;
  std::string param_dtype;  // fp32, bf16, fp16
  ManifestOptimizer optimizer;
  double loss_scale = 1;
  ManifestLayout layout;
  /// Where the data stream stands, as string key/values (the example
  /// trainer's sampler.* entries); empty when the writer has none.
  std::map<std::string, std::string> data_position;
  /// The seed the writer derives its random streams from (with the step).
  std::optional<std::uint64_t> seed;
  /// One per rank, in rank order.
  std::vector<ManifestFile> files;
  /// Free-form text of the writer's configuration (TOML for the trainer).
  std::string config;
};

/// Fills stage, param_dtype, optimizer, loss_scale and layout from an engine
/// (the step is the caller's: it may count differently).
void describe_engine(const Engine& engine, CheckpointManifest& manifest);

/// The manifest as JSON text (version 2, ends with a newline). Throws
/// zero::InvalidArgument when the manifest would not read back (files.size()
/// != world_size, a file name with a separator, invalid UTF-8...).
std::string manifest_to_json(const CheckpointManifest& manifest);

/// Parses and validates manifest text: every key is checked for presence,
/// type and range. Throws zero::IoError "<where>: key 'world_size' should be
/// an integer >= 1, found \"abc\"". Never crashes on arbitrary bytes.
CheckpointManifest parse_manifest(std::string_view text, const std::string& where);

/// Reads <folder>/manifest.json (or the file itself when `path` names it).
/// Throws zero::IoError naming the path when it is missing, too large or invalid.
CheckpointManifest read_manifest(const std::filesystem::path& path);

/// Writes <folder>/manifest.json atomically (the last step of a save).
void write_manifest(const std::filesystem::path& folder, const CheckpointManifest& manifest);

// ---------------------------------------------------------------- folders

struct CheckpointFolder {
  std::int64_t step = 0;
  std::filesystem::path path;
};

/// What a checkpoint root holds, by kind, each list by ascending step.
struct CheckpointScan {
  /// Folders "step-<digits>" holding a manifest.json.
  std::vector<CheckpointFolder> complete;
  /// Folders "step-<digits>" without one: a save interrupted before staging
  /// folders existed, or a manifest removed by hand.
  std::vector<CheckpointFolder> incomplete;
  /// Hidden leftovers of saves that did not finish (".step-<digits>.tmp-*",
  /// ".step-<digits>.replaced-*"): never resumed from, removed by the next
  /// save (remove_interrupted_saves).
  std::vector<CheckpointFolder> interrupted;
};

/// Sorts the entries of root (not descending into them). Empty when root
/// does not exist; other names are skipped. Only names and the presence of
/// manifest.json are looked at: read_manifest() validates. Throws
/// zero::IoError when an entry named like a checkpoint is a symbolic link,
/// naming it and its target: rotation would delete through it, in a folder
/// that belongs to something else.
CheckpointScan scan_checkpoints(const std::filesystem::path& root);

/// scan_checkpoints(root).complete: what `--resume latest` and rotation see.
std::vector<CheckpointFolder> list_complete_checkpoints(const std::filesystem::path& root);

/// Checks the size and, when listed, the CRC-32C of file `index` of the
/// manifest. Throws zero::IoError naming the file and the mismatch:
/// "... is missing", "... is not a regular file (it is a FIFO ...)" (checked
/// before any read, which could block), "... has N bytes, the manifest says M
/// (truncated or replaced)", "... is corrupted: its CRC32C ...".
void verify_checkpoint_file(const std::filesystem::path& folder, const CheckpointManifest& manifest,
                            std::size_t index);
/// verify_checkpoint_file for every file, in rank order.
void verify_checkpoint_files(const std::filesystem::path& folder, const CheckpointManifest& manifest);

/// Removes a checkpoint folder: the manifest first (the folder stops counting
/// as complete at once), then each entry, then the folder. Entry by entry
/// through a descriptor of the folder opened without following links (not
/// std::filesystem::remove_all, which pip's LibTorch breaks: its old
/// filesystem symbols shadow libstdc++'s); an entry that is a link is
/// unlinked, never followed. Throws zero::IoError, removing nothing, when
/// `folder` itself is a symbolic link. Other failures are ignored: a leftover
/// folder without a manifest is harmless. Subfolders are not descended into.
void remove_checkpoint(const std::filesystem::path& folder);

/// Keeps the `keep` newest complete checkpoints under root and removes the
/// older ones (keep 0 removes all). Returns the folders removed.
std::vector<std::filesystem::path> rotate_checkpoints(const std::filesystem::path& root, std::size_t keep);

// ---------------------------------------------------------------- saving

/// The hidden folder a save of `step` writes into:
/// root/.step-00000100.tmp-<16 hex digits of nonce>. Every rank must use the
/// same nonce (the caller draws it on one rank and shares it).
std::filesystem::path checkpoint_staging_folder(const std::filesystem::path& root, std::int64_t step,
                                                std::uint64_t nonce);

/// Starts a save (one process): creates root if needed, clears what earlier
/// interrupted saves left (remove_interrupted_saves) and creates the staging
/// folder, which must not exist yet. Returns the staging folder; the ranks'
/// files and then the manifest go into it. Throws zero::IoError naming the
/// folder and the cause (read-only, no space, permission).
std::filesystem::path begin_checkpoint(const std::filesystem::path& root, std::int64_t step, std::uint64_t nonce);

/// Ends a save (one process, once the manifest is in the staging folder):
/// puts the staging folder in place of root/step-<step> and fsyncs root.
/// When that folder exists (a step saved again), the two are exchanged in one
/// renameat2(RENAME_EXCHANGE) and the old one is removed afterwards, so some
/// complete checkpoint of the step is in place at every moment. A file system
/// without RENAME_EXCHANGE gets two renames: the old folder first becomes
/// ".step-<step>.replaced-<nonce>", which remove_interrupted_saves puts back
/// if the process dies before the new one is in place. Throws zero::IoError
/// when the staging folder has no manifest, when the step folder is a
/// symbolic link (nothing is replaced through a link) or a rename fails.
/// Returns root/step-<step>.
std::filesystem::path commit_checkpoint(const std::filesystem::path& staging, const std::filesystem::path& root,
                                        std::int64_t step);

/// Clears the hidden leftovers of saves that did not finish: staging folders
/// are removed (remove_checkpoint: no link followed); a ".replaced-" folder is
/// renamed back to its step folder when that is missing (a commit cut between
/// its two renames), removed otherwise. Returns the folders removed. Call it
/// only while no save into root is running (the trainer holds output_dir's lock).
std::vector<std::filesystem::path> remove_interrupted_saves(const std::filesystem::path& root);

// ---------------------------------------------------------------- shards

/// Checks that the folder's rank files belong together: each opens as a
/// safetensors file carrying Engine::save_state's metadata, file r says rank
/// r, all have the same layout and step as rank 0, that world size and step
/// agree with the manifest, and the state tensors have the shard's length.
/// The manifest's step counts every optimizer step taken, applied or skipped
/// for non-finite gradients: it must equal the shard's applied steps plus its
/// skipped ones (SavedShard::step + skipped_steps). Throws zero::IoError
/// naming the first file that does not, with both values.
void verify_checkpoint_shards(const std::filesystem::path& folder, const CheckpointManifest& manifest);

struct ConsolidateOptions {
  /// F32 (bit-exact copy of the fp32 values) or BF16 (round to nearest even).
  TensorDType dtype = TensorDType::F32;
  /// "master" weights or their "ema".
  std::string what = "master";
  /// Also write each parameter's optimizer moments, named after PyTorch's
  /// state: <name>.exp_avg and <name>.exp_avg_sq (AdamW), <name>.exp_avg
  /// (Lion), <name>.momentum_buffer (SGD).
  bool optimizer_state = false;
};

struct ConsolidateResult {
  std::size_t tensors = 0;
  std::uint64_t bytes = 0;  // of the written file
};

/// Writes one safetensors file of the full parameters (names and shapes from
/// the layout; [numel] where the shape was not recorded) from a checkpoint
/// folder, streaming: the shards are memory-mapped and one parameter at a
/// time is assembled, converted and appended, so memory stays about one
/// parameter. The output replaces `out` atomically; nothing is written
/// unless every check passes. Checks first, in order: that `out` lies outside
/// `folder` and is none of its files (zero::InvalidArgument naming both), the
/// size and CRC-32C of every rank file against the manifest
/// (verify_checkpoint_files, a streamed read of each), then the shards as
/// verify_checkpoint_shards does. Throws zero::IoError / zero::InvalidArgument.
ConsolidateResult consolidate_checkpoint(const std::filesystem::path& folder, const std::filesystem::path& out,
                                         const ConsolidateOptions& options = {});

}  // namespace zero::io
