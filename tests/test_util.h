// Helpers shared by tests that work with files and the built binaries.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <fstream>
#include <optional>
#include <sstream>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/shard.h"

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

// Environment variables set or unset for a scope and put back as they were at its end (tests/process_state.h
// fails a test that leaves the environment changed).
class ScopedEnv {
 public:
  ScopedEnv() = default;
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  ~ScopedEnv() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      if (it->second) ::setenv(it->first.c_str(), it->second->c_str(), 1);
      else ::unsetenv(it->first.c_str());
    }
  }
  void set(const std::string& name, const std::string& value) {
    save(name);
    ::setenv(name.c_str(), value.c_str(), 1);
  }
  void unset(const std::string& name) {
    save(name);
    ::unsetenv(name.c_str());
  }

 private:
  void save(const std::string& name) {
    const char* v = std::getenv(name.c_str());
    saved_.emplace_back(name, v ? std::optional<std::string>(v) : std::nullopt);
  }
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

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

// The message of the tuna::Error that f throws; empty when it throws none.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Token shards for trainer tests (vocab 128): a learnable stream, 62 training windows of 16
// tokens in train-0000{0,1}.bin, 31 in val-00000.bin.
// tokenizer_fingerprint: what the shards record of the tokenizer that wrote them (0: unknown).
inline void write_test_shards(const std::filesystem::path& dir, uint64_t tokenizer_fingerprint = 0) {
  std::filesystem::create_directories(dir);
  std::mt19937 rng(5);
  for (const char* name : {"train-00000.bin", "train-00001.bin", "val-00000.bin"}) {
    ShardWriter w((dir / name).string(), 128, /*with_mask=*/false, tokenizer_fingerprint);
    for (int doc = 0; doc < 12; doc++) {
      std::vector<int32_t> tokens{1};
      const int start = rng() % 100;
      for (int i = 0; i < 40; i++) tokens.push_back(3 + (start + i * 7) % 120);
      tokens.push_back(2);
      w.add_document(tokens);
    }
    w.finish();
  }
}

}  // namespace tuna::testing_util
