// Near-duplicate detection quality: recall and precision of prepare's MinHash LSH with verification
// (data/dedup.h, the code prepare runs), on real documents and on a synthetic corpus.
//
// Debian (BM_NearDupDebian): the Debian copyright files (/usr/share/doc/*/copyright: real legal text, on every
// Debian machine), cleaned as prepare cleans. Exact duplicates are left out (exact dedup's job), and so is
// any file whose exact 5-shingle Jaccard with an earlier file is 0.5 or more: those are near duplicates
// already (another package's file with a field changed, libsm-dev and libxau-dev differ in one year), so the
// rest are unrelated by the measure prepare uses. What remains is split in two by a hash of the file name:
// part 0 chooses the defaults, part 1 is held out and reported. In a part: originals are the documents of at
// least 2 KB, negatives the others, and for each original a copy with a fraction of its words (maximal runs
// of letters and digits, as MinHash sees them) replaced by random words of the part, at a fixed seed, after
// all originals. A copy counts as found when it is marked near duplicate; any original or negative marked is
// a false positive, and its name is printed.
//   recall    = copies found / copies planted
//   precision = copies found / documents marked near duplicate
// The files present differ between machines (installed packages): the counters name how many were used.
//
// Synthetic (BM_NearDup): 4000 distinct documents of 200-800 words from a bigram chain over the demo corpus;
// 500 "template siblings" that share the first half of an original and go on differently (Jaccard ~0.33);
// for 1000 originals a copy with a fraction of its words replaced by random corpus words.
//
// Run from the repository root: build/bench_prepare_neardup
#include <benchmark/benchmark.h>

#include <algorithm>
#include <iterator>
#include <numeric>
#include <sstream>
#include <tuple>

#include <xxhash.h>

#include <cstdio>
#include <unordered_map>
#include <unordered_set>

#include "bench/prepare_bench_util.h"
#include "data/clean.h"
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

struct Measured {
  double recall = 0, precision = 1;
  uint64_t false_positives = 0;
  std::vector<size_t> false_positive_docs;
};

// Runs prepare's near dedup (no exact dedup) over docs in order and scores it against is_copy.
Measured measure(const std::vector<std::string>& docs, const std::vector<bool>& is_copy, const MinHashOptions& mh,
                 double verify) {
  const MinHasher hasher(mh);
  std::string templ = (fs::temp_directory_path() / "tuna-bench-neardup-XXXXXX").string();
  const fs::path dir = ::mkdtemp(templ.data());
  std::vector<DedupVerdict> verdicts;
  {
    LocalComm comm;
    DedupSpill spill((dir / "spill").string(), mh.bands, hasher.sketch_bytes());
    std::vector<uint64_t> bands(static_cast<size_t>(mh.bands));
    std::vector<uint8_t> sketch(hasher.sketch_bytes());
    for (const std::string& doc : docs) {
      const bool words = hasher.band_hashes(doc, bands.data(), sketch.data());
      spill.add(false, 0, words ? bands.data() : nullptr, sketch.data());  // near dedup only
    }
    verdicts = spill.join(comm, true, uint64_t{256} << 20, 2, verify);
  }
  fs::remove_all(dir);
  uint64_t planted = 0, found = 0, flagged = 0;
  Measured m;
  for (size_t i = 0; i < docs.size(); ++i) {
    const bool near = verdicts[i] == DedupVerdict::near_duplicate;
    planted += is_copy[i];
    flagged += near;
    found += near && is_copy[i];
    if (near && !is_copy[i]) m.false_positive_docs.push_back(i);
  }
  m.recall = static_cast<double>(found) / static_cast<double>(std::max<uint64_t>(planted, 1));
  m.precision = flagged ? static_cast<double>(found) / static_cast<double>(flagged) : 1.0;
  m.false_positives = flagged - found;
  return m;
}

MinHashOptions lsh(const benchmark::State& state, int first_arg) {
  MinHashOptions mh;
  mh.bands = static_cast<int>(state.range(first_arg));
  mh.rows = static_cast<int>(state.range(first_arg + 1));
  return mh;
}

void BM_NearDup(benchmark::State& state) {
  const double edit_rate = static_cast<double>(state.range(0)) / 100.0;
  const MinHashOptions mh = lsh(state, 1);
  const double verify = static_cast<double>(state.range(3)) / 100.0;
  const Planted p = make_corpus(edit_rate);
  Measured m;
  for (auto _ : state) m = measure(p.docs, p.is_copy, mh, verify);
  state.counters["recall"] = m.recall;
  state.counters["precision"] = m.precision;
  state.counters["false_pos"] = static_cast<double>(m.false_positives);
  state.counters["lsh"] = minhash_threshold(mh);
  state.counters["docs"] = static_cast<double>(p.docs.size());
}

