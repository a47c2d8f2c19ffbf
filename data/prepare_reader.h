// prepare's input side (data/prepare.cpp): the records of the input files, read in batches by one rank, the next
// batch on a second thread while the current one is processed.
#pragma once

#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/error.h"  // str
#include "data/input.h"
#include "data/prepare.h"  // Outcome, PrepareOptions, PrepareReport

namespace tuna {

// A batch is PrepareOptions::batch_records records or this many bytes, whichever comes first: enough work
// to keep every thread busy, little enough memory to not matter (two batches are in flight).
constexpr size_t kBatchBytes = size_t{64} << 20;

// One record as read, before any decoding.
struct Record {
  uint32_t file = 0;
  uint64_t line = 0;               // 1-based line of a JSONL record; 0 for a whole-file document
  Outcome preset = Outcome::kept;  // truncated or oversized: decided by the reader
  std::string bytes;
};

// Only spaces, tabs, newlines, carriage returns, form and vertical feeds (or nothing).
bool is_blank(std::string_view s);

// Rank r of `ranks` reads files [first, last): contiguous in input order (so that global document order is
// rank order), balanced by bytes on disk. A file goes to the rank whose byte range holds its middle.
std::pair<size_t, size_t> share_of(const std::vector<InputFile>& files, int rank, int ranks);

// Reads files [first, last) in order, handing batches of records to a consumer. The same files give the
// same records in the same order every time: pass 2 finds pass 1's documents by position.
class RecordReader {
 public:
  // report: where damaged and unreadable files are counted (null on the passes that count nothing).
  RecordReader(const std::vector<InputFile>& files, size_t first, size_t last, const PrepareOptions& options,
               PrepareReport* report)
      : files_(files),
        next_file_(first),
        last_(last),
        max_bytes_(options.max_document_bytes),
        batch_records_(std::max<size_t>(1, options.batch_records)),
        report_(report) {}

  // Fills batch (cleared first); false when the inputs are exhausted and the batch is empty.
  bool next_batch(std::vector<Record>& batch) {
    batch.clear();
    size_t bytes = 0;
    while (batch.size() < batch_records_ && bytes < kBatchBytes) {
      if (!open_next_if_needed()) break;
      const InputFile& file = files_[file_];
      Record record;
      record.file = static_cast<uint32_t>(file_);
      if (file.kind == InputKind::text) {
        if (!read_all(stream_.get(), max_bytes_, &record.bytes)) record.preset = Outcome::oversized;
        if (!stream_->error().empty() && record.preset == Outcome::kept) record.preset = Outcome::truncated;
        close_current();
      } else {
        bool oversized, cut;
        if (!lines_->next(&record.bytes, &oversized, &cut)) {
          close_current();
          continue;
        }
        record.line = ++line_;
        if (oversized) record.preset = Outcome::oversized;
        else if (cut && !stream_->error().empty()) record.preset = Outcome::truncated;
        // Blank lines separate nothing; they are not documents.
        if (record.preset == Outcome::kept && is_blank(record.bytes)) continue;
      }
      bytes += record.bytes.size();
      batch.push_back(std::move(record));
    }
    return !batch.empty();
  }

  uint64_t bytes_consumed() const { return done_bytes_ + (stream_ ? stream_->consumed() : 0); }

 private:
  bool open_next_if_needed() {
    while (!stream_) {
      if (next_file_ >= last_) return false;
      file_ = next_file_++;
      line_ = 0;
      std::string why;
      stream_ = open_input(files_[file_], &why);
      if (!stream_) {
        if (report_) report_->files_unreadable.add(str(files_[file_].path, ": ", why));
        done_bytes_ += files_[file_].bytes;
        continue;
      }
      if (files_[file_].kind == InputKind::jsonl) lines_ = std::make_unique<LineReader>(stream_.get(), max_bytes_);
      if (report_) ++report_->files_read, report_->bytes_read += files_[file_].bytes;
    }
    return true;
  }
  void close_current() {
    if (report_ && !stream_->error().empty())
      report_->files_damaged.add(
          str(files_[file_].path, line_ ? str(":", line_) : std::string(), ": ", stream_->error()));
    done_bytes_ += files_[file_].bytes;
    lines_.reset();
    stream_.reset();
  }

  const std::vector<InputFile>& files_;
  size_t next_file_, last_;
  uint64_t max_bytes_;
  size_t batch_records_;
  PrepareReport* report_;
  size_t file_ = 0;
  uint64_t line_ = 0;
  uint64_t done_bytes_ = 0;
  std::unique_ptr<ByteStream> stream_;
  std::unique_ptr<LineReader> lines_;
};

// Reads the next batch on a second thread while the current one is processed, so that decompression and
// line splitting overlap the parallel stages. Batches come out in the reader's order.
class Prefetcher {
 public:
  explicit Prefetcher(RecordReader& reader) : reader_(reader) { start(); }
  ~Prefetcher() {
    if (pending_.valid()) pending_.wait();
  }
  bool next(std::vector<Record>& batch) {
    const bool got = pending_.get();
    consumed_ = reader_.bytes_consumed();
    batch.swap(ahead_);
    if (got) start();
    return got;
  }
  uint64_t bytes_consumed() const { return consumed_; }  // up to the end of the batch last returned

 private:
  void start() {
    pending_ = std::async(std::launch::async, [this] { return reader_.next_batch(ahead_); });
  }
  RecordReader& reader_;
  std::vector<Record> ahead_;
  std::future<bool> pending_;
  uint64_t consumed_ = 0;
};

}  // namespace tuna
