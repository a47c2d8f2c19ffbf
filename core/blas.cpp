#include "core/blas.h"

#include <strings.h>

#include <cstdlib>
#include <optional>

// Weak: without OpenBLAS (the gpu-check build links the reference BLAS) these are null and nothing happens.
// gotoblas_dynamic_quit/init are exported by every DYNAMIC_ARCH OpenBLAS: quit forgets the chosen kernel table,
// init chooses again (from OPENBLAS_CORETYPE when set, else from the CPU model) and initializes its parameters.
extern "C" char* openblas_get_corename() __attribute__((weak));
extern "C" void gotoblas_dynamic_init() __attribute__((weak));
extern "C" void gotoblas_dynamic_quit() __attribute__((weak));

namespace tuna {
namespace {

// The kernels a current OpenBLAS would take for this CPU's features, or "" when nothing better than the
// generic ones applies. SkylakeX's kernels need AVX-512 F, BW, DQ and VL; __builtin_cpu_supports also checks
// that the OS saves the vector registers.
std::string core_for_this_cpu() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl"))
    return "SkylakeX";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "Haswell";
  if (__builtin_cpu_supports("avx")) return "Sandybridge";
#endif
  return "";
}

BlasKernels choose() {
  BlasKernels k;
  if (openblas_get_corename == nullptr) return k;
  k.core = openblas_get_corename();
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr || strcasecmp(k.core.c_str(), "Prescott") != 0) return k;
  const std::string better = core_for_this_cpu();
  if (better.empty() || !use_blas_core(better)) return k;
  k.replaced = k.core;
  k.core = blas_core();
  return k;
}

// Before main, while the process has one thread: setenv below is then safe.
__attribute__((constructor)) void choose_at_load() { ensure_blas_kernels(); }

}  // namespace

const BlasKernels& ensure_blas_kernels() {
  static const BlasKernels chosen = choose();
  return chosen;
}

std::string blas_core() { return openblas_get_corename != nullptr ? openblas_get_corename() : ""; }

bool use_blas_core(const std::string& name) {
  if (openblas_get_corename == nullptr || gotoblas_dynamic_init == nullptr || gotoblas_dynamic_quit == nullptr)
    return false;
  // OpenBLAS reads the core from its environment variable only; it is restored right after.
  const char* previous = std::getenv("OPENBLAS_CORETYPE");
  const std::optional<std::string> saved = previous ? std::optional<std::string>(previous) : std::nullopt;
  if (name.empty()) ::unsetenv("OPENBLAS_CORETYPE");
  else ::setenv("OPENBLAS_CORETYPE", name.c_str(), 1);
  gotoblas_dynamic_quit();
  gotoblas_dynamic_init();
  if (saved) ::setenv("OPENBLAS_CORETYPE", saved->c_str(), 1);
  else ::unsetenv("OPENBLAS_CORETYPE");
  return name.empty() || strcasecmp(blas_core().c_str(), name.c_str()) == 0;
}

}  // namespace tuna
