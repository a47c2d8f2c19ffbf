#include "core/checksum.h"

#include <unistd.h>
// Inlined: the hash needs no library at link time, so every binary (the emulated GPU tests, gpu-check's
// static build for a machine without Debian's packages) can carry checkpoint code.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <memory>
#include <vector>

#include "core/error.h"
#include "core/file.h"

namespace tuna {

struct Checksum::State {
  XXH3_state_t* xxh = XXH3_createState();
  ~State() { XXH3_freeState(xxh); }
};

Checksum::Checksum() : state_(std::make_unique<State>()) {
  TUNA_CHECK(state_->xxh, "XXH3_createState failed");
  XXH3_64bits_reset(state_->xxh);
}

Checksum::~Checksum() = default;

void Checksum::update(const void* data, size_t bytes) {
  if (bytes == 0) return;
  XXH3_64bits_update(state_->xxh, data, bytes);
  bytes_ += bytes;
}

FileDigest Checksum::digest() const { return {bytes_, XXH3_64bits_digest(state_->xxh)}; }

FileDigest digest_file(const std::filesystem::path& path) {
  const int fd = open_regular_file(path, "checkpoint file");
  Checksum sum;
  // Not value-initialized: only the pages a read fills become resident (a manifest's digest costs a page, not 8 MB).
  constexpr size_t kBlock = size_t{8} << 20;
  const std::unique_ptr<char[]> block = std::make_unique_for_overwrite<char[]>(kBlock);
  while (true) {
    const ssize_t n = ::read(fd, block.get(), kBlock);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      fail(path.string(), ": read failed: ", std::strerror(err));
    }
    if (n == 0) break;
    sum.update(block.get(), static_cast<size_t>(n));
  }
  ::close(fd);
  return sum.digest();
}

std::string hex64(uint64_t value) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(value));
  return buf;
}

uint64_t parse_hex64(const std::string& text, const std::string& what) {
  uint64_t value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value, 16);
  if (text.size() != 16 || ec != std::errc() || end != text.data() + text.size())
    fail(what, ": expected 16 hex digits, found '", text, "'");
  return value;
}

}  // namespace tuna
