// The corpus preparer: see data/prepare.h for the pipeline.
#include "data/prepare.h"

#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/error.h"
#include "data/shard.h"

namespace tuna {

namespace fs = std::filesystem;

namespace {

// A batch is this many records or bytes, whichever comes first: enough work to keep every thread busy,
// little enough memory to not matter.
constexpr size_t kBatchRecords = 4096;
constexpr size_t kBatchBytes = size_t{64} << 20;

enum class InputKind { text, jsonl };

struct InputFile {
  std::string path;
  InputKind kind;
};

// One record as read, before any decoding.
struct Record {
  uint32_t file = 0;
  uint64_t line = 0;  // 1-based line of a JSONL record; 0 for a whole-file document
  std::string bytes;
};

enum class Outcome { kept, empty, malformed_json, missing_text, tokenize_failed };

// What the parallel stages make of one record.
struct Processed {
  Outcome outcome = Outcome::kept;
  std::string text;             // the document, once decoded
  std::vector<int32_t> tokens;  // BOS + text + EOS when kept
  uint64_t hash = 0;            // XXH3-64 of the text
};

bool input_kind(const fs::path& path, InputKind* kind) {
  const std::string ext = path.extension().string();
  if (ext == ".txt" || ext == ".md") return *kind = InputKind::text, true;
  if (ext == ".jsonl") return *kind = InputKind::jsonl, true;
  return false;
}

bool is_blank(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
  });
}

// Uniform in [0, 1) from a 64-bit hash.
double unit(uint64_t hash) { return static_cast<double>(hash >> 11) * 0x1.0p-53; }

std::vector<InputFile> list_inputs(const std::vector<std::string>& inputs, PrepareReport& report) {
  if (inputs.empty()) fail("prepare: no inputs given (files or directories of .txt, .md, .jsonl)");
  std::vector<InputFile> files;
  for (const std::string& input : inputs) {
    std::error_code ec;
    InputKind kind;
    if (fs::is_directory(input, ec)) {
      std::vector<fs::path> found;
      for (auto it =
               fs::recursive_directory_iterator(input, fs::directory_options::skip_permission_denied, ec);
           !ec && it != fs::recursive_directory_iterator(); it.increment(ec))
        if (it->is_regular_file(ec)) found.push_back(it->path());
      if (ec) fail("prepare: input directory ", input, ": cannot list: ", ec.message());
      std::sort(found.begin(), found.end());
      for (const fs::path& p : found) {
        if (input_kind(p, &kind))
          files.push_back({p.string(), kind});
        else
          report.files_skipped.add(p.string());
      }
    } else if (fs::exists(input, ec)) {
      if (!input_kind(input, &kind))
        fail("prepare: input ", input, ": unsupported file type '", fs::path(input).extension().string(),
             "' (expected .txt, .md or .jsonl)");
      files.push_back({input, kind});
    } else {
      fail("prepare: input ", input, ": no such file or directory");
    }
  }
  return files;
}

// Reads the inputs in order, handing batches of records to a consumer.
class RecordReader {
 public:
  RecordReader(const std::vector<InputFile>& files, PrepareReport* report) : files_(files), report_(report) {}

  // Fills batch (cleared first); false when the inputs are exhausted and the batch is empty.
  bool next_batch(std::vector<Record>& batch) {
    batch.clear();
    size_t bytes = 0;
    while (batch.size() < kBatchRecords && bytes < kBatchBytes) {
      if (!open_next_if_needed()) break;
      const InputFile& file = files_[file_];
      Record record;
      record.file = static_cast<uint32_t>(file_);
      if (file.kind == InputKind::text) {
        record.bytes.assign(std::istreambuf_iterator<char>(in_), std::istreambuf_iterator<char>());
        bool bad = in_.bad();
        close_current();
        if (bad) {
          if (report_) report_->files_unreadable.add(file.path);
          continue;
        }
      } else {
        if (!std::getline(in_, record.bytes)) {
          if (in_.bad() && report_) report_->files_unreadable.add(file.path);
          close_current();
          continue;
        }
        record.line = ++line_;
        if (is_blank(record.bytes)) continue;  // blank lines separate nothing; they are not documents
      }
      bytes += record.bytes.size();
      batch.push_back(std::move(record));
    }
    return !batch.empty();
  }

