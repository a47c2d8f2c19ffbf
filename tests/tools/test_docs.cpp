// The user pages stay true to the repository (scripts/check-docs.py): every link and anchor of README.md, docs/ and
// benchmarks/ resolves, every path they name exists, every --option they give a tool is one the built tool
// declares, no page lists test names, and no tracked file points outside the repository. Skipped, saying so, where
// python3 is not installed.
#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace tuna {
namespace {

using testing_util::run_command;
using testing_util::TempDir;

TEST(Docs, PagesAgreeWithTheRepository) {
  if (std::system("python3 --version > /dev/null 2>&1") != 0) GTEST_SKIP() << "python3 is not installed";
  TempDir tmp("docs");
  const auto r = run_command("python3 scripts/check-docs.py " + testing_util::build_dir(), tmp / "log");
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

}  // namespace
}  // namespace tuna
