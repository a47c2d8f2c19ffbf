// data/dedup: MinHash signatures, exact and near verdicts with the earliest document kept, clusters joined
// through chains, and the same verdicts whatever the partition budget and however documents are spread
// over ranks (ranks simulated by threads sharing an in-process PrepareComm).
#include <gtest/gtest.h>

#include <algorithm>
#include <barrier>
#include <cstring>
#include <iterator>
#include <random>
#include <sstream>
#include <thread>

#include "data/dedup.h"
#include "tests/data/data_test_util.h"

namespace tuna {
namespace {

using testing_data::TempDir;

// `size` threads in one process acting as ranks: all_gather through shared slots and a barrier.
struct ThreadGroup {
  explicit ThreadGroup(int size) : slots(static_cast<size_t>(size)), sync(size) {}
  std::vector<std::vector<char>> slots;
  std::barrier<> sync;
};

class ThreadComm : public PrepareComm {
 public:
  ThreadComm(ThreadGroup* group, int rank) : group_(group), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(group_->slots.size()); }
  std::vector<char> all_gather(const void* data, size_t bytes, std::vector<uint64_t>* lengths) override {
    const char* p = static_cast<const char*>(data);
    group_->slots[static_cast<size_t>(rank_)].assign(p, p + bytes);
    group_->sync.arrive_and_wait();
    std::vector<char> out;
    if (lengths) lengths->clear();
    for (const auto& s : group_->slots) {
      out.insert(out.end(), s.begin(), s.end());
      if (lengths) lengths->push_back(s.size());
    }
    group_->sync.arrive_and_wait();
    return out;
  }

