// core/blas: the kernels in use fit the CPU (never the generic fallback on a CPU with AVX2, unless the user
// named a core), and switching OpenBLAS's kernels at run time keeps the GEMMs correct, on whatever CPU CI has.
#include <gtest/gtest.h>
#include <strings.h>

#include <cstdlib>

#include "core/blas.h"
#include "kernels/cpu/matmul.h"
#include "tests/kernels/op_test_util.h"

namespace tuna {
namespace {

// cpu::matmul_fwd against a double loop on a shape with ragged edges for every kernel's tiling.
double matmul_error() {
  test::TestRng rng;
  const int64_t n = 37, ic = 29, oc = 53;
  const std::vector<float> inp = rng.vector<float>(n * ic), weight = rng.vector<float>(oc * ic);
  std::vector<float> out(n * oc);
  cpu::matmul_fwd(out.data(), inp.data(), weight.data(), n, ic, oc);
  std::vector<double> expected(n * oc, 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t o = 0; o < oc; ++o)
      for (int64_t c = 0; c < ic; ++c) expected[i * oc + o] += double(inp[i * ic + c]) * weight[o * ic + c];
  return test::rel_error_norm(out, expected);
}

TEST(Blas, KernelsFitTheCpu) {
  const BlasKernels& k = ensure_blas_kernels();
  if (k.core.empty()) GTEST_SKIP() << "not OpenBLAS";
  EXPECT_EQ(k.core, blas_core());
#if defined(__x86_64__)
  if (std::getenv("OPENBLAS_CORETYPE") == nullptr && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    EXPECT_STRCASENE(k.core.c_str(), "Prescott") << "the generic SSE3 kernels on a CPU with AVX2";
  }
#endif
  if (!k.replaced.empty()) {
    EXPECT_STRCASEEQ(k.replaced.c_str(), "Prescott");
  }
}

TEST(Blas, SwitchingKernelsKeepsGemmsCorrect) {
  const std::string original = blas_core();
  if (original.empty()) GTEST_SKIP() << "not OpenBLAS";
  EXPECT_LT(matmul_error(), 1e-6);
  ASSERT_TRUE(use_blas_core("Prescott"));
  EXPECT_STRCASEEQ(blas_core().c_str(), "Prescott");
  EXPECT_LT(matmul_error(), 1e-6);
  // Back to exactly the kernels the process had, by their name: whatever chose them (OpenBLAS from the CPU model,
  // an OPENBLAS_CORETYPE in the environment, or ensure_blas_kernels), naming them selects them again. Restoring
  // "OpenBLAS's own choice" instead left a process started with OPENBLAS_CORETYPE=Haswell on the CPU's own core,
  // and every later GEMM of the test process on other kernels than the binaries it compares with.
  ASSERT_TRUE(use_blas_core(original));
  EXPECT_EQ(blas_core(), original);
  EXPECT_LT(matmul_error(), 1e-6);
}

}  // namespace
}  // namespace tuna
