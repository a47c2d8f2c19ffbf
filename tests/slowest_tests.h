// The slowest tests of a run, printed at its end: where `make test`'s time goes, so that a test that trains longer
// than its claim needs is seen (CI runs on two cores in a bounded time).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace tuna::testing_util {

class SlowestTests : public ::testing::EmptyTestEventListener {
 public:
  explicit SlowestTests(size_t count) : count_(count) {}
  void OnTestEnd(const ::testing::TestInfo& test) override {
    times_.emplace_back(test.result()->elapsed_time(), std::string(test.test_suite_name()) + "." + test.name());
  }
  void OnTestProgramEnd(const ::testing::UnitTest& unit) override {
    if (times_.empty()) return;
    std::sort(times_.begin(), times_.end(), std::greater<>());
    std::printf("slowest %zu of %zu tests (%.1f s in all):\n", std::min(count_, times_.size()), times_.size(),
                unit.elapsed_time() / 1000.0);
    for (size_t i = 0; i < count_ && i < times_.size(); ++i)
      std::printf("  %8.1f s  %s\n", times_[i].first / 1000.0, times_[i].second.c_str());
  }

 private:
  size_t count_;
  std::vector<std::pair<long long, std::string>> times_;
};

inline void print_slowest_tests(size_t count) {
  ::testing::UnitTest::GetInstance()->listeners().Append(new SlowestTests(count));
}

}  // namespace tuna::testing_util
