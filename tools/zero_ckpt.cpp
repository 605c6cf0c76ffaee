// zero-ckpt: look into, check and consolidate zero checkpoint folders
// (docs/checkpoints.md). No MPI: it reads the files that every rank wrote.
//
//   zero-ckpt inspect DIR [--json] [--params]
//   zero-ckpt verify DIR
//   zero-ckpt consolidate DIR --out FILE.safetensors [--dtype fp32|bf16]
//                             [--what master|ema] [--optimizer-state]
//
// DIR is a checkpoint folder (step-00000100/) or a folder of them, in which
// case the newest complete one is used. Exit status: 0 fine, 1 a check failed
// or a file could not be read (the message names it), CLI11's codes for
// usage errors.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "zero/core/error.hpp"
#include "zero/engine/engine.hpp"
#include "zero/engine/engine_state.hpp"
#include "zero/checkpoint/checkpoint.hpp"
#include "zero/io/crc32c.hpp"
#include "zero/io/safetensors.hpp"

namespace fs = std::filesystem;
using namespace zero;

namespace {

// ---------------------------------------------------------------- helpers

// The message without zero's "[zero] file:line:" prefix: users need the file, not ours.
std::string message_of(const std::exception& e) {
  if (const auto* z = dynamic_cast<const zero::Error*>(&e)) return z->message();
  return e.what();
}

// A checkpoint folder, or the newest complete one under a folder of them.
fs::path resolve_folder(const fs::path& dir) {
  std::error_code ec;
  if (fs::exists(dir / io::kManifestName, ec)) return dir;
  const auto all = io::list_complete_checkpoints(dir);
  if (!all.empty()) return all.back().path;
  ZERO_THROW(IoError, dir.string(), " holds no ", io::kManifestName,
             " and no complete step-* checkpoint folder (an interrupted save, or not a checkpoint)");
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

std::string hex32(std::uint32_t value) {
  char text[16];
  std::snprintf(text, sizeof text, "0x%08x", value);
  return text;
}

std::vector<std::int64_t> shape_of(const ParamSpec& p) {
  return p.shape.empty() ? std::vector<std::int64_t>{static_cast<std::int64_t>(p.numel)} : p.shape;
}

// ---------------------------------------------------------------- inspect

int inspect(const fs::path& dir, bool as_json, bool with_params) {
  const fs::path folder = resolve_folder(dir);
  const io::CheckpointManifest m = io::read_manifest(folder);
  // Each rank file's tensors; a file that does not open is reported, not fatal.
  nlohmann::json files = nlohmann::json::array();
  std::optional<SavedShard> first;
  bool all_open = true;
  for (const io::ManifestFile& f : m.files) {
    nlohmann::json entry = {{"file", f.file}, {"bytes", f.bytes}};
    if (f.crc32c) entry["crc32c"] = *f.crc32c;
    try {
      const io::SafeTensorsFile file = io::SafeTensorsFile::open(folder / f.file);
      nlohmann::json tensors = nlohmann::json::array();
      for (const io::TensorInfo& t : file.tensors())
        tensors.push_back({{"name", t.name}, {"dtype", std::string(io::name_of(t.dtype))}, {"shape", t.shape}});
      entry["tensors"] = tensors;
      if (!first) first = read_saved_shard(file);
    } catch (const std::exception& e) {
      entry["error"] = message_of(e);
      all_open = false;
    }
    files.push_back(entry);
  }
  nlohmann::json params = nlohmann::json::array();
  if (first)
    for (const ParamSpec& p : first->layout.params())
      params.push_back({{"name", p.name}, {"shape", shape_of(p)}, {"numel", p.numel}});

  if (as_json) {
    nlohmann::json out = {{"path", folder.string()},
                          {"version", m.version},
                          {"step", m.step},
                          {"world_size", m.world_size},
                          {"stage", m.stage},
                          {"files", files}};
    if (m.version >= 2) {
      const io::ManifestOptimizer& o = m.optimizer;
      out["param_dtype"] = m.param_dtype;
      out["optimizer"] = {{"name", o.name}, {"lr", o.lr}, {"beta1", o.beta1}, {"beta2", o.beta2}, {"eps", o.eps},
                          {"weight_decay", o.weight_decay}, {"momentum", o.momentum}, {"dampening", o.dampening},
                          {"nesterov", o.nesterov}, {"state_slots", o.state_slots}};
      out["loss_scale"] = m.loss_scale;
      out["layout"] = {{"param_count", m.layout.param_count}, {"param_numel", m.layout.param_numel},
                       {"padded_numel", m.layout.padded_numel}, {"alignment", m.layout.alignment},
                       {"bucket_count", m.layout.bucket_count}};
      out["data_position"] = m.data_position;
      out["seed"] = m.seed ? nlohmann::json(*m.seed) : nlohmann::json();
    }
    if (first) out["state_dtype"] = "F32";
    if (with_params) out["params"] = params;
    std::printf("%s\n", out.dump(2, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
    return all_open ? 0 : 1;
  }

  std::printf("checkpoint   %s\n", folder.string().c_str());
  std::printf("manifest     version %d\n", m.version);
  std::printf("step         %lld\n", static_cast<long long>(m.step));
  std::printf("world size   %d\n", m.world_size);
  std::printf("stage        %d\n", m.stage);
  if (m.version >= 2) {
    const io::ManifestOptimizer& o = m.optimizer;
    std::printf("dtypes       parameters %s, master weights and optimizer state F32\n", m.param_dtype.c_str());
    std::printf("optimizer    %s lr=%g beta1=%g beta2=%g eps=%g weight_decay=%g momentum=%g%s (%d state tensors)\n",
                o.name.c_str(), o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.momentum,
                o.nesterov ? " nesterov" : "", o.state_slots);
    std::printf("loss scale   %g\n", m.loss_scale);
    std::printf("layout       %llu parameters, %llu elements (%llu padded, alignment %llu), %llu buckets\n",
                static_cast<unsigned long long>(m.layout.param_count),
                static_cast<unsigned long long>(m.layout.param_numel),
                static_cast<unsigned long long>(m.layout.padded_numel),
                static_cast<unsigned long long>(m.layout.alignment),
                static_cast<unsigned long long>(m.layout.bucket_count));
    if (m.seed) std::printf("seed         %llu\n", static_cast<unsigned long long>(*m.seed));
    for (const auto& [key, value] : m.data_position) std::printf("data         %s = %s\n", key.c_str(), value.c_str());
  }
  std::printf("files\n");
  for (const nlohmann::json& f : files) {
    std::printf("  %s  %llu bytes", f["file"].get<std::string>().c_str(),
                static_cast<unsigned long long>(f["bytes"].get<std::uint64_t>()));
    if (f.contains("crc32c")) std::printf("  crc32c %s", hex32(f["crc32c"].get<std::uint32_t>()).c_str());
    if (f.contains("error")) {
      std::printf("  UNREADABLE: %s\n", f["error"].get<std::string>().c_str());
      continue;
    }
    std::printf("  %zu tensors:", f["tensors"].size());
    for (const nlohmann::json& t : f["tensors"])
      std::printf(" %s %s%s", t["name"].get<std::string>().c_str(), t["dtype"].get<std::string>().c_str(),
                  shape_text(t["shape"].get<std::vector<std::int64_t>>()).c_str());
    std::printf("\n");
  }
  if (with_params) {
    std::printf("parameters (%zu)\n", params.size());
    for (const nlohmann::json& p : params)
      std::printf("  %-60s %-20s %llu\n", p["name"].get<std::string>().c_str(),
                  shape_text(p["shape"].get<std::vector<std::int64_t>>()).c_str(),
                  static_cast<unsigned long long>(p["numel"].get<std::uint64_t>()));
  }
  return all_open ? 0 : 1;
}

// ---------------------------------------------------------------- verify

int verify(const fs::path& dir) {
  const fs::path folder = resolve_folder(dir);
  io::CheckpointManifest m;
  try {
    m = io::read_manifest(folder);
  } catch (const std::exception& e) {
    std::printf("FAILED %s: %s\n", (folder / io::kManifestName).string().c_str(), message_of(e).c_str());
    return 1;
  }
  std::printf("OK     %s (step %lld, %d ranks)\n", (folder / io::kManifestName).string().c_str(),
              static_cast<long long>(m.step), m.world_size);
  for (std::size_t r = 0; r < m.files.size(); ++r) {
    const fs::path file = folder / m.files[r].file;
    try {
      io::verify_checkpoint_file(folder, m, r);
    } catch (const std::exception& e) {
      std::printf("FAILED %s: %s\n", file.string().c_str(), message_of(e).c_str());
      return 1;
    }
    std::printf("OK     %s  %llu bytes%s\n", file.string().c_str(), static_cast<unsigned long long>(m.files[r].bytes),
                m.files[r].crc32c ? ("  crc32c " + hex32(*m.files[r].crc32c)).c_str() : "  (no checksum recorded)");
  }
  try {
    io::verify_checkpoint_shards(folder, m);
  } catch (const std::exception& e) {
    std::printf("FAILED shard metadata: %s\n", message_of(e).c_str());
    return 1;
  }
  std::printf("OK     shard metadata: %d ranks in order, one layout and step\n", m.world_size);
  return 0;
}

// ---------------------------------------------------------------- consolidate

int consolidate(const fs::path& dir, const fs::path& out, const std::string& dtype, const std::string& what,
                bool optimizer_state) {
  const fs::path folder = resolve_folder(dir);
  io::ConsolidateOptions options{.dtype = dtype == "bf16" ? io::TensorDType::BF16 : io::TensorDType::F32,
                                 .what = what,
                                 .optimizer_state = optimizer_state};
  const io::ConsolidateResult result = io::consolidate_checkpoint(folder, out, options);
  std::printf("wrote %s: %zu tensors, %llu bytes (%s, %s) from %s\n", out.string().c_str(), result.tensors,
              static_cast<unsigned long long>(result.bytes), what.c_str(), dtype.c_str(), folder.string().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"zero-ckpt: inspect, verify and consolidate zero checkpoint folders"};
  app.require_subcommand(1);
  std::string dir, out, dtype = "fp32", what = "master";
  bool as_json = false, with_params = false, optimizer_state = false;

  CLI::App* inspect_cmd = app.add_subcommand("inspect", "What a checkpoint holds");
  inspect_cmd->add_option("DIR", dir, "checkpoint folder (or a folder of them: the newest)")->required();
  inspect_cmd->add_flag("--json", as_json, "machine-readable output");
  inspect_cmd->add_flag("--params", with_params, "list every parameter (name, shape, numel)");

  CLI::App* verify_cmd = app.add_subcommand("verify", "Check sizes, CRC32C and shard metadata against the manifest");
  verify_cmd->add_option("DIR", dir, "checkpoint folder (or a folder of them: the newest)")->required();

  CLI::App* consolidate_cmd =
      app.add_subcommand("consolidate", "Write the full weights (and optimizer state) to one safetensors file");
  consolidate_cmd->add_option("DIR", dir, "checkpoint folder (or a folder of them: the newest)")->required();
  consolidate_cmd
      ->add_option("--out", out,
                   "output .safetensors file (replaced atomically); outside the checkpoint folder, none of its files")
      ->required();
  consolidate_cmd->add_option("--dtype", dtype, "fp32 (exact) or bf16 (round to nearest even)")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str();
  consolidate_cmd->add_option("--what", what, "master weights or their EMA")
      ->check(CLI::IsMember({"master", "ema"}))
      ->capture_default_str();
  consolidate_cmd->add_flag("--optimizer-state", optimizer_state,
                            "also write <name>.exp_avg / .exp_avg_sq (AdamW), .exp_avg (Lion), .momentum_buffer (SGD)");
  CLI11_PARSE(app, argc, argv);

  try {
    if (inspect_cmd->parsed()) return inspect(dir, as_json, with_params);
    if (verify_cmd->parsed()) return verify(dir);
    return consolidate(dir, out, dtype, what, optimizer_state);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zero-ckpt: %s\n", message_of(e).c_str());
    return 1;
  }
}
