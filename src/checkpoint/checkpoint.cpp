// Checkpoint folders and their manifest. Free of MPI and of the engine (the
// engine-aware parts live in consolidate.cpp), so that the manifest reader
// builds alone into its fuzzer (tests/fuzz/fuzz_manifest.cpp).
#include "../io/error_text.hpp"
#include "../io/json_reader.hpp"
#include "zero/checkpoint/checkpoint.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <optional>
#include <nlohmann/json.hpp>
#include <system_error>

#include "zero/core/error.hpp"
#include "zero/io/atomic_file.hpp"
#include "zero/io/crc32c.hpp"

namespace zero::io {
namespace fs = std::filesystem;
using Json = nlohmann::json;

namespace {

/// The format name of version-1 manifests, written by the example trainer
/// before the manifest was the library's (read, never written).
constexpr std::string_view kCheckpointFormatV1 = "zero.sdxl.checkpoint";


constexpr int kMaxWorldSize = 1 << 20;

// ---------------------------------------------------------------- messages

// At most 80 bytes of a string, cut on a UTF-8 character boundary.
using detail::brief_text;
// What a value is, for "found ..." in messages.
using detail::describe;
// Typed getters naming each failure by its dotted path.
using Reader = detail::JsonReader;

// nlohmann's parse errors quote the input, which may be arbitrary bytes.
std::string printable(std::string_view what) { return detail::printable_error_text(what, 300); }

constexpr double kHuge = std::numeric_limits<double>::max();

void read_files(const Reader& root, CheckpointManifest& m) {
  const Json& files = root.get("files", "an array");
  const std::string expected = "an array of " + std::to_string(m.world_size) + " entries (one per rank, world_size)";
  if (!files.is_array() || files.size() != static_cast<std::size_t>(m.world_size))
    root.fail("files", expected, describe(files));
  m.files.reserve(files.size());
  for (std::size_t i = 0; i < files.size(); ++i) {
    const std::string index = "files[" + std::to_string(i) + "]";
    if (!files[i].is_object()) root.fail(index, "an object {file, bytes, crc32c}", describe(files[i]));
    const Reader entry = root.nested(files[i], index);
    ManifestFile f;
    const std::string name = rank_file_name(static_cast<int>(i));
    f.file = entry.string("file", "\"" + name + "\"");
    if (f.file != name) entry.fail("file", "\"" + name + "\"", describe(files[i]["file"]));
    f.bytes = entry.unsigned_integer("bytes", 0, std::numeric_limits<std::uint64_t>::max(), "an integer >= 0");
    if (m.version >= 2 || entry.has("crc32c"))
      f.crc32c = static_cast<std::uint32_t>(
          entry.unsigned_integer("crc32c", 0, 0xFFFFFFFFu, "an integer in [0, 4294967295]"));
    m.files.push_back(std::move(f));
  }
}

void read_training_state(const Reader& root, CheckpointManifest& m) {
  m.param_dtype = root.one_of("param_dtype", {"fp32", "bf16", "fp16"}, "\"fp32\", \"bf16\" or \"fp16\"");
  const Reader opt = root.object("optimizer");
  ManifestOptimizer& o = m.optimizer;
  o.name = opt.one_of("name", {"adamw", "sgd", "lion"}, "\"adamw\", \"sgd\" or \"lion\"");
  o.lr = opt.number("lr", 0, kHuge, false, "a finite number >= 0");
  o.beta1 = opt.number("beta1", 0, 1, false, "a number in [0, 1]");
  o.beta2 = opt.number("beta2", 0, 1, false, "a number in [0, 1]");
  o.eps = opt.number("eps", 0, kHuge, false, "a finite number >= 0");
  o.weight_decay = opt.number("weight_decay", 0, kHuge, false, "a finite number >= 0");
  o.momentum = opt.number("momentum", 0, 1, false, "a number in [0, 1]");
  o.dampening = opt.number("dampening", 0, 1, false, "a number in [0, 1]");
  o.nesterov = opt.boolean("nesterov");
  o.state_slots = static_cast<int>(opt.integer("state_slots", 0, 2, "an integer in [0, 2]"));
  m.loss_scale = root.number("loss_scale", 0, kHuge, true, "a finite number > 0");

  const Reader layout = root.object("layout");
  constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
  ManifestLayout& l = m.layout;
  l.param_count = layout.unsigned_integer("param_count", 0, kMax, "an integer >= 0");
  l.param_numel = layout.unsigned_integer("param_numel", 0, kMax, "an integer >= 0");
  l.padded_numel = layout.unsigned_integer("padded_numel", l.param_numel, kMax,
                                           "an integer >= param_numel (" + std::to_string(l.param_numel) + ")");
  l.alignment = layout.unsigned_integer("alignment", 1, kMax, "an integer >= 1");
  l.bucket_count = layout.unsigned_integer("bucket_count", 0, kMax, "an integer >= 0");

  const Reader data = root.object("data_position");
  for (auto it = data.json().begin(); it != data.json().end(); ++it) {
    if (!it->is_string()) root.fail("data_position." + brief_text(it.key()), "a string", describe(*it));
    m.data_position[it.key()] = it->get<std::string>();
  }
  const Reader rng = root.object("rng");
  if (rng.has("seed"))
    m.seed = rng.unsigned_integer("seed", 0, std::numeric_limits<std::uint64_t>::max(), "an integer >= 0");
  m.config = root.string("config");
}

// What a directory entry is, for "is not a regular file (it is ...)".
const char* file_kind(fs::file_type type) {
  switch (type) {
    case fs::file_type::directory: return "a directory";
    case fs::file_type::fifo: return "a FIFO (named pipe)";
    case fs::file_type::socket: return "a socket";
    case fs::file_type::block: return "a block device";
    case fs::file_type::character: return "a character device";
    case fs::file_type::symlink: return "a symbolic link";
    default: return "not a plain file";
  }
}

// The hidden names of a save in progress and of the folder it replaces.
constexpr std::string_view kStagingTag = ".tmp-";
constexpr std::string_view kReplacedTag = ".replaced-";

// The step of "step-<digits>" (visible) or "step-<digits>.tmp-<nonce>" /
// "step-<digits>.replaced-<nonce>" (hidden, the dot already cut off).
std::optional<std::int64_t> step_of_name(std::string_view name, bool hidden) {
  constexpr std::string_view prefix = "step-";
  if (name.substr(0, prefix.size()) != prefix) return std::nullopt;
  name.remove_prefix(prefix.size());
  std::size_t digits = 0;
  while (digits < name.size() && name[digits] >= '0' && name[digits] <= '9') ++digits;
  if (digits == 0 || digits > 18) return std::nullopt;
  const std::string_view rest = name.substr(digits);
  if (hidden ? !(rest.substr(0, kStagingTag.size()) == kStagingTag || rest.substr(0, kReplacedTag.size()) == kReplacedTag)
             : !rest.empty())
    return std::nullopt;
  return std::stoll(std::string(name.substr(0, digits)));
}

Json json_text(const std::string& text, std::string_view what) {
  // Round trip through the strict serializer: invalid UTF-8 is refused here,
  // not silently replaced, so the manifest always reads back.
  try {
    (void)Json(text).dump(-1, ' ', false, Json::error_handler_t::strict);
  } catch (const nlohmann::json::exception&) {
    ZERO_THROW(InvalidArgument, "manifest: ", what, " is not valid UTF-8");
  }
  return Json(text);
}

}  // namespace

// ---------------------------------------------------------------- names

std::string checkpoint_folder_name(std::int64_t step) {
  ZERO_CHECK(step >= 0, "checkpoint step must be >= 0, got ", step);
  char name[32];
  std::snprintf(name, sizeof name, "step-%08lld", static_cast<long long>(step));
  return name;
}

fs::path checkpoint_folder(const fs::path& root, std::int64_t step) { return root / checkpoint_folder_name(step); }

std::string rank_file_name(int rank) {
  ZERO_CHECK(rank >= 0, "rank must be >= 0, got ", rank);
  char name[48];
  std::snprintf(name, sizeof name, "rank-%05d.safetensors", rank);
  return name;
}

// ---------------------------------------------------------------- manifest

std::string manifest_to_json(const CheckpointManifest& m) {
  ZERO_CHECK(m.world_size >= 1 && m.world_size <= kMaxWorldSize, "manifest: world_size ", m.world_size,
             " outside [1, ", kMaxWorldSize, "]");
  ZERO_CHECK(m.files.size() == static_cast<std::size_t>(m.world_size), "manifest: ", m.files.size(),
             " files for world_size ", m.world_size);
  ZERO_CHECK(m.step >= 0, "manifest: step must be >= 0, got ", m.step);
  ZERO_CHECK(m.stage >= 0 && m.stage <= 3, "manifest: stage must be 0..3, got ", m.stage);
  ZERO_CHECK(std::isfinite(m.loss_scale) && m.loss_scale > 0, "manifest: loss_scale must be finite and > 0, got ",
             m.loss_scale);
  const ManifestOptimizer& o = m.optimizer;
  for (double x : {o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.momentum, o.dampening})
    ZERO_CHECK(std::isfinite(x) && x >= 0, "manifest: optimizer '", o.name, "' has a setting ", x,
               " that is negative or not finite");
  // Keys in a reading order (format first, config last), not sorted.
  using Ordered = nlohmann::ordered_json;
  Ordered files = Ordered::array();
  for (std::size_t r = 0; r < m.files.size(); ++r) {
    const ManifestFile& f = m.files[r];
    ZERO_CHECK(f.file == rank_file_name(static_cast<int>(r)), "manifest: file ", r, " is '", f.file,
               "', expected '", rank_file_name(static_cast<int>(r)), "'");
    ZERO_CHECK(f.crc32c.has_value(), "manifest: file '", f.file, "' has no CRC32C");
    files.push_back({{"file", f.file}, {"bytes", f.bytes}, {"crc32c", *f.crc32c}});
  }
  Ordered data = Ordered::object();
  for (const auto& [k, v] : m.data_position) data[k] = json_text(v, "data_position value").get<std::string>();
  Ordered rng = Ordered::object();
  if (m.seed) rng["seed"] = *m.seed;
  const Ordered manifest = {
      {"format", kCheckpointFormat},
      {"version", kCheckpointVersion},
      {"step", m.step},
      {"world_size", m.world_size},
      {"stage", m.stage},
      {"param_dtype", m.param_dtype},
      {"optimizer",
       {{"name", o.name}, {"lr", o.lr}, {"beta1", o.beta1}, {"beta2", o.beta2}, {"eps", o.eps},
        {"weight_decay", o.weight_decay}, {"momentum", o.momentum}, {"dampening", o.dampening},
        {"nesterov", o.nesterov}, {"state_slots", o.state_slots}}},
      {"loss_scale", m.loss_scale},
      {"layout",
       {{"param_count", m.layout.param_count}, {"param_numel", m.layout.param_numel},
        {"padded_numel", m.layout.padded_numel}, {"alignment", m.layout.alignment},
        {"bucket_count", m.layout.bucket_count}}},
      {"data_position", data},
      {"rng", rng},
      {"files", files},
      {"config", json_text(m.config, "config").get<std::string>()}};
  std::string text;
  try {
    text = manifest.dump(2, ' ', false, Ordered::error_handler_t::strict) + "\n";
  } catch (const nlohmann::json::exception& e) {
    ZERO_THROW(InvalidArgument, "manifest: a key or value is not valid UTF-8 (", printable(e.what()), ")");
  }
  // What is written must read back: the same checks as any reader's.
  (void)parse_manifest(text, "manifest being written");
  return text;
}

CheckpointManifest parse_manifest(std::string_view text, const std::string& where) {
  // nlohmann's lexer stops at a NUL byte as at the end of input; a manifest
  // with one is damaged, whatever precedes it.
  if (text.find('\0') != std::string_view::npos)
    ZERO_THROW(IoError, where, ": not valid JSON (holds a NUL byte at offset ", text.find('\0'), ")");
  Json root;
  try {
    root = Json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::exception& e) {
    ZERO_THROW(IoError, where, ": not valid JSON: ", printable(e.what()));
  }
  if (!root.is_object()) ZERO_THROW(IoError, where, ": should hold a JSON object, found ", describe(root));
  const std::string origin = where + ": ";
  const Reader r(origin, root);
  CheckpointManifest m;
  const std::string& format = r.one_of("format", {kCheckpointFormat, kCheckpointFormatV1},
                                       R"("zero.checkpoint" (or "zero.sdxl.checkpoint" of version 1))");
  const bool v1 = format == kCheckpointFormatV1;
  m.version = static_cast<int>(r.integer("version", v1 ? 1 : 2, v1 ? 1 : 2, v1 ? "1 (for this format)" : "2"));
  m.step = r.integer("step", 0, std::numeric_limits<std::int64_t>::max(), "an integer >= 0");
  m.world_size = static_cast<int>(
      r.integer("world_size", 1, kMaxWorldSize, "an integer >= 1 (and <= " + std::to_string(kMaxWorldSize) + ")"));
  m.stage = static_cast<int>(r.integer("stage", 0, 3, "an integer in [0, 3]"));
  read_files(r, m);
  if (v1) {
    if (r.has("config")) m.config = r.string("config");
  } else {
    read_training_state(r, m);
  }
  return m;
}

CheckpointManifest read_manifest(const fs::path& path) {
  std::error_code ec;
  const fs::path file = fs::is_directory(path, ec) ? path / kManifestName : path;
  const auto size = fs::file_size(file, ec);
  if (ec)
    ZERO_THROW(IoError, file.string(), " is missing or unreadable (", ec.message(),
               "): an interrupted save, or not a checkpoint folder");
  if (size > kMaxManifestBytes)
    ZERO_THROW(IoError, file.string(), ": ", size, " bytes is too large for a manifest (at most ", kMaxManifestBytes,
               ")");
  std::ifstream in(file, std::ios::binary);
  std::string text(static_cast<std::size_t>(size), '\0');
  if (!in.read(text.data(), static_cast<std::streamsize>(size)))
    ZERO_THROW(IoError, "cannot read ", file.string(), ": ", std::strerror(errno));
  return parse_manifest(text, file.string());
}

void write_manifest(const fs::path& folder, const CheckpointManifest& manifest) {
  const std::string text = manifest_to_json(manifest);
  write_file_atomically(folder / kManifestName, std::as_bytes(std::span<const char>(text.data(), text.size())));
}

// ---------------------------------------------------------------- folders

CheckpointScan scan_checkpoints(const fs::path& root) {
  CheckpointScan found;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return found;
  fs::directory_iterator it(root, ec);
  if (ec) ZERO_THROW(IoError, "cannot list checkpoints in ", root.string(), ": ", ec.message());
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const bool hidden = !name.empty() && name[0] == '.';
    const std::optional<std::int64_t> step = step_of_name(hidden ? std::string_view(name).substr(1) : name, hidden);
    if (!step) continue;
    std::error_code status_ec;
    const fs::file_status status = fs::symlink_status(it->path(), status_ec);
    if (fs::is_symlink(status)) {
      const fs::path target = fs::read_symlink(it->path(), status_ec);
      ZERO_THROW(IoError, "checkpoint folder ", it->path().string(), " is a symbolic link (to ", target.string(),
                 "): checkpoint folders must be real folders inside ", root.string(),
                 ", since rotation deletes them and zero never deletes through a link. Remove the link (it only "
                 "removes the link), and name its target directly to read that checkpoint");
    }
    if (!fs::is_directory(status)) continue;
    CheckpointFolder folder{*step, it->path()};
    if (hidden) found.interrupted.push_back(std::move(folder));
    else if (fs::is_regular_file(it->path() / kManifestName, status_ec)) found.complete.push_back(std::move(folder));
    else found.incomplete.push_back(std::move(folder));
  }
  if (ec) ZERO_THROW(IoError, "cannot list checkpoints in ", root.string(), ": ", ec.message());
  const auto by_step = [](const CheckpointFolder& a, const CheckpointFolder& b) {
    return a.step != b.step ? a.step < b.step : a.path < b.path;
  };
  for (auto* list : {&found.complete, &found.incomplete, &found.interrupted})
    std::sort(list->begin(), list->end(), by_step);
  return found;
}

