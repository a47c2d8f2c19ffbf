// Deduplication: MinHash signatures, the spill of pass 1 and the global join. See data/dedup.h.
#include "data/dedup.h"

#include <xxhash.h>

#include <algorithm>
#include <bit>
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

// Every permutation's minimum over the shingles: the hot loop of MinHash. Lanes of 8 permutations, so that
// the compiler vectorizes without a remainder loop (-O2's cost model alone declines, hence the optimize
// attribute); the clones pick the widest vectors the CPU has at run time (x86-64-v4: 64-bit lane multiplies).
// Integer math: every clone gives the same minima.
constexpr size_t kLanes = 8;
#if defined(__x86_64__)
#define TUNA_MINHASH_CLONES [[gnu::target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")]]
#else
#define TUNA_MINHASH_CLONES  // other architectures (aarch64 Grace nodes): the baseline vectors only
#endif
[[gnu::optimize("tree-vectorize", "vect-cost-model=dynamic")]] TUNA_MINHASH_CLONES void
update_minima(const uint64_t* __restrict hashes, size_t count, const uint64_t* __restrict mul,
              const uint64_t* __restrict inc, uint32_t* __restrict mins, size_t padded) {
  for (size_t s = 0; s < count; ++s) {
    const uint64_t h = hashes[s];
    for (size_t j0 = 0; j0 < padded; j0 += kLanes)
      for (size_t j = j0; j < j0 + kLanes; ++j) {
        const uint32_t v = static_cast<uint32_t>((mul[j] * h + inc[j]) >> 32);
        mins[j] = mins[j] < v ? mins[j] : v;
      }
  }
}

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
  // Padding permutations (computed, never read) so that the minima loop runs whole lanes.
  while (multipliers_.size() % kLanes != 0) multipliers_.push_back(1), increments_.push_back(0);
}

bool MinHasher::band_hashes(std::string_view text, uint64_t* out, uint8_t* sketch) const {
  thread_local std::vector<uint64_t> words;
  thread_local std::vector<uint32_t> mins;
  thread_local std::string word;
  words.clear();
  for (size_t i = 0; i < text.size();) {
    while (i < text.size() && !is_word_byte(static_cast<unsigned char>(text[i]))) ++i;
    const size_t start = i;
    bool upper = false;
    while (i < text.size() && is_word_byte(static_cast<unsigned char>(text[i]))) upper |= text[i] >= 'A' && text[i] <= 'Z', ++i;
    if (i == start) continue;
    if (!upper) {  // hashed in place; a copy only to lowercase
      words.push_back(XXH3_64bits(text.data() + start, i - start));
      continue;
    }
    word.assign(text.data() + start, i - start);
    for (char& c : word) c = c >= 'A' && c <= 'Z' ? static_cast<char>(c + 32) : c;
    words.push_back(XXH3_64bits(word.data(), word.size()));
  }
  if (words.empty()) return false;
  const size_t perms = static_cast<size_t>(options_.bands) * static_cast<size_t>(options_.rows);
  mins.assign(multipliers_.size(), UINT32_MAX);  // padded to a multiple of kLanes
  const size_t k = static_cast<size_t>(options_.shingle_words);
  const size_t shingles = words.size() > k ? words.size() - k + 1 : 1;
  const size_t width = std::min(k, words.size());
  thread_local std::vector<uint64_t> hashes;
  hashes.resize(shingles);
  for (size_t s = 0; s < shingles; ++s) hashes[s] = XXH3_64bits(words.data() + s, width * sizeof(uint64_t));
  update_minima(hashes.data(), shingles, multipliers_.data(), increments_.data(), mins.data(), mins.size());
  const uint32_t* m = mins.data();
  const size_t rows = static_cast<size_t>(options_.rows);
  for (int b = 0; b < options_.bands; ++b)
    out[b] = XXH3_64bits_withSeed(m + static_cast<size_t>(b) * rows, rows * sizeof(uint32_t),
                                  static_cast<uint64_t>(b)) |
             1;
  if (sketch) {
    std::fill(sketch, sketch + sketch_bytes(), 0);
    for (size_t j = 0; j < perms; ++j) sketch[j / 4] |= static_cast<uint8_t>((m[j] & 3u) << (2 * (j % 4)));
  }
  return true;
}

DedupSpill::DedupSpill(std::string dir, int bands, int sketch_fields)
    : dir_(std::move(dir)),
      bands_(bands),
      sketch_fields_(sketch_fields),
      sketch_bytes_((static_cast<size_t>(sketch_fields) + 3) / 4) {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) fail("prepare: cannot create the scratch directory ", dir_, ": ", ec.message());
  for (int c = 0; c <= bands_ + (sketch_fields_ > 0 ? 1 : 0); ++c) {
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
  const std::string name = column == 0            ? std::string("exact.u64")
                           : column == bands_ + 1 ? std::string("sketch.bin")
                                                  : str("band-", column - 1, ".u64");
  return (fs::path(dir_) / name).string();
}

