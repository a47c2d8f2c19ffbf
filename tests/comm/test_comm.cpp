// comm/comm's collectives under `mpirun -np 2` and `-np 4` (the tests themselves are in tests/mpi/test_comm.cpp).
#include <gtest/gtest.h>

#include <chrono>

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

// A pipeline stage that hangs before its send (TUNA_FAULT=hang_p2p, comm/fault_injection.h): the stage waiting
// for it stops the job within the timeout, naming the recv, itself and the hung rank (tests/mpi/test_comm.cpp).
TEST(DistComm, AHungStageStopsTheJobNamingTheRecv) {
  TempDir tmp("p2p_fault");
  const auto start = std::chrono::steady_clock::now();
  auto r = run_command("TUNA_FAULT=hang_p2p:1:1 " + mpirun(2) + kMpiTests +
                           " --gtest_also_run_disabled_tests --gtest_filter='CommFault.DISABLED_ARecvFromAHungStage'",
                       tmp / "log");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_LT(seconds, 2 + 10.0) << r.output;  // the timeout, up to 5 s of asking the others, mpirun's teardown
  EXPECT_NE(r.output.find("TUNA_FAULT: rank 1 hangs at send/recv #1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("error: rank 0: recv 'activations of micro-batch 0' (1024 elements from rank 1)"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("did not complete within 2 s (--comm_timeout): rank(s) 1 did not answer"), std::string::npos)
      << r.output;
}

// A stage that dies before its send: the job stops well within the test's timeout, and mpirun names the dead rank.
TEST(DistComm, ADeadStageStopsTheJob) {
  TempDir tmp("p2p_kill");
  const auto start = std::chrono::steady_clock::now();
  auto r = run_command("TUNA_FAULT=kill_p2p:1:1 " + mpirun(2) + kMpiTests +
                           " --gtest_also_run_disabled_tests --gtest_filter='CommFault.DISABLED_ARecvFromAHungStage'",
                       tmp / "log");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_LT(seconds, 2 + 10.0) << r.output;
  EXPECT_NE(r.output.find("TUNA_FAULT: rank 1 dies at send/recv #1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("process rank 1"), std::string::npos) << r.output;  // mpirun's notice
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