std::vector<CheckpointFolder> list_complete_checkpoints(const fs::path& root) { return scan_checkpoints(root).complete; }

void verify_checkpoint_file(const fs::path& folder, const CheckpointManifest& manifest, std::size_t index) {
  ZERO_CHECK(index < manifest.files.size(), (folder / kManifestName).string(), " lists ", manifest.files.size(),
             " files; rank ", index, "'s is missing");
  const ManifestFile& entry = manifest.files[index];
  const fs::path file = folder / entry.file;
  std::error_code ec;
  const fs::file_status status = fs::status(file, ec);
  if (!fs::exists(status))
    ZERO_THROW(IoError, "checkpoint file ", file.string(), " is missing (",
               ec ? ec.message() : std::string("no such file"), ")");
  // A FIFO or a device would block or never end the checksum below; a folder has no size.
  if (!fs::is_regular_file(status))
    ZERO_THROW(IoError, "checkpoint file ", file.string(), " is not a regular file (it is ", file_kind(status.type()),
               "): expected the rank's safetensors file");
  const auto size = fs::file_size(file, ec);
  if (ec) ZERO_THROW(IoError, "cannot read the size of checkpoint file ", file.string(), " (", ec.message(), ")");
  if (size != entry.bytes)
    ZERO_THROW(IoError, "checkpoint file ", file.string(), " has ", size, " bytes, the manifest says ", entry.bytes,
               " (truncated or replaced)");
  if (entry.crc32c) {
    const std::uint32_t crc = file_crc32c(file);
    if (crc != *entry.crc32c)
      ZERO_THROW(IoError, "checkpoint file ", file.string(), " is corrupted: its CRC32C is ", crc,
                 ", the manifest says ", *entry.crc32c);
  }
}

