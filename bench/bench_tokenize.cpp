// Tokenizing speed on real legal text, tuna against the reference implementations, side by side in one run.
// Data: the Debian copyright files (/usr/share/doc/*/copyright, ~850 documents, ~20 MB; invalid UTF-8
// repaired as prepare's cleaning does; TUNA_BENCH_TOKENIZE_MB caps the size).
//   SpmEncode            sentencepiece's command-line encoder (spm_encode --output_format=id), 1 process, the
//                        corpus as one file (it encodes line by line)
//   Sentencepiece/T      tuna's CachedEncoder (what prepare uses) with the same model, per document, T threads
//   HfTokenizers         Hugging Face tokenizers' encode_batch on 1 thread (tools/reference/bench_tokenizers.py;
//                        needs python3 and `pip install tokenizers`), Llama 3.2's tokenizer.json
//   Llama3Json/T         tuna's CachedEncoder with the same tokenizer.json, T threads
//   Llama3Tiktoken/T     the same tokenizer read from its tiktoken file
// The sentencepiece model is an 8000-piece BPE trained on demo/corpus/text with LLaMA's settings. Each
// encoder starts with a cold cache. MB_per_s counts the documents' bytes; the summary at the end prints the
// per-core ratios (tuna on 1 thread over each peer on 1), by wall time and by CPU time (MB_per_cpu_s: the
// bytes over the CPU seconds the encoder's process or thread spent, which a loaded machine disturbs less).
// Run from the repository root: build/bench_tokenize
#include <benchmark/benchmark.h>
#include <sys/resource.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "bench/prepare_bench_util.h"
#include "core/error.h"
#include "data/clean.h"
#include "data/input.h"
#include "data/tokenizer.h"

