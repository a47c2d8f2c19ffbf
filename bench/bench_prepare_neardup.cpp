// Near-duplicate detection quality: recall and precision of prepare's MinHash LSH (data/dedup.h, the code
// prepare runs) on a synthetic corpus with planted near duplicates.
//
// Corpus: 4000 distinct documents of 200-800 words from a bigram chain over the demo corpus (they share the
// corpus's phrases, as real filings share boilerplate); 500 more distinct "template siblings" that share the
// first half of an original and go on differently (Jaccard ~0.33: the hard case for precision); then for 1000
// originals a copy with a fraction of its words replaced by random corpus words (2%, 5% or 10%), inserted at
// random later positions. A copy counts as found when it is marked near duplicate (its original, earlier, is
// kept); a false positive is a distinct document (original or sibling) marked near duplicate.
//   recall    = copies found / copies planted
//   precision = copies found / documents marked near duplicate
// Rows: the default (14 bands x 8 rows, threshold ~0.72, candidates verified at Jaccard >= 0.5) and 28 x 4
// (~0.43, also 112 permutations) with and without verification, at several edit rates. Run from the repository root: build/bench_prepare_neardup
#include <benchmark/benchmark.h>

#include <algorithm>
#include <iterator>
#include <numeric>
#include <sstream>
#include <tuple>

#include "bench/prepare_bench_util.h"
#include "data/dedup.h"

namespace tuna {
namespace {

namespace fs = std::filesystem;

struct Planted {
  std::vector<std::string> docs;
  std::vector<bool> is_copy;
};

Planted make_corpus(double edit_rate) {
  static const bench_prepare::Chain chain;
  std::mt19937_64 rng(21);
  const int distinct = 4000, copies = 1000, siblings = 500;
  std::vector<std::string> originals;
  for (int i = 0; i < distinct; ++i) originals.push_back(chain.document(rng, 200 + static_cast<int>(rng() % 600)));
  // (position key, document, is a copy): a copy's key falls after its source's, so the source comes first.
  std::vector<std::tuple<double, std::string, bool>> order;
  for (int i = 0; i < distinct; ++i) order.emplace_back(i, originals[static_cast<size_t>(i)], false);
  for (int c = 0; c < copies; ++c) {
    const size_t source = static_cast<size_t>(c) * distinct / copies;
    std::istringstream in(originals[source]);
    std::vector<std::string> words{std::istream_iterator<std::string>(in), std::istream_iterator<std::string>()};
    const size_t edits = static_cast<size_t>(edit_rate * static_cast<double>(words.size()) + 0.5);
    std::vector<size_t> positions(words.size());
    std::iota(positions.begin(), positions.end(), 0);
    std::shuffle(positions.begin(), positions.end(), rng);
    for (size_t e = 0; e < edits; ++e) {
      std::string& w = words[positions[e]];
      std::string repl;
      do repl = chain.random_word(rng);
      while (repl == w);
      w = repl;
    }
    std::string copy;
    for (const std::string& w : words) copy += (copy.empty() ? "" : " ") + w;
    const double key = static_cast<double>(source) + 0.5 +
                       static_cast<double>(rng() % 1000) / 1000.0 * static_cast<double>(distinct - source);
    order.emplace_back(key, copy, true);
  }
  // Template siblings: distinct documents that share their first half with an original (a contract made
  // from the same template, Jaccard ~0.33). Not duplicates: marking one is a false positive.
  for (int t = 0; t < siblings; ++t) {
    const size_t source = (static_cast<size_t>(t) * 8 + 3) % distinct;
    std::istringstream in(originals[source]);
    std::vector<std::string> words{std::istream_iterator<std::string>(in), std::istream_iterator<std::string>()};
    std::string sibling;
    for (size_t w = 0; w < words.size() / 2; ++w) sibling += (sibling.empty() ? "" : " ") + words[w];
    sibling += " " + chain.document(rng, static_cast<int>(words.size() - words.size() / 2));
    order.emplace_back(static_cast<double>(source) + 0.25, sibling, false);
  }
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) { return std::get<0>(a) < std::get<0>(b); });
  Planted p;
  for (auto& [key, doc, is_copy] : order) {
    p.docs.push_back(std::move(doc));
    p.is_copy.push_back(is_copy);
  }
  return p;
}

void BM_NearDup(benchmark::State& state) {
  const double edit_rate = static_cast<double>(state.range(0)) / 100.0;
  MinHashOptions mh;
  mh.bands = static_cast<int>(state.range(1));
  mh.rows = static_cast<int>(state.range(2));
  const double verify = static_cast<double>(state.range(3)) / 100.0;
  const Planted p = make_corpus(edit_rate);
  const MinHasher hasher(mh);
  std::string templ = (fs::temp_directory_path() / "tuna-bench-neardup-XXXXXX").string();
  const fs::path dir = ::mkdtemp(templ.data());
  std::vector<DedupVerdict> verdicts;
  for (auto _ : state) {
    LocalComm comm;
    DedupSpill spill((dir / "spill").string(), mh.bands, hasher.permutations());
    std::vector<uint64_t> bands(static_cast<size_t>(mh.bands));
    std::vector<uint8_t> sketch(hasher.sketch_bytes());
    for (size_t i = 0; i < p.docs.size(); ++i) {
      const bool words = hasher.band_hashes(p.docs[i], bands.data(), sketch.data());
      spill.add(false, 0, words ? bands.data() : nullptr, sketch.data());  // near dedup only
    }
    verdicts = spill.join(comm, true, uint64_t{256} << 20, 2, verify);
  }
  fs::remove_all(dir);
  uint64_t planted = 0, found = 0, flagged = 0;
  for (size_t i = 0; i < p.docs.size(); ++i) {
    const bool near = verdicts[i] == DedupVerdict::near_duplicate;
    planted += p.is_copy[i];
    flagged += near;
    found += near && p.is_copy[i];
  }
  state.counters["recall"] = static_cast<double>(found) / static_cast<double>(planted);
  state.counters["precision"] = flagged ? static_cast<double>(found) / static_cast<double>(flagged) : 1.0;
  state.counters["false_pos"] = static_cast<double>(flagged - found);
  state.counters["threshold"] = minhash_threshold(mh);
  state.counters["docs"] = static_cast<double>(p.docs.size());
}

// Args: edit percent, bands, rows, verify (percent Jaccard; 0: off).
BENCHMARK(BM_NearDup)
    ->ArgNames({"edit_pct", "bands", "rows", "verify_pct"})
    ->Args({2, 14, 8, 50})
    ->Args({5, 14, 8, 50})
    ->Args({2, 28, 4, 0})
    ->Args({5, 28, 4, 0})
    ->Args({2, 28, 4, 50})
    ->Args({5, 28, 4, 50})
    ->Args({10, 28, 4, 50})
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace tuna

BENCHMARK_MAIN();