void verify_checkpoint_files(const fs::path& folder, const CheckpointManifest& manifest) {
  for (std::size_t i = 0; i < manifest.files.size(); ++i) verify_checkpoint_file(folder, manifest, i);
}

void remove_checkpoint(const fs::path& folder) {
  struct stat status {};
  if (::lstat(folder.c_str(), &status) != 0) return;  // already gone
  if (S_ISLNK(status.st_mode))
    ZERO_THROW(IoError, "not removing ", folder.string(), ": it is a symbolic link, and a checkpoint folder is "
               "never removed through a link (what it points to belongs to something else)");
  // O_NOFOLLOW: a folder swapped for a link after the check is refused by open().
  const int dir = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (dir < 0) return;
  ::unlinkat(dir, std::string(kManifestName).c_str(), 0);  // first: the folder stops counting as complete
  if (DIR* entries = ::fdopendir(::dup(dir))) {
    std::vector<std::string> names;
    while (const dirent* entry = ::readdir(entries))
      if (std::strcmp(entry->d_name, ".") != 0 && std::strcmp(entry->d_name, "..") != 0) names.emplace_back(entry->d_name);
    ::closedir(entries);
    // unlinkat without AT_REMOVEDIR removes a link itself, never its target,
    // and leaves a subfolder alone (EISDIR).
    for (const std::string& name : names) ::unlinkat(dir, name.c_str(), 0);
  }
  ::close(dir);
  ::rmdir(folder.c_str());
}

