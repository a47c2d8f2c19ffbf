#include "core/threads.h"

#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

// Weak: binaries linked against another BLAS (the gpu-check build uses the reference BLAS, single-threaded)
// have no such function, and then there is no BLAS thread pool to size.
extern "C" void openblas_set_num_threads(int) __attribute__((weak));
extern "C" char* openblas_get_corename() __attribute__((weak));

namespace tuna {

int set_cpu_threads(long threads, int ranks_on_node) {
  const int n = threads > 0 ? static_cast<int>(threads) : std::max(1, omp_get_num_procs() / std::max(1, ranks_on_node));
  omp_set_num_threads(n);
  if (openblas_set_num_threads != nullptr) openblas_set_num_threads(n);
  return n;
}

const char* blas_hint() {
  if (openblas_get_corename == nullptr || std::getenv("OPENBLAS_CORETYPE") != nullptr) return "";
  const char* core = openblas_get_corename();
  if (core == nullptr || std::strcmp(core, "Prescott") != 0) return "";
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx512f"))
    return "OpenBLAS uses its generic Prescott kernels on this CPU; OPENBLAS_CORETYPE=SkylakeX selects its "
           "AVX-512 kernels (the demo's CPU step took half the time with them)";
  if (__builtin_cpu_supports("avx2"))
    return "OpenBLAS uses its generic Prescott kernels on this CPU; OPENBLAS_CORETYPE=Haswell selects its AVX2 "
           "kernels (the demo's CPU step took two thirds of the time with them)";
#endif
  return "";
}

}  // namespace tuna