 private:
  bool open_next_if_needed() {
    while (!in_.is_open()) {
      if (next_file_ >= files_.size()) return false;
      file_ = next_file_++;
      line_ = 0;
      in_.clear();
      in_.open(files_[file_].path, std::ios::binary);
      if (!in_.is_open()) {
        if (report_) report_->files_unreadable.add(files_[file_].path);
        continue;
      }
      if (report_) ++report_->files_read;
    }
    return true;
  }
  void close_current() {
    in_.close();
    in_.clear();
  }

  const std::vector<InputFile>& files_;
  PrepareReport* report_;  // null on the tokenizer-sampling pass: that pass counts nothing
  size_t next_file_ = 0;
  size_t file_ = 0;
  uint64_t line_ = 0;
  std::ifstream in_;
};

std::string where(const std::vector<InputFile>& files, const Record& r) {
  return r.line ? str(files[r.file].path, ":", r.line) : files[r.file].path;
}

// decode + filter: everything up to tokenization. Pure function of the record.
void decode(const InputFile& file, Record& record, const std::string& text_field, Processed& out) {
  if (file.kind == InputKind::text) {
    out.text = std::move(record.bytes);
  } else {
    nlohmann::json j = nlohmann::json::parse(record.bytes, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return void(out.outcome = Outcome::malformed_json);
    auto it = j.is_object() ? j.find(text_field) : j.end();
    if (!j.is_object() || it == j.end() || !it->is_string()) return void(out.outcome = Outcome::missing_text);
    out.text = it->get<std::string>();
  }
  // Filters slot in here (cleaning, quality, dedup): each keeps the document or sets an outcome.
  if (is_blank(out.text)) return void(out.outcome = Outcome::empty);
  out.hash = XXH3_64bits(out.text.data(), out.text.size());
  out.outcome = Outcome::kept;
}

// Runs decode (and tokenization when tokenizer is set) over a batch on `threads` threads.
void process_batch(const std::vector<InputFile>& files, std::vector<Record>& batch,
                   std::vector<Processed>& out, const std::string& text_field, const Tokenizer* tokenizer,
                   int threads) {
  out.assign(batch.size(), Processed{});
  const int64_t n = static_cast<int64_t>(batch.size());
#pragma omp parallel for num_threads(threads) schedule(dynamic, 16)
  for (int64_t i = 0; i < n; ++i) {
    Processed& p = out[i];
    decode(files[batch[i].file], batch[i], text_field, p);
    if (!tokenizer || p.outcome != Outcome::kept) continue;
    try {
      std::vector<int32_t> body = tokenizer->encode(p.text);
      p.tokens.reserve(body.size() + 2);
      if (tokenizer->bos_id() >= 0) p.tokens.push_back(tokenizer->bos_id());
      p.tokens.insert(p.tokens.end(), body.begin(), body.end());
      if (tokenizer->eos_id() >= 0) p.tokens.push_back(tokenizer->eos_id());
    } catch (const std::exception&) {
      p.outcome = Outcome::tokenize_failed;
      p.tokens.clear();
    }
    p.text.clear();
    p.text.shrink_to_fit();
  }
}

// One split's shards: train-00000.bin, train-00001.bin, ...
class SplitWriter {
 public:
  SplitWriter(std::string dir, std::string name, uint32_t vocab_size, uint64_t shard_tokens,
              PrepareReport::Split* split)
      : dir_(std::move(dir)),
        name_(std::move(name)),
        vocab_size_(vocab_size),
        shard_tokens_(shard_tokens),
        split_(split) {}

  void add(const std::vector<int32_t>& tokens) {
    if (writer_ && writer_->token_count() > 0 && writer_->token_count() + tokens.size() > shard_tokens_)
      finish();
    if (!writer_) {
      char file[64];
      std::snprintf(file, sizeof file, "%s-%05zu%s", name_.c_str(), split_->shards.size(), kShardExtension);
      writer_ = std::make_unique<ShardWriter>((fs::path(dir_) / file).string(), vocab_size_);
    }
    writer_->add_document(tokens);
    split_->documents += 1;
    split_->tokens += tokens.size();
  }

  void finish() {
    if (!writer_) return;
    writer_->finish();
    split_->shards.push_back(writer_->path());
    writer_.reset();
  }

 private:
  std::string dir_, name_;
  uint32_t vocab_size_;
  uint64_t shard_tokens_;
  PrepareReport::Split* split_;
  std::unique_ptr<ShardWriter> writer_;
};

bool is_output_name(const std::string& name) {
  auto starts = [&](const char* p) { return name.rfind(p, 0) == 0; };
  return name == "report.json" || ((starts("train-") || starts("val-")) &&
                                   (name.ends_with(kShardExtension) || name.ends_with(".tmp")));
}

// An out_dir that holds an earlier run is refused, or emptied of that run's outputs with overwrite:
// stale shards next to new ones would silently join the training set.
void prepare_out_dir(const PrepareOptions& options) {
  std::error_code ec;
  fs::create_directories(options.out_dir, ec);
  if (ec || !fs::is_directory(options.out_dir))
    fail("prepare: --out ", options.out_dir, ": cannot create the directory",
         ec ? str(": ", ec.message()) : std::string());
  std::vector<fs::path> earlier;
  for (const auto& entry : fs::directory_iterator(options.out_dir))
    if (entry.is_regular_file() && is_output_name(entry.path().filename().string()))
      earlier.push_back(entry.path());
  if (earlier.empty()) return;
  if (!options.overwrite)
    fail("prepare: --out ", options.out_dir, " already holds the output of an earlier run (",
         earlier.front().filename().string(),
         earlier.size() > 1 ? str(" and ", earlier.size() - 1, " more") : "",
         "); pass --overwrite to replace it, or choose another directory");
  for (const fs::path& p : earlier) fs::remove(p);
}

void write_text_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    if (!out) fail("prepare: cannot write ", tmp);
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) fail("prepare: cannot rename ", tmp, " to ", path, ": ", ec.message());
}

