// Deduplication: exact (a 64-bit hash of the cleaned text) and near (MinHash LSH over word shingles), global
// across threads and ranks, deterministic, with a small memory footprint.
//
// Near duplicates. Words are maximal runs of letters and digits (ASCII lowercased; any byte >= 0x80 counts
// as a letter); a shingle is `shingle_words` consecutive words (a shorter document is one shingle). Each of
// bands * rows permutations is a multiply-shift hash of the shingle's 64-bit hash, and the signature keeps
// the minimum of each (32 bits). A band is `rows` consecutive minima hashed to 64 bits. Two documents are
// candidates when any band matches; the probability is 1 - (1 - J^rows)^bands for Jaccard similarity J, a
// step at about (1/bands)^(1/rows): 0.72 for the default 14 x 8. Candidates are joined into clusters
// (connected components, by union-find); each cluster keeps its earliest document in input order.
//
// Order and determinism. Documents carry a global id: their position in the input order (rank r's ids
// follow rank r-1's). The union-find joins a component under its smallest id whatever order the unions
// come in, so the verdicts depend on the set of matching bands only: not on threads, ranks or partitions.
//
// Verification. LSH candidates are only likely similar: at 28 x 4, a pair at Jaccard 0.33 (two contracts
// from one template) is a candidate 28% of the time. With verify > 0, each candidate pair (a group member
// with the group's first member, and with the member before it) is joined only when the documents' sketches
// (2 bits of each of the bands * rows minima, 28 bytes for 112) agree on enough fields: 2-bit fields match
// with probability J + (1 - J) / 4, so J is estimated as (matches / fields - 1/4) / (3/4).
//
// Memory. Pass 1 spills, per document, the exact hash and the band hashes to files in a scratch directory
// (8 * (1 + bands) bytes: 120 for 14 bands; + 28 for the sketch), written sequentially, one file per column.
// Joining then holds the union-find parent array, 4 bytes per document of the whole corpus, and one
// partition of one column at a time: (hash, id) pairs of 16 bytes, with as many partitions (by hash range)
// as keep that under memory_bytes. Verification adds one bit per document (has a candidate) and 32 bytes per
// document that has a candidate (its sketch, gathered from its rank). So the resident index is 4 bytes per
// document plus a fixed budget (plus the sketches of candidates); nothing else grows with the corpus. Ranks
// exchange each partition's pairs (all-gather) and all run the same joins and the same checks.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "data/prepare_comm.h"

namespace tuna {

struct MinHashOptions {
  int shingle_words = 5;
  int bands = 14;
  int rows = 8;
  uint64_t seed = 0x6d696e68617368ull;  // of the permutations; part of what makes two runs comparable
};

// The Jaccard similarity at which a pair becomes a candidate with probability about 1/2.
double minhash_threshold(const MinHashOptions& options);

class MinHasher {
 public:
  explicit MinHasher(const MinHashOptions& options);
  // The band hashes of text into out[0..bands) (never 0) and, when sketch is given, the low 2 bits of every
  // minimum packed 4 to a byte into sketch[0..sketch_bytes()); false, writing nothing, when it has no word.
  // Thread-safe.
  bool band_hashes(std::string_view text, uint64_t* out, uint8_t* sketch = nullptr) const;
  int bands() const { return options_.bands; }
  int permutations() const { return options_.bands * options_.rows; }
  size_t sketch_bytes() const { return (static_cast<size_t>(permutations()) + 3) / 4; }

 private:
  MinHashOptions options_;
  std::vector<uint64_t> multipliers_, increments_;
};

// Verdict of one document after dedup.
enum class DedupVerdict : uint8_t { unique = 0, exact_duplicate = 1, near_duplicate = 2 };

// The spill of pass 1: a rank's documents in its input order, appended one at a time.
class DedupSpill {
 public:
  // Creates dir (a scratch directory of this rank) and one file per column in it. sketch_fields: the
  // permutations behind each document's sketch (0: no sketches, no verification).
  DedupSpill(std::string dir, int bands, int sketch_fields = 0);
  ~DedupSpill();  // closes and removes the files and dir
  DedupSpill(const DedupSpill&) = delete;
  DedupSpill& operator=(const DedupSpill&) = delete;

  // A document: `exact` takes part in exact dedup (else it is only a placeholder), `bands` (may be null:
  // no near dedup for it) in near dedup.
  // sketch: with band_hashes, when the spill keeps sketches.
  void add(bool exact_eligible, uint64_t exact_hash, const uint64_t* band_hashes, const uint8_t* sketch = nullptr);
  uint64_t documents() const { return flags_.size(); }

  // Joins every rank's spill (a collective: every member of comm calls it) and returns this rank's
  // verdicts, one per document added. threads: for the sorts. verify > 0 (needs sketches): a candidate pair
  // is joined only when its sketches estimate a Jaccard similarity of at least verify (see dedup.cpp).
  std::vector<DedupVerdict> join(PrepareComm& comm, bool near, uint64_t memory_bytes, int threads,
                                 double verify = 0);

 private:
  std::string path(int column) const;
  template <typename Fn>
  void scan(int column, Fn&& fn);  // fn(local index, value) over the column, in order

  std::string dir_;
  int bands_;
  int sketch_fields_;
  size_t sketch_bytes_;
  std::vector<std::FILE*> files_;  // 0: exact, 1 + b: band b, 1 + bands: sketches (when kept)
  std::vector<uint8_t> flags_;     // bit 0: exact eligible, bit 1: has bands
};

}  // namespace tuna
