// build/prepare: text and JSONL corpora -> token shards for build/train. The pipeline is data/prepare.h;
// this file is the command line.
#include "data/prepare.h"  // PrepareOptions, prepare_corpus, report_summary

#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace {

constexpr const char* kUsage = R"(usage: build/prepare --tokenizer TOK.model --out DIR [options] INPUT...

Turns text into token shards for build/train: DIR/train-NNNNN.bin, DIR/val-NNNNN.bin, DIR/report.json.
INPUT is a file or a directory (searched recursively, in name order): .txt and .md files are one document
each; .jsonl files hold one JSON object per line, the document in its text field. Every document becomes
BOS + tokens + EOS. Bad records (malformed JSON, no text field, empty) are counted in the report, never fatal.

  --tokenizer PATH          sentencepiece model to tokenize with (written first with --train-tokenizer)
  --out DIR                 output directory (created if missing)
  --train-tokenizer         train PATH on the inputs first (BPE, byte fallback), writing PATH and its .vocab
  --vocab-size N            vocabulary of the trained tokenizer (default 32000)
  --tokenizer-sample-mb N   text sampled for tokenizer training, in MiB (default 1024)
  --val-fraction F          share of documents in the validation split, by a hash of the text (default 0.05)
  --text-field NAME         JSONL field that holds the document (default text)
  --shard-tokens N          tokens per shard before the next one starts (default 100000000)
  --threads N               tokenization threads (default: all cores); the output does not depend on it
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
    if constexpr (std::is_floating_point_v<T>)
      result = static_cast<T>(std::stod(value, &used));
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

  try {
    tuna::PrepareReport report = tuna::prepare_corpus(options);
    std::fputs(tuna::report_summary(report).c_str(), stdout);
    std::printf("wrote %s/report.json\n", options.out_dir.c_str());
    if (report.train.tokens == 0) std::fprintf(stderr, "warning: the training split is empty\n");
    if (report.val.tokens == 0 && options.val_fraction > 0)
      std::fprintf(stderr,
                   "warning: the validation split is empty (too few documents for --val-fraction %g)\n",
                   options.val_fraction);
  } catch (const tuna::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