 private:
  ThreadGroup* group_;
  int rank_;
};

std::string words(std::mt19937_64& rng, int n) {
  static const char* vocab[] = {"the",   "lessee", "shall", "pay",     "rent",  "monthly", "to",    "lessor",
                                "under", "this",   "lease", "terms",   "of",    "party",   "notice", "days",
                                "any",   "breach", "cure",  "written", "agree", "hereby",  "sum",   "amount"};
  std::ostringstream out;
  for (int i = 0; i < n; ++i) out << (i ? " " : "") << vocab[rng() % 24] << (rng() % 7);
  return out.str();
}

TEST(MinHash, SameTextSameBandsUnrelatedTextNone) {
  MinHasher hasher({});
  ASSERT_EQ(hasher.bands(), 32);
  EXPECT_NEAR(minhash_threshold({}), 0.315, 0.001);
  std::mt19937_64 rng(1);
  const std::string a = words(rng, 400), b = words(rng, 400);
  std::vector<uint64_t> ha(32), ha2(32), hb(32);
  ASSERT_TRUE(hasher.band_hashes(a, ha.data()));
  ASSERT_TRUE(hasher.band_hashes("  " + a + "!!", ha2.data())) << "punctuation and spacing are not words";
  ASSERT_TRUE(hasher.band_hashes(b, hb.data()));
  EXPECT_EQ(ha, ha2);
  for (int i = 0; i < 32; ++i) EXPECT_NE(ha[i], hb[i]);
  std::vector<uint64_t> none(32, 7);
  EXPECT_FALSE(hasher.band_hashes(" -- ... ", none.data()));
  EXPECT_EQ(none[0], 7u);
  ASSERT_TRUE(hasher.band_hashes("two words", none.data())) << "shorter than a shingle: one shingle";
}

// The same text has the same signature on every machine (whichever vector clone of the minima loop the CPU
// runs): ranks on different nodes must agree. Golden values from the first run.
TEST(MinHash, SignatureIsTheSameEverywhere) {
  MinHasher hasher({});
  std::vector<uint64_t> bands(32);
  std::vector<uint8_t> sketch(hasher.sketch_bytes());
  ASSERT_EQ(sketch.size(), 1024u);
  ASSERT_TRUE(hasher.band_hashes("The Lessee shall pay the rent monthly to the Lessor under this Lease.", bands.data(),
                                 sketch.data()));
  EXPECT_EQ(bands[0], 13236737746548932515ull);
  EXPECT_EQ(bands[31], 1982016232151186045ull);
  // The sketch: the 9 distinct shingles' values, ascending, then padding.
  std::vector<uint32_t> values(256);
  std::memcpy(values.data(), sketch.data(), sketch.size());
  EXPECT_EQ(values[0], 13819889u);
  EXPECT_TRUE(std::is_sorted(values.begin(), values.end()));
  EXPECT_NE(values[8], 0xffffffffu);
  EXPECT_EQ(values[9], 0xffffffffu);
}

// The bottom-k estimate is the exact Jaccard similarity of the shingle sets when both documents have fewer
// than sketch_size distinct shingles, and within a few standard errors of it when they have more.
TEST(MinHash, SketchEstimatesTheJaccardSimilarity) {
  std::mt19937_64 rng(3);
  auto exact = [](const std::string& a, const std::string& b) {
    std::vector<uint64_t> x, y;
    shingle_hashes(a, 5, &x);
    shingle_hashes(b, 5, &y);
    std::sort(x.begin(), x.end());
    x.erase(std::unique(x.begin(), x.end()), x.end());
    std::sort(y.begin(), y.end());
    y.erase(std::unique(y.begin(), y.end()), y.end());
    std::vector<uint64_t> both;
    std::set_intersection(x.begin(), x.end(), y.begin(), y.end(), std::back_inserter(both));
    return static_cast<double>(both.size()) / static_cast<double>(x.size() + y.size() - both.size());
  };
  auto estimate = [](const MinHasher& h, const std::string& a, const std::string& b) {
    std::vector<uint64_t> bands(static_cast<size_t>(h.bands()));
    std::vector<uint8_t> x(h.sketch_bytes()), y(h.sketch_bytes());
    EXPECT_TRUE(h.band_hashes(a, bands.data(), x.data()));
    EXPECT_TRUE(h.band_hashes(b, bands.data(), y.data()));
    return estimated_jaccard(x.data(), y.data(), x.size());
  };
  const MinHasher hasher({});
  for (int words_in : {100, 200}) {  // under 256 shingles: exact
    const std::string common = words(rng, words_in / 2);
    const std::string a = common + " " + words(rng, words_in / 2), b = common + " " + words(rng, words_in / 2);
    EXPECT_DOUBLE_EQ(estimate(hasher, a, b), exact(a, b));
    EXPECT_DOUBLE_EQ(estimate(hasher, a, a), 1.0);
  }
  for (int trial = 0; trial < 5; ++trial) {  // 3000 words: sampled, standard error ~0.03
    const std::string common = words(rng, 1500);
    const std::string a = common + " " + words(rng, 1500), b = common + " " + words(rng, 1500);
    const double j = exact(a, b);
    EXPECT_NEAR(j, 1.0 / 3.0, 0.02);
    EXPECT_NEAR(estimate(hasher, a, b), j, 0.12);
  }
}

// Shared boilerplate alone: two documents that hold the same long licence, each with its own text besides,
// share LSH bands through the licence, but their Jaccard similarity is under the threshold: verification
// keeps them apart. A copy of one with a few words changed is joined.
TEST(Dedup, SharedLicenceAloneDoesNotMakeDuplicates) {
  const auto corpus = testing_data::demo_corpus();
  auto cat = [&](const std::string& licence, int first, int last) {
    std::string text;
    for (int i = first; i <= last; ++i) {
      char name[16];
      std::snprintf(name, sizeof name, "/%03d.txt", i);
      text += testing_data::read_file((corpus / licence).string() + name) + "\n";
    }
    return text;
  };
  const std::string licence = cat("GPL-3", 1, 20);
  const std::string a = cat("Apache-2.0", 1, 9) + licence, b = cat("MPL-2.0", 1, 12) + licence;
  std::string copy = a;
  for (size_t at = 100; at < copy.size(); at += 400) copy.insert(copy.find(' ', at) + 1, "changed ");
  const MinHasher hasher({});
  const size_t bands = static_cast<size_t>(hasher.bands());
  std::vector<std::vector<uint64_t>> band(3, std::vector<uint64_t>(bands));
  std::vector<std::vector<uint8_t>> sketch(3, std::vector<uint8_t>(hasher.sketch_bytes()));
  const std::string* docs[3] = {&a, &b, &copy};
  for (int d = 0; d < 3; ++d) ASSERT_TRUE(hasher.band_hashes(*docs[d], band[d].data(), sketch[d].data()));
  int shared = 0;
  for (size_t k = 0; k < bands; ++k) shared += band[0][k] == band[1][k];
  ASSERT_GE(shared, 1) << "the licence makes them LSH candidates";
  const double j = estimated_jaccard(sketch[0].data(), sketch[1].data(), sketch[0].size());
  EXPECT_GT(j, 0.2);
  EXPECT_LT(j, 0.5);
  EXPECT_GT(estimated_jaccard(sketch[0].data(), sketch[2].data(), sketch[0].size()), 0.6);
  TempDir dir;
  for (double verify : {0.0, 0.5}) {
    LocalComm comm;
    DedupSpill spill(dir.file(str("s", verify)), static_cast<int>(bands), hasher.sketch_bytes());
    for (int d = 0; d < 3; ++d) spill.add(true, static_cast<uint64_t>(d), band[d].data(), sketch[d].data());
    std::vector<uint32_t> kept_as;
    const std::vector<DedupVerdict> v = spill.join(comm, true, 1 << 20, 2, verify, &kept_as);
    EXPECT_EQ(v[1], verify > 0 ? DedupVerdict::unique : DedupVerdict::near_duplicate) << "verify " << verify;
    EXPECT_EQ(v[2], DedupVerdict::near_duplicate);
    EXPECT_EQ(kept_as, (std::vector<uint32_t>{0, verify > 0 ? 1u : 0u, 0}));
  }
}

TEST(MinHash, ALightlyEditedCopyMatchesSomeBand) {
  MinHasher hasher({});
  std::mt19937_64 rng(2);
  int matched = 0;
  for (int trial = 0; trial < 20; ++trial) {
    std::string text = words(rng, 500);
    std::string copy = text;
    // Replace 1% of words by an unseen one.
    std::vector<size_t> starts = {0};
    for (size_t i = 0; i < copy.size(); ++i)
      if (copy[i] == ' ') starts.push_back(i + 1);
    for (int e = 0; e < 5; ++e) copy.insert(starts[rng() % starts.size()], "edited ");
    std::vector<uint64_t> ht(32), hc(32);
    hasher.band_hashes(text, ht.data());
    hasher.band_hashes(copy, hc.data());
    bool any = false;
    for (int i = 0; i < 32; ++i) any |= ht[i] == hc[i];
    matched += any;
  }
  EXPECT_GE(matched, 19);
}

// Documents with hand-made hashes: exact[i], and bands that are unique unless listed in shared.
struct Doc {
  bool eligible;
  uint64_t exact;
  std::vector<std::pair<int, uint64_t>> shared;  // (band, value) pairs this document has in common
  bool has_bands = true;
};

std::vector<Doc> crafted() {
  return {
      {true, 100, {{0, 7}}},   // 0: unique; shares band 0 with 1 (but 1 is its exact duplicate)
      {true, 100, {{0, 7}}},   // 1: exact duplicate of 0
      {true, 200, {{3, 9}}},   // 2: kept: earliest of the cluster {2, 4, 5}
      {false, 300, {{3, 9}}},  // 3: filtered earlier: takes no part, even though it shares band 3
      {true, 400, {{3, 9}, {5, 11}}},  // 4: near duplicate of 2
      {true, 500, {{5, 11}}},  // 5: near duplicate of 4 only: joined to 2's cluster through 4
      {true, 600, {}, false},  // 6: no words: exact only
      {true, 200, {}},         // 7: exact duplicate of 2
      {true, 700, {{13, 9}}},  // 8: same value as 2's band 3 but in band 13: no match
  };
}
const std::vector<DedupVerdict> kExpected = {
    DedupVerdict::unique,          DedupVerdict::exact_duplicate, DedupVerdict::unique,
    DedupVerdict::unique,          DedupVerdict::near_duplicate,  DedupVerdict::near_duplicate,
    DedupVerdict::unique,          DedupVerdict::exact_duplicate, DedupVerdict::unique};

void add(DedupSpill& spill, const Doc& d, size_t index) {
  std::vector<uint64_t> bands(14);
  for (int b = 0; b < 14; ++b) bands[static_cast<size_t>(b)] = (index + 1) * 1000 + static_cast<uint64_t>(b) * 2 + 1;
  for (auto [b, v] : d.shared) bands[static_cast<size_t>(b)] = v;
  spill.add(d.eligible, d.exact, d.has_bands && d.eligible ? bands.data() : nullptr);
}

std::vector<DedupVerdict> join_all(const std::vector<Doc>& docs, uint64_t memory, const std::string& dir,
                                   std::vector<uint32_t>* kept_as = nullptr) {
  LocalComm comm;
  DedupSpill spill(dir, 14);
  for (size_t i = 0; i < docs.size(); ++i) add(spill, docs[i], i);
  return spill.join(comm, /*near=*/true, memory, 2, 0, kept_as);
}

TEST(Dedup, EarliestKeptClustersJoinedThroughChains) {
  TempDir dir;
  std::vector<uint32_t> kept_as;
  std::vector<DedupVerdict> v = join_all(crafted(), 1 << 20, dir.file("s"), &kept_as);
  // Ineligible documents get 'unique' (the caller already dropped them).
  EXPECT_EQ(v, kExpected);
  // Each duplicate names the document kept in its place: 5 joined 2's cluster through 4.
  EXPECT_EQ(kept_as, (std::vector<uint32_t>{0, 0, 2, 3, 2, 2, 6, 2, 8}));
  EXPECT_FALSE(std::filesystem::exists(dir.file("s"))) << "the spill removes its files";
}

TEST(Dedup, SameVerdictsWhateverThePartitionBudget) {
  TempDir dir;
  // 16 bytes of budget: one entry per partition at most, so every column is split many ways.
  EXPECT_EQ(join_all(crafted(), 16, dir.file("s")), kExpected);
}

TEST(Dedup, SameVerdictsWhateverTheRankSplit) {
  TempDir dir;
  const std::vector<Doc> docs = crafted();
  for (std::vector<size_t> split : {std::vector<size_t>{0, 2, 6, 9}, std::vector<size_t>{0, 0, 9, 9},
                                    std::vector<size_t>{0, 5, 5, 9}}) {
    const int ranks = 3;
    ThreadGroup group(ranks);
    std::vector<std::vector<DedupVerdict>> out(ranks);
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks; ++r)
      threads.emplace_back([&, r] {
        ThreadComm comm(&group, r);
        DedupSpill spill(dir.file("s" + std::to_string(r)), 14);
        for (size_t i = split[static_cast<size_t>(r)]; i < split[static_cast<size_t>(r) + 1]; ++i) add(spill, docs[i], i);
        out[static_cast<size_t>(r)] = spill.join(comm, true, 64, 1);
      });
    for (auto& t : threads) t.join();
    std::vector<DedupVerdict> all;
    for (const auto& o : out) all.insert(all.end(), o.begin(), o.end());
    EXPECT_EQ(all, kExpected);
  }
}