// The tokenizer-training pass: samples documents into one plain-text file, one line per line.
void train_tokenizer_on_inputs(const PrepareOptions& options, const std::vector<InputFile>& files,
                               int threads) {
  const std::string& model = options.tokenizer_path;
  if (!model.ends_with(".model"))
    fail("prepare: --tokenizer ", model, ": with --train-tokenizer it must name the .model file to write");
  uint64_t total_bytes = 0;
  for (const InputFile& f : files) {
    std::error_code ec;
    uint64_t size = fs::file_size(f.path, ec);
    if (!ec) total_bytes += size;
  }
  const double rate =
      total_bytes <= options.tokenizer_sample_bytes
          ? 1.0
          : static_cast<double>(options.tokenizer_sample_bytes) / static_cast<double>(total_bytes);
  const std::string sample_path = (fs::path(options.out_dir) / "tokenizer-sample.txt.tmp").string();
  uint64_t lines = 0;
  {
    std::ofstream sample(sample_path, std::ios::binary | std::ios::trunc);
    if (!sample) fail("prepare: cannot create ", sample_path);
    RecordReader reader(files, nullptr);
    std::vector<Record> batch;
    std::vector<Processed> processed;
    while (reader.next_batch(batch)) {
      process_batch(files, batch, processed, options.text_field, nullptr, threads);
      for (const Processed& p : processed) {
        if (p.outcome != Outcome::kept) continue;
        // A seed other than the split's, so that the sample is not the validation set.
        if (rate < 1.0 && unit(XXH3_64bits_withSeed(p.text.data(), p.text.size(), 1)) >= rate) continue;
        size_t begin = 0;
        while (begin <= p.text.size()) {
          size_t end = p.text.find('\n', begin);
          if (end == std::string::npos) end = p.text.size();
          std::string_view line(p.text.data() + begin, end - begin);
          if (!is_blank(line)) {
            sample << line << '\n';
            ++lines;
          }
          begin = end + 1;
        }
      }
    }
    if (!sample.flush()) fail("prepare: cannot write ", sample_path);
  }
  if (lines == 0) {
    fs::remove(sample_path);
    fail("prepare: --train-tokenizer: the inputs hold no text to train on");
  }
  if (!options.quiet)
    std::fprintf(stderr, "prepare: training a %d-piece tokenizer on %llu lines -> %s\n", options.vocab_size,
                 static_cast<unsigned long long>(lines), model.c_str());
  TokenizerTrainOptions tok = options.tokenizer_options;
  tok.num_threads = threads;
  try {
    train_tokenizer({sample_path}, model.substr(0, model.size() - 6), options.vocab_size, tok);
  } catch (...) {
    fs::remove(sample_path);
    throw;
  }
  fs::remove(sample_path);
}

}  // namespace

