// build/prepare: text and JSONL corpora -> token shards for build/train. The pipeline is data/prepare.h;
// this file is the command line, on core/options like every tool: --a-b and --a_b alike, --name=value,
// --config FILE.toml, an unknown name answered with the nearest one.
#include <cstdint>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "ckpt/checkpoint.h" // verify_model_directory
#include "core/options.h"   // Options
#include "data/prepare.h"   // PrepareOptions, prepare_corpus, report_summary

namespace {

constexpr const char* kSummary = R"(Cleans, filters, deduplicates and tokenizes text into shards for build/train.

  build/prepare --tokenizer TOKENIZER --out DIR [options] INPUT...
  mpirun -np N build/prepare ... (same options: each rank reads a share, dedup stays global)

Writes DIR/train-NNNNN.bin, DIR/val-NNNNN.bin (DIR/train-rRRRRR-NNNNN.bin under mpirun), DIR/report.json and
DIR/dropped.jsonl (one line per dropped document: where it was and why). INPUT is a file or a directory
(searched recursively, in name order): .txt and .md files are one document each; .jsonl files one JSON object
per line; any of them may be compressed (.gz, .zst). Inputs must be regular files: a FIFO, a device or a
symbolic link loop is refused by name, and a symbolic link inside a directory that leads out of it is skipped
and counted unless --follow-symlinks. Every document becomes BOS + tokens + EOS. Nothing is dropped without
being counted: the report accounts for every document read (kept, malformed, filtered by which rule, exact or
near duplicate). Option names take dashes or underscores alike (--val-fraction, --val_fraction).)";

// Flags whose field has another unit or integer type than core/options' int64: each is read as an int64,
// then checked (a whole number in [min, the field's largest]) and stored, scaled by 2^shift (MiB -> bytes).
class WideFlags {
 public:
  template <typename T>
  void add(tuna::Options& o, const char* name, T* field, const std::string& help, int64_t min = 0, int shift = 0) {
    const uint64_t type_max = static_cast<uint64_t>(std::numeric_limits<T>::max());
    const auto max = static_cast<int64_t>(std::min<uint64_t>(type_max, std::numeric_limits<int64_t>::max()) >> shift);
    flags_.push_back({name, static_cast<int64_t>(*field >> shift), min, max,
                      [field, shift](int64_t v) { *field = static_cast<T>(static_cast<T>(v) << shift); }});
    o.add(name, &flags_.back().value, help);
  }
  void apply() const {
    for (const Flag& f : flags_) {
      if (f.value < f.min || f.value > f.max)
        tuna::fail("command line: option '--", f.name, "': expected an integer in [", f.min, ", ", f.max, "], found ",
                   f.value);
      f.store(f.value);
    }
  }

 private:
  struct Flag {
    const char* name;
    int64_t value, min, max;
    std::function<void(int64_t)> store;
  };
  std::deque<Flag> flags_;  // a deque: Options keeps a pointer to each value
};

