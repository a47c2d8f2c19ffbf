// dist/comm's collectives under `mpirun -np 2` and `-np 4` (the tests themselves are in tests/mpi/test_comm.cpp).
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

}  // namespace
}  // namespace tuna