namespace tuna {
namespace {

namespace fs = std::filesystem;

int all_threads() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

fs::path repository() { return bench_prepare::demo_corpus().parent_path().parent_path().parent_path(); }

std::string unpack_fixture(const fs::path& zst) {
  std::string why, out;
  auto stream = open_input({zst.string(), InputKind::text, Compression::zstd, 0}, &why);
  if (!stream) throw std::runtime_error(zst.string() + ": " + why);
  if (!read_all(stream.get(), uint64_t{1} << 30, &out) || !stream->error().empty())
    throw std::runtime_error(zst.string() + ": cannot unpack: " + stream->error());
  return out;
}

struct Corpus {
  fs::path dir;
  std::vector<std::string> docs;
  uint64_t bytes = 0;
  std::string spm_model, llama3_json, llama3_tiktoken;
  Corpus() {
    std::string templ = (fs::temp_directory_path() / "tuna-bench-tokenize-XXXXXX").string();
    dir = ::mkdtemp(templ.data());
    std::vector<fs::path> files;
    for (const auto& e : fs::directory_iterator("/usr/share/doc")) {
      std::error_code ec;
      if (fs::is_regular_file(e.path() / "copyright", ec)) files.push_back(e.path() / "copyright");
    }
    std::sort(files.begin(), files.end());
    const char* mb = std::getenv("TUNA_BENCH_TOKENIZE_MB");
    const uint64_t cap = mb ? static_cast<uint64_t>(std::atof(mb) * 1e6) : ~uint64_t{0};
    for (const fs::path& f : files) {
      std::ifstream in(f, std::ios::binary);
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      if (!is_valid_utf8(text)) text = repair_utf8(text);
      if (text.empty() || bytes + text.size() > cap) continue;
      bytes += text.size();
      docs.push_back(std::move(text));
    }
    std::ofstream jsonl(dir / "corpus.jsonl"), plain(dir / "corpus.txt");
    for (const std::string& d : docs) jsonl << nlohmann::json{{"text", d}}.dump() << '\n', plain << d << '\n';
    spm_model = bench_prepare::demo_tokenizer(dir, 8000);
    const fs::path fixtures = repository() / "tests/fixtures/tokenizers/llama3";
    fs::create_directories(dir / "llama3/original");
    for (const char* name : {"tokenizer.json", "tokenizer_config.json", "original/tokenizer.model"}) {
      std::ofstream out(dir / "llama3" / name, std::ios::binary);
      out << unpack_fixture(fixtures / (std::string(name) + ".zst"));
    }
    llama3_json = (dir / "llama3/tokenizer.json").string();
    llama3_tiktoken = (dir / "llama3/original/tokenizer.model").string();
    std::fprintf(stderr, "bench_tokenize: %zu Debian copyright files, %.1f MB\n", docs.size(), bytes / 1e6);
  }
  ~Corpus() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
};

Corpus& corpus() {
  static Corpus c;
  return c;
}

struct Rate {
  double wall = 0, cpu = 0;  // MB/s by wall time and by CPU time
};
std::map<std::string, Rate>& rates() {  // by benchmark, for the summary
  static std::map<std::string, Rate> r;
  return r;
}

double cpu_seconds(int who) {  // RUSAGE_SELF or RUSAGE_CHILDREN
  rusage u{};
  ::getrusage(who, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + 1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

void set_rate(benchmark::State& state, const std::string& name, double seconds, double cpu, uint64_t tokens) {
  const double mb = static_cast<double>(corpus().bytes) * static_cast<double>(state.iterations()) / 1e6;
  state.counters["MB_per_s"] = benchmark::Counter(mb / seconds);
  state.counters["MB_per_cpu_s"] = benchmark::Counter(mb / cpu);
  state.counters["tokens"] = static_cast<double>(tokens);
  rates()[name] = {mb / seconds, mb / cpu};
}

// Runs a command, returns its standard output (empty on failure).
std::string run(const std::string& command) {
  std::string out;
  if (FILE* p = ::popen(command.c_str(), "r")) {
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
    if (::pclose(p) != 0) out.clear();
  }
  return out;
}

void BM_SpmEncode(benchmark::State& state) {
  const std::string command =
      "spm_encode --model " + corpus().spm_model + " --output_format=id < " + (corpus().dir / "corpus.txt").string();
  double total = 0, cpu = 0;
  uint64_t tokens = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    const double c0 = cpu_seconds(RUSAGE_CHILDREN);
    const std::string ids = run(command);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    cpu += cpu_seconds(RUSAGE_CHILDREN) - c0;
    if (ids.empty()) state.SkipWithError("spm_encode failed (is the sentencepiece package installed?)");
    tokens = static_cast<uint64_t>(std::count(ids.begin(), ids.end(), ' ') + std::count(ids.begin(), ids.end(), '\n'));
    state.SetIterationTime(s);
    total += s;
  }
  set_rate(state, "spm_encode", total, cpu, tokens);
}

void BM_HfTokenizers(benchmark::State& state) {
  const std::string command = "python3 " + (repository() / "tools/reference/bench_tokenizers.py").string() +
                              " --threads 1 --tokenizer " + corpus().llama3_json + " --corpus " +
                              (corpus().dir / "corpus.jsonl").string();
  for (auto _ : state) {
    const std::string line = run(command);
    if (line.empty()) {
      state.SkipWithError("tools/reference/bench_tokenizers.py failed (python3 and `pip install tokenizers` needed)");
      return;
    }
    const nlohmann::json j = nlohmann::json::parse(line);
    state.SetIterationTime(j.at("seconds").get<double>());
    state.counters["MB_per_s"] = j.at("mb_per_s").get<double>();
    state.counters["MB_per_cpu_s"] = j.at("mb_per_cpu_s").get<double>();
    state.counters["tokens"] = j.at("tokens").get<double>();
    rates()["tokenizers"] = {j.at("mb_per_s").get<double>(), j.at("mb_per_cpu_s").get<double>()};
  }
}

enum class Model { spm, llama3_json, llama3_tiktoken };

template <Model kModel>
void BM_Cached(benchmark::State& state) {
  const int threads = state.range(0) ? static_cast<int>(state.range(0)) : all_threads();
  const Corpus& c = corpus();
  const Tokenizer tok(kModel == Model::spm ? c.spm_model : kModel == Model::llama3_json ? c.llama3_json : c.llama3_tiktoken);
  double total = 0, cpu = 0;
  uint64_t tokens = 0;
  for (auto _ : state) {
    const CachedEncoder encoder(tok);  // a cold cache every iteration
    if (!encoder.exact()) state.SkipWithError("the segment cache is off for this model");
    const auto t0 = std::chrono::steady_clock::now();
    const double c0 = cpu_seconds(RUSAGE_SELF);
    tokens = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 4) reduction(+ : tokens)
    for (size_t d = 0; d < c.docs.size(); ++d) {
      std::vector<int32_t> ids;
      encoder.encode(c.docs[d], &ids);
      tokens += ids.size();
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    cpu += cpu_seconds(RUSAGE_SELF) - c0;
    state.SetIterationTime(s);
    total += s;
  }
  set_rate(state, str(kModel == Model::spm ? "sentencepiece" : kModel == Model::llama3_json ? "llama3_json" : "llama3_tiktoken", "/", threads), total, cpu, tokens);
}

// range 0 = all hardware threads.
BENCHMARK(BM_SpmEncode)->Name("SpmEncode")->Iterations(1)->UseManualTime()->Unit(benchmark::kSecond);
BENCHMARK(BM_Cached<Model::spm>)->Name("Sentencepiece")->ArgName("threads")->Arg(1)->Arg(0)->Iterations(1)->UseManualTime()->Unit(benchmark::kSecond);
BENCHMARK(BM_HfTokenizers)->Name("HfTokenizers")->Iterations(1)->UseManualTime()->Unit(benchmark::kSecond);
BENCHMARK(BM_Cached<Model::llama3_json>)->Name("Llama3Json")->ArgName("threads")->Arg(1)->Arg(0)->Iterations(1)->UseManualTime()->Unit(benchmark::kSecond);
BENCHMARK(BM_Cached<Model::llama3_tiktoken>)->Name("Llama3Tiktoken")->ArgName("threads")->Arg(1)->Iterations(1)->UseManualTime()->Unit(benchmark::kSecond);

}  // namespace
}  // namespace tuna

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  auto& r = tuna::rates();
  auto ratio = [&](const char* ours, const char* peer) {
    const auto a = r.find(ours), b = r.find(peer);
    if (a == r.end() || b == r.end() || b->second.wall <= 0 || b->second.cpu <= 0) return;
    std::printf("bench_tokenize: %s %.1f MB/s vs %s %.2f MB/s: %.1fx by wall time; %.1f vs %.2f MB per CPU second: %.1fx\n",
                ours, a->second.wall, peer, b->second.wall, a->second.wall / b->second.wall, a->second.cpu, b->second.cpu,
                a->second.cpu / b->second.cpu);
  };
  ratio("sentencepiece/1", "spm_encode");
  ratio("llama3_json/1", "tokenizers");
  return 0;
}
