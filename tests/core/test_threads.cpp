// core/threads.h: the thread count is what was asked (or cores / ranks), and the BLAS note appears exactly
// when tuna replaced OpenBLAS's kernels.
#include <gtest/gtest.h>
#include <omp.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "core/blas.h"
#include "core/threads.h"
#include "tests/test_util.h"

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

// OpenMP's idle threads sleep by default (passive), set before the runtime reads its environment; a policy in
// the environment is kept. The default is checked in a process started without one: this binary again, run for
// this test only.
TEST(Threads, WaitPolicyIsPassiveUnlessTheEnvironmentSetsOne) {
  const CpuWaitPolicy policy = cpu_wait_policy();
  if (!policy.from_environment) {
    EXPECT_STREQ(policy.policy, "passive");
    EXPECT_STREQ(std::getenv("OMP_WAIT_POLICY"), "passive");
  }
  if (const char* expect = std::getenv("TUNA_WAIT_POLICY_CHILD")) {  // the child: what its parent expects
    EXPECT_EQ(policy.from_environment, std::string(expect) == "environment");
    EXPECT_STREQ(policy.policy, std::string(expect) == "environment" ? "active" : "passive");
    return;
  }
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  const std::string filter = " --gtest_filter=Threads.WaitPolicyIsPassiveUnlessTheEnvironmentSetsOne";
  const testing_util::TempDir tmp("waitpolicy");
  auto r = testing_util::run_command(
      "env -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT -u TUNA_OMP_WAIT_POLICY_DEFAULTED TUNA_WAIT_POLICY_CHILD=default " + self + filter, tmp / "child.log");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[  PASSED  ] 1 test"), std::string::npos) << r.output;
  r = testing_util::run_command("env -u GOMP_SPINCOUNT OMP_WAIT_POLICY=active TUNA_WAIT_POLICY_CHILD=environment " +
                                    self + filter,
                                tmp / "child2.log");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[  PASSED  ] 1 test"), std::string::npos) << r.output;
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
