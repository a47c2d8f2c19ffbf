#include "comm/fault_injection.h"

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "core/error.h"

namespace tuna {

void inject_fault_for_tests(int world_rank, int64_t step) {
  const char* spec = std::getenv("TUNA_FAULT");
  if (!spec) return;
  char kind[8] = {};
  int rank = -1;
  long long at = -1;
  if (std::sscanf(spec, "%7[a-z]:%d:%lld", kind, &rank, &at) != 3)
    fail("TUNA_FAULT='", spec, "': expected kill:RANK:STEP, hang:RANK:STEP or nan:RANK:FIRST[-LAST]");
  if (std::strcmp(kind, "nan") == 0) return;  // nan_loss_for_tests' kind
  if (rank != world_rank || at != step) return;
  std::fprintf(stderr, "TUNA_FAULT: rank %d %s at step %lld\n", world_rank, std::strcmp(kind, "hang") ? "dies" : "hangs", at);
  std::fflush(stderr);
  if (std::strcmp(kind, "hang") == 0) ::raise(SIGSTOP);
  // A second first, so the other ranks are surely waiting in the step's first collective (the case tested).
  ::sleep(1);
  ::raise(SIGKILL);
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