PrepareReport prepare_corpus(const PrepareOptions& options) {
  const auto started = std::chrono::steady_clock::now();
  if (options.out_dir.empty()) fail("prepare: --out is required");
  if (options.tokenizer_path.empty()) fail("prepare: --tokenizer is required");
  if (!(options.val_fraction >= 0.0 && options.val_fraction <= 1.0))
    fail("prepare: --val-fraction must lie in [0, 1], found ", options.val_fraction);
  if (options.shard_tokens < 1) fail("prepare: --shard-tokens must be at least 1");
  const int threads = options.threads > 0
                          ? options.threads
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));

  PrepareReport report;
  const std::vector<InputFile> files = list_inputs(options.inputs, report);
  if (!options.train_tokenizer) {
    Tokenizer check(options.tokenizer_path);  // a missing tokenizer fails before out_dir is touched
  }
  prepare_out_dir(options);

  if (options.train_tokenizer) {
    train_tokenizer_on_inputs(options, files, threads);
    report.tokenizer_trained = true;
  }
  const Tokenizer tokenizer(options.tokenizer_path);
  report.tokenizer_path = options.tokenizer_path;
  report.vocab_size = tokenizer.vocab_size();
  report.bos_id = tokenizer.bos_id();
  report.eos_id = tokenizer.eos_id();

  const uint32_t vocab = static_cast<uint32_t>(tokenizer.vocab_size());
  SplitWriter train(options.out_dir, "train", vocab, options.shard_tokens, &report.train);
  SplitWriter val(options.out_dir, "val", vocab, options.shard_tokens, &report.val);

  RecordReader reader(files, &report);
  std::vector<Record> batch;
  std::vector<Processed> processed;
  auto last_progress = std::chrono::steady_clock::now();
  while (reader.next_batch(batch)) {
    process_batch(files, batch, processed, options.text_field, &tokenizer, threads);
    for (size_t i = 0; i < batch.size(); ++i) {
      Processed& p = processed[i];
      ++report.documents_read;
      switch (p.outcome) {
        case Outcome::empty:
          report.empty.add(where(files, batch[i]));
          continue;
        case Outcome::malformed_json:
          report.malformed_json.add(where(files, batch[i]));
          continue;
        case Outcome::missing_text:
          report.missing_text.add(where(files, batch[i]));
          continue;
        case Outcome::tokenize_failed:
          report.tokenize_failed.add(where(files, batch[i]));
          continue;
        case Outcome::kept:
          break;
      }
      ++report.documents_kept;
      (unit(p.hash) < options.val_fraction ? val : train).add(p.tokens);
    }
    if (!options.quiet && std::chrono::steady_clock::now() - last_progress > std::chrono::seconds(10)) {
      last_progress = std::chrono::steady_clock::now();
      std::fprintf(stderr, "prepare: %llu documents, %llu tokens so far\n",
                   static_cast<unsigned long long>(report.documents_read),
                   static_cast<unsigned long long>(report.train.tokens + report.val.tokens));
    }
  }
  train.finish();
  val.finish();

  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  // report.json last: its presence marks a finished run.
  write_text_atomically((fs::path(options.out_dir) / "report.json").string(),
                        report_json(report, options).dump(2) + "\n");
  return report;
}