// Every flag of prepare. no_exact_dedup / no_near_dedup: PrepareOptions says it the other way round.
void declare(tuna::Options& o, tuna::PrepareOptions& p, WideFlags& w, bool* no_exact_dedup, bool* no_near_dedup) {
  o.add("tokenizer", &p.tokenizer_path,
        "the model's tokenizer, required: a model directory (tuna checkpoint or Hugging Face download) or a file: "
        "sentencepiece .model, Hugging Face tokenizer.json (any BPE pipeline), tiktoken ranks (Llama 3's "
        "original/tokenizer.model); BOS/EOS as its config names them");
  o.add("out", &p.out_dir, "output directory (created if missing); required");
  o.add("bos", &p.bos, "the token every document starts with (its text, e.g. '<s>'), where the tokenizer names none "
        "or another one is wanted");
  o.add("eos", &p.eos, "the token every document ends with (its text, e.g. '<|endoftext|>')");
  o.add("no_bos_eos", &p.no_bos_eos, "write documents without BOS and EOS (a tokenizer that names neither is refused "
        "otherwise)");
  o.add("train_tokenizer", &p.train_tokenizer,
        "train a sentencepiece model at --tokenizer (a .model file) on the inputs first (BPE, byte fallback), writing "
        "it and its .vocab");
  w.add(o, "vocab_size", &p.vocab_size, "vocabulary of the trained tokenizer", 1);
  w.add(o, "tokenizer_sample_mb", &p.tokenizer_sample_bytes, "text sampled for tokenizer training, in MiB", 1, 20);
  o.add("val_fraction", &p.val_fraction, "share of documents in the validation split, by a hash of the text, in [0, 1]");
  o.add("text_field", &p.text_field, "JSONL field that holds the document");
  o.add("sft", &p.sft,
        "JSONL records are {prompt, response} or {messages: [{role, content}, ...]}: the loss mask trains on the "
        "response, or on the assistant's turns, only");
  o.add("chat_template", &p.chat_template,
        "SFT messages: llama3, llama2, or auto (the model's own, from its tokenizer_config.json or its special "
        "tokens; other templates are refused)");
  o.add("prompt_field", &p.prompt_field, "SFT: JSONL field of the prompt");
  o.add("response_field", &p.response_field, "SFT: JSONL field of the response");
  w.add(o, "max_document_mb", &p.max_document_bytes, "a longer line or file is counted as oversized and skipped, in MiB", 1, 20);
  o.add("follow_symlinks", &p.follow_symlinks,
        "inside an input directory, follow symbolic links that lead out of it (default: skip and count them)");
  // cleaning and filters
  o.add("drop_invalid_utf8", &p.clean.drop_invalid_utf8,
        "drop a document with invalid UTF-8 (default: replace each bad byte with U+FFFD)");
  o.add("keep_whitespace", &p.clean.keep_whitespace, "do not collapse spaces and blank lines (control characters still go)");
  w.add(o, "min_chars", &p.quality.min_chars, "drop documents shorter than this many characters");
  w.add(o, "max_chars", &p.quality.max_chars, "drop documents longer than this many characters (0: no limit)");
  o.add("min_alpha", &p.quality.min_alpha_fraction, "drop documents whose letters are under this share of their non-space characters");
  o.add("max_repeated_line_chars", &p.quality.max_repeated_line_chars,
        "drop documents whose repeated lines (each copy after the first) hold over this share of the characters (1: off)");
  o.add("max_repeated_lines", &p.quality.max_repeated_line_fraction,
        "drop documents whose repeated lines are over this share of their non-blank lines (1: off, the default:\n"
        "      a short line repeated, like a licence header, is what trips it; the character share weighs it)");
  // dedup
  o.add("no_exact_dedup", no_exact_dedup, "keep exact duplicates (of the cleaned text)");
  o.add("no_near_dedup", no_near_dedup, "keep near duplicates");
  w.add(o, "shingle_words", &p.minhash.shingle_words, "words per MinHash shingle", 1);
  w.add(o, "minhash_bands", &p.minhash.bands, "LSH bands (candidates: documents that agree on every row of a band)", 1);
  w.add(o, "minhash_rows", &p.minhash.rows, "rows per LSH band", 1);
  o.add("near_verify", &p.near_verify,
        "the near-duplicate threshold: an LSH candidate pair is joined only when its signatures estimate a "
        "Jaccard similarity of at least this (0: join every candidate)");
  w.add(o, "dedup_memory_mb", &p.dedup_memory_bytes, "memory for the dedup join's partitions, in MiB", 1, 20);
  // output
  w.add(o, "shard_tokens", &p.shard_tokens, "tokens per shard before the next one starts", 1);
  w.add(o, "threads", &p.threads, "threads (0: all cores); the output does not depend on it");
  o.add("overwrite", &p.overwrite, "replace the shards and report of an earlier run in --out");
  o.add("quiet", &p.quiet, "no progress lines");
  o.add("progress_seconds", &p.progress_seconds,
        "seconds between progress lines (0: one live line on a terminal, a line every 30 s in a log)");
}

}  // namespace

