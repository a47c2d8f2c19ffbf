// The files prepare writes besides its shards' contents: the scratch log of where each document was read, the
// dropped-document list, one split's shard files, and the out_dir rules. Internal to data/prepare*.cpp.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "data/prepare.h"
#include "data/shard.h"

namespace tuna {

// Where each of this rank's documents was read, (file index, line) in input order, one 12-byte record per
// document in a scratch file (not in memory: it grows with the corpus). A duplicate's line in dropped.jsonl
// names the document kept in its place, which may be any earlier document of any rank.
class LocationLog {
 public:
  explicit LocationLog(std::string path) : path_(std::move(path)) {
    file_ = std::fopen(path_.c_str(), "w+b");
    if (!file_) fail("prepare: cannot create ", path_, ": ", std::strerror(errno));
  }
  ~LocationLog() {
    std::fclose(file_);
    std::remove(path_.c_str());
  }
  LocationLog(const LocationLog&) = delete;
  LocationLog& operator=(const LocationLog&) = delete;

  void add(uint32_t file, uint64_t line) {
    char record[kRecord];
    std::memcpy(record, &file, 4);
    std::memcpy(record + 4, &line, 8);
    if (std::fwrite(record, 1, kRecord, file_) != kRecord)
      fail("prepare: cannot write ", path_, ": ", std::strerror(errno));
  }
  std::pair<uint32_t, uint64_t> at(uint64_t index) {
    char record[kRecord];
    if (std::fflush(file_) != 0 || ::pread(::fileno(file_), record, kRecord, static_cast<off_t>(index * kRecord)) != kRecord)
      fail("prepare: cannot read back ", path_, ": ", std::strerror(errno));
    std::pair<uint32_t, uint64_t> out;
    std::memcpy(&out.first, record, 4);
    std::memcpy(&out.second, record + 4, 8);
    return out;
  }

 private:
  static constexpr size_t kRecord = 12;
  std::string path_;
  std::FILE* file_;
};

// The locations of the documents kept in place of this rank's duplicates: every rank asks for the ids it
// needs, every rank answers for the ids it holds (collectives: all ranks call it). Sorted by id.
struct KeptLocation {
  uint32_t id, file;
  uint64_t line;
};
std::vector<KeptLocation> locate_kept(PrepareComm& comm, const std::vector<uint32_t>& kept_as,
                                      const std::vector<Outcome>& fate, LocationLog& log);

// OUT/dropped.jsonl (dropped-rRRRRR.jsonl for rank R of several): one JSON line per document not kept, in
// input order; written as .tmp and renamed when the pass is done.
class DroppedList {
 public:
  explicit DroppedList(std::string path) : path_(std::move(path)), out_(path_ + ".tmp", std::ios::binary | std::ios::trunc) {
    if (!out_) fail("prepare: cannot create ", path_, ".tmp");
  }
  void add(const nlohmann::json& line) { out_ << line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << '\n'; }
  std::string finish() {
    out_.flush();
    if (!out_) fail("prepare: cannot write ", path_, ".tmp");
    out_.close();
    std::error_code ec;
    std::filesystem::rename(path_ + ".tmp", path_, ec);
    if (ec) fail("prepare: cannot rename ", path_, ".tmp to ", path_, ": ", ec.message());
    return path_;
  }

 private:
  std::string path_;
  std::ofstream out_;
};

// One split's shards: train-00000.bin, ... (train-r00001-00000.bin, ... for rank 1 of several).
class SplitWriter {
 public:
  // pairs: preference pairs (add_pair only), each pair whole in one shard.
  SplitWriter(std::string dir, std::string name, uint32_t vocab_size, uint64_t fingerprint, uint64_t shard_tokens,
              bool with_mask, PrepareReport::Split* split, bool pairs = false)
      : pairs_(pairs),
        dir_(std::move(dir)),
        name_(std::move(name)),
        vocab_size_(vocab_size),
        fingerprint_(fingerprint),
        shard_tokens_(shard_tokens),
        with_mask_(with_mask),
        split_(split) {}

  // A preference pair: its two documents in one shard (the shard rolls over before the pair, never inside it).
  void add_pair(const std::vector<int32_t>& chosen, const std::vector<uint8_t>& chosen_mask,
                const std::vector<int32_t>& rejected, const std::vector<uint8_t>& rejected_mask) {
    roll(chosen.size() + rejected.size());
    append(chosen, chosen_mask);
    append(rejected, rejected_mask);
  }

  void add(const std::vector<int32_t>& tokens, const std::vector<uint8_t>& mask) {
    roll(tokens.size());
    append(tokens, mask);
  }

 private:
  bool pairs_ = false;

  // A new shard when this many more tokens would overflow the current one.
  void roll(size_t tokens) {
    if (writer_ && writer_->token_count() > 0 && writer_->token_count() + tokens > shard_tokens_) finish();
    if (!writer_) {
      char file[96];
      std::snprintf(file, sizeof file, "%s-%05zu%s", name_.c_str(), shards_, kShardExtension);
      writer_ = std::make_unique<ShardWriter>((std::filesystem::path(dir_) / file).string(), vocab_size_, with_mask_,
                                              fingerprint_, pairs_);
      ++shards_;
    }
  }

  void append(const std::vector<int32_t>& tokens, const std::vector<uint8_t>& mask) {
    if (with_mask_)
      writer_->add_document(tokens, mask);
    else
      writer_->add_document(tokens);
    split_->documents += 1;
    split_->tokens += tokens.size();
  }

 public:
  void finish() {
    if (!writer_) return;
    writer_->finish();
    split_->shards.push_back(writer_->path());
    writer_.reset();
  }

 private:
  std::string dir_, name_;
  uint32_t vocab_size_;
  uint64_t fingerprint_;
  uint64_t shard_tokens_;
  bool with_mask_;
  size_t shards_ = 0;
  PrepareReport::Split* split_;
  std::unique_ptr<ShardWriter> writer_;
};

// An out_dir that holds an earlier run is refused, or emptied of that run's outputs with overwrite:
// stale shards next to new ones would silently join the training set.
void prepare_out_dir(const PrepareOptions& options);

// Writes `text` to path.tmp, then renames it over path: a reader never sees half a file.
void write_text_atomically(const std::string& path, const std::string& text);

}  // namespace tuna
