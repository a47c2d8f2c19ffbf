// The test runner's main: GoogleTest, the process-state guard (a test that leaves the process changed fails the
// run: tests/process_state.h), plus one plain closing line ("N passed, N failed, N skipped") that CI reads whatever
// runner it expects.
#include <gtest/gtest.h>

#include <cstdio>

#include "tests/process_state.h"
#include "tests/slowest_tests.h"

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  const tuna::testing_util::ProcessStateGuard& guard = tuna::testing_util::guard_process_state();
  tuna::testing_util::print_slowest_tests(15);
  int rc = RUN_ALL_TESTS();
  const testing::UnitTest& unit = *testing::UnitTest::GetInstance();
  std::printf("tests: %d passed, %d failed, %d skipped\n", unit.successful_test_count(),
              unit.failed_test_count(), unit.skipped_test_count());
  if (guard.tests_that_changed_state() > 0) {
    std::printf("tests: %d left the process changed (see PROCESS STATE above)\n", guard.tests_that_changed_state());
    rc = rc ? rc : 1;
  }
  return rc;
}
