// Deduplication: MinHash signatures, the spill of pass 1 and the global join. See data/dedup.h.
#include "data/dedup.h"

#include <sys/mman.h>
#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
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

// Pads a bottom-k sketch of a document with fewer than k distinct shingles. (A shingle whose value is this
// one is dropped from the sketch: a 2^-32 chance that costs nothing but that shingle.)
constexpr uint32_t kEmpty = UINT32_MAX;

// Each member of a group sharing a band is checked against the group's first and this many members before it.
constexpr size_t kVerifyWindow = 4;

// Random access to the sketches verification compares: on a single process the spill's own sketch column,
// memory-mapped (documents are indexed by their id); under mpirun the (id, sketch) records of every rank's
// documents that have a candidate, sorted by id.
class SketchTable {
 public:
  SketchTable(std::FILE* column, const std::string& path, uint64_t documents, size_t bytes) : bytes_(bytes) {
    mapped_bytes_ = static_cast<size_t>(documents) * bytes;
    if (mapped_bytes_ == 0) return;
    if (std::fflush(column) != 0) fail("prepare: cannot read back ", path, ": ", std::strerror(errno));
    void* p = ::mmap(nullptr, mapped_bytes_, PROT_READ, MAP_SHARED, ::fileno(column), 0);
    if (p == MAP_FAILED) fail("prepare: cannot map ", path, ": ", std::strerror(errno));
    mapped_ = static_cast<const uint8_t*>(p);
  }
  SketchTable(std::vector<char> records, size_t bytes) : bytes_(bytes), records_(std::move(records)) {}
  ~SketchTable() {
    if (mapped_) ::munmap(const_cast<uint8_t*>(mapped_), mapped_bytes_);
  }
  SketchTable(const SketchTable&) = delete;
  SketchTable& operator=(const SketchTable&) = delete;

  const uint8_t* of(uint32_t id) const {
    if (mapped_) {
      TUNA_CHECK(static_cast<size_t>(id) * bytes_ < mapped_bytes_, "no sketch for document ", id);
      return mapped_ + static_cast<size_t>(id) * bytes_;
    }
    const size_t stride = 4 + bytes_, known = records_.size() / stride;
    size_t lo = 0, hi = known;
    while (lo < hi) {
      const size_t mid = (lo + hi) / 2;
      if (id_at(mid) < id) lo = mid + 1;
      else hi = mid;
    }
    TUNA_CHECK(lo < known && id_at(lo) == id, "no sketch for candidate document ", id);
    return reinterpret_cast<const uint8_t*>(records_.data() + lo * stride + 4);
  }

 private:
  uint32_t id_at(size_t record) const {
    uint32_t id;
    std::memcpy(&id, records_.data() + record * (4 + bytes_), 4);
    return id;
  }
  size_t bytes_;
  const uint8_t* mapped_ = nullptr;
  size_t mapped_bytes_ = 0;
  std::vector<char> records_;
};

}  // namespace

double estimated_jaccard(const uint8_t* a, const uint8_t* b, size_t bytes) {
  // Bottom-k: the k smallest values of the union are a uniform sample of it; the share of them that both
  // documents hold estimates |A n B| / |A u B|. When both sketches are complete (padded: the documents have
  // fewer than k distinct shingles) the whole union is walked and the result is exact. Both lists are
  // ascending and kEmpty-padded; values are read with memcpy (no alignment is assumed).
  const size_t k = bytes / sizeof(uint32_t);
  auto at = [](const uint8_t* p, size_t i) {
    uint32_t v;
    std::memcpy(&v, p + i * sizeof(uint32_t), sizeof v);
    return v;
  };
  if (k == 0) return 0;
  const size_t limit = at(a, k - 1) == kEmpty && at(b, k - 1) == kEmpty ? 2 * k : k;
  size_t i = 0, j = 0, sampled = 0, shared = 0;
  while (sampled < limit) {
    const uint32_t x = i < k ? at(a, i) : kEmpty, y = j < k ? at(b, j) : kEmpty;
    if (x == kEmpty && y == kEmpty) break;  // both sets exhausted: the sample is the whole union
    ++sampled;
    if (x == y) ++shared, ++i, ++j;
    else if (x < y) ++i;
    else ++j;
  }
  return sampled ? static_cast<double>(shared) / static_cast<double>(sampled) : 0.0;
}

