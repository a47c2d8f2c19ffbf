// CPU threads of this process: OpenMP (tuna's own ops) and OpenBLAS (GEMMs) set together, since the CPU
// backend uses both and a mismatch oversubscribes the cores.
#pragma once

namespace tuna {

// Sets both to `threads`; 0 means the machine's cores divided by `ranks_on_node` (at least 1).
// Returns the count set.
int set_cpu_threads(long threads, int ranks_on_node = 1);

// A hint for the log when OpenBLAS runs its generic SSE3 ("Prescott") kernels on a CPU with AVX2: Debian's
// OpenBLAS 0.3.21 does not recognise some newer CPU models and falls back to them, which halves the CPU
// step (README, "Measured"); OPENBLAS_CORETYPE names the core instead. Empty when there is nothing to say.
const char* blas_hint();

}  // namespace tuna