// Args: edit percent, bands, rows, verify (percent Jaccard; 0: off).
BENCHMARK(BM_NearDup)
    ->ArgNames({"edit_pct", "bands", "rows", "verify_pct"})
    ->Args({2, 32, 3, 50})
    ->Args({5, 32, 3, 50})
    ->Args({10, 32, 3, 50})
    ->Args({5, 32, 3, 0})
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);

// ---- The Debian copyright files.

bool is_word_byte(unsigned char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c >= 0x80;
}
// [begin, end) of each word of text: maximal runs of letters and digits, as data/dedup.cpp reads them.
std::vector<std::pair<size_t, size_t>> word_spans(const std::string& text) {
  std::vector<std::pair<size_t, size_t>> spans;
  for (size_t i = 0; i < text.size();) {
    while (i < text.size() && !is_word_byte(static_cast<unsigned char>(text[i]))) ++i;
    const size_t start = i;
    while (i < text.size() && is_word_byte(static_cast<unsigned char>(text[i]))) ++i;
    if (i > start) spans.emplace_back(start, i);
  }
  return spans;
}
std::string lower(std::string s) {
  for (char& c : s) c = c >= 'A' && c <= 'Z' ? static_cast<char>(c + 32) : c;
  return s;
}

struct DebianSet {
  std::vector<std::string> names, texts;  // the pool, in name order
  std::vector<int> part;                  // 0: choose defaults, 1: held out
  size_t files = 0, exact_duplicates = 0, near_twins = 0;
};

const DebianSet& debian() {
  static const DebianSet set = [] {
    DebianSet d;
    std::vector<fs::path> paths;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator("/usr/share/doc", ec))
      if (fs::is_regular_file(e.path() / "copyright", ec)) paths.push_back(e.path() / "copyright");
    std::sort(paths.begin(), paths.end());
    std::unordered_set<std::string> seen;
    std::vector<std::vector<uint64_t>> sets;        // each pool document's distinct shingles, sorted
    std::unordered_map<uint64_t, std::vector<uint32_t>> holders;  // shingle -> pool documents
    for (const fs::path& path : paths) {
      std::ifstream in(path, std::ios::binary);
      const std::string raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      std::string text;
      CleanResult flags;
      if (!clean_text(raw, {}, &text, &flags) || text.empty()) continue;
      ++d.files;
      if (!seen.insert(text).second) {
        ++d.exact_duplicates;
        continue;
      }
      std::vector<uint64_t> shingles;
      shingle_hashes(text, 5, &shingles);
      std::sort(shingles.begin(), shingles.end());
      shingles.erase(std::unique(shingles.begin(), shingles.end()), shingles.end());
      std::unordered_map<uint32_t, uint32_t> shared;
      for (uint64_t h : shingles) {
        auto it = holders.find(h);
        if (it != holders.end())
          for (uint32_t other : it->second) ++shared[other];
      }
      bool twin = false;
      for (auto [other, common] : shared)
        twin |= static_cast<double>(common) / static_cast<double>(shingles.size() + sets[other].size() - common) >= 0.5;
      if (twin) {
        ++d.near_twins;
        continue;
      }
      const auto id = static_cast<uint32_t>(d.texts.size());
      for (uint64_t h : shingles) holders[h].push_back(id);
      sets.push_back(std::move(shingles));
      const std::string name = path.parent_path().filename().string();
      d.names.push_back(name);
      d.texts.push_back(std::move(text));
      d.part.push_back(static_cast<int>(XXH3_64bits(name.data(), name.size()) & 1));
    }
    return d;
  }();
  return set;
}