void DedupSpill::add(bool exact_eligible, uint64_t exact_hash, const uint64_t* band_hashes, const uint8_t* sketch) {
  TUNA_CHECK(!(band_hashes && sketch_fields_ > 0 && !sketch), "a spill with sketches needs one per document");
  flags_.push_back(static_cast<uint8_t>((exact_eligible ? 1 : 0) | (band_hashes ? 2 : 0)));
  bool ok = std::fwrite(&exact_hash, sizeof exact_hash, 1, files_[0]) == 1;
  static const std::vector<uint64_t> zeros(512, 0);
  const uint64_t* bands = band_hashes ? band_hashes : zeros.data();
  for (int b = 0; b < bands_; ++b) ok &= std::fwrite(&bands[b], sizeof(uint64_t), 1, files_[1 + b]) == 1;
  if (sketch_fields_ > 0) {
    const void* bytes = band_hashes ? static_cast<const void*>(sketch) : static_cast<const void*>(zeros.data());
    ok &= std::fwrite(bytes, 1, sketch_bytes_, files_[static_cast<size_t>(bands_) + 1]) == sketch_bytes_;
  }
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

std::vector<DedupVerdict> DedupSpill::join(PrepareComm& comm, bool near, uint64_t memory_bytes, int threads,
                                           double verify) {
  TUNA_CHECK(verify <= 0 || sketch_fields_ > 0, "verification needs a spill with sketches");
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
  if (verify <= 0) {
    for (int b = 0; b < bands_; ++b)
      join_column(1 + b, near_eligible, [&](const Entry* begin, const Entry* end) {
        for (const Entry* e = begin + 1; e < end; ++e) clusters.join(begin->id, e->id);
      });
  } else {
    // Sweep 1: which documents have a candidate at all (one bit each).
    std::vector<bool> candidate(total, false);
    for (int b = 0; b < bands_; ++b)
      join_column(1 + b, near_eligible, [&](const Entry* begin, const Entry* end) {
        for (const Entry* e = begin; e < end; ++e) candidate[e->id] = true;
      });
    // Their sketches, from every rank: (id, sketch) records sorted by id, the same on every rank.
    std::vector<char> mine;
    {
      std::FILE* f = files_[static_cast<size_t>(bands_) + 1];
      if (std::fflush(f) != 0 || std::fseek(f, 0, SEEK_SET) != 0)
        fail("prepare: cannot read back ", path(bands_ + 1), ": ", std::strerror(errno));
      std::vector<char> record(sketch_bytes_);
      for (uint64_t i = 0; i < local; ++i) {
        if (std::fread(record.data(), 1, sketch_bytes_, f) != sketch_bytes_)
          fail("prepare: cannot read back ", path(bands_ + 1), ": short read");
        if (!candidate[base + i] || !near_eligible(i)) continue;
        const uint32_t id = static_cast<uint32_t>(base + i);
        mine.insert(mine.end(), reinterpret_cast<const char*>(&id), reinterpret_cast<const char*>(&id) + 4);
        mine.insert(mine.end(), record.begin(), record.end());
      }
    }
    const std::vector<char> all = comm.size() == 1 ? std::move(mine) : comm.all_gather(mine.data(), mine.size());
    mine = {};
    const size_t stride = 4 + sketch_bytes_;
    const size_t known = all.size() / stride;  // in id order: ranks in order, each in local order
    auto sketch_of = [&](uint32_t id) -> const uint8_t* {
      size_t lo = 0, hi = known;
      while (lo < hi) {
        const size_t mid = (lo + hi) / 2;
        uint32_t at;
        std::memcpy(&at, all.data() + mid * stride, 4);
        if (at < id) lo = mid + 1;
        else hi = mid;
      }
      uint32_t at = 0;
      if (lo < known) std::memcpy(&at, all.data() + lo * stride, 4);
      TUNA_CHECK(lo < known && at == id, "no sketch for candidate document ", id);
      return reinterpret_cast<const uint8_t*>(all.data() + lo * stride + 4);
    };
    // Fields that must match: J >= verify  <=>  matches >= fields * (verify * 3/4 + 1/4).
    const double need = static_cast<double>(sketch_fields_) * (verify * 0.75 + 0.25);
    auto similar = [&](uint32_t a, uint32_t b) {
      const uint8_t* x = sketch_of(a);
      const uint8_t* y = sketch_of(b);
      int differ = 0;
      for (size_t k = 0; k < sketch_bytes_; ++k) {
        const unsigned d = x[k] ^ y[k];
        differ += std::popcount((d | (d >> 1)) & 0x55u);
      }
      return static_cast<double>(sketch_fields_ - differ) >= need;
    };
    // Sweep 2: join the candidate pairs that pass.
    for (int b = 0; b < bands_; ++b)
      join_column(1 + b, near_eligible, [&](const Entry* begin, const Entry* end) {
        for (const Entry* e = begin + 1; e < end; ++e) {
          if (similar(begin->id, e->id)) clusters.join(begin->id, e->id);
          if (e - 1 != begin && similar((e - 1)->id, e->id)) clusters.join((e - 1)->id, e->id);
        }
      });
  }
  for (uint64_t i = 0; i < local; ++i)
    if (near_eligible(i) && clusters.find(static_cast<uint32_t>(base + i)) != base + i)
      verdict[i] = DedupVerdict::near_duplicate;
  return verdict;
}

}  // namespace tuna
