// Deduplication: MinHash signatures, the spill of pass 1 and the global join. See data/dedup.h.
#include "data/dedup.h"

#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <parallel/algorithm>

#include "core/error.h"

namespace tuna {

namespace fs = std::filesystem;

namespace {

uint64_t splitmix64(uint64_t& state) {
  uint64_t x = (state += 0x9e3779b97f4a7c15ull);
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

bool is_word_byte(unsigned char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c >= 0x80;
}

// One (hash, global document id) entry of a column partition. 16 bytes with padding; sorted by both fields,
// so the order is total and a parallel sort gives the same array every time.
struct Entry {
  uint64_t hash;
  uint32_t id;
  bool operator<(const Entry& o) const { return hash != o.hash ? hash < o.hash : id < o.id; }
};

// Partition of a hash among `parts` ranges of equal width.
uint64_t partition_of(uint64_t hash, uint64_t parts) {
  return static_cast<uint64_t>((static_cast<unsigned __int128>(hash) * parts) >> 64);
}

class UnionFind {
 public:
  explicit UnionFind(uint64_t n) : parent_(n) { std::iota(parent_.begin(), parent_.end(), uint32_t{0}); }
  uint32_t find(uint32_t x) {
    while (parent_[x] != x) x = parent_[x] = parent_[parent_[x]];  // path halving
    return x;
  }
  // The smaller root wins: the component's root is its smallest id whatever the order of the unions.
  void join(uint32_t a, uint32_t b) {
    a = find(a), b = find(b);
    if (a == b) return;
    if (a < b) parent_[b] = a;
    else parent_[a] = b;
  }

 private:
  std::vector<uint32_t> parent_;
};

}  // namespace

double minhash_threshold(const MinHashOptions& o) {
  return std::pow(1.0 / static_cast<double>(o.bands), 1.0 / static_cast<double>(o.rows));
}

MinHasher::MinHasher(const MinHashOptions& options) : options_(options) {
  if (options.shingle_words < 1) fail("prepare: --shingle-words must be at least 1, found ", options.shingle_words);
  if (options.bands < 1 || options.rows < 1)
    fail("prepare: --minhash-bands and --minhash-rows must be at least 1, found ", options.bands, " and ",
         options.rows);
  if (options.bands > 64) fail("prepare: --minhash-bands is at most 64, found ", options.bands);
  const size_t perms = static_cast<size_t>(options.bands) * static_cast<size_t>(options.rows);
  uint64_t state = options.seed;
  for (size_t i = 0; i < perms; ++i) {
    multipliers_.push_back(splitmix64(state) | 1);  // odd: multiply-shift hashing
    increments_.push_back(splitmix64(state));
  }
}

bool MinHasher::band_hashes(std::string_view text, uint64_t* out) const {
  thread_local std::vector<uint64_t> words;
  thread_local std::vector<uint32_t> mins;
  thread_local std::string word;
  words.clear();
  for (size_t i = 0; i < text.size();) {
    while (i < text.size() && !is_word_byte(static_cast<unsigned char>(text[i]))) ++i;
    word.clear();
    while (i < text.size() && is_word_byte(static_cast<unsigned char>(text[i]))) {
      char c = text[i++];
      word.push_back(c >= 'A' && c <= 'Z' ? static_cast<char>(c + 32) : c);
    }
    if (!word.empty()) words.push_back(XXH3_64bits(word.data(), word.size()));
  }
  if (words.empty()) return false;
  const size_t perms = multipliers_.size();
  mins.assign(perms, UINT32_MAX);
  const size_t k = static_cast<size_t>(options_.shingle_words);
  const size_t shingles = words.size() > k ? words.size() - k + 1 : 1;
  const size_t width = std::min(k, words.size());
  const uint64_t* mul = multipliers_.data();
  const uint64_t* inc = increments_.data();
  uint32_t* m = mins.data();
  for (size_t s = 0; s < shingles; ++s) {
    const uint64_t h = XXH3_64bits(words.data() + s, width * sizeof(uint64_t));
    for (size_t j = 0; j < perms; ++j) m[j] = std::min(m[j], static_cast<uint32_t>((mul[j] * h + inc[j]) >> 32));
  }
  const size_t rows = static_cast<size_t>(options_.rows);
  for (int b = 0; b < options_.bands; ++b)
    out[b] = XXH3_64bits_withSeed(m + static_cast<size_t>(b) * rows, rows * sizeof(uint32_t),
                                  static_cast<uint64_t>(b)) |
             1;
  return true;
}

DedupSpill::DedupSpill(std::string dir, int bands) : dir_(std::move(dir)), bands_(bands) {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) fail("prepare: cannot create the scratch directory ", dir_, ": ", ec.message());
  for (int c = 0; c <= bands_; ++c) {
    std::FILE* f = std::fopen(path(c).c_str(), "w+b");
    if (!f) fail("prepare: cannot create ", path(c), ": ", std::strerror(errno));
    files_.push_back(f);
  }
}

DedupSpill::~DedupSpill() {
  for (std::FILE* f : files_) std::fclose(f);
  std::error_code ec;
  fs::remove_all(dir_, ec);
}

std::string DedupSpill::path(int column) const {
  return (fs::path(dir_) / (column == 0 ? std::string("exact.u64") : str("band-", column - 1, ".u64"))).string();
}

void DedupSpill::add(bool exact_eligible, uint64_t exact_hash, const uint64_t* band_hashes) {
  flags_.push_back(static_cast<uint8_t>((exact_eligible ? 1 : 0) | (band_hashes ? 2 : 0)));
  bool ok = std::fwrite(&exact_hash, sizeof exact_hash, 1, files_[0]) == 1;
  static const std::vector<uint64_t> zeros(64, 0);
  const uint64_t* bands = band_hashes ? band_hashes : zeros.data();
  for (int b = 0; b < bands_; ++b) ok &= std::fwrite(&bands[b], sizeof(uint64_t), 1, files_[1 + b]) == 1;
  if (!ok) fail("prepare: cannot write the dedup spill in ", dir_, ": ", std::strerror(errno));
}

template <typename Fn>
void DedupSpill::scan(int column, Fn&& fn) {
  std::FILE* f = files_[static_cast<size_t>(column)];
  if (std::fflush(f) != 0 || std::fseek(f, 0, SEEK_SET) != 0)
    fail("prepare: cannot read back ", path(column), ": ", std::strerror(errno));
  std::vector<uint64_t> chunk(size_t{1} << 16);
  uint64_t i = 0;
  while (i < flags_.size()) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(chunk.size(), flags_.size() - i));
    if (std::fread(chunk.data(), sizeof(uint64_t), want, f) != want)
      fail("prepare: cannot read back ", path(column), ": short read");
    for (size_t k = 0; k < want; ++k) fn(i + k, chunk[k]);
    i += want;
  }
}