// Part `part` of the set with copies planted at `edit_rate`: originals and negatives, then the copies.
Planted debian_corpus(int part, double edit_rate, std::vector<std::string>* names) {
  const DebianSet& d = debian();
  Planted p;
  std::vector<size_t> originals;
  std::vector<std::string> vocabulary;
  for (size_t i = 0; i < d.texts.size(); ++i) {
    if (d.part[i] != part) continue;
    if (d.texts[i].size() >= 2048) originals.push_back(i);
    p.docs.push_back(d.texts[i]);
    p.is_copy.push_back(false);
    names->push_back(d.names[i]);
    for (auto [b, e] : word_spans(d.texts[i])) vocabulary.push_back(d.texts[i].substr(b, e - b));
  }
  std::sort(vocabulary.begin(), vocabulary.end());
  vocabulary.erase(std::unique(vocabulary.begin(), vocabulary.end()), vocabulary.end());
  for (size_t i : originals) {
    const std::string& text = d.texts[i];
    std::mt19937_64 rng(1000 + i);
    std::vector<std::pair<size_t, size_t>> spans = word_spans(text);
    const size_t edits = static_cast<size_t>(edit_rate * static_cast<double>(spans.size()) + 0.5);
    std::vector<size_t> order(spans.size());
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<std::string> replacement(spans.size());
    for (size_t e = 0; e < edits; ++e) {
      const auto [b, end] = spans[order[e]];
      const std::string old = lower(text.substr(b, end - b));
      do replacement[order[e]] = vocabulary[rng() % vocabulary.size()];
      while (lower(replacement[order[e]]) == old);
    }
    std::string copy;
    size_t at = 0;
    for (size_t w = 0; w < spans.size(); ++w) {
      if (replacement[w].empty()) continue;
      copy.append(text, at, spans[w].first - at);
      copy += replacement[w];
      at = spans[w].second;
    }
    copy.append(text, at, std::string::npos);
    p.docs.push_back(std::move(copy));
    p.is_copy.push_back(true);
    names->push_back(d.names[i] + " (copy)");
  }
  return p;
}

void BM_NearDupDebian(benchmark::State& state) {
  const int part = static_cast<int>(state.range(0));
  const double edit_rate = static_cast<double>(state.range(1)) / 100.0;
  MinHashOptions mh = lsh(state, 2);
  const double verify = static_cast<double>(state.range(4)) / 100.0;
  mh.sketch_size = static_cast<int>(state.range(5));
  std::vector<std::string> names;
  const Planted p = debian_corpus(part, edit_rate, &names);
  if (p.docs.empty()) {
    state.SkipWithError("no Debian copyright files under /usr/share/doc");
    return;
  }
  Measured m;
  for (auto _ : state) m = measure(p.docs, p.is_copy, mh, verify);
  uint64_t copies = 0;
  for (bool c : p.is_copy) copies += c;
  state.counters["recall"] = m.recall;
  state.counters["precision"] = m.precision;
  state.counters["false_pos"] = static_cast<double>(m.false_positives);
  state.counters["originals"] = static_cast<double>(copies);
  state.counters["negatives"] = static_cast<double>(p.docs.size() - 2 * copies);
  state.counters["lsh"] = minhash_threshold(mh);
  std::string label;
  for (size_t i : m.false_positive_docs) label += (label.empty() ? "false positives: " : ", ") + names[i];
  state.SetLabel(label);
  static bool once = false;
  if (!once) {
    once = true;
    const DebianSet& d = debian();
    std::fprintf(stderr,
                 "Debian copyright files: %zu read, %zu exact duplicates and %zu near twins (Jaccard >= 0.5 with an "
                 "earlier file) left out, %zu in the set\n",
                 d.files, d.exact_duplicates, d.near_twins, d.texts.size());
  }
}

// Args: part (0: tuning, 1: held out), edit percent, bands, rows, verify (percent Jaccard; 0: off), sketch size.
// Part 0: the sweep the defaults were chosen on (5% edits). Part 1: the table of
// benchmarks/2026-11-30-prepare-near-duplicates.md.
void DebianArgs(benchmark::internal::Benchmark* b) {
  b->ArgNames({"part", "edit_pct", "bands", "rows", "verify_pct", "sketch"});
  for (auto [bands, rows] : {std::pair{32, 3}, std::pair{28, 4}, std::pair{14, 8}})
    for (int verify : {0, 45, 50, 55}) b->Args({0, 5, bands, rows, verify, 256});
  b->Args({0, 5, 32, 3, 50, 1024});
  for (int edit : {2, 5, 10}) b->Args({1, edit, 32, 3, 50, 256});
  b->Args({1, 5, 32, 3, 0, 256});
  b->Args({1, 5, 28, 4, 50, 256});
  b->Args({1, 5, 14, 8, 50, 256});
}
BENCHMARK(BM_NearDupDebian)->Apply(DebianArgs)->Iterations(1)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace tuna

BENCHMARK_MAIN();
