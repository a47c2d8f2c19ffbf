// Helpers shared by the tests of data/: a temporary directory, small file writers, and a check that a
// call fails with a tuna::Error whose message holds given pieces.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>
#include <zlib.h>
#include <zstd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <string>

#include "core/error.h"

namespace tuna::testing_data {

// A fresh directory under $TMPDIR, removed with everything in it at scope exit.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "tuna-test-XXXXXX").string();
    if (!::mkdtemp(pattern.data())) throw std::runtime_error("mkdtemp failed");
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

inline void write_file(const std::string& path, const std::string& bytes) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
  ASSERT_TRUE(out.good()) << path;
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// The bundled demo corpus (demo/corpus/text), found from the working directory upwards so that the test
// binary runs from the repository root or from build/.
inline std::filesystem::path demo_corpus() {
  for (auto dir = std::filesystem::current_path(); !dir.empty(); dir = dir.parent_path()) {
    if (std::filesystem::is_directory(dir / "demo/corpus/text")) return dir / "demo/corpus/text";
    if (dir == dir.root_path()) break;
  }
  throw std::runtime_error("demo/corpus/text not found above the working directory");
}

// `text` as one gzip member / one zstd frame (concatenate results for several).
inline std::string gzip_bytes(const std::string& text) {
  z_stream z{};
  deflateInit2(&z, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY);  // +16: gzip header
  std::string out(deflateBound(&z, text.size()) + 64, '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(text.data()));
  z.avail_in = static_cast<uInt>(text.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  deflate(&z, Z_FINISH);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}
inline std::string zstd_bytes(const std::string& text) {
  std::string out(ZSTD_compressBound(text.size()), '\0');
  out.resize(ZSTD_compress(out.data(), out.size(), text.data(), text.size(), 3));
  return out;
}

// Runs fn, expects a tuna::Error whose message contains every piece.
inline void expect_error(const std::function<void()>& fn, std::initializer_list<std::string> pieces) {
  try {
    fn();
  } catch (const tuna::Error& e) {
    const std::string message = e.what();
    for (const std::string& piece : pieces)
      EXPECT_NE(message.find(piece), std::string::npos) << "message: " << message << "\nlacks: " << piece;
    return;
  }
  ADD_FAILURE() << "expected a tuna::Error";
}

}  // namespace tuna::testing_data