std::vector<DedupVerdict> DedupSpill::join(PrepareComm& comm, bool near, uint64_t memory_bytes, int threads) {
  const std::vector<uint64_t> counts = comm.all_gather_value<uint64_t>(flags_.size());
  uint64_t base = 0, total = 0;
  for (int r = 0; r < comm.size(); ++r) {
    if (r < comm.rank()) base += counts[static_cast<size_t>(r)];
    total += counts[static_cast<size_t>(r)];
  }
  if (total >= (uint64_t{1} << 32))
    fail("prepare: ", total, " documents: dedup ids are 32-bit, run prepare on parts of under 4 billion");
  const uint64_t local = flags_.size();
  std::vector<DedupVerdict> verdict(local, DedupVerdict::unique);

  // One column, in partitions: gather every rank's eligible entries of the partition, sort, and hand each
  // group of two or more equal hashes (ids ascending) to on_group.
  auto join_column = [&](int column, auto&& eligible, auto&& on_group) {
    uint64_t mine = 0;
    for (uint64_t i = 0; i < local; ++i) mine += eligible(i);
    uint64_t entries = 0;
    for (uint64_t c : comm.all_gather_value<uint64_t>(mine)) entries += c;
    // A partition's entries live twice (this rank's and everyone's): 32 bytes each.
    const uint64_t parts = std::max<uint64_t>(1, (entries * 2 * sizeof(Entry) + memory_bytes - 1) / std::max<uint64_t>(memory_bytes, 1));
    for (uint64_t p = 0; p < parts; ++p) {
      std::vector<Entry> part;
      scan(column, [&](uint64_t i, uint64_t hash) {
        if (eligible(i) && partition_of(hash, parts) == p) part.push_back({hash, static_cast<uint32_t>(base + i)});
      });
      std::vector<Entry> all = comm.size() == 1 ? std::move(part) : comm.all_gather_values(part);
      part = {};
      __gnu_parallel::sort(all.begin(), all.end(), std::less<Entry>(),
                           __gnu_parallel::default_parallel_tag(std::max(1, threads)));
      for (size_t g = 0; g < all.size();) {
        size_t end = g + 1;
        while (end < all.size() && all[end].hash == all[g].hash) ++end;
        if (end - g > 1) on_group(all.data() + g, all.data() + end);
        g = end;
      }
    }
  };

  // Exact: in a group of equal hashes, all but the earliest are duplicates.
  join_column(
      0, [&](uint64_t i) { return (flags_[i] & 1) != 0; },
      [&](const Entry* begin, const Entry* end) {
        for (const Entry* e = begin + 1; e < end; ++e)
          if (e->id >= base && e->id < base + local) verdict[e->id - base] = DedupVerdict::exact_duplicate;
      });
  if (!near) return verdict;

  // Near: documents that share a band are joined; exact duplicates stay out (they are counted as such).
  auto near_eligible = [&](uint64_t i) { return (flags_[i] & 2) != 0 && verdict[i] == DedupVerdict::unique; };
  UnionFind clusters(total);
  for (int b = 0; b < bands_; ++b)
    join_column(1 + b, near_eligible, [&](const Entry* begin, const Entry* end) {
      for (const Entry* e = begin + 1; e < end; ++e) clusters.join(begin->id, e->id);
    });
  for (uint64_t i = 0; i < local; ++i)
    if (near_eligible(i) && clusters.find(static_cast<uint32_t>(base + i)) != base + i)
      verdict[i] = DedupVerdict::near_duplicate;
  return verdict;
}

}  // namespace tuna
