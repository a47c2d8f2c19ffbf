// The corpus preparer behind build/prepare: text files and JSONL -> token shards + a train/val split +
// a report that accounts for every input document.
//
// Pipeline, one batch of records at a time so memory stays bounded and output is ordered:
//   read     (serial)   inputs in order: files as given, directories recursively in name order;
//                       .txt/.md = one document per file, .jsonl = one document per non-blank line
//   decode   (parallel) a JSONL line -> its text field; malformed lines are counted, never fatal
//   filter   (parallel) empty / whitespace-only documents are dropped    [cleaning, quality filters and
//                       dedup slot in here: each is a function of one document that keeps or counts it]
//   tokenize (parallel) BOS + encode(text) + EOS (each only when the tokenizer defines it)
//   write    (serial)   split by XXH3-64 of the text (so duplicates always land in the same split) into
//                       OUT/train-NNNNN.bin and OUT/val-NNNNN.bin, a new shard every shard_tokens tokens
//                       (documents are never cut); then OUT/report.json.
// The parallel stages work on a batch whose results are committed in input order, so the shards are
// byte-identical whatever the thread count.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "data/tokenizer.h"

namespace tuna {

struct PrepareOptions {
  std::vector<std::string> inputs;  // files (.txt .md .jsonl) or directories (searched recursively)
  std::string tokenizer_path;       // sentencepiece .model to read (or to write with train_tokenizer)
  std::string out_dir;
  bool train_tokenizer = false;  // train tokenizer_path on the inputs first (also writes its .vocab)
  int vocab_size = 32000;        // of the tokenizer to train
  TokenizerTrainOptions tokenizer_options;
  // Text handed to tokenizer training: documents are sampled (by a hash, so repeatably) at the rate that
  // brings the inputs' total size down to about this many bytes.
  uint64_t tokenizer_sample_bytes = uint64_t{1} << 30;
  double val_fraction = 0.05;
  std::string text_field = "text";      // JSONL field holding the document
  uint64_t shard_tokens = 100'000'000;  // tokens per shard before a new one starts
  int threads = 0;                      // 0: all hardware threads
  bool overwrite = false;  // replace the outputs of an earlier run in out_dir (otherwise refused)
  bool quiet = false;      // no progress lines on stderr
};

// How many records fell in one category, and where the first one was ("file" or "file:line").
struct Tally {
  uint64_t count = 0;
  std::string first;
  void add(const std::string& where) {
    if (count++ == 0) first = where;
  }
};

struct PrepareReport {
  // Files.
  uint64_t files_read = 0;
  Tally files_skipped;     // inside an input directory, with an extension prepare does not read
  Tally files_unreadable;  // could not be opened or read
  // Documents: read = kept + empty + malformed_json + missing_text + tokenize_failed.
  uint64_t documents_read = 0;
  uint64_t documents_kept = 0;
  Tally empty;            // nothing but whitespace
  Tally malformed_json;   // a JSONL line that does not parse
  Tally missing_text;     // parses, but has no string field text_field
  Tally tokenize_failed;  // sentencepiece refused it
  struct Split {
    uint64_t documents = 0;
    uint64_t tokens = 0;
    std::vector<std::string> shards;  // paths, in order
  };
  Split train, val;
  // Tokenizer.
  std::string tokenizer_path;
  bool tokenizer_trained = false;
  int32_t vocab_size = 0, bos_id = -1, eos_id = -1;
  double seconds = 0;
};

// Runs the pipeline. Bad records are counted, never fatal; a bad invocation (no inputs, an input that
// does not exist, a missing tokenizer, an out_dir holding an earlier run without overwrite) is a
// tuna::Error before anything is written.
PrepareReport prepare_corpus(const PrepareOptions& options);

// The report as written to OUT/report.json, and as a few lines for a person.
nlohmann::json report_json(const PrepareReport& report, const PrepareOptions& options);
std::string report_summary(const PrepareReport& report);

}  // namespace tuna