double minhash_threshold(const MinHashOptions& o) {
  return std::pow(1.0 / static_cast<double>(o.bands), 1.0 / static_cast<double>(o.rows));
}

MinHasher::MinHasher(const MinHashOptions& options) : options_(options) {
  if (options.shingle_words < 1) fail("prepare: --shingle-words must be at least 1, found ", options.shingle_words);
  if (options.bands < 1 || options.rows < 1)
    fail("prepare: --minhash-bands and --minhash-rows must be at least 1, found ", options.bands, " and ",
         options.rows);
  if (options.bands > 512) fail("prepare: --minhash-bands is at most 512, found ", options.bands);
  if (options.rows > 64) fail("prepare: --minhash-rows is at most 64, found ", options.rows);
  if (options.sketch_size < 1 || options.sketch_size > 65536)
    fail("prepare: the verification sketch holds 1 to 65536 values, found ", options.sketch_size);
  const size_t perms = static_cast<size_t>(options.bands) * static_cast<size_t>(options.rows);
  uint64_t state = options.seed;
  for (size_t i = 0; i < perms; ++i) {
    multipliers_.push_back(splitmix64(state) | 1);  // odd: multiply-shift hashing
    increments_.push_back(splitmix64(state));
  }
  // Padding permutations (computed, never read) so that the minima loop runs whole lanes.
  while (multipliers_.size() % kLanes != 0) multipliers_.push_back(1), increments_.push_back(0);
}

void shingle_hashes(std::string_view text, int shingle_words, std::vector<uint64_t>* out) {
  thread_local std::vector<uint64_t> words;
  thread_local std::string word;
  words.clear();
  out->clear();
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
  if (words.empty()) return;
  const size_t k = static_cast<size_t>(shingle_words);
  const size_t shingles = words.size() > k ? words.size() - k + 1 : 1;
  const size_t width = std::min(k, words.size());
  out->resize(shingles);
  for (size_t s = 0; s < shingles; ++s) (*out)[s] = XXH3_64bits(words.data() + s, width * sizeof(uint64_t));
}

bool MinHasher::band_hashes(std::string_view text, uint64_t* out, uint8_t* sketch) const {
  thread_local std::vector<uint32_t> mins;
  thread_local std::vector<uint64_t> hashes;
  shingle_hashes(text, options_.shingle_words, &hashes);
  if (hashes.empty()) return false;
  const size_t shingles = hashes.size();
  mins.assign(multipliers_.size(), UINT32_MAX);  // padded to a multiple of kLanes
  update_minima(hashes.data(), shingles, multipliers_.data(), increments_.data(), mins.data(), mins.size());
  const uint32_t* m = mins.data();
  const size_t rows = static_cast<size_t>(options_.rows);
  for (int b = 0; b < options_.bands; ++b)
    out[b] = XXH3_64bits_withSeed(m + static_cast<size_t>(b) * rows, rows * sizeof(uint32_t),
                                  static_cast<uint64_t>(b)) |
             1;
  if (sketch) {
    // Bottom-k: the sketch_size smallest distinct values (the top 32 bits of the shingle hashes), ascending.
    // Selection, not a sort of every value: the smallest `take` moved to the front in linear time and
    // sorted; `take` doubles in the rare case that repeats leave fewer than k distinct among them.
    thread_local std::vector<uint32_t> values, smallest;
    values.resize(shingles);
    for (size_t s = 0; s < shingles; ++s) values[s] = static_cast<uint32_t>(hashes[s] >> 32);
    const size_t k = static_cast<size_t>(options_.sketch_size);
    for (size_t take = std::min(values.size(), k + k / 4);; take = std::min(values.size(), 2 * take)) {
      if (take < values.size()) std::nth_element(values.begin(), values.begin() + static_cast<int64_t>(take), values.end());
      smallest.assign(values.begin(), values.begin() + static_cast<int64_t>(take));
      std::sort(smallest.begin(), smallest.end());
      smallest.erase(std::unique(smallest.begin(), smallest.end()), smallest.end());
      if (smallest.size() >= k || take == values.size()) break;
    }
    if (!smallest.empty() && smallest.back() == kEmpty) smallest.pop_back();
    smallest.resize(k, kEmpty);
    std::memcpy(sketch, smallest.data(), k * sizeof(uint32_t));
  }
  return true;
}

