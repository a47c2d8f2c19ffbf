// Checksums of the files tuna writes (checkpoint manifests): XXH3-64, streamed, so that a file is hashed as it
// is written and verified without holding it in memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

namespace tuna {

// A file's size and the XXH3-64 of its bytes.
struct FileDigest {
  uint64_t bytes = 0;
  uint64_t xxh3 = 0;
  bool operator==(const FileDigest&) const = default;
};

// XXH3-64 over bytes given in pieces: the same value as one XXH3_64bits call over their concatenation.
class Checksum {
 public:
  Checksum();
  ~Checksum();
  Checksum(const Checksum&) = delete;
  Checksum& operator=(const Checksum&) = delete;
  void update(const void* data, size_t bytes);
  FileDigest digest() const;  // bytes seen so far and their hash

 private:
  struct State;
  std::unique_ptr<State> state_;
  uint64_t bytes_ = 0;
};

// Reads a regular file through (core/file.h: a FIFO or device is refused by name).
FileDigest digest_file(const std::filesystem::path& path);

// 16 lowercase hex digits, and back (nullopt-free: fails naming `what` on anything else).
std::string hex64(uint64_t value);
uint64_t parse_hex64(const std::string& text, const std::string& what);

}  // namespace tuna
