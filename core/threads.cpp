#include "core/threads.h"

#include <omp.h>

#include <algorithm>

extern "C" void openblas_set_num_threads(int);

namespace tuna {

int set_cpu_threads(long threads, int ranks_on_node) {
  const int n = threads > 0 ? static_cast<int>(threads) : std::max(1, omp_get_num_procs() / std::max(1, ranks_on_node));
  omp_set_num_threads(n);
  openblas_set_num_threads(n);
  return n;
}

}  // namespace tuna
