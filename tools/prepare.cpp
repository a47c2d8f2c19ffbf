// build/prepare: text and JSONL corpora -> token shards for build/train. The pipeline is data/prepare.h;
// this file is the command line.
#include "data/prepare.h"  // PrepareOptions, prepare_corpus, report_summary

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace {

constexpr const char* kUsage = R"(usage: build/prepare --tokenizer TOK.model --out DIR [options] INPUT...
       mpirun -np N build/prepare ... (same options: each rank reads a share, dedup stays global)

Cleans, filters, deduplicates and tokenizes text into shards for build/train: DIR/train-NNNNN.bin,
DIR/val-NNNNN.bin (DIR/train-rRRRRR-NNNNN.bin under mpirun), DIR/report.json. INPUT is a file or a directory
(searched recursively, in name order): .txt and .md files are one document each; .jsonl files one JSON
object per line. Any of them may be compressed (.gz, .zst). Every document becomes BOS + tokens + EOS.
Nothing is dropped without being counted: the report accounts for every document read (kept, malformed,
filtered by which rule, exact or near duplicate) with the first location of each.

  --tokenizer PATH          sentencepiece model to tokenize with (written first with --train-tokenizer)
  --out DIR                 output directory (created if missing)
  --train-tokenizer         train PATH on the inputs first (BPE, byte fallback), writing PATH and its .vocab
  --vocab-size N            vocabulary of the trained tokenizer (default 32000)
  --tokenizer-sample-mb N   text sampled for tokenizer training, in MiB (default 1024)
  --val-fraction F          share of documents in the validation split, by a hash of the text (default 0.05)
  --text-field NAME         JSONL field that holds the document (default text)
  --sft                     JSONL records are {prompt, response}: the loss mask trains on the response only
  --prompt-field NAME       (default prompt)
  --response-field NAME     (default response)
  --max-document-mb N       a longer line or file is counted as oversized and skipped (default 64)
cleaning and filters:
  --drop-invalid-utf8       drop a document with invalid UTF-8 (default: replace each bad byte with U+FFFD)
  --keep-whitespace         do not collapse spaces and blank lines (control characters still go)
  --min-chars N             drop documents shorter than N characters (default 1)
  --max-chars N             drop documents longer than N characters (default 0: no limit)
  --min-alpha F             drop documents whose letters are under F of their non-space characters (0.25)
  --max-repeated-lines F    drop documents whose repeated lines are over F of their lines (default 0.3)
dedup:
  --no-exact-dedup          keep exact duplicates (of the cleaned text)
  --no-near-dedup           keep near duplicates
  --shingle-words N         words per MinHash shingle (default 5)
  --minhash-bands B         LSH bands (default 14)
  --minhash-rows R          rows per band (default 8); B x R permutations; threshold ~ (1/B)^(1/R) = 0.72
  --near-verify J           join an LSH candidate pair only if its signatures estimate Jaccard >= J
                            (default 0.5; 0: join every candidate)
  --dedup-memory-mb N       memory for the dedup join's partitions, in MiB (default 1024)
output:
  --shard-tokens N          tokens per shard before the next one starts (default 100000000)
  --threads N               threads (default: all cores); the output does not depend on it
  --overwrite               replace the shards and report of an earlier run in DIR
  --quiet                   no progress lines
)";

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "error: %s\n\n%s", message.c_str(), kUsage);
  std::exit(2);
}

template <typename T>
T parse_number(const std::string& flag, const std::string& value) {
  try {
    size_t used = 0;
    T result;
    if constexpr (std::is_floating_point_v<T>) {
      result = static_cast<T>(std::stod(value, &used));
      if (!std::isfinite(result)) throw std::invalid_argument(value);  // inf and nan are no setting
    }
    else
      result = static_cast<T>(std::stoll(value, &used));
    if (used != value.size()) throw std::invalid_argument(value);
    if constexpr (!std::is_floating_point_v<T>)
      if (std::stoll(value) < 0) throw std::invalid_argument(value);
    return result;
  } catch (const std::exception&) {
    usage_error(tuna::str(flag, ": expected a ",
                          std::is_floating_point_v<T> ? "number" : "non-negative integer", ", found '", value,
                          "'"));
  }
}

}  // namespace

