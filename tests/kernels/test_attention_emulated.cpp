// The attention kernels' device code, run on the host emulator (build/attention_emulator_tests, from
// tests/kernels/attention_emulator): every build checks the tensor-core kernels' fragment layouts, swizzle,
// cp.async ordering and barriers, and the plain small-head-dim kernels, against the CPU twin with the GPU
// tests' tolerance rule; a GPU is not needed, and the GPU tests (test_attention_gpu.cpp) skip without one.
// The emulator is its own binary because it compiles the kernels against host stand-ins of the CUDA headers.
//
// Two runs at opposite ends of what the hardware may do (see attention_emulator/driver.cpp): cp.async data
// landing at issue with the warps in near lockstep, and landing at the wait with each warp running ahead. A
// read too early or a missing barrier shows as wrong numbers in one or the other, and as a race in both.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "tests/test_util.h"

namespace tuna {
namespace {

using testing_util::run_command;
using testing_util::TempDir;

void run_emulator(const std::string& options) {
  TempDir tmp("attention_emulator");
  const auto r = run_command(testing_util::build_dir() + "/attention_emulator_tests --quick " + options, tmp / "log");
  std::printf("%s", r.output.c_str());  // the errors against their bounds, as the GPU tests print them
  EXPECT_EQ(r.exit_code, 0) << "see the emulator's output above";
  EXPECT_NE(r.output.find(" cases, 0 failures, 0 blocks with races"), std::string::npos)
      << "see the emulator's output above";
}

TEST(AttentionEmulated, CopiesLandAtIssueWarpsInLockstep) {
  run_emulator("--timing immediate --schedule round-robin");
}

TEST(AttentionEmulated, CopiesLandAtTheirWaitWarpsInTurn) {
  run_emulator("--timing deferred --schedule warps-in-turn");
}

}  // namespace
}  // namespace tuna