int main(int argc, char** argv) {
  tuna::PrepareOptions options;
  WideFlags wide;
  bool no_exact_dedup = false, no_near_dedup = false;
  try {
    tuna::Options flags("build/prepare", kSummary);
    declare(flags, options, wide, &no_exact_dedup, &no_near_dedup);
    options.inputs = flags.parse(argc, argv);  // --help prints the table and exits
    wide.apply();
    options.exact_dedup = !no_exact_dedup;
    options.near_dedup = !no_near_dedup;
    for (const std::string& input : options.inputs)
      if (input.size() > 1 && input[0] == '-')
        tuna::fail("command line: unknown option '", input, "' (options are --name value); run build/prepare --help for the list");
    if (options.tokenizer_path.empty()) tuna::fail("command line: --tokenizer is required");
    if (options.out_dir.empty()) tuna::fail("command line: --out is required");
    if (options.inputs.empty()) tuna::fail("command line: no INPUT given (files or directories to prepare)");
  } catch (const tuna::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;  // as every tool's error (docs/reliability.md)
  }

  // Under mpirun: MPI up before anything else; every rank runs the same pipeline on its share.
  std::unique_ptr<tuna::PrepareComm> comm = tuna::world_prepare_comm_if_launched();
  options.comm = comm.get();
  const bool speaker = !comm || comm->rank() == 0;
  try {
    // A model directory's tokenizer and config files, against its manifest (ckpt/checkpoint.h: one rule in
    // every tool that reads a model directory).
    if (!options.train_tokenizer && std::filesystem::is_directory(options.tokenizer_path) &&
        !tuna::verify_model_directory(options.tokenizer_path, tuna::ModelFiles::Tokenizer) && speaker && !options.quiet)
      std::fprintf(stderr, "note: %s\n", tuna::unverified_note(options.tokenizer_path).c_str());
    tuna::PrepareReport report = tuna::prepare_corpus(options);
    if (!speaker) return 0;
    std::fputs(tuna::report_summary(report).c_str(), stdout);
    std::printf("wrote %s/report.json\n", options.out_dir.c_str());
    if (report.train.shards.empty() && report.val.shards.empty()) {
      // Nothing to train on is a failure, not a run: a job script must not go on to build/train.
      std::fprintf(stderr,
                   "error: no shard written to %s: %llu file(s) read, %llu document(s) read, none kept (inputs not "
                   "read: %llu skipped by name, %llu not regular files, %llu symbolic links not followed, %llu "
                   "unreadable; see the summary above and report.json)\n",
                   options.out_dir.c_str(), (unsigned long long)report.files_read,
                   (unsigned long long)report.documents_read, (unsigned long long)report.files_skipped.count,
                   (unsigned long long)report.files_not_regular.count, (unsigned long long)report.files_symlinks.count,
                   (unsigned long long)report.files_unreadable.count);
      return 1;
    }
    if (report.train.tokens == 0) std::fprintf(stderr, "warning: the training split is empty\n");
    if (report.val.tokens == 0 && options.val_fraction > 0)
      std::fprintf(stderr,
                   "warning: the validation split is empty (too few documents for --val-fraction %g)\n",
                   options.val_fraction);
  } catch (...) {  // every exception (core/error.h): a std::bad_alloc or a filesystem error too, with its message
    std::fprintf(stderr, "error: %s%s\n", comm ? tuna::str("rank ", comm->rank(), ": ").c_str() : "",
                 tuna::describe_current_exception().c_str());
    // The other ranks may wait in a collective for this one: stop them all.
    if (comm && comm->size() > 1) comm->abort(1);
    return 1;
  }
  return 0;
}
