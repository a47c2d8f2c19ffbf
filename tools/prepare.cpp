// build/prepare: text and JSONL corpora -> token shards for build/train. The pipeline is data/prepare.h;
// this file is the command line, on core/options like every tool: --a-b and --a_b alike, --name=value,
// --config FILE.toml, an unknown name answered with the nearest one.
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/options.h"   // Options
#include "data/prepare.h"   // PrepareOptions, prepare_corpus, report_summary

namespace {

constexpr const char* kSummary = R"(Cleans, filters, deduplicates and tokenizes text into shards for build/train.

  build/prepare --tokenizer TOK.model --out DIR [options] INPUT...
  mpirun -np N build/prepare ... (same options: each rank reads a share, dedup stays global)

Writes DIR/train-NNNNN.bin, DIR/val-NNNNN.bin (DIR/train-rRRRRR-NNNNN.bin under mpirun), DIR/report.json and
DIR/dropped.jsonl (one line per dropped document: where it was and why). INPUT is a file or a directory
(searched recursively, in name order): .txt and .md files are one document each; .jsonl files one JSON object
per line; any of them may be compressed (.gz, .zst). Inputs must be regular files: a FIFO, a device or a
symbolic link loop is refused by name, and a symbolic link inside a directory that leads out of it is skipped
and counted unless --follow-symlinks. Every document becomes BOS + tokens + EOS. Nothing is dropped without
being counted: the report accounts for every document read (kept, malformed, filtered by which rule, exact or
near duplicate). Option names take dashes or underscores alike (--val-fraction, --val_fraction).)";

// Flags whose unit or integer type differs from the PrepareOptions field they set: read here, checked and
// converted by apply().
struct WideFlags {
  int64_t vocab_size, tokenizer_sample_mb, max_document_mb, min_chars, max_chars, shingle_words, minhash_bands,
      minhash_rows, dedup_memory_mb, shard_tokens, threads;
  bool no_exact_dedup = false, no_near_dedup = false;  // PrepareOptions says it the other way round
};

// A whole non-negative flag value as the field's type; `shift` scales MiB to bytes.
template <typename T>
T checked(const char* flag, int64_t value, int64_t min = 0, int shift = 0) {
  const uint64_t type_max = static_cast<uint64_t>(std::numeric_limits<T>::max());
  const auto max = static_cast<int64_t>(std::min<uint64_t>(type_max, std::numeric_limits<int64_t>::max()) >> shift);
  if (value < min || value > max)
    tuna::fail("command line: option '--", flag, "': expected an integer in [", min, ", ", max, "], found ", value);
  return static_cast<T>(value) << shift;
}

void declare(tuna::Options& o, tuna::PrepareOptions& p, WideFlags& w) {
  o.add("tokenizer", &p.tokenizer_path, "sentencepiece model to tokenize with (written first with --train-tokenizer); required");
  o.add("out", &p.out_dir, "output directory (created if missing); required");
  o.add("train_tokenizer", &p.train_tokenizer,
        "train --tokenizer on the inputs first (BPE, byte fallback), writing it and its .vocab");
  o.add("vocab_size", &w.vocab_size, "vocabulary of the trained tokenizer");
  o.add("tokenizer_sample_mb", &w.tokenizer_sample_mb, "text sampled for tokenizer training, in MiB");
  o.add("val_fraction", &p.val_fraction, "share of documents in the validation split, by a hash of the text, in [0, 1]");
  o.add("text_field", &p.text_field, "JSONL field that holds the document");
  o.add("sft", &p.sft, "JSONL records are {prompt, response}: the loss mask trains on the response only");
  o.add("prompt_field", &p.prompt_field, "SFT: JSONL field of the prompt");
  o.add("response_field", &p.response_field, "SFT: JSONL field of the response");
  o.add("max_document_mb", &w.max_document_mb, "a longer line or file is counted as oversized and skipped, in MiB");
  o.add("follow_symlinks", &p.follow_symlinks,
        "inside an input directory, follow symbolic links that lead out of it (default: skip and count them)");
  // cleaning and filters
  o.add("drop_invalid_utf8", &p.clean.drop_invalid_utf8,
        "drop a document with invalid UTF-8 (default: replace each bad byte with U+FFFD)");
  o.add("keep_whitespace", &p.clean.keep_whitespace, "do not collapse spaces and blank lines (control characters still go)");
  o.add("min_chars", &w.min_chars, "drop documents shorter than this many characters");
  o.add("max_chars", &w.max_chars, "drop documents longer than this many characters (0: no limit)");
  o.add("min_alpha", &p.quality.min_alpha_fraction, "drop documents whose letters are under this share of their non-space characters");
  o.add("max_repeated_line_chars", &p.quality.max_repeated_line_chars,
        "drop documents whose repeated lines (each copy after the first) hold over this share of the characters (1: off)");
  o.add("max_repeated_lines", &p.quality.max_repeated_line_fraction,
        "drop documents whose repeated lines are over this share of their non-blank lines (1: off, the default:\n"
        "      a short line repeated, like a licence header, is what trips it; the character share weighs it)");
  // dedup
  o.add("no_exact_dedup", &w.no_exact_dedup, "keep exact duplicates (of the cleaned text)");
  o.add("no_near_dedup", &w.no_near_dedup, "keep near duplicates");
  o.add("shingle_words", &w.shingle_words, "words per MinHash shingle");
  o.add("minhash_bands", &w.minhash_bands, "LSH bands (candidates: documents that agree on every row of a band)");
  o.add("minhash_rows", &w.minhash_rows, "rows per LSH band");
  o.add("near_verify", &p.near_verify,
        "the near-duplicate threshold: an LSH candidate pair is joined only when its signatures estimate a "
        "Jaccard similarity of at least this (0: join every candidate)");
  o.add("dedup_memory_mb", &w.dedup_memory_mb, "memory for the dedup join's partitions, in MiB");
  // output
  o.add("shard_tokens", &w.shard_tokens, "tokens per shard before the next one starts");
  o.add("threads", &w.threads, "threads (0: all cores); the output does not depend on it");
  o.add("overwrite", &p.overwrite, "replace the shards and report of an earlier run in --out");
  o.add("quiet", &p.quiet, "no progress lines");
  o.add("progress_seconds", &p.progress_seconds,
        "seconds between progress lines (0: one live line on a terminal, a line every 30 s in a log)");
}

