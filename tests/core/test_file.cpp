// Where a file is expected, only a regular file is opened: FIFOs, devices, directories and symlink loops are
// refused by name, without blocking.
#include "core/file.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>

#include "core/error.h"
#include "tests/test_util.h"

namespace tuna {
namespace {

std::string error_of(const std::filesystem::path& p, uint64_t max_bytes = 1 << 20) {
  try {
    read_regular_file(p, "config file", max_bytes);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(File, OnlyRegularFilesAreRead) {
  testing_util::TempDir tmp("file");
  std::ofstream(tmp / "ok.json") << "{}";
  EXPECT_EQ(read_regular_file(tmp / "ok.json", "config file", 10), "{}");
  ASSERT_EQ(::mkfifo((tmp / "fifo").c_str(), 0600), 0);
  EXPECT_NE(error_of(tmp / "fifo").find("is a FIFO (named pipe), not a regular file (expected the config file)"),
            std::string::npos);
  EXPECT_NE(error_of("/dev/zero").find("is a character device"), std::string::npos);
  EXPECT_NE(error_of(tmp.path).find("is a directory"), std::string::npos);
  ASSERT_EQ(::symlink((tmp / "loop_b").c_str(), (tmp / "loop_a").c_str()), 0);
  ASSERT_EQ(::symlink((tmp / "loop_a").c_str(), (tmp / "loop_b").c_str()), 0);
  EXPECT_NE(error_of(tmp / "loop_a").find("symlink loop"), std::string::npos);
  EXPECT_NE(error_of(tmp / "missing").find("No such file"), std::string::npos);
  EXPECT_NE(error_of(tmp / "ok.json", 1).find("2 bytes, more than the 1"), std::string::npos);
}

TEST(File, DirectoriesAreCheckedByName) {
  testing_util::TempDir tmp("dir");
  std::ofstream(tmp / "f") << "x";
  EXPECT_NO_THROW(require_directory(tmp.path, "a model directory"));
  auto error = [](const std::filesystem::path& p) {
    try {
      require_directory(p, "a model directory");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(error(tmp / "f").find("is a regular file, not a directory (expected a model directory)"), std::string::npos);
  EXPECT_NE(error(tmp / "none").find("no such directory"), std::string::npos);
}

}  // namespace
}  // namespace tuna