// Verification: four documents share a band. Their sketches (bottom-k, k = 8): the second's equals the
// first's, the third shares nothing with it, the fourth shares 6 of the 8 smallest values of their union
// (estimated Jaccard 0.75).
std::vector<DedupVerdict> verified(int ranks, double verify, const std::string& dir) {
  const std::vector<std::vector<uint32_t>> sketches = {{10, 20, 30, 40, 50, 60, 70, 80},
                                                       {10, 20, 30, 40, 50, 60, 70, 80},
                                                       {11, 21, 31, 41, 51, 61, 71, 81},
                                                       {10, 20, 30, 40, 50, 60, 75, 85}};
  const size_t bytes = 8 * sizeof(uint32_t);
  ThreadGroup group(ranks);
  std::vector<std::vector<DedupVerdict>> out(static_cast<size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      ThreadComm comm(&group, r);
      DedupSpill spill(dir + "/s" + std::to_string(r), 14, bytes);
      for (size_t i = 0; i < 4; ++i) {
        const int owner = ranks == 1 || i < 2 ? 0 : 1;
        if (owner != r) continue;
        std::vector<uint64_t> bands(14);
        for (int b = 0; b < 14; ++b) bands[static_cast<size_t>(b)] = (i + 1) * 1000 + static_cast<uint64_t>(b) * 2 + 1;
        bands[0] = 77;
        spill.add(true, i + 1, bands.data(), reinterpret_cast<const uint8_t*>(sketches[i].data()));
      }
      out[static_cast<size_t>(r)] = spill.join(comm, true, 1 << 20, 1, verify);
    });
  for (auto& t : threads) t.join();
  std::vector<DedupVerdict> all;
  for (const auto& o : out) all.insert(all.end(), o.begin(), o.end());
  return all;
}

