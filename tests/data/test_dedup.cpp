// data/dedup: MinHash signatures, exact and near verdicts with the earliest document kept, clusters joined
// through chains, and the same verdicts whatever the partition budget and however documents are spread
// over ranks (ranks simulated by threads sharing an in-process PrepareComm).
#include <gtest/gtest.h>

#include <barrier>
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
  EXPECT_NEAR(minhash_threshold({}), 0.719, 0.001);
  std::mt19937_64 rng(1);
  const std::string a = words(rng, 400), b = words(rng, 400);
  std::vector<uint64_t> ha(14), ha2(14), hb(14);
  ASSERT_TRUE(hasher.band_hashes(a, ha.data()));
  ASSERT_TRUE(hasher.band_hashes("  " + a + "!!", ha2.data())) << "punctuation and spacing are not words";
  ASSERT_TRUE(hasher.band_hashes(b, hb.data()));
  EXPECT_EQ(ha, ha2);
  for (int i = 0; i < 14; ++i) EXPECT_NE(ha[i], hb[i]);
  std::vector<uint64_t> none(14, 7);
  EXPECT_FALSE(hasher.band_hashes(" -- ... ", none.data()));
  EXPECT_EQ(none[0], 7u);
  ASSERT_TRUE(hasher.band_hashes("two words", none.data())) << "shorter than a shingle: one shingle";
}

// The same text has the same signature on every machine (whichever vector clone of the minima loop the CPU
// runs): ranks on different nodes must agree. Golden values from the first run.
TEST(MinHash, SignatureIsTheSameEverywhere) {
  MinHasher hasher({});
  std::vector<uint64_t> bands(14);
  std::vector<uint8_t> sketch(hasher.sketch_bytes());
  ASSERT_EQ(sketch.size(), 28u);
  ASSERT_TRUE(hasher.band_hashes("The Lessee shall pay the rent monthly to the Lessor under this Lease.", bands.data(),
                                 sketch.data()));
  EXPECT_EQ(bands[0], 13447320111937343703ull);
  EXPECT_EQ(bands[13], 1926744827517364333ull);
  EXPECT_EQ(sketch[0], 196);
  EXPECT_EQ(sketch[27], 60);
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
    std::vector<uint64_t> ht(14), hc(14);
    hasher.band_hashes(text, ht.data());
    hasher.band_hashes(copy, hc.data());
    bool any = false;
    for (int i = 0; i < 14; ++i) any |= ht[i] == hc[i];
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

std::vector<DedupVerdict> join_all(const std::vector<Doc>& docs, uint64_t memory, const std::string& dir) {
  LocalComm comm;
  DedupSpill spill(dir, 14);
  for (size_t i = 0; i < docs.size(); ++i) add(spill, docs[i], i);
  return spill.join(comm, /*near=*/true, memory, 2);
}

TEST(Dedup, EarliestKeptClustersJoinedThroughChains) {
  TempDir dir;
  std::vector<DedupVerdict> v = join_all(crafted(), 1 << 20, dir.file("s"));
  // Ineligible documents get 'unique' (the caller already dropped them).
  EXPECT_EQ(v, kExpected);
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

// Verification: three documents share a band; the second's sketch equals the first's, the third's differs
// in every field, the fourth differs in a quarter of the fields (estimated Jaccard 1 - 0.25 / 0.75 = 0.67).
std::vector<DedupVerdict> verified(int ranks, double verify, const std::string& dir) {
  const int fields = 112;
  const size_t bytes = 28;
  std::vector<std::vector<uint8_t>> sketches(4, std::vector<uint8_t>(bytes, 0x1B));
  for (uint8_t& b : sketches[2]) b ^= 0x55;                  // every 2-bit field differs
  for (size_t k = 0; k < bytes; ++k) sketches[3][k] ^= 0x01;  // one field of four differs
  ThreadGroup group(ranks);
  std::vector<std::vector<DedupVerdict>> out(static_cast<size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      ThreadComm comm(&group, r);
      DedupSpill spill(dir + "/s" + std::to_string(r), 14, fields);
      for (size_t i = 0; i < 4; ++i) {
        const int owner = ranks == 1 || i < 2 ? 0 : 1;
        if (owner != r) continue;
        std::vector<uint64_t> bands(14);
        for (int b = 0; b < 14; ++b) bands[static_cast<size_t>(b)] = (i + 1) * 1000 + static_cast<uint64_t>(b) * 2 + 1;
        bands[0] = 77;
        spill.add(true, i + 1, bands.data(), sketches[i].data());
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
  EXPECT_EQ(verified(1, 0.7, dir.file("c")), (std::vector<DedupVerdict>{U, N, U, U}));
  // Documents 0-1 on rank 0, 2-3 on rank 1: the sketches cross ranks, the verdicts do not change.
  EXPECT_EQ(verified(2, 0.5, dir.file("d")), (std::vector<DedupVerdict>{U, N, U, N}));
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