int main(int argc, char** argv) {
  tuna::PrepareOptions options;
  std::vector<std::string> args(argv + 1, argv + argc);
  for (size_t i = 0; i < args.size(); ++i) {
    std::string arg = args[i], value;
    bool has_inline_value = false;
    if (arg.rfind("--", 0) == 0 && arg.find('=') != std::string::npos) {
      value = arg.substr(arg.find('=') + 1);
      arg = arg.substr(0, arg.find('='));
      has_inline_value = true;
    }
    auto take = [&]() -> std::string {
      if (has_inline_value) return value;
      if (i + 1 >= args.size()) usage_error(arg + " needs a value");
      return args[++i];
    };
    if (arg == "-h" || arg == "--help") {
      std::fputs(kUsage, stdout);
      return 0;
    } else if (arg == "--tokenizer") {
      options.tokenizer_path = take();
    } else if (arg == "--out") {
      options.out_dir = take();
    } else if (arg == "--train-tokenizer") {
      options.train_tokenizer = true;
    } else if (arg == "--vocab-size") {
      options.vocab_size = parse_number<int>(arg, take());
    } else if (arg == "--tokenizer-sample-mb") {
      options.tokenizer_sample_bytes = parse_number<uint64_t>(arg, take()) << 20;
    } else if (arg == "--val-fraction") {
      options.val_fraction = parse_number<double>(arg, take());
    } else if (arg == "--text-field") {
      options.text_field = take();
    } else if (arg == "--sft") {
      options.sft = true;
    } else if (arg == "--prompt-field") {
      options.prompt_field = take();
    } else if (arg == "--response-field") {
      options.response_field = take();
    } else if (arg == "--max-document-mb") {
      options.max_document_bytes = parse_number<uint64_t>(arg, take()) << 20;
    } else if (arg == "--drop-invalid-utf8") {
      options.clean.drop_invalid_utf8 = true;
    } else if (arg == "--keep-whitespace") {
      options.clean.keep_whitespace = true;
    } else if (arg == "--min-chars") {
      options.quality.min_chars = parse_number<uint64_t>(arg, take());
    } else if (arg == "--max-chars") {
      options.quality.max_chars = parse_number<uint64_t>(arg, take());
    } else if (arg == "--min-alpha") {
      options.quality.min_alpha_fraction = parse_number<double>(arg, take());
    } else if (arg == "--max-repeated-lines") {
      options.quality.max_repeated_line_fraction = parse_number<double>(arg, take());
    } else if (arg == "--no-exact-dedup") {
      options.exact_dedup = false;
    } else if (arg == "--no-near-dedup") {
      options.near_dedup = false;
    } else if (arg == "--shingle-words") {
      options.minhash.shingle_words = parse_number<int>(arg, take());
    } else if (arg == "--minhash-bands") {
      options.minhash.bands = parse_number<int>(arg, take());
    } else if (arg == "--minhash-rows") {
      options.minhash.rows = parse_number<int>(arg, take());
    } else if (arg == "--near-verify") {
      options.near_verify = parse_number<double>(arg, take());
    } else if (arg == "--dedup-memory-mb") {
      options.dedup_memory_bytes = parse_number<uint64_t>(arg, take()) << 20;
    } else if (arg == "--shard-tokens") {
      options.shard_tokens = parse_number<uint64_t>(arg, take());
    } else if (arg == "--threads") {
      options.threads = parse_number<int>(arg, take());
    } else if (arg == "--overwrite") {
      options.overwrite = true;
    } else if (arg == "--quiet") {
      options.quiet = true;
    } else if (arg.rfind("-", 0) == 0 && arg != "-") {
      usage_error("unknown option " + arg);
    } else {
      options.inputs.push_back(arg);
    }
  }
  if (options.tokenizer_path.empty()) usage_error("--tokenizer is required");
  if (options.out_dir.empty()) usage_error("--out is required");
  if (options.inputs.empty()) usage_error("no INPUT given");

  // Under mpirun: MPI up before anything else; every rank runs the same pipeline on its share.
  std::unique_ptr<tuna::PrepareComm> comm = tuna::world_prepare_comm_if_launched();
  options.comm = comm.get();
  const bool speaker = !comm || comm->rank() == 0;
  try {
    tuna::PrepareReport report = tuna::prepare_corpus(options);
    if (!speaker) return 0;
    std::fputs(tuna::report_summary(report).c_str(), stdout);
    std::printf("wrote %s/report.json\n", options.out_dir.c_str());
    if (report.train.tokens == 0) std::fprintf(stderr, "warning: the training split is empty\n");
    if (report.val.tokens == 0 && options.val_fraction > 0)
      std::fprintf(stderr,
                   "warning: the validation split is empty (too few documents for --val-fraction %g)\n",
                   options.val_fraction);
  } catch (...) {  // every exception, not only tuna::Error: nothing ends prepare with SIGABRT and no message
    std::fprintf(stderr, "error: %s%s\n", comm ? tuna::str("rank ", comm->rank(), ": ").c_str() : "",
                 tuna::describe_current_exception().c_str());
    // The other ranks may wait in a collective for this one: stop them all.
    if (comm && comm->size() > 1) comm->abort(1);
    return 1;
  }
  return 0;
}
