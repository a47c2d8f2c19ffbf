// The test runner's main: GoogleTest, plus one plain closing line ("N passed, N failed, N skipped")
// that CI reads whatever runner it expects.
#include <gtest/gtest.h>

#include <cstdio>

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  int rc = RUN_ALL_TESTS();
  const testing::UnitTest& unit = *testing::UnitTest::GetInstance();
  std::printf("tests: %d passed, %d failed, %d skipped\n", unit.successful_test_count(),
              unit.failed_test_count(), unit.skipped_test_count());
  return rc;
}