std::vector<fs::path> rotate_checkpoints(const fs::path& root, std::size_t keep) {
  std::vector<fs::path> removed;
  const auto all = list_complete_checkpoints(root);
  for (std::size_t i = 0; i + keep < all.size(); ++i) {
    remove_checkpoint(all[i].path);
    removed.push_back(all[i].path);
  }
  return removed;
}

// ---------------------------------------------------------------- saving

fs::path checkpoint_staging_folder(const fs::path& root, std::int64_t step, std::uint64_t nonce) {
  char suffix[32];
  std::snprintf(suffix, sizeof suffix, "%016llx", static_cast<unsigned long long>(nonce));
  std::string name = ".";
  name += checkpoint_folder_name(step);
  name += kStagingTag;
  name += suffix;
  return root / name;
}

fs::path begin_checkpoint(const fs::path& root, std::int64_t step, std::uint64_t nonce) {
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) ZERO_THROW(IoError, "cannot create the checkpoint folder ", root.string(), ": ", ec.message());
  (void)remove_interrupted_saves(root);
  const fs::path staging = checkpoint_staging_folder(root, step, nonce);
  if (::mkdir(staging.c_str(), 0777) != 0) {
    const int error = errno;
    ZERO_THROW(IoError, "cannot create ", staging.string(), " to save the step-", step, " checkpoint: ",
               std::strerror(error));
  }
  return staging;
}

