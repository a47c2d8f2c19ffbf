// CPU threads of this process: OpenMP (tuna's own ops) and OpenBLAS (GEMMs) set together, since the CPU
// backend uses both and a mismatch oversubscribes the cores.
#pragma once

namespace tuna {

// Sets both to `threads`; 0 means the machine's cores divided by `ranks_on_node` (at least 1).
// Returns the count set.
int set_cpu_threads(long threads, int ranks_on_node = 1);

// How OpenMP's idle threads wait between parallel regions. tuna's default is passive (they sleep at once):
// on cores shared with other jobs, GCC's default spinning lets a waiting thread burn the time slice that a
// descheduled one needs, and every region's barrier then waits for the kernel to run that one again
// (benchmarks/2026-12-01-cpu-step-under-load.md). The runtime reads OMP_WAIT_POLICY once, when it loads, so a
// binary linking this file and started without one re-executes itself with it set, before main. An
// OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment is kept (OMP_WAIT_POLICY=active restores spinning);
// `from_environment` says which happened.
struct CpuWaitPolicy {
  const char* policy;  // "passive", or the environment's OMP_WAIT_POLICY / "GOMP_SPINCOUNT=..."
  bool from_environment;
};
CpuWaitPolicy cpu_wait_policy();

// A note for the log when tuna replaced OpenBLAS's generic fallback kernels with ones for this CPU
// (core/blas.h). Empty when there is nothing to say.
const char* blas_hint();

}  // namespace tuna
