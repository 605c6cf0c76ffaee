// Rank discovery from the variables that launchers set, so that a process
// knows its rank, world size and local rank before any communicator exists
// (to pick its GPU, and to cross-check MPI's view).
#pragma once

#include <cstdlib>
#include <functional>
#include <optional>
#include <string>

#include "zero/core/error.hpp"

namespace zero {

struct LaunchEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_size = 1;
  /// Which launcher's variables were found: "openmpi", "pmi", "slurm",
  /// "torchrun", "mvapich" or "none" (a plain single process).
  std::string launcher = "none";
};

using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;

inline std::optional<std::string> process_env(const std::string& name) {
  if (const char* value = std::getenv(name.c_str())) return std::string(value);
  return std::nullopt;
}

namespace detail {
inline std::optional<int> env_int(const EnvLookup& lookup, const std::string& name) {
  auto text = lookup(name);
  if (!text) return std::nullopt;
  std::size_t used = 0;
  int value = 0;
  try {
    value = std::stoi(*text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  ZERO_CHECK(used == text->size() && !text->empty(), "environment variable ", name, "='", *text,
             "' is not an integer");
  return value;
}
}  // namespace detail

/// Reads, in order of precedence: Open MPI (OMPI_COMM_WORLD_*), MVAPICH
/// (MV2_COMM_WORLD_*), PMI/PMIx (PMI_RANK/PMIX_RANK, PMI_SIZE), Slurm
/// (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE) and
/// torchrun (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE). Values are
/// validated: 0 <= rank < world_size, 0 <= local_rank < local_size.
inline LaunchEnv discover_launch_env(const EnvLookup& lookup = process_env) {
  struct Scheme {
    const char* launcher;
    const char* rank;
    const char* size;
    const char* local_rank;
    const char* local_size;
  };
  static const Scheme schemes[] = {
      {"openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
       "OMPI_COMM_WORLD_LOCAL_SIZE"},
      {"mvapich", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK",
       "MV2_COMM_WORLD_LOCAL_SIZE"},
      {"pmi", "PMIX_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
      {"pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
      {"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"},
      {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
  };
  for (const Scheme& s : schemes) {
    auto rank = detail::env_int(lookup, s.rank);
    if (!rank) continue;
    LaunchEnv env;
    env.launcher = s.launcher;
    env.rank = *rank;
    env.world_size = detail::env_int(lookup, s.size).value_or(1);
    env.local_rank = detail::env_int(lookup, s.local_rank).value_or(0);
    // Slurm writes e.g. "4(x2)" for NTASKS_PER_NODE; fall back to the world size then.
    std::optional<int> local_size;
    try {
      local_size = detail::env_int(lookup, s.local_size);
    } catch (const InvalidArgument&) {
      local_size.reset();
    }
    env.local_size = local_size.value_or(env.world_size);
    ZERO_CHECK(env.world_size >= 1, s.size, "=", env.world_size, " must be >= 1");
    ZERO_CHECK(env.rank >= 0 && env.rank < env.world_size, s.rank, "=", env.rank,
               " is outside [0, ", s.size, "=", env.world_size, ")");
    ZERO_CHECK(env.local_size >= 1 && env.local_size <= env.world_size, s.local_size, "=",
               env.local_size, " must be in [1, world size ", env.world_size, "]");
    ZERO_CHECK(env.local_rank >= 0 && env.local_rank < env.local_size, s.local_rank, "=",
               env.local_rank, " is outside [0, ", env.local_size, ")");
    return env;
  }
  return {};
}

}  // namespace zero
