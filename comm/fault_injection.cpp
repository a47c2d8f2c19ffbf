#include "comm/fault_injection.h"

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "core/error.h"

namespace tuna {

namespace {

// kind: "hang..." stops the process (SIGSTOP), anything else kills it (SIGKILL) a second later.
void die_or_hang(const char* kind, const std::string& what) {
  std::fprintf(stderr, "TUNA_FAULT: %s\n", what.c_str());
  std::fflush(stderr);
  if (kind[0] == 'h') ::raise(SIGSTOP);
  // A second first, so the other ranks are surely waiting in the step's first collective (the case tested).
  ::sleep(1);
  ::raise(SIGKILL);
}

}  // namespace

void inject_fault_for_tests(int world_rank, int64_t step) {
  const char* spec = std::getenv("TUNA_FAULT");
  if (!spec) return;
  char kind[16] = {};
  int rank = -1;
  long long at = -1;
  if (std::sscanf(spec, "%15[a-z0-9_]:%d:%lld", kind, &rank, &at) != 3 ||
      (std::strcmp(kind, "kill") && std::strcmp(kind, "hang") && std::strcmp(kind, "nan") &&
       std::strcmp(kind, "kill_p2p") && std::strcmp(kind, "hang_p2p")))
    fail("TUNA_FAULT='", spec, "': expected kill:RANK:STEP, hang:RANK:STEP, kill_p2p:RANK:N, hang_p2p:RANK:N or ",
         "nan:RANK:FIRST[-LAST]");
  if (std::strcmp(kind, "kill") && std::strcmp(kind, "hang")) return;  // another function's kind
  if (rank != world_rank || at != step) return;
  die_or_hang(kind, str("rank ", world_rank, " ", std::strcmp(kind, "hang") ? "dies" : "hangs", " at step ", at));
}

void inject_p2p_fault_for_tests(int world_rank) {
  static const char* spec = std::getenv("TUNA_FAULT");  // read once: this runs at every send and recv
  static int64_t calls = 0;
  if (!spec || std::strstr(spec, "_p2p:") == nullptr) return;
  calls++;
  char kind[16] = {};
  int rank = -1;
  long long at = -1;
  if (std::sscanf(spec, "%15[a-z0-9_]:%d:%lld", kind, &rank, &at) != 3 ||
      (std::strcmp(kind, "kill_p2p") && std::strcmp(kind, "hang_p2p")))
    fail("TUNA_FAULT='", spec, "': expected kill_p2p:RANK:N or hang_p2p:RANK:N");
  if (rank != world_rank || at != calls) return;
  die_or_hang(kind, str("rank ", world_rank, " ", kind[0] == 'h' ? "hangs" : "dies", " at send/recv #", at));
}

bool nan_loss_for_tests(int world_rank, int64_t step) {
  const char* spec = std::getenv("TUNA_FAULT");
  if (!spec || std::strncmp(spec, "nan:", 4) != 0) return false;
  int rank = -1;
  long long first = -1, last = -1;
  const int n = std::sscanf(spec, "nan:%d:%lld-%lld", &rank, &first, &last);
  if (n < 2) fail("TUNA_FAULT='", spec, "': expected nan:RANK:FIRST[-LAST]");
  return rank == world_rank && step >= first && (n < 3 || step <= last);
}

}  // namespace tuna
