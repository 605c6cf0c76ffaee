#include "stop_signals.hpp"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iterator>

#include "zero/core/error.hpp"

namespace sdxl {
namespace {

constexpr int kStopSignals[] = {SIGTERM, SIGINT, SIGUSR1};

// What the handler touches: a lock-free atomic and plain data written before
// the handlers are installed; it calls only async-signal-safe functions.
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler needs a lock-free flag");
std::atomic<int> g_first_signal{0};
char g_rank_text[24] = "?";
struct sigaction g_previous[std::size(kStopSignals)];
bool g_installed = false;

void write_stderr(const char* text) {
  std::size_t left = std::strlen(text);
  while (left > 0) {
    const ssize_t written = ::write(STDERR_FILENO, text, left);
    if (written < 0 && errno == EINTR) continue;
    if (written <= 0) return;
    text += written;
    left -= static_cast<std::size_t>(written);
  }
}

void on_stop_signal(int signal) {
  const int saved_errno = errno;  // the interrupted code may be between a call and its errno check
  int first = 0;
  if (g_first_signal.compare_exchange_strong(first, signal) || (signal == first && signal != SIGINT)) {
    errno = saved_errno;
    return;
  }
  // A second request: stop now, dying of the signal as if it were not handled,
  // so that mpirun and shells report it as such.
  write_stderr("[rank ");
  write_stderr(g_rank_text);
  write_stderr(signal == first ? "] second " : "] ");
  write_stderr(signal_name(signal));
  if (signal != first) {
    write_stderr(" after ");
    write_stderr(signal_name(first));
  }
  write_stderr(": stopping at once, without a checkpoint\n");
  struct sigaction default_action {};
  default_action.sa_handler = SIG_DFL;
  ::sigaction(signal, &default_action, nullptr);
  ::raise(signal);  // blocked while this handler runs: delivered, fatally, when it returns
}

}  // namespace

const char* signal_name(int signal) noexcept {
  switch (signal) {
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    case SIGUSR1: return "SIGUSR1";
    default: return "a signal";
  }
}

StopSignals::StopSignals(int rank) {
  ZERO_CHECK(!g_installed, "StopSignals: one object at a time");
  std::snprintf(g_rank_text, sizeof g_rank_text, "%d", rank);
  g_first_signal.store(0);
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  // SA_RESTART: a checkpoint's write() or a wait interrupted by the signal
  // goes on instead of failing with EINTR. The stop signals are blocked while
  // the handler runs, so it never interrupts itself.
  action.sa_flags = SA_RESTART;
  sigemptyset(&action.sa_mask);
  for (int s : kStopSignals) sigaddset(&action.sa_mask, s);
  for (std::size_t i = 0; i < std::size(kStopSignals); ++i) ::sigaction(kStopSignals[i], &action, &g_previous[i]);
  g_installed = true;
}

StopSignals::~StopSignals() {
  for (std::size_t i = 0; i < std::size(kStopSignals); ++i) ::sigaction(kStopSignals[i], &g_previous[i], nullptr);
  g_installed = false;
}

int StopSignals::received() const noexcept { return g_first_signal.load(); }

}  // namespace sdxl