void apply(const WideFlags& w, tuna::PrepareOptions& p) {
  p.vocab_size = checked<int>("vocab_size", w.vocab_size, 1);
  p.tokenizer_sample_bytes = checked<uint64_t>("tokenizer_sample_mb", w.tokenizer_sample_mb, 1, 20);
  p.max_document_bytes = checked<uint64_t>("max_document_mb", w.max_document_mb, 1, 20);
  p.quality.min_chars = checked<uint64_t>("min_chars", w.min_chars);
  p.quality.max_chars = checked<uint64_t>("max_chars", w.max_chars);
  p.minhash.shingle_words = checked<int>("shingle_words", w.shingle_words, 1);
  p.minhash.bands = checked<int>("minhash_bands", w.minhash_bands, 1);
  p.minhash.rows = checked<int>("minhash_rows", w.minhash_rows, 1);
  p.dedup_memory_bytes = checked<uint64_t>("dedup_memory_mb", w.dedup_memory_mb, 1, 20);
  p.shard_tokens = checked<uint64_t>("shard_tokens", w.shard_tokens, 1);
  p.threads = checked<int>("threads", w.threads);
  p.exact_dedup = !w.no_exact_dedup;
  p.near_dedup = !w.no_near_dedup;
}

}  // namespace

int main(int argc, char** argv) {
  tuna::PrepareOptions options;
  WideFlags wide{options.vocab_size,
                 static_cast<int64_t>(options.tokenizer_sample_bytes >> 20),
                 static_cast<int64_t>(options.max_document_bytes >> 20),
                 static_cast<int64_t>(options.quality.min_chars),
                 static_cast<int64_t>(options.quality.max_chars),
                 options.minhash.shingle_words,
                 options.minhash.bands,
                 options.minhash.rows,
                 static_cast<int64_t>(options.dedup_memory_bytes >> 20),
                 static_cast<int64_t>(options.shard_tokens),
                 options.threads};
  try {
    tuna::Options flags("build/prepare", kSummary);
    declare(flags, options, wide);
    options.inputs = flags.parse(argc, argv);  // --help prints the table and exits
    apply(wide, options);
    for (const std::string& input : options.inputs)
      if (input.size() > 1 && input[0] == '-')
        tuna::fail("command line: unknown option '", input, "' (options are --name value); run build/prepare --help for the list");
    if (options.tokenizer_path.empty()) tuna::fail("command line: --tokenizer is required");
    if (options.out_dir.empty()) tuna::fail("command line: --out is required");
    if (options.inputs.empty()) tuna::fail("command line: no INPUT given (files or directories to prepare)");
  } catch (const tuna::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }

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
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s%s\n", comm ? tuna::str("rank ", comm->rank(), ": ").c_str() : "", e.what());
    // The other ranks may wait in a collective for this one: stop them all.
    if (comm && comm->size() > 1) comm->abort(1);
    return 1;
  }
  return 0;
}
