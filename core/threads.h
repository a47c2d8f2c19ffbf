// CPU threads of this process: OpenMP (tuna's own ops) and OpenBLAS (GEMMs) set together, since the CPU
// backend uses both and a mismatch oversubscribes the cores.
#pragma once

namespace tuna {

// Sets both to `threads`; 0 means the machine's cores divided by `ranks_on_node` (at least 1).
// Returns the count set.
int set_cpu_threads(long threads, int ranks_on_node = 1);

// A note for the log when tuna replaced OpenBLAS's generic fallback kernels with ones for this CPU
// (core/blas.h). Empty when there is nothing to say.
const char* blas_hint();

}  // namespace tuna
