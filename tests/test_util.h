// Helpers shared by tests that work with files and the built binaries.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace tuna::testing_util {

// A fresh directory under /tmp, removed when the object goes away.
struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& tag) {
    std::string templ = (std::filesystem::temp_directory_path() / ("tuna_" + tag + "_XXXXXX")).string();
    path = ::mkdtemp(templ.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::filesystem::path operator/(const std::string& name) const { return path / name; }
};

inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The directory holding the built binaries (tests run from the repository root).
inline std::string build_dir() {
  const char* b = std::getenv("TUNA_BUILD_DIR");
  return b ? b : "build";
}

struct RunResult {
  int exit_code;
  std::string output;  // stdout and stderr together
};

// Runs a shell command, capturing its output into a file beside the caller's temp data.
inline RunResult run_command(const std::string& command, const std::filesystem::path& log) {
  const std::string full = command + " > '" + log.string() + "' 2>&1";
  const int status = std::system(full.c_str());
  const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return {code, read_file(log)};
}

}  // namespace tuna::testing_util
