// The corpus preparer behind build/prepare: text and JSONL (plain, .gz, .zst) -> cleaned, filtered,
// deduplicated token shards + a train/val split + a report that accounts for every input document.
//
// Two passes over the inputs, each one batch of records at a time (bounded memory, results committed in
// input order, so the output is byte-identical whatever the thread count):
//   pass 1  read (serial) -> decode, clean, filter, hash, MinHash (parallel) -> append the hashes to the
//           dedup spill and the document's fate so far to a 1-byte-per-document list (serial)
//   join    exact and near dedup over all documents of all ranks (data/dedup.h)
//   pass 2  read again -> for each document kept: decode, clean, tokenize (parallel) -> write (serial)
//           BOS + tokens + EOS; SFT records BOS + prompt + response + EOS with a loss mask on the response
//           (and EOS) only. Split by XXH3-64 of the cleaned text, so duplicates would land in the same split.
// Reading twice costs a second decompression and clean, and buys a dedup that sees every document before
// any is written: the earliest document of a cluster is the one kept, whichever rank read it.
//
// Several processes (mpirun): rank r reads a contiguous share of the input files (balanced by bytes), the
// join is global (data/dedup.h), and rank r writes its kept documents to its own shards,
// OUT/train-rRRRRR-NNNNN.bin (a single process writes OUT/train-NNNNN.bin). Read in name order, the shards
// of an N-rank run hold the same documents and the same token stream as the single-process run; only where
// shard files begin and end differs. Rank 0 merges the reports.
#pragma once

#include <array>
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "data/chat_template.h"
#include "data/clean.h"
#include "data/dedup.h"
#include "data/prepare_comm.h"
#include "data/tokenizer.h"

