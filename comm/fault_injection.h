// The trainer's fault injection, for the tests of failure handling (tests/dist/test_failure.cpp,
// tests/tools/test_train.cpp): a rank dies, hangs or diverges mid-step when the environment variable TUNA_FAULT
// says so. Kept out of comm/comm.h: no collective depends on it, and a run without TUNA_FAULT pays a getenv a step.
#pragma once

#include <cstdint>

namespace tuna {

// TUNA_FAULT="kill:R:S" or "hang:R:S" makes world rank R end itself with SIGKILL (after sleeping a second), or
// stop itself with SIGSTOP, when called with step S (train.cu calls it mid-step, after the backward and before the
// step's collectives). Unset: nothing.
void inject_fault_for_tests(int world_rank, int64_t step);
// TUNA_FAULT="kill_p2p:R:N" or "hang_p2p:R:N": world rank R dies (SIGKILL, after a second) or stops (SIGSTOP) at its
// N-th point-to-point start (send or recv, counted from 1 over every comm of the process), before posting it:
// a pipeline stage that dies or hangs between its sends. MpiComm calls it (comm/comm_mpi.cpp). Unset: nothing.
void inject_p2p_fault_for_tests(int world_rank);
// TUNA_FAULT="nan:R:F" (or "nan:R:F-L") makes world rank R's loss of every step
// from F on (to L) NaN: a run that diverges, for the trainer's non-finite step handling. Unset: false.
bool nan_loss_for_tests(int world_rank, int64_t step);

}  // namespace tuna
