// Throughput of build/prepare on one generated corpus (bench/prepare_bench_util.h: a bigram chain over the
// demo corpus, ~12 MB of one-line documents; TUNA_BENCH_PREPARE_MB changes the size), in one run:
//   SpmEncode/procs:P    sentencepiece's own command-line encoder (spm_encode --output_format=id), the
//                        corpus cut into P parts encoded by P processes at once (P = 1 and all cores)
//   Tokenize/threads:T   tuna's Tokenizer::encode per document on T threads (the same library call)
//   TokenizeCached/T     CachedEncoder (data/tokenizer.h), what prepare uses: exact same ids, a word cache
//   Prepare/threads:T    the whole pipeline on the same documents as JSONL: read, clean, filter, exact and
//                        near dedup, tokenize, write shards (two passes over the input)
// MB_per_s counts input text bytes. The tokenizer is a 8000-piece BPE trained on the demo corpus with
// LLaMA's settings. Run from the repository root: build/bench_prepare
#include <benchmark/benchmark.h>
#include <omp.h>

#include <chrono>
#include <thread>

#include <nlohmann/json.hpp>

#include "bench/prepare_bench_util.h"
#include "data/prepare.h"

namespace tuna {
namespace {

namespace fs = std::filesystem;
using bench_prepare::Chain;

int all_threads() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

struct Corpus {
  fs::path dir;
  std::string tokenizer;
  std::vector<std::string> docs;
  uint64_t bytes = 0;
  Corpus() {
    std::string templ = (fs::temp_directory_path() / "tuna-bench-prepare-XXXXXX").string();
    dir = ::mkdtemp(templ.data());
    tokenizer = bench_prepare::demo_tokenizer(dir, 8000);
    const char* mb = std::getenv("TUNA_BENCH_PREPARE_MB");
    const uint64_t target = static_cast<uint64_t>(mb ? std::atof(mb) : 12.0) << 20;
    Chain chain;
    std::mt19937_64 rng(11);
    while (bytes < target) {
      docs.push_back(chain.document(rng, 200 + static_cast<int>(rng() % 1800)));
      bytes += docs.back().size();
    }
    std::ofstream jsonl(dir / "corpus.jsonl");
    for (const std::string& d : docs) jsonl << nlohmann::json{{"text", d}}.dump() << '\n';
  }
  ~Corpus() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
  // The documents as P plain-text files of whole lines, for P spm_encode processes.
  std::vector<std::string> parts(int p) {
    std::vector<std::string> paths;
    for (int i = 0; i < p; ++i) {
      paths.push_back((dir / ("part" + std::to_string(p) + "-" + std::to_string(i) + ".txt")).string());
      if (fs::exists(paths.back())) continue;
      std::ofstream out(paths.back());
      for (size_t d = static_cast<size_t>(i); d < docs.size(); d += static_cast<size_t>(p)) out << docs[d] << '\n';
    }
    return paths;
  }
};

Corpus& corpus() {
  static Corpus c;
  return c;
}

void set_rate(benchmark::State& state, double seconds_total) {
  state.counters["MB_per_s"] = benchmark::Counter(static_cast<double>(corpus().bytes) * static_cast<double>(state.iterations()) / 1e6 / seconds_total);
  state.counters["docs_per_s"] = benchmark::Counter(static_cast<double>(corpus().docs.size()) * static_cast<double>(state.iterations()) / seconds_total);
}

void BM_SpmEncode(benchmark::State& state) {
  const int procs = state.range(0) ? static_cast<int>(state.range(0)) : all_threads();
  const std::vector<std::string> parts = corpus().parts(procs);
  std::string command;
  for (const std::string& part : parts)
    command += "spm_encode --model " + corpus().tokenizer + " --output_format=id < " + part + " > /dev/null & ";
  command += "wait";
  double total = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    if (std::system(command.c_str()) != 0) state.SkipWithError("spm_encode failed (is the sentencepiece package installed?)");
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state.SetIterationTime(s);
    total += s;
  }
  set_rate(state, total);
}

template <bool kCached>
void BM_Tokenize(benchmark::State& state) {
  const int threads = state.range(0) ? static_cast<int>(state.range(0)) : all_threads();
  Tokenizer tok(corpus().tokenizer);
  const auto& docs = corpus().docs;
  double total = 0;
  uint64_t tokens = 0;
  for (auto _ : state) {
    const CachedEncoder encoder(tok);  // a cold cache every iteration
    if (kCached && !encoder.exact()) state.SkipWithError("the word cache is off for this model");
    const auto t0 = std::chrono::steady_clock::now();
    tokens = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 16) reduction(+ : tokens)
    for (size_t d = 0; d < docs.size(); ++d) {
      std::vector<int32_t> ids;
      if (kCached)
        encoder.encode(docs[d], &ids);
      else
        ids = tok.encode(docs[d]);
      tokens += ids.size();
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state.SetIterationTime(s);
    total += s;
  }
  set_rate(state, total);
  state.counters["tokens"] = static_cast<double>(tokens);
}

void BM_Prepare(benchmark::State& state) {
  const int threads = state.range(0) ? static_cast<int>(state.range(0)) : all_threads();
  double total = 0;
  PrepareReport report;
  for (auto _ : state) {
    PrepareOptions o;
    o.inputs = {(corpus().dir / "corpus.jsonl").string()};
    o.tokenizer_path = corpus().tokenizer;
    o.out_dir = (corpus().dir / "out").string();
    o.overwrite = true;
    o.threads = threads;
    o.quiet = true;
    const auto t0 = std::chrono::steady_clock::now();
    report = prepare_corpus(o);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state.SetIterationTime(s);
    total += s;
  }
  set_rate(state, total);
  state.counters["kept"] = static_cast<double>(report.documents_kept());
  state.counters["near_dups"] = static_cast<double>(report.of(Outcome::near_duplicate).count);
}

// range 0 = all hardware threads.
BENCHMARK(BM_SpmEncode)->ArgName("procs")->Arg(1)->Arg(0)->Iterations(1)->UseManualTime()->Unit(benchmark::kSecond);
BENCHMARK(BM_Tokenize<false>)->Name("Tokenize")->ArgName("threads")->Arg(1)->Arg(0)->Iterations(1)->UseManualTime()->Unit(benchmark::kSecond);
BENCHMARK(BM_Tokenize<true>)->Name("TokenizeCached")->ArgName("threads")->Arg(1)->Arg(0)->Iterations(1)->UseManualTime()->Unit(benchmark::kSecond);
BENCHMARK(BM_Prepare)->ArgName("threads")->Arg(1)->Arg(0)->Iterations(1)->UseManualTime()->Unit(benchmark::kSecond);

}  // namespace
}  // namespace tuna

BENCHMARK_MAIN();