namespace tuna {

struct PrepareOptions {
  std::vector<std::string> inputs;  // files or directories (searched recursively)
  // A tokenizer file of any format, or a model directory holding one (data/tokenizer.h); with
  // train_tokenizer, the sentencepiece .model file to write.
  std::string tokenizer_path;
  std::string out_dir;
  bool train_tokenizer = false;  // train a sentencepiece tokenizer_path on the inputs first (also writes its .vocab)
  int vocab_size = 32000;        // of the tokenizer to train
  TokenizerTrainOptions tokenizer_options;
  // Text handed to tokenizer training: documents are sampled (by a hash, so repeatably) at the rate that
  // brings the inputs' total size down to about this many bytes.
  uint64_t tokenizer_sample_bytes = uint64_t{1} << 30;
  double val_fraction = 0.05;
  std::string text_field = "text";  // JSONL field holding the document
  // SFT: JSONL records hold prompt_field and response_field, or a "messages" list of {role, content}
  // rendered through the model's chat template (data/chat_template.h); the shards carry a loss mask
  // (response, or assistant turns, only). Plain-text inputs of an SFT run train on every token.
  bool sft = false;
  std::string prompt_field = "prompt", response_field = "response";
  std::string chat_template = "auto";  // llama3 | llama2 | auto (the model's, see resolve_chat_format)
  uint64_t max_document_bytes = uint64_t{64} << 20;  // a longer line or file is counted 'oversized', skipped
  // Inside an input directory, follow symbolic links that lead out of it or to a directory (data/input.h).
  bool follow_symlinks = false;
  CleanOptions clean;
  QualityOptions quality;
  bool exact_dedup = true;
  bool near_dedup = true;
  MinHashOptions minhash;
  // The near-duplicate threshold: LSH candidates are joined only when their sketches estimate a Jaccard
  // similarity of at least this (0: every candidate is joined). See data/dedup.h.
  double near_verify = 0.5;
  uint64_t dedup_memory_bytes = uint64_t{1} << 30;  // the join's partition budget (see data/dedup.h)
  uint64_t shard_tokens = 100'000'000;              // tokens per shard before a new one starts
  int threads = 0;                                  // 0: all hardware threads
  size_t batch_records = 4096;  // records per batch (the output does not depend on it; tests make it small)
  // Every document is framed BOS + tokens + EOS, with the ids the tokenizer's model names. A tokenizer that names
  // no BOS or no EOS is refused unless they are named here (a token's text, "<s>") or no_bos_eos leaves the
  // documents unframed.
  std::string bos, eos;
  bool no_bos_eos = false;
  bool overwrite = false;  // replace the outputs of an earlier run in out_dir (otherwise refused)
  bool quiet = false;      // no progress lines on stderr
  // Seconds between progress lines; 0: 1 s on a terminal (one line rewritten in place), 30 s otherwise.
  double progress_seconds = 0;
  PrepareComm* comm = nullptr;  // the group of processes; null: this process alone
};

// How many records fell in one category, and where the first one was ("file" or "file:line"). Every
// document not kept is also listed, one JSON line each, in OUT/dropped.jsonl (OUT/dropped-rRRRRR.jsonl per
// rank under mpirun), in input order: {"where": "file:line", "reason": "near_duplicate",
// "duplicate_of": "file:line"} for a duplicate, {"where", "reason", "measure", "value", "limit"} for a
// filter (e.g. "repeated_line_chars", 0.74, 0.7).
struct Tally {
  uint64_t count = 0;
  std::string first;
  void add(const std::string& where) {
    if (count++ == 0) first = where;
  }
  void merge(const Tally& other) {
    if (count == 0) first = other.first;
    count += other.count;
  }
};

// The fate of an input document. Every document read ends in exactly one.
enum class Outcome : uint8_t {
  kept,
  // malformed
  malformed_json,  // a JSONL line that does not parse
  missing_field,   // parses, but lacks the text field (or, for SFT, prompt and response or messages) as strings
  truncated,       // cut short by a damaged compressed file
  oversized,       // longer than max_document_bytes (a 100 MB line)
  invalid_utf8,    // invalid UTF-8 with clean.drop_invalid_utf8
  bad_chat,        // SFT messages the chat template cannot render (a role it does not know, turns out of order)
  // filtered
  empty,           // nothing left after cleaning
  too_short,
  too_long,
  low_alpha,
  repeated_lines,
  // deduplicated
  exact_duplicate,
  near_duplicate,
  tokenize_failed,  // sentencepiece refused it
  count_            // not an outcome: the number of them
};
inline constexpr size_t kOutcomes = static_cast<size_t>(Outcome::count_);
const char* outcome_name(Outcome outcome);

struct PrepareReport {
  // Files.
  uint64_t files_read = 0;
  uint64_t bytes_read = 0;  // on disk (compressed)
  Tally files_skipped;      // inside an input directory, with a name prepare does not read
  Tally files_symlinks;     // symbolic links out of an input directory (or to a directory), not followed
  Tally files_not_regular;  // FIFOs, sockets, devices inside an input directory
  Tally files_unreadable;   // could not be opened (or a broken link, a link loop)
  Tally files_damaged;      // a compressed file cut short or corrupt: read up to the damage
  // Documents: documents_read == sum of outcome[k] over every outcome k (checked on every run).
  uint64_t documents_read = 0;
  std::array<Tally, kOutcomes> outcome;
  uint64_t documents_kept() const { return outcome[static_cast<size_t>(Outcome::kept)].count; }
  const Tally& of(Outcome o) const { return outcome[static_cast<size_t>(o)]; }
  // Repairs made to documents (they may still be kept or dropped for another reason).
  Tally repaired_utf8, removed_nul, removed_control;
  struct Split {
    uint64_t documents = 0;
    uint64_t tokens = 0;
    std::vector<std::string> shards;  // paths, in order
  };
  Split train, val;
  // Tokenizer.
  std::string tokenizer_path;  // the file read
  std::string tokenizer_format;
  uint64_t tokenizer_fingerprint = 0;
  std::string chat_template;  // SFT runs: the format conversations were rendered with
  bool tokenizer_trained = false;
  int32_t vocab_size = 0, bos_id = -1, eos_id = -1;
  // Bytes of kept documents the tokenizer drops: a byte-level vocabulary without a token for some bytes (its trainer
  // never saw them alone) drops them, as Hugging Face tokenizers does (TokenizerImpl::missing_bytes).
  std::string missing_bytes;  // the bytes it has no token for, of those UTF-8 text can hold
  uint64_t dropped_bytes = 0;
  Tally dropped_byte_documents;  // kept documents that lost a byte
  int ranks = 1, threads = 1;
  double near_verify = 0;    // the near-duplicate threshold (estimated Jaccard; 0: LSH candidates unchecked)
  double lsh_threshold = 0;  // (1/bands)^(1/rows): where LSH finds a pair half the time
  std::vector<std::string> dropped_lists;  // the dropped.jsonl file(s): one line per document not kept
  double seconds = 0;
};

// Runs the pipeline. Bad records and damaged files are counted, never fatal; a bad invocation (no inputs, an
// input that does not exist, a missing tokenizer, an out_dir holding an earlier run without overwrite) is a
// tuna::Error before anything is written. Under a comm of several ranks every rank calls it; each returns
// the merged report.
PrepareReport prepare_corpus(const PrepareOptions& options);

// The report as written to OUT/report.json, read back, and as a few lines for a person.
nlohmann::json report_json(const PrepareReport& report, const PrepareOptions& options);
PrepareReport report_from_json(const nlohmann::json& j);
std::string report_summary(const PrepareReport& report);

}  // namespace tuna
