// OpenBLAS's GEMM kernels, chosen for the CPU this process runs on.
//
// An OpenBLAS built with DYNAMIC_ARCH (Debian's) picks its kernels when it loads, from the CPU's model
// number. A release older than the CPU does not know the model and falls back to its generic SSE3 kernels
// ("Prescott"): Debian 12's 0.3.21 does so on Sapphire Rapids Xeons, where that halves the CPU training step.
// ensure_blas_kernels() then does what a newer OpenBLAS (the one numpy ships) does: it picks the kernels from
// the CPU's features (AVX-512 -> SkylakeX, AVX2 + FMA -> Haswell, AVX -> Sandybridge) and reruns OpenBLAS's
// dispatch with that core, exactly as OPENBLAS_CORETYPE would have at load. A core named in OPENBLAS_CORETYPE
// is left alone, and so is a BLAS without that dispatch (the reference BLAS of the gpu-check build).
//
// It runs once per process, before main (core/blas.cpp) and again, as a no-op, before the first GEMM
// (kernels/cpu/matmul.cpp), so every binary that computes on the CPU gets it; the kernels never change while
// a run computes, so results stay independent of the thread count.
#pragma once

#include <string>

namespace tuna {

struct BlasKernels {
  std::string core;      // OpenBLAS's name for the kernels in use ("SkylakeX"); empty when not OpenBLAS
  std::string replaced;  // the core OpenBLAS had chosen, when tuna replaced it ("Prescott"); else empty
};

// Idempotent and thread-safe; the first call decides.
const BlasKernels& ensure_blas_kernels();

// Reruns OpenBLAS's dispatch with a core of OpenBLAS's naming ("Haswell"; case-insensitive), or with its own
// choice from the CPU model when `name` is empty, and returns whether that is now in use: false when this BLAS
// has no run-time dispatch or does not know the name (it then keeps a working core of its own choice). Not
// while a BLAS call runs. For ensure_blas_kernels and tests.
bool use_blas_core(const std::string& name);

// The core in use now ("" when not OpenBLAS).
std::string blas_core();

}  // namespace tuna