fs::path commit_checkpoint(const fs::path& staging, const fs::path& root, std::int64_t step) {
  const fs::path final_folder = checkpoint_folder(root, step);
  std::error_code ec;
  if (!fs::is_regular_file(staging / kManifestName, ec))
    ZERO_THROW(IoError, "cannot commit ", staging.string(), ": it has no ", kManifestName,
               " (write every rank's file, then the manifest)");
  fsync_directory(staging);
  struct stat status {};
  const bool replacing = ::lstat(final_folder.c_str(), &status) == 0;
  if (replacing && S_ISLNK(status.st_mode))
    ZERO_THROW(IoError, "not replacing ", final_folder.string(), ": it is a symbolic link (a checkpoint folder is "
               "never written or removed through a link); the new checkpoint is left in ", staging.string());
  auto fail = [&](const char* what, const fs::path& from, const fs::path& to) {
    const int error = errno;
    ZERO_THROW(IoError, "cannot ", what, " ", from.string(), " to ", to.string(), ": ", std::strerror(error),
               " (the new step-", step, " checkpoint is complete in ", staging.string(), ")");
  };
  if (!replacing) {
    if (::rename(staging.c_str(), final_folder.c_str()) != 0) fail("rename", staging, final_folder);
    fsync_directory(root);
    return final_folder;
  }
  // The old folder takes the staging name in the same step: a complete
  // checkpoint of the step stays in place, then the old one goes.
  if (::renameat2(AT_FDCWD, staging.c_str(), AT_FDCWD, final_folder.c_str(), RENAME_EXCHANGE) == 0) {
    fsync_directory(root);
    remove_checkpoint(staging);
    return final_folder;
  }
  if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP) fail("exchange", staging, final_folder);
  // No RENAME_EXCHANGE here (NFS, some FUSE file systems): move the old one
  // aside under a name remove_interrupted_saves knows to put back.
  std::string aside_name = staging.filename().string();
  aside_name.replace(aside_name.find(kStagingTag), kStagingTag.size(), kReplacedTag);
  const fs::path aside = root / aside_name;
  if (::rename(final_folder.c_str(), aside.c_str()) != 0) fail("rename", final_folder, aside);
  if (::rename(staging.c_str(), final_folder.c_str()) != 0) {
    const int error = errno;
    (void)::rename(aside.c_str(), final_folder.c_str());  // the old one back in place
    errno = error;
    fail("rename", staging, final_folder);
  }
  fsync_directory(root);
  remove_checkpoint(aside);
  return final_folder;
}

std::vector<fs::path> remove_interrupted_saves(const fs::path& root) {
  std::vector<fs::path> removed;
  for (const CheckpointFolder& leftover : scan_checkpoints(root).interrupted) {
    const std::string name = leftover.path.filename().string();
    const fs::path final_folder = checkpoint_folder(root, leftover.step);
    std::error_code ec;
    // A commit cut between its two renames: the old checkpoint goes back.
    if (name.find(kReplacedTag) != std::string::npos && !fs::exists(fs::symlink_status(final_folder, ec)) &&
        fs::is_regular_file(leftover.path / kManifestName, ec) &&
        ::rename(leftover.path.c_str(), final_folder.c_str()) == 0) {
      fsync_directory(root);
      continue;
    }
    remove_checkpoint(leftover.path);
    removed.push_back(leftover.path);
  }
  return removed;
}

}  // namespace zero::io