DedupSpill::DedupSpill(std::string dir, int bands, size_t sketch_bytes)
    : dir_(std::move(dir)), bands_(bands), sketch_bytes_(sketch_bytes) {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) fail("prepare: cannot create the scratch directory ", dir_, ": ", ec.message());
  for (int c = 0; c <= bands_ + (sketch_bytes_ > 0 ? 1 : 0); ++c) {
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
  TUNA_CHECK(!(band_hashes && sketch_bytes_ > 0 && !sketch), "a spill with sketches needs one per document");
  flags_.push_back(static_cast<uint8_t>((exact_eligible ? 1 : 0) | (band_hashes ? 2 : 0)));
  bool ok = std::fwrite(&exact_hash, sizeof exact_hash, 1, files_[0]) == 1;
  static const std::vector<uint64_t> zeros(512, 0);
  const uint64_t* bands = band_hashes ? band_hashes : zeros.data();
  for (int b = 0; b < bands_; ++b) ok &= std::fwrite(&bands[b], sizeof(uint64_t), 1, files_[1 + b]) == 1;
  if (sketch_bytes_ > 0) {
    if (!band_hashes) no_sketch_.assign(sketch_bytes_, 0);  // never read: the document takes no part in near dedup
    const void* bytes = band_hashes ? static_cast<const void*>(sketch) : static_cast<const void*>(no_sketch_.data());
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
                                           double verify, std::vector<uint32_t>* kept_as) {
  TUNA_CHECK(verify <= 0 || sketch_bytes_ > 0, "verification needs a spill with sketches");
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
  if (kept_as) {
    kept_as->resize(local);
    std::iota(kept_as->begin(), kept_as->end(), static_cast<uint32_t>(base));
  }

  // What one entry of a partition costs: it lives twice (this rank's and everyone's), 32 bytes; with
  // verification, up to 1 + kVerifyWindow candidate pairs of 8 bytes and their verdicts too.
  uint64_t entry_cost = 2 * sizeof(Entry);
  // One column, in partitions: gather every rank's eligible entries of the partition, sort, and hand each
  // group of two or more equal hashes (ids ascending) to on_group; after_partition runs once the
  // partition's groups are all seen.
  auto join_column = [&](int column, auto&& eligible, auto&& on_group, auto&& after_partition) {
    uint64_t mine = 0;
    for (uint64_t i = 0; i < local; ++i) mine += eligible(i);
    uint64_t entries = 0;
    for (uint64_t c : comm.all_gather_value<uint64_t>(mine)) entries += c;
    const uint64_t parts = std::max<uint64_t>(1, (entries * entry_cost + memory_bytes - 1) / std::max<uint64_t>(memory_bytes, 1));
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
      after_partition();
    }
  };
  const auto nothing = [] {};

  // Exact: in a group of equal hashes, all but the earliest are duplicates.
  join_column(
      0, [&](uint64_t i) { return (flags_[i] & 1) != 0; },
      [&](const Entry* begin, const Entry* end) {
        for (const Entry* e = begin + 1; e < end; ++e)
          if (e->id >= base && e->id < base + local) {
            verdict[e->id - base] = DedupVerdict::exact_duplicate;
            if (kept_as) (*kept_as)[e->id - base] = begin->id;
          }
      },
      nothing);
  if (!near) return verdict;

  // Near: documents that share a band are joined; exact duplicates stay out (they are counted as such).
  auto near_eligible = [&](uint64_t i) { return (flags_[i] & 2) != 0 && verdict[i] == DedupVerdict::unique; };
  UnionFind clusters(total);
  if (verify <= 0) {
    for (int b = 0; b < bands_; ++b)
      join_column(
          1 + b, near_eligible,
          [&](const Entry* begin, const Entry* end) {
            for (const Entry* e = begin + 1; e < end; ++e) clusters.join(begin->id, e->id);
          },
          nothing);
  } else {
    std::FILE* column = files_[static_cast<size_t>(bands_) + 1];
    std::unique_ptr<SketchTable> sketches;
    if (comm.size() == 1) {
      sketches = std::make_unique<SketchTable>(column, path(bands_ + 1), local, sketch_bytes_);
    } else {
      // Which documents have a candidate at all (one bit each), then their sketches from every rank:
      // (id, sketch) records in id order, the same on every rank.
      std::vector<bool> candidate(total, false);
      for (int b = 0; b < bands_; ++b)
        join_column(
            1 + b, near_eligible,
            [&](const Entry* begin, const Entry* end) {
              for (const Entry* e = begin; e < end; ++e) candidate[e->id] = true;
            },
            nothing);
      std::vector<char> mine;
      if (std::fflush(column) != 0 || std::fseek(column, 0, SEEK_SET) != 0)
        fail("prepare: cannot read back ", path(bands_ + 1), ": ", std::strerror(errno));
      std::vector<char> record(sketch_bytes_);
      for (uint64_t i = 0; i < local; ++i) {
        if (std::fread(record.data(), 1, sketch_bytes_, column) != sketch_bytes_)
          fail("prepare: cannot read back ", path(bands_ + 1), ": short read");
        if (!candidate[base + i] || !near_eligible(i)) continue;
        const uint32_t id = static_cast<uint32_t>(base + i);
        mine.insert(mine.end(), reinterpret_cast<const char*>(&id), reinterpret_cast<const char*>(&id) + 4);
        mine.insert(mine.end(), record.begin(), record.end());
      }
      sketches = std::make_unique<SketchTable>(comm.all_gather(mine.data(), mine.size()), sketch_bytes_);
    }
    entry_cost += (1 + kVerifyWindow) * (sizeof(std::pair<uint32_t, uint32_t>) + 1);
    // Each partition's candidate pairs are checked in parallel, then joined in order (the union-find's
    // result does not depend on the order, but the joins themselves are not thread-safe).
    std::vector<std::pair<uint32_t, uint32_t>> pairs;
    std::vector<uint8_t> pass;
    for (int b = 0; b < bands_; ++b)
      join_column(
          1 + b, near_eligible,
          [&](const Entry* begin, const Entry* end) {
            for (const Entry* e = begin + 1; e < end; ++e) {
              pairs.emplace_back(begin->id, e->id);
              for (const Entry* before = e - 1; before > begin && before >= e - kVerifyWindow; --before)
                pairs.emplace_back(before->id, e->id);
            }
          },
          [&] {
            pass.assign(pairs.size(), 0);
            const int64_t n = static_cast<int64_t>(pairs.size());
#pragma omp parallel for num_threads(std::max(1, threads)) schedule(static, 1024) if (n > 4096)
            for (int64_t k = 0; k < n; ++k)
              pass[k] = estimated_jaccard(sketches->of(pairs[k].first), sketches->of(pairs[k].second), sketch_bytes_) >= verify;
            for (size_t k = 0; k < pairs.size(); ++k)
              if (pass[k]) clusters.join(pairs[k].first, pairs[k].second);
            pairs.clear();
          });
  }
  for (uint64_t i = 0; i < local; ++i) {
    if (!near_eligible(i)) continue;
    const uint32_t root = clusters.find(static_cast<uint32_t>(base + i));
    if (root == base + i) continue;
    verdict[i] = DedupVerdict::near_duplicate;
    if (kept_as) (*kept_as)[i] = root;
  }
  return verdict;
}

}  // namespace tuna
