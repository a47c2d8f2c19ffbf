#include "core/threads.h"

#include "core/blas.h"

#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <string>

// Weak: binaries linked against another BLAS (the gpu-check build uses the reference BLAS, single-threaded)
// have no such function, and then there is no BLAS thread pool to size.
extern "C" void openblas_set_num_threads(int) __attribute__((weak));

namespace tuna {

int set_cpu_threads(long threads, int ranks_on_node) {
  const int n = threads > 0 ? static_cast<int>(threads) : std::max(1, omp_get_num_procs() / std::max(1, ranks_on_node));
  omp_set_num_threads(n);
  if (openblas_set_num_threads != nullptr) openblas_set_num_threads(n);
  return n;
}

const char* blas_hint() {
  static const std::string hint = [] {
    const BlasKernels& k = ensure_blas_kernels();
    if (k.replaced.empty()) return std::string();
    return "OpenBLAS did not recognise this CPU and chose its generic " + k.replaced + " kernels; tuna selected its " +
           k.core + " kernels for the CPU's vector units instead (OPENBLAS_CORETYPE=NAME picks another)";
  }();
  return hint.c_str();
}

}  // namespace tuna
