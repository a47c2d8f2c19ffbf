// The precomputed reference's file: see data/reference_logps.h.
#include "data/reference_logps.h"

#include <unistd.h>
#include <xxhash.h>

#include <cstdio>
#include <cstring>

#include "core/checksum.h"
#include "core/error.h"
#include "core/file.h"

namespace tuna {

namespace {

constexpr char kMagic[8] = {'T', 'U', 'N', 'A', 'R', 'E', 'F', 'L'};
constexpr uint32_t kVersion = 1;
constexpr uint64_t kHeaderBytes = 48;

template <typename T>
T get(const char* at) {
  T v;
  std::memcpy(&v, at, sizeof v);
  return v;
}

}  // namespace

uint64_t files_key(const std::vector<std::string>& paths) {
  std::vector<uint64_t> parts;
  for (const std::string& p : paths) {
    const FileDigest d = digest_file(p);
    parts.push_back(d.bytes), parts.push_back(d.xxh3);
  }
  return XXH3_64bits(parts.data(), parts.size() * sizeof(uint64_t));
}

std::filesystem::path reference_logps_path(const std::vector<std::string>& shards) {
  TUNA_CHECK(!shards.empty(), "no shards");
  return std::filesystem::path(shards.front()).parent_path() / "reference-logps.bin";
}

std::optional<ReferenceLogps> read_reference_logps(const std::filesystem::path& path, const ReferenceKey& key,
                                                   uint64_t pairs) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return std::nullopt;
  const uint64_t expected = kHeaderBytes + pairs * 16;
  const std::string bytes = read_regular_file(path, "reference log-probs", expected + 1);
  if (bytes.size() < kHeaderBytes || std::memcmp(bytes.data(), kMagic, 8) != 0)
    fail("reference log-probs ", path.string(), ": not a tuna reference file (bad magic or too short)");
  if (get<uint32_t>(bytes.data() + 8) != kVersion)
    fail("reference log-probs ", path.string(), ": version ", get<uint32_t>(bytes.data() + 8), ", this build reads ",
         kVersion);
  const ReferenceKey found{get<uint64_t>(bytes.data() + 16), get<uint64_t>(bytes.data() + 24),
                           get<uint64_t>(bytes.data() + 32)};
  const std::string again = str(": delete it to compute the reference again from this run's starting weights");
  if (found.data != key.data)
    fail("reference log-probs ", path.string(), " were computed for other data (the shards changed since)", again);
  if (found.model != key.model)
    fail("reference log-probs ", path.string(), " were computed with another model (the starting weights differ)", again);
  if (found.options != key.options)
    fail("reference log-probs ", path.string(), " were computed with other options (seq_len, document masks)", again);
  if (get<uint64_t>(bytes.data() + 40) != pairs || bytes.size() != expected)
    fail("reference log-probs ", path.string(), ": ", get<uint64_t>(bytes.data() + 40), " pairs in ", bytes.size(),
         " bytes, the shards hold ", pairs, " pairs (", expected, " bytes)", again);
  ReferenceLogps out;
  out.key = found;
  out.chosen.resize(pairs), out.rejected.resize(pairs);
  for (uint64_t p = 0; p < pairs; ++p) {
    out.chosen[p] = get<double>(bytes.data() + kHeaderBytes + 16 * p);
    out.rejected[p] = get<double>(bytes.data() + kHeaderBytes + 16 * p + 8);
  }
  return out;
}

void write_reference_logps(const std::filesystem::path& path, const ReferenceLogps& logps) {
  TUNA_CHECK(logps.chosen.size() == logps.rejected.size(), "reference log-probs of unequal halves");
  std::string bytes(kHeaderBytes + logps.chosen.size() * 16, '\0');
  std::memcpy(bytes.data(), kMagic, 8);
  auto put = [&](size_t at, auto v) { std::memcpy(bytes.data() + at, &v, sizeof v); };
  put(8, kVersion);
  put(16, logps.key.data), put(24, logps.key.model), put(32, logps.key.options);
  put(40, uint64_t(logps.chosen.size()));
  for (size_t p = 0; p < logps.chosen.size(); ++p) put(kHeaderBytes + 16 * p, logps.chosen[p]), put(kHeaderBytes + 16 * p + 8, logps.rejected[p]);
  const std::string tmp = path.string() + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) fail("reference log-probs ", path.string(), ": cannot create ", tmp, ": ", std::strerror(errno));
  const bool ok = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size() && std::fflush(f) == 0 &&
                  ::fsync(fileno(f)) == 0;
  std::fclose(f);
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    fail("reference log-probs ", path.string(), ": cannot write it: ", std::strerror(errno));
  }
}

}  // namespace tuna
