// ZeRO-1, -2 and -3's memory at 4 ranks (the test itself is tests/mpi/test_zero.cpp); its training runs against the
// single rank are in test_train_dist.cpp.
#include <gtest/gtest.h>

#include <cstdio>

#include "tests/dist/dist_test_util.h"

namespace tuna {
namespace {

using testing_util::mpirun;
using testing_util::run_command;
using testing_util::TempDir;

const std::string kMpiTests = testing_util::build_dir() + "/mpi_tests";

TEST(DistZero, MemoryOfEachStageAtFourRanks) {
  TempDir tmp("zero_mem");
  auto r = run_command(mpirun(4) + kMpiTests + " --gtest_filter='Zero.*'", tmp / "log");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("ZeRO-3 rank"), std::string::npos) << r.output;
  const size_t at = r.output.find("single rank");
  if (at != std::string::npos) std::printf("%s\n", r.output.substr(at, r.output.find('\n', at) - at).c_str());
}

}  // namespace
}  // namespace tuna
