// Stopping a training run on request: a scheduler's time limit or warning
// (SIGTERM, Slurm's `--signal=USR1@120`), Ctrl-C (SIGINT), or `kill` of one
// rank. The signal handler only records the signal; the step loop reads it at
// each step boundary, all ranks agree on it in an all-reduce they already do,
// and every rank then writes the same checkpoint and exits with
// kExitStoppedBySignal. What mpirun does with each signal is described in
// examples/sdxl/README.md ("Stopping a run: signals").
#pragma once

namespace sdxl {

/// The exit code of a run that stopped on SIGTERM, SIGINT or SIGUSR1 after
/// writing its checkpoint: EX_TEMPFAIL of <sysexits.h> ("try again later"),
/// which a job script can tell from success (0) and failure (1). Resume with
/// --resume latest.
inline constexpr int kExitStoppedBySignal = 75;

/// While an object lives, SIGTERM, SIGINT and SIGUSR1 no longer end the
/// process: the first one is recorded (received()) for the step loop to act
/// on. A second request stops at once, without a checkpoint: SIGINT again, or
/// a signal other than the first (after SIGUSR1, say, SIGTERM). The same
/// SIGTERM or SIGUSR1 again is the same request delivered twice and is
/// ignored: Slurm signals every process of a job, mpirun forwards SIGUSR1 to
/// the ranks and sends its own SIGTERM, so one request can arrive two or
/// three times. The destructor restores the previous handlers. One object at
/// a time per process.
class StopSignals {
 public:
  /// `rank` is named in the message of an immediate stop.
  explicit StopSignals(int rank);
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  /// The first of SIGTERM, SIGINT, SIGUSR1 received since construction; 0 if none.
  int received() const noexcept;
};

/// "SIGTERM", "SIGINT", "SIGUSR1", else "signal <n>".
const char* signal_name(int signal) noexcept;

}  // namespace sdxl
