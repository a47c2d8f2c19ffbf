#include "core/threads.h"

#include "core/blas.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

// Weak: binaries linked against another BLAS (the gpu-check build uses the reference BLAS, single-threaded)
// have no such function, and then there is no BLAS thread pool to size.
extern "C" void openblas_set_num_threads(int) __attribute__((weak));

namespace {

constexpr const char* kDefaultedMarker = "TUNA_OMP_WAIT_POLICY_DEFAULTED";

// libgomp reads OMP_WAIT_POLICY once, in its own initializer, and offers no call to change it later; an
// executable's constructors run after it. So a process started without a policy sets tuna's default and
// executes itself again (the same pid, before main: no thread, file or MPI connection exists yet), marking that
// it did so; a failed exec leaves the process as it was, with OpenMP's own default.
__attribute__((constructor)) void default_wait_policy(int, char** argv, char**) {
  if (std::getenv("OMP_WAIT_POLICY") || std::getenv("GOMP_SPINCOUNT") || argv == nullptr) return;
  setenv("OMP_WAIT_POLICY", "passive", 1);
  setenv(kDefaultedMarker, "passive", 1);
  ::execv("/proc/self/exe", argv);
  unsetenv("OMP_WAIT_POLICY");
  unsetenv(kDefaultedMarker);
}

}  // namespace

namespace tuna {

CpuWaitPolicy cpu_wait_policy() {
  const char* policy = std::getenv("OMP_WAIT_POLICY");
  const char* defaulted = std::getenv(kDefaultedMarker);  // inherited by child processes, which may set another
  if (defaulted && policy && std::strcmp(defaulted, policy) == 0) return {policy, false};
  return {policy ? policy : std::getenv("GOMP_SPINCOUNT") ? "GOMP_SPINCOUNT" : "OpenMP's default", true};
}

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