nlohmann::json report_json(const PrepareReport& r, const PrepareOptions& o) {
  auto tally = [](const Tally& t) { return nlohmann::json{{"count", t.count}, {"first", t.first}}; };
  auto split = [](const PrepareReport::Split& s) {
    return nlohmann::json{{"documents", s.documents}, {"tokens", s.tokens}, {"shards", s.shards}};
  };
  return nlohmann::json{
      {"files",
       {{"read", r.files_read},
        {"skipped", tally(r.files_skipped)},
        {"unreadable", tally(r.files_unreadable)}}},
      {"documents",
       {{"read", r.documents_read},
        {"kept", r.documents_kept},
        {"empty", tally(r.empty)},
        {"malformed_json", tally(r.malformed_json)},
        {"missing_text", tally(r.missing_text)},
        {"tokenize_failed", tally(r.tokenize_failed)}}},
      {"train", split(r.train)},
      {"val", split(r.val)},
      {"tokenizer",
       {{"path", r.tokenizer_path},
        {"trained", r.tokenizer_trained},
        {"vocab_size", r.vocab_size},
        {"bos_id", r.bos_id},
        {"eos_id", r.eos_id}}},
      {"shard_format",
       {{"version", kShardVersion},
        {"token_width", shard_token_width(static_cast<uint32_t>(std::max(r.vocab_size, 1)))}}},
      {"options",
       {{"inputs", o.inputs},
        {"val_fraction", o.val_fraction},
        {"text_field", o.text_field},
        {"shard_tokens", o.shard_tokens}}},
      {"seconds", r.seconds},
  };
}

std::string report_summary(const PrepareReport& r) {
  auto line = [](const char* what, const Tally& t) {
    return str("  ", what, t.count, t.count ? str("   (first: ", t.first, ")") : std::string(), "\n");
  };
  auto shards = [](const PrepareReport::Split& s) {
    return s.shards.empty() ? std::string("no shard")
                            : str(s.shards.size(), " shard(s) ", s.shards.front(),
                                  s.shards.size() > 1 ? str(" .. ", s.shards.back()) : std::string());
  };
  std::string out = str("prepare: ", r.files_read, " file(s) read, ", r.documents_read, " document(s)\n");
  out += str("  kept            ", r.documents_kept, "   (train ", r.train.documents, ", val ",
             r.val.documents, ")\n");
  out += line("empty           ", r.empty);
  out += line("malformed JSON  ", r.malformed_json);
  out += line("no text field   ", r.missing_text);
  if (r.tokenize_failed.count) out += line("tokenize failed ", r.tokenize_failed);
  if (r.files_skipped.count) out += line("files skipped   ", r.files_skipped);
  if (r.files_unreadable.count) out += line("files unreadable", r.files_unreadable);
  out += str("tokens: train ", r.train.tokens, " in ", shards(r.train), "\n");
  out += str("        val   ", r.val.tokens, " in ", shards(r.val), "\n");
  out += str("tokenizer: ", r.tokenizer_path, r.tokenizer_trained ? " (trained)" : "", ", vocab ",
             r.vocab_size, ", bos ", r.bos_id, ", eos ", r.eos_id, "; ", r.seconds, " s\n");
  return out;
}

}  // namespace tuna
