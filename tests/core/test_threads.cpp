// core/threads.h: the thread count is what was asked (or cores / ranks), and the BLAS note appears exactly
// when tuna replaced OpenBLAS's kernels.
#include <gtest/gtest.h>
#include <omp.h>

#include <string>

#include "core/blas.h"
#include "core/threads.h"

namespace tuna {
namespace {

TEST(Threads, CountIsWhatWasAskedOrCoresPerRank) {
  EXPECT_EQ(set_cpu_threads(3), 3);
  EXPECT_EQ(omp_get_max_threads(), 3);
  const int all = omp_get_num_procs();
  EXPECT_EQ(set_cpu_threads(0, 1), all);
  EXPECT_EQ(set_cpu_threads(0, 4 * all), 1);  // more ranks than cores: still one thread each
  set_cpu_threads(0);
}

TEST(Threads, BlasHintOnlyWhenTunaReplacedTheKernels) {
  const BlasKernels& k = ensure_blas_kernels();
  const std::string hint = blas_hint();
  EXPECT_EQ(hint.empty(), k.replaced.empty()) << hint;
  if (!hint.empty()) {
    EXPECT_NE(hint.find(k.replaced), std::string::npos) << hint;
    EXPECT_NE(hint.find(k.core), std::string::npos) << hint;
  }
}

}  // namespace
}  // namespace tuna
