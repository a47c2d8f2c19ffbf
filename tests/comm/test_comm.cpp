// comm/comm's collectives under `mpirun -np 2` and `-np 4` (the tests themselves are in tests/mpi/test_comm.cpp).
#include <gtest/gtest.h>

#include "tests/dist/dist_test_util.h"

namespace tuna {
namespace {

using testing_util::mpirun;
using testing_util::run_command;
using testing_util::TempDir;

const std::string kMpiTests = testing_util::build_dir() + "/mpi_tests";

TEST(DistComm, CollectivesOnTwoAndFourRanks) {
  TempDir tmp("comm");
  for (int np : {2, 3, 4}) {
    auto r = run_command(mpirun(np) + kMpiTests + " --gtest_filter='Comm.*'", tmp / "log");
    EXPECT_EQ(r.exit_code, 0) << "np " << np << "\n" << r.output;
  }
}

// The NCCL backend's test, where the build has NCCL (it skips itself without a GPU per rank).
TEST(DistComm, NcclCollectivesWhereGpusAre) {
#if TUNA_NCCL
  TempDir tmp("nccl");
  auto r = run_command(mpirun(2) + kMpiTests + " --gtest_filter='NcclComm.*'", tmp / "log");
  EXPECT_EQ(r.exit_code, 0) << r.output;
#else
  GTEST_SKIP() << "built without NCCL";
#endif
}

}  // namespace
}  // namespace tuna