TEST(Dedup, VerificationJoinsOnlySimilarSketches) {
  TempDir dir;
  const auto U = DedupVerdict::unique, N = DedupVerdict::near_duplicate;
  EXPECT_EQ(verified(1, 0.0, dir.file("a")), (std::vector<DedupVerdict>{U, N, N, N})) << "no verification";
  EXPECT_EQ(verified(1, 0.5, dir.file("b")), (std::vector<DedupVerdict>{U, N, U, N}));
  EXPECT_EQ(verified(1, 0.8, dir.file("c")), (std::vector<DedupVerdict>{U, N, U, U}));
  // Documents 0-1 on rank 0, 2-3 on rank 1: the sketches cross ranks, the verdicts do not change.
  EXPECT_EQ(verified(2, 0.5, dir.file("d")), (std::vector<DedupVerdict>{U, N, U, N}));
  const uint32_t a[] = {10, 20, 30, 40, 50, 60, 70, 80}, b[] = {10, 20, 30, 40, 50, 60, 75, 85};
  EXPECT_DOUBLE_EQ(estimated_jaccard(reinterpret_cast<const uint8_t*>(a), reinterpret_cast<const uint8_t*>(b), 32), 0.75);
}

TEST(Dedup, NearCanBeOff) {
  TempDir dir;
  LocalComm comm;
  DedupSpill spill(dir.file("s"), 14);
  const std::vector<Doc> docs = crafted();
  for (size_t i = 0; i < docs.size(); ++i) add(spill, docs[i], i);
  std::vector<DedupVerdict> v = spill.join(comm, /*near=*/false, 1 << 20, 1);
  EXPECT_EQ(v[4], DedupVerdict::unique);
  EXPECT_EQ(v[1], DedupVerdict::exact_duplicate);
}

}  // namespace
}  // namespace tuna
