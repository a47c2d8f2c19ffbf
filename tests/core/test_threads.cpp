// core/threads.h: the thread count is what was asked (or cores / ranks), and the BLAS hint names the
// variable only when OpenBLAS really runs its Prescott fallback and the user has not chosen a core.
#include <gtest/gtest.h>
#include <omp.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "core/threads.h"

extern "C" char* openblas_get_corename() __attribute__((weak));

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

TEST(Threads, BlasHintOnlyForThePrescottFallback) {
  const std::string hint = blas_hint();
  const bool prescott = openblas_get_corename && std::strcmp(openblas_get_corename(), "Prescott") == 0;
  if (!prescott || std::getenv("OPENBLAS_CORETYPE")) {
    EXPECT_EQ(hint, "");
  }
  if (!hint.empty()) {
    EXPECT_NE(hint.find("OPENBLAS_CORETYPE="), std::string::npos) << hint;
  }
  // A core chosen by the user silences it.
  const char* before = std::getenv("OPENBLAS_CORETYPE");
  const std::string saved = before ? before : "";
  ::setenv("OPENBLAS_CORETYPE", "Haswell", 1);
  EXPECT_STREQ(blas_hint(), "");
  if (before) ::setenv("OPENBLAS_CORETYPE", saved.c_str(), 1);
  else ::unsetenv("OPENBLAS_CORETYPE");
}

}  // namespace
}  // namespace tuna
