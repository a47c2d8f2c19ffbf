// Deduplication: exact (a 64-bit hash of the cleaned text) and near (MinHash LSH over word shingles), global
// across threads and ranks, deterministic, with a small memory footprint.
//
// Near duplicates. Words are maximal runs of letters and digits (ASCII lowercased; any byte >= 0x80 counts
// as a letter); a shingle is `shingle_words` consecutive words (a shorter document is one shingle). Each of
// max(bands * rows, sketch_permutations) permutations is a multiply-shift hash of the shingle's 64-bit hash,
// and the signature keeps the minimum of each (32 bits). A band is `rows` consecutive minima hashed to 64
// bits. Two documents are candidates when any band matches; the probability is 1 - (1 - J^rows)^bands for
// Jaccard similarity J, a step at about (1/bands)^(1/rows): 0.31 for the default 32 x 3. Candidates that
// pass verification (below) are joined into clusters (connected components, by union-find); each cluster
// keeps its earliest document in input order.
//
// Order and determinism. Documents carry a global id: their position in the input order (rank r's ids
// follow rank r-1's). The union-find joins a component under its smallest id whatever order the unions
// come in, so the verdicts depend on the set of matching bands only: not on threads, ranks or partitions.
//
// Verification: one threshold, whatever the banding. Bands only propose candidates; a candidate pair is
// joined when its documents' sketches estimate a Jaccard similarity of at least `verify` (0.5 by default:
// two thirds of each document's shingles shared). The sketch is a bottom-k sample: the sketch_size (256)
// smallest distinct shingle values of the document (32 bits each). The k smallest of the union of two
// sketches are a uniform sample of the union of the two documents, and the share of them both hold
// estimates J: exactly when both documents have fewer than k distinct shingles (under ~260 words), else with a
// standard error of sqrt(J (1 - J) / k), 0.031 at 0.5. (It replaced 2-bit fields of the 112 LSH minima,
// whose error of 0.06 let pairs at J = 0.4 through: benchmarks/2026-11-30-prepare-near-duplicates.md.)
// The pairs checked in a group of documents sharing a band: each member with the group's first and with the
// kVerifyWindow members before it (a group of thousands, the documents that share one licence, is checked
// in linear time; true near duplicates also share bands drawn from their own text, where the groups are small).
// Shared boilerplate alone: two documents that share a licence but whose own text makes their Jaccard fall
// under the threshold are not joined, however many bands the licence gives them in common; documents that
// are mostly one licence and differ in a few fields (a template) are near duplicates by this measure, like
// a lightly edited copy (benchmarks/2026-11-30-prepare-near-duplicates.md measures both on the Debian
// copyright files).
//
// Memory. Pass 1 spills, per document, the exact hash, the band hashes and the sketch to files in a scratch
// directory (8 * (1 + bands) + 4 * sketch_size bytes: 1288 for the defaults), written
// sequentially, one file per column. Joining then holds the union-find parent array, 4 bytes per document of
// the whole corpus, and one partition of one column at a time: (hash, id) pairs of 16 bytes, with as many
// partitions (by hash range) as keep that under memory_bytes. Verification reads the sketches from the spill
// (memory-mapped) on a single process; under mpirun every rank gathers the sketches of the documents that
// have an LSH candidate (4 + 1024 bytes each) and one bit per document. Ranks exchange each partition's pairs
// (all-gather) and all run the same joins and the same checks.
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
  // 32 x 3: a pair at Jaccard 0.5 shares a band with probability 1 - (1 - 0.5^3)^32 = 0.986, at 0.6 0.9997:
  // candidates for everything the default threshold keeps (benchmarks/2026-11-30-prepare-near-duplicates.md
  // measures it).
  int bands = 32;
  int rows = 3;
  int sketch_size = 256;  // values of the verification sketch (bottom-k: 4 bytes each)
  uint64_t seed = 0x6d696e68617368ull;  // of the permutations; part of what makes two runs comparable
};

// The 64-bit hashes of text's shingles, in order (repeats included; one shingle for a text shorter than
// shingle_words; none without a word): what MinHash samples, and what an exact Jaccard is computed over.
void shingle_hashes(std::string_view text, int shingle_words, std::vector<uint64_t>* out);

// The Jaccard similarity at which a pair becomes a candidate with probability about 1/2.
double minhash_threshold(const MinHashOptions& options);

class MinHasher {
 public:
  explicit MinHasher(const MinHashOptions& options);
  // The band hashes of text into out[0..bands) (never 0) and, when sketch is given, its verification
  // sketch into sketch[0..sketch_bytes()): the sketch_size smallest distinct shingle values (32 bits),
  // ascending, padded with 0xffffffff; false, writing nothing, when it has no word. Thread-safe.
  bool band_hashes(std::string_view text, uint64_t* out, uint8_t* sketch = nullptr) const;
  int bands() const { return options_.bands; }
  size_t sketch_bytes() const { return static_cast<size_t>(options_.sketch_size) * sizeof(uint32_t); }

 private:
  MinHashOptions options_;
  std::vector<uint64_t> multipliers_, increments_;
};

// The Jaccard similarity two sketches of `bytes` fields estimate (clamped to [0, 1]).
double estimated_jaccard(const uint8_t* a, const uint8_t* b, size_t bytes);

// Verdict of one document after dedup.
enum class DedupVerdict : uint8_t { unique = 0, exact_duplicate = 1, near_duplicate = 2 };

// The spill of pass 1: a rank's documents in its input order, appended one at a time.
class DedupSpill {
 public:
  // Creates dir (a scratch directory of this rank) and one file per column in it. sketch_bytes: of each
  // document's sketch (0: no sketches, no verification).
  DedupSpill(std::string dir, int bands, size_t sketch_bytes = 0);
  ~DedupSpill();  // closes and removes the files and dir
  DedupSpill(const DedupSpill&) = delete;
  DedupSpill& operator=(const DedupSpill&) = delete;

  // A document: `exact` takes part in exact dedup (else it is only a placeholder), `bands` (may be null:
  // no near dedup for it) in near dedup.
  // sketch: with band_hashes, when the spill keeps sketches.
  void add(bool exact_eligible, uint64_t exact_hash, const uint64_t* band_hashes, const uint8_t* sketch = nullptr);
  uint64_t documents() const { return flags_.size(); }

  // Joins every rank's spill (a collective: every member of comm calls it) and returns this rank's
  // verdicts, one per document added. threads: for the sorts and the checks. verify > 0 (needs sketches): a
  // candidate pair is joined only when its sketches estimate a Jaccard similarity of at least verify.
  // kept_as, when given, receives for each document the global id (input position over all ranks) of the
  // document kept in its place: the first of its exact group, or the root of its near cluster; its own id
  // when it is unique.
  std::vector<DedupVerdict> join(PrepareComm& comm, bool near, uint64_t memory_bytes, int threads,
                                 double verify = 0, std::vector<uint32_t>* kept_as = nullptr);

 private:
  std::string path(int column) const;
  template <typename Fn>
  void scan(int column, Fn&& fn);  // fn(local index, value) over the column, in order

  std::string dir_;
  int bands_;
  size_t sketch_bytes_;
  std::vector<std::FILE*> files_;  // 0: exact, 1 + b: band b, 1 + bands: sketches (when kept)
  std::vector<uint8_t> flags_;     // bit 0: exact eligible, bit 1: has bands
  std::vector<uint8_t> no_sketch_;  // what a document without words writes in the sketch column
};

}  // namespace tuna
