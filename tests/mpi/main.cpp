// build/mpi_tests: GoogleTest under mpirun. Every rank runs every test; the process exits non-zero on every
// rank when a test failed on any, so mpirun's exit code is the verdict. Only rank 0 prints the summary.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <memory>

#include "tests/mpi/mpi_test_util.h"
#include "tests/process_state.h"

namespace tuna::test {
namespace {
std::unique_ptr<Comm> g_world;

// Ranks other than 0 print only their failures, prefixed with the rank.
class FailurePrinter : public testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const testing::TestPartResult& r) override {
    if (r.failed())
      std::fprintf(stderr, "[rank %d] %s:%d: failure\n%s\n", rank_, r.file_name() ? r.file_name() : "?",
                   r.line_number(), r.summary());
  }

 private:
  int rank_;
};
}  // namespace
Comm& world() { return *g_world; }
}  // namespace tuna::test

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) {  // one rank's report is enough; failures on other ranks still show in the exit code
    testing::TestEventListeners& listeners = testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new tuna::test::FailurePrinter(rank));
  }
  tuna::test::g_world = tuna::make_mpi_world_comm(/*timeout_s=*/60);
  const tuna::testing_util::ProcessStateGuard& guard = tuna::testing_util::guard_process_state();
  int rc = RUN_ALL_TESTS();
  if (guard.tests_that_changed_state() > 0) {
    std::fprintf(stderr, "[rank %d] %d tests left the process changed (see PROCESS STATE above)\n", rank,
                 guard.tests_that_changed_state());
    rc = rc ? rc : 1;
  }
  int worst = 0;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0) {
    const testing::UnitTest& unit = *testing::UnitTest::GetInstance();
    std::printf("mpi tests (rank 0): %d passed, %d failed, %d skipped; any rank failed: %s\n",
                unit.successful_test_count(), unit.failed_test_count(), unit.skipped_test_count(),
                worst ? "yes" : "no");
  }
  tuna::test::g_world.reset();
  MPI_Finalize();
  return worst;
}
