// The corpus preparer: see data/prepare.h for the pipeline.
#include "data/prepare.h"

#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/error.h"
#include "core/progress.h"  // human_bytes
#include "data/input.h"
#include "data/prepare_output.h"  // LocationLog, DroppedList, SplitWriter, out_dir rules
#include "data/prepare_reader.h"  // Record, RecordReader, Prefetcher, share_of
#include "data/shard.h"
#include "data/tokenizer_impl.h"  // missing_bytes

namespace tuna {

namespace fs = std::filesystem;

namespace {

// A document once decoded and cleaned: `text` is the document or, for SFT, the response.
struct Document {
  std::string prompt, text;
  std::string joined;  // SFT only: prompt + '\n' + response (or the conversation), what filters and dedup see
  std::vector<ChatMessage> messages;  // SFT conversations (then text is empty); a preference record's prompt messages
  bool no_template = false;           // a conversation, but the model's chat template is unknown
  // A preference record: prompt (plain) or messages (conversational) is the prompt; these the two completions.
  bool pair = false, conversational = false;
  std::string chosen, rejected;
  std::vector<ChatMessage> chosen_messages, rejected_messages;
  std::string_view whole() const { return joined.empty() ? std::string_view(text) : std::string_view(joined); }
};

// The chat format SFT conversations render with, once resolved from the tokenizer (or why it could not be).
struct ChatSetup {
  bool resolved = false;
  ChatFormat format = ChatFormat::llama3;
  std::string error;
  int32_t bos = -1, eos = -1;  // the frame of a plain document (-1: none)
};

// Uniform in [0, 1) from a 64-bit hash.
double unit(uint64_t hash) { return static_cast<double>(hash >> 11) * 0x1.0p-53; }

std::string where(const std::vector<InputFile>& files, const Record& r) {
  return r.line ? str(files[r.file].path, ":", r.line) : files[r.file].path;
}

// A message list: [{"role": string, "content": string}, ...]; false for anything else.
bool read_messages(const nlohmann::json& j, std::vector<ChatMessage>* out) {
  if (!j.is_array()) return false;
  for (const nlohmann::json& m : j) {
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !m.contains("content") ||
        !m["content"].is_string())
      return false;
    out->push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
  }
  return true;
}

// A preference record in one of TRL's formats (data/prepare.h): plain strings, or message lists whose prompt is the
// "prompt" list or, without one, the leading messages chosen and rejected share (TRL's extract_prompt).
Outcome extract_pair(const nlohmann::json& j, Document* doc) {
  doc->pair = true;
  const auto chosen = j.find("chosen"), rejected = j.find("rejected"), prompt = j.find("prompt");
  if (chosen == j.end() || rejected == j.end()) return Outcome::missing_field;
  if (chosen->is_string() && rejected->is_string()) {
    if (prompt == j.end() || !prompt->is_string()) return Outcome::missing_field;
    doc->prompt = prompt->get<std::string>();
    doc->chosen = chosen->get<std::string>(), doc->rejected = rejected->get<std::string>();
    return Outcome::kept;
  }
  doc->conversational = true;
  if (!read_messages(*chosen, &doc->chosen_messages) || !read_messages(*rejected, &doc->rejected_messages))
    return Outcome::missing_field;
  if (prompt != j.end()) {
    if (!read_messages(*prompt, &doc->messages)) return Outcome::missing_field;
    return Outcome::kept;
  }
  size_t shared = 0;
  auto same = [](const ChatMessage& a, const ChatMessage& b) { return a.role == b.role && a.content == b.content; };
  while (shared < doc->chosen_messages.size() && shared < doc->rejected_messages.size() &&
         same(doc->chosen_messages[shared], doc->rejected_messages[shared]))
    ++shared;
  doc->messages.assign(doc->chosen_messages.begin(), doc->chosen_messages.begin() + static_cast<int64_t>(shared));
  doc->chosen_messages.erase(doc->chosen_messages.begin(), doc->chosen_messages.begin() + static_cast<int64_t>(shared));
  doc->rejected_messages.erase(doc->rejected_messages.begin(),
                               doc->rejected_messages.begin() + static_cast<int64_t>(shared));
  return Outcome::kept;
}

// Record -> raw document (JSON decoding). kept, or the malformed outcome.
Outcome extract(const InputFile& file, Record& record, const PrepareOptions& o, Document* doc, bool* repaired) {
  if (record.preset != Outcome::kept) return record.preset;
  if (file.kind == InputKind::text) {
    doc->text = std::move(record.bytes);
    return Outcome::kept;
  }
  if (!is_valid_utf8(record.bytes)) {
    // A JSON parser refuses invalid UTF-8 outright: repair (or refuse) it here, as cleaning would.
    if (o.clean.drop_invalid_utf8) return Outcome::invalid_utf8;
    record.bytes = repair_utf8(record.bytes);
    *repaired = true;
  }
  nlohmann::json j = nlohmann::json::parse(record.bytes, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Outcome::malformed_json;
  if (!j.is_object()) return Outcome::missing_field;
  auto string_field = [&](const std::string& name, std::string* out) {
    auto it = j.find(name);
    if (it == j.end() || !it->is_string()) return false;
    *out = it->get<std::string>();
    return true;
  };
  if (o.preference) return extract_pair(j, doc);
  if (o.sft && j.contains("messages")) {
    const nlohmann::json& messages = j["messages"];
    if (!messages.is_array() || messages.empty()) return Outcome::missing_field;
    for (const nlohmann::json& m : messages) {
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !m.contains("content") ||
          !m["content"].is_string())
        return Outcome::missing_field;
      doc->messages.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
    }
  } else if (o.sft) {
    if (!string_field(o.prompt_field, &doc->prompt) || !string_field(o.response_field, &doc->text))
      return Outcome::missing_field;
  } else if (!string_field(o.text_field, &doc->text)) {
    return Outcome::missing_field;
  }
  return Outcome::kept;
}

// The outcome of a quality rule.
Outcome quality_outcome(QualityRule rule) {
  switch (rule) {
    case QualityRule::pass:
      return Outcome::kept;
    case QualityRule::too_short:
      return Outcome::too_short;
    case QualityRule::too_long:
      return Outcome::too_long;
    case QualityRule::low_alpha:
      return Outcome::low_alpha;
    case QualityRule::repeated_lines:
      return Outcome::repeated_lines;
  }
  return Outcome::kept;
}

// A conversation cleaned message by message; filters and dedup see "role\ncontent\n" per message.
Outcome clean_conversation(const PrepareOptions& o, const ChatSetup* chat, Document* doc, CleanResult* flags) {
  std::string cleaned;
  bool blank = true;
  for (ChatMessage& m : doc->messages) {
    CleanResult f;
    if (!clean_text(m.content, o.clean, &cleaned, &f)) return flags->invalid_utf8 = true, Outcome::invalid_utf8;
    m.content = std::move(cleaned);
    flags->invalid_utf8 |= f.invalid_utf8, flags->nul_bytes |= f.nul_bytes, flags->control_chars |= f.control_chars;
    blank &= is_blank(m.content);
    doc->joined += m.role + "\n" + m.content + "\n";
  }
  if (blank) return Outcome::empty;
  if (chat && !chat->resolved) {
    doc->no_template = true;
    return Outcome::bad_chat;
  }
  std::string why;
  if (chat && !validate_chat(chat->format, doc->messages, &why)) return Outcome::bad_chat;
  return Outcome::kept;
}

// A preference record cleaned field by field and message by message, then its own checks: an empty prompt or
// completion, identical completions, and for conversations the chat template's (a completion of assistant turns
// only). Filters and dedup see the prompt and both completions, joined.
Outcome clean_pair(const PrepareOptions& o, const ChatSetup* chat, Document* doc, CleanResult* flags) {
  std::string cleaned;
  auto clean = [&](std::string& text) {
    CleanResult f;
    if (!clean_text(text, o.clean, &cleaned, &f)) return false;
    text = std::move(cleaned);
    flags->invalid_utf8 |= f.invalid_utf8, flags->nul_bytes |= f.nul_bytes, flags->control_chars |= f.control_chars;
    return true;
  };
  auto blank_messages = [](const std::vector<ChatMessage>& ms) {
    return std::all_of(ms.begin(), ms.end(), [](const ChatMessage& m) { return is_blank(m.content); });
  };
  if (!doc->conversational) {
    for (std::string* text : {&doc->prompt, &doc->chosen, &doc->rejected})
      if (!clean(*text)) return flags->invalid_utf8 = true, Outcome::invalid_utf8;
    if (is_blank(doc->prompt)) return Outcome::empty_prompt;
    if (is_blank(doc->chosen) || is_blank(doc->rejected)) return Outcome::empty_completion;
    if (doc->chosen == doc->rejected) return Outcome::identical_completions;
    doc->joined = doc->prompt + "\n" + doc->chosen + "\n" + doc->rejected;
    return Outcome::kept;
  }
  for (auto* list : {&doc->messages, &doc->chosen_messages, &doc->rejected_messages})
    for (ChatMessage& m : *list)
      if (!clean(m.content)) return flags->invalid_utf8 = true, Outcome::invalid_utf8;
  if (blank_messages(doc->messages)) return Outcome::empty_prompt;  // also: no prompt messages at all
  if (blank_messages(doc->chosen_messages) || blank_messages(doc->rejected_messages))
    return Outcome::empty_completion;
  auto same = [](const ChatMessage& a, const ChatMessage& b) { return a.role == b.role && a.content == b.content; };
  if (std::equal(doc->chosen_messages.begin(), doc->chosen_messages.end(), doc->rejected_messages.begin(),
                 doc->rejected_messages.end(), same))
    return Outcome::identical_completions;
  for (const auto* list : {&doc->messages, &doc->chosen_messages, &doc->rejected_messages})
    for (const ChatMessage& m : *list) doc->joined += m.role + "\n" + m.content + "\n";
  if (chat && !chat->resolved) {
    doc->no_template = true;
    return Outcome::bad_chat;
  }
  if (chat) {
    for (const auto* completion : {&doc->chosen_messages, &doc->rejected_messages}) {
      for (const ChatMessage& m : *completion)
        if (m.role != "assistant") return Outcome::bad_chat;  // a completion is the assistant's turn(s)
      std::vector<ChatMessage> whole = doc->messages;
      whole.insert(whole.end(), completion->begin(), completion->end());
      std::string why;
      if (!validate_chat(chat->format, whole, &why)) return Outcome::bad_chat;
    }
  }
  return Outcome::kept;
}

// extract + clean + quality filters: the document as it will be tokenized, or why it is dropped.
// filter: false in pass 2, which decodes only documents that passed every filter in pass 1. chat: the
// template conversations are checked against (null: not checked, in the tokenizer-training pass).
// measure: what a failing filter measured (for dropped.jsonl).
Outcome decode(const InputFile& file, Record& record, const PrepareOptions& o, Document* doc, CleanResult* flags,
               bool filter = true, const ChatSetup* chat = nullptr, QualityMeasure* measure = nullptr) {
  *flags = CleanResult{};
  bool repaired = false;
  Outcome outcome = extract(file, record, o, doc, &repaired);
  record.bytes = {};
  if (outcome != Outcome::kept) return outcome;
  if (doc->pair) {
    flags->invalid_utf8 = repaired;
    outcome = clean_pair(o, filter ? chat : nullptr, doc, flags);
    if (outcome != Outcome::kept || !filter) return outcome;
    return quality_outcome(quality_check(doc->whole(), o.quality, measure));
  }
  if (!doc->messages.empty()) {
    flags->invalid_utf8 = repaired;
    outcome = clean_conversation(o, filter ? chat : nullptr, doc, flags);
    if (outcome != Outcome::kept || !filter) return outcome;
    return quality_outcome(quality_check(doc->whole(), o.quality, measure));
  }
  std::string cleaned;
  CleanResult f;
  if (!clean_text(doc->text, o.clean, &cleaned, &f)) return flags->invalid_utf8 = true, Outcome::invalid_utf8;
  doc->text = std::move(cleaned);
  *flags = f;
  flags->invalid_utf8 |= repaired;
  if (!doc->prompt.empty()) {
    if (!clean_text(doc->prompt, o.clean, &cleaned, &f)) return flags->invalid_utf8 = true, Outcome::invalid_utf8;
    doc->prompt = std::move(cleaned);
    flags->invalid_utf8 |= f.invalid_utf8, flags->nul_bytes |= f.nul_bytes, flags->control_chars |= f.control_chars;
  }
  if (is_blank(doc->text)) return Outcome::empty;
  if (o.sft && file.kind == InputKind::jsonl) doc->joined = doc->prompt + "\n" + doc->text;
  if (!filter) return Outcome::kept;
  return quality_outcome(quality_check(doc->whole(), o.quality, measure));
}

bool is_filter_outcome(Outcome o) {
  return o == Outcome::too_short || o == Outcome::too_long || o == Outcome::low_alpha || o == Outcome::repeated_lines;
}

// The hash that exact dedup and the train/val split use. For SFT, the response hashed with the prompt's
// hash as seed, so that moving text between prompt and response makes another record.
uint64_t exact_hash(const Document& doc) {
  if (doc.pair || !doc.messages.empty()) return XXH3_64bits(doc.joined.data(), doc.joined.size());
  if (doc.joined.empty()) return XXH3_64bits(doc.text.data(), doc.text.size());
  return XXH3_64bits_withSeed(doc.text.data(), doc.text.size(), XXH3_64bits(doc.prompt.data(), doc.prompt.size()));
}

// Progress of a pass on stderr: the share of the input done, bytes on disk (compressed: what the share and
// the ETA are reckoned in) and their rate, text bytes (decompressed) and their rate, documents/s and the ETA.
// On a terminal, one live line rewritten in place; otherwise (a log file, a batch job) a line every
// `interval` seconds. Either way a last line when the pass ends.
class Progress {
 public:
  Progress(bool enabled, std::string label, uint64_t total_bytes, double interval)
      : enabled_(enabled),
        tty_(enabled && is_live_terminal(stderr)),
        label_(std::move(label)),
        total_(total_bytes),
        interval_(interval > 0 ? interval : tty_ ? 1.0 : 30.0),
        start_(clock::now()),
        last_(start_) {}
  void update(uint64_t bytes, uint64_t text_bytes, uint64_t documents, bool final = false) {
    if (!enabled_) return;
    const auto now = clock::now();
    if (!final && std::chrono::duration<double>(now - last_).count() < interval_) return;
    last_ = now;
    const double s = std::max(1e-9, std::chrono::duration<double>(now - start_).count());
    const double rate = static_cast<double>(bytes) / s;
    const double share = final || total_ == 0 ? 1.0 : std::min(1.0, static_cast<double>(bytes) / static_cast<double>(total_));
    std::string eta = "ETA -";
    if (final) {
      eta = str("done in ", clock_time(s));
    } else if (bytes >= total_) {
      eta = "ETA 0:00:00";
    } else if (rate > 0) {
      eta = str("ETA ", clock_time(static_cast<double>(total_ - bytes) / rate));
    }
    char line[512];
    std::snprintf(line, sizeof line, "prepare: %s %5.1f%%  %s / %s on disk (%.1f MB/s), %s text (%.1f MB/s), %.0f docs/s, %s",
                  label_.c_str(), 100.0 * share, human_bytes(static_cast<double>(bytes)).c_str(),
                  human_bytes(static_cast<double>(total_)).c_str(), rate / 1e6,
                  human_bytes(static_cast<double>(text_bytes)).c_str(), static_cast<double>(text_bytes) / s / 1e6,
                  static_cast<double>(documents) / s, eta.c_str());
    if (tty_)
      std::fprintf(stderr, "\r%s\033[K%s", line, final ? "\n" : "");  // \033[K: clear what a longer line left
    else
      std::fprintf(stderr, "%s\n", line);
  }

 private:
  using clock = std::chrono::steady_clock;
  static std::string clock_time(double seconds) {
    const auto t = static_cast<unsigned long long>(seconds + 0.5);
    char buf[32];
    std::snprintf(buf, sizeof buf, "%llu:%02llu:%02llu", t / 3600, t / 60 % 60, t % 60);
    return buf;
  }
  bool enabled_, tty_;
  std::string label_;
  uint64_t total_;
  double interval_;
  clock::time_point start_, last_;
};

// The tokenizer-training pass: samples cleaned documents into one plain-text file, one line per line.
void train_tokenizer_on_inputs(const PrepareOptions& options, const std::vector<InputFile>& files,
                               int threads) {
  const std::string& model = options.tokenizer_path;
  if (!model.ends_with(".model"))
    fail("prepare: --tokenizer ", model, ": --train-tokenizer trains a sentencepiece model, and --tokenizer must name "
         "the .model file to write (a Llama 3 tokenizer.json or tiktoken file is used as it is, not trained)");
  uint64_t total_bytes = 0;
  for (const InputFile& f : files) total_bytes += f.bytes;
  const double rate =
      total_bytes <= options.tokenizer_sample_bytes
          ? 1.0
          : static_cast<double>(options.tokenizer_sample_bytes) / static_cast<double>(total_bytes);
  const std::string sample_path = (fs::path(options.out_dir) / "tokenizer-sample.txt.tmp").string();
  uint64_t lines = 0;
  {
    std::ofstream sample(sample_path, std::ios::binary | std::ios::trunc);
    if (!sample) fail("prepare: cannot create ", sample_path);
    RecordReader reader(files, 0, files.size(), options, nullptr);
    std::vector<Record> batch;
    std::vector<Document> docs;
    std::vector<Outcome> outcomes;
    while (reader.next_batch(batch)) {
      docs.assign(batch.size(), Document{});
      outcomes.assign(batch.size(), Outcome::kept);
      const int64_t n = static_cast<int64_t>(batch.size());
#pragma omp parallel for num_threads(threads) schedule(dynamic, 16)
      for (int64_t i = 0; i < n; ++i) {
        CleanResult flags;
        outcomes[i] = decode(files[batch[i].file], batch[i], options, &docs[i], &flags);
      }
      for (size_t i = 0; i < docs.size(); ++i) {
        if (outcomes[i] != Outcome::kept) continue;
        const std::string_view text = docs[i].whole();
        // A seed other than the split's, so that the sample is not the validation set.
        if (rate < 1.0 && unit(XXH3_64bits_withSeed(text.data(), text.size(), 1)) >= rate) continue;
        size_t begin = 0;
        while (begin <= text.size()) {
          size_t end = text.find('\n', begin);
          if (end == std::string::npos) end = text.size();
          std::string_view line(text.data() + begin, end - begin);
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

void check_accounting(const PrepareReport& r, const char* what) {
  uint64_t sum = 0;
  for (const Tally& t : r.outcome) sum += t.count;
  TUNA_CHECK(sum == r.documents_read, what, ": ", r.documents_read, " documents read but ", sum,
             " accounted for");
}

void merge_into(PrepareReport& into, const PrepareReport& from) {
  into.files_read += from.files_read;
  into.bytes_read += from.bytes_read;
  into.files_skipped.merge(from.files_skipped);
  into.files_symlinks.merge(from.files_symlinks);
  into.files_not_regular.merge(from.files_not_regular);
  into.files_unreadable.merge(from.files_unreadable);
  into.files_damaged.merge(from.files_damaged);
  into.documents_read += from.documents_read;
  for (size_t k = 0; k < kOutcomes; ++k) into.outcome[k].merge(from.outcome[k]);
  into.repaired_utf8.merge(from.repaired_utf8);
  into.removed_nul.merge(from.removed_nul);
  into.removed_control.merge(from.removed_control);
  into.dropped_bytes += from.dropped_bytes;
  into.dropped_byte_documents.merge(from.dropped_byte_documents);
  into.dropped_lists.insert(into.dropped_lists.end(), from.dropped_lists.begin(), from.dropped_lists.end());
  for (auto [a, b] : {std::pair{&into.train, &from.train}, std::pair{&into.val, &from.val}}) {
    a->documents += b->documents;
    a->tokens += b->tokens;
    a->shards.insert(a->shards.end(), b->shards.begin(), b->shards.end());
  }
  into.seconds = std::max(into.seconds, from.seconds);
}

// Every rank's report, merged in rank order (so 'first' is the first in global input order), on every rank.
PrepareReport merge_reports(PrepareComm& comm, const PrepareReport& mine, const PrepareOptions& options) {
  if (comm.size() == 1) return mine;
  std::vector<uint64_t> lengths;
  const std::string text = report_json(mine, options).dump();
  const std::vector<char> all = comm.all_gather(text.data(), text.size(), &lengths);
  PrepareReport merged;
  size_t offset = 0;
  for (size_t r = 0; r < lengths.size(); ++r) {
    PrepareReport part = report_from_json(nlohmann::json::parse(all.begin() + static_cast<int64_t>(offset),
                                                                all.begin() + static_cast<int64_t>(offset + lengths[r])));
    offset += lengths[r];
    if (r == 0) {
      merged = part;
    } else {
      merge_into(merged, part);
    }
  }
  merged.ranks = comm.size();
  return merged;
}

}  // namespace

namespace {

void check_options(const PrepareOptions& options) {
  if (options.out_dir.empty()) fail("prepare: --out is required");
  if (options.tokenizer_path.empty()) fail("prepare: --tokenizer is required");
  if (!(options.val_fraction >= 0.0 && options.val_fraction <= 1.0))
    fail("prepare: --val-fraction must lie in [0, 1], found ", options.val_fraction);
  if (options.shard_tokens < 1) fail("prepare: --shard-tokens must be at least 1");
  if (!(options.near_verify >= 0.0 && options.near_verify <= 1.0))
    fail("prepare: --near-verify must lie in [0, 1], found ", options.near_verify);
  if (options.sft && (options.prompt_field.empty() || options.response_field.empty()))
    fail("prepare: --sft needs non-empty --prompt-field and --response-field");
  if (options.preference && options.sft)
    fail("prepare: --preference and --sft are two kinds of shards; choose one");
  if (options.seq_len < 0) fail("prepare: --seq-len must be at least 0, found ", options.seq_len);
  if (options.seq_len > 0 && !options.preference)
    fail("prepare: --seq-len is the length preference pairs must fit (--preference); other documents pack across "
         "windows and need none");
}

// One rank's run: the inputs it reads and what it reports. Every step below reads it.
struct PrepareRun {
  PrepareRun(const PrepareOptions& o, PrepareComm& c, int r, int n) : options(o), comm(c), rank(r), ranks(n) {}
  const PrepareOptions& options;
  PrepareComm& comm;
  int rank = 0, ranks = 1, threads = 1;
  std::vector<InputFile> files;
  size_t first = 0, last = 0;  // this rank's share of files
  uint64_t share_bytes = 0;
  bool progress = false;       // rank 0 prints, unless --quiet
  std::string who;             // " (rank 0 of N)" in progress lines
  PrepareReport report;
};

// Lists the inputs (rank 0 counts what it skips) and this rank's share of them.
void list_run_inputs(PrepareRun& run) {
  run.files = list_inputs(run.options.inputs, run.options.follow_symlinks, [&](InputSkip why, const std::string& what) {
    if (run.rank != 0) return;  // every rank lists the inputs: count once
    switch (why) {
      case InputSkip::name: return run.report.files_skipped.add(what);
      case InputSkip::symlink: return run.report.files_symlinks.add(what);
      case InputSkip::not_regular: return run.report.files_not_regular.add(what);
      case InputSkip::unreadable: return run.report.files_unreadable.add(what);
    }
  });
  // Preference pairs are JSONL records: a text file among the inputs (a README beside pairs.jsonl) would become a
  // document of no pair, so it is refused by name before anything is read.
  if (run.options.preference)
    for (const InputFile& f : run.files)
      if (f.kind != InputKind::jsonl)
        fail("prepare --preference: ", f.path, " is not a JSONL file (.jsonl, maybe .gz or .zst): preference "
             "pairs are JSONL records in TRL's formats; give the JSONL files themselves");
  std::tie(run.first, run.last) = share_of(run.files, run.rank, run.ranks);
  for (size_t f = run.first; f < run.last; ++f) run.share_bytes += run.files[f].bytes;
}

// The tokenizer, and the model's vocab_size where a config.json stands beside it (*model_vocab; 0: none): a
// tokenizer with ids the model has no embedding for is refused (or, for unused special tokens, accepted with a
// warning) before anything is written, not by the trainer after the whole corpus is prepared. Then rank 0 prepares
// out_dir (and trains the tokenizer, which is read after it); the gather is the barrier the others wait at. Read
// once: loading Llama 3's tokenizer.json is a fifth of preparing 5 MB of text.
Tokenizer open_out_dir_and_tokenizer(PrepareRun& run, int64_t* model_vocab) {
  const PrepareOptions& options = run.options;
  *model_vocab = 0;
  Tokenizer tokenizer;
  if (!options.train_tokenizer) {
    tokenizer.load(options.tokenizer_path);  // a missing tokenizer fails before out_dir is touched
    std::string config;
    *model_vocab = model_vocab_beside(options.tokenizer_path, &config);
    const std::string warning = *model_vocab > 0 ? check_tokenizer_fits(tokenizer, *model_vocab, config) : "";
    if (!warning.empty() && run.rank == 0) std::fprintf(stderr, "warning: %s\n", warning.c_str());
  }
  if (run.rank == 0) {
    prepare_out_dir(options);
    if (options.train_tokenizer) train_tokenizer_on_inputs(options, run.files, run.threads);
  }
  run.comm.all_gather(nullptr, 0);
  run.report.tokenizer_trained = options.train_tokenizer;
  if (options.train_tokenizer) tokenizer.load(options.tokenizer_path);
  return tokenizer;
}

// SFT conversations: the chat format, named (refused here when unknown) or the model's own (a failure is reported at
// the first conversation, since a run of prompt/response records needs none).
ChatSetup chat_setup(const PrepareOptions& options, const Tokenizer& tokenizer, PrepareReport& report) {
  ChatSetup chat;
  if (!options.sft && !options.preference) return chat;
  try {
    chat.format = resolve_chat_format(tokenizer, options.chat_template);
    chat.resolved = true;
    report.chat_template = chat_format_name(chat.format);
  } catch (const Error& e) {
    if (options.chat_template != "auto") throw;
    chat.error = e.what();
  }
  return chat;
}

// Pass 1's outcome: each local document's fate so far, and what the dedup join reads.
struct PassOne {
  std::vector<Outcome> fate;
  std::unique_ptr<DedupSpill> spill;
  std::unique_ptr<LocationLog> locations;
};

// Pass 1: decode, clean, filter, hash. fate[i] is local document i's outcome so far.
PassOne clean_filter_hash(PrepareRun& run, const ChatSetup& chat) {
  const PrepareOptions& options = run.options;
  const std::vector<InputFile>& files = run.files;
  PrepareReport& report = run.report;
  const int threads = run.threads;
  const MinHasher hasher(options.minhash);
  const bool dedup = options.exact_dedup || options.near_dedup;
  const int bands = options.minhash.bands;
  const bool verify = options.near_dedup && options.near_verify > 0;
  const size_t sketch_bytes = verify ? hasher.sketch_bytes() : 0;
  PassOne one;
  std::vector<Outcome>& fate = one.fate;
  if (dedup) {
    const std::string scratch =
        (fs::path(options.out_dir) / str(".prepare-scratch-", run.rank, "-", ::getpid())).string();
    one.spill = std::make_unique<DedupSpill>(scratch, bands, sketch_bytes);
    one.locations = std::make_unique<LocationLog>(scratch + "-locations.bin");
  }
  DedupSpill* spill = one.spill.get();
  LocationLog* locations = one.locations.get();
  const size_t first = run.first, last = run.last;
  const bool progress = run.progress;
  const std::string& who = run.who;
  const uint64_t share_bytes = run.share_bytes;
  RecordReader records(files, first, last, options, &report);
  Prefetcher reader(records);
  Progress meter(progress, str("pass 1/2 (clean, filter, hash)", who), share_bytes, options.progress_seconds);
  std::vector<Record> batch;
  std::vector<Outcome> outcomes;
  std::vector<CleanResult> flags;
  std::vector<uint64_t> exact, band_hashes;
  std::vector<uint8_t> sketches;
  std::vector<uint8_t> has_bands;
  std::vector<uint8_t> no_template;
  uint64_t text_bytes = 0;
  while (reader.next(batch)) {
    for (const Record& record : batch) text_bytes += record.bytes.size();
    const size_t n = batch.size();
    outcomes.assign(n, Outcome::kept);
    flags.assign(n, CleanResult{});
    exact.assign(n, 0);
    has_bands.assign(n, 0);
    no_template.assign(n, 0);
    band_hashes.resize(n * static_cast<size_t>(bands));
    sketches.resize(n * sketch_bytes);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 16)
    for (int64_t i = 0; i < static_cast<int64_t>(n); ++i) {
      Document doc;
      outcomes[i] = decode(files[batch[i].file], batch[i], options, &doc, &flags[i], /*filter=*/true, &chat);
      no_template[i] = doc.no_template;
      if (outcomes[i] != Outcome::kept || !dedup) continue;
      exact[i] = exact_hash(doc);
      if (options.near_dedup)
        has_bands[i] = hasher.band_hashes(doc.whole(), &band_hashes[i * bands], verify ? &sketches[i * sketch_bytes] : nullptr);
    }
    for (size_t i = 0; i < n; ++i) {
      if (no_template[i])
        fail("prepare: ", where(files, batch[i]), " is a conversation (\"messages\"), but ", chat.error);
      ++report.documents_read;
      if (flags[i].invalid_utf8 && outcomes[i] != Outcome::invalid_utf8) report.repaired_utf8.add(where(files, batch[i]));
      if (flags[i].nul_bytes) report.removed_nul.add(where(files, batch[i]));
      if (flags[i].control_chars) report.removed_control.add(where(files, batch[i]));
      if (outcomes[i] != Outcome::kept) report.outcome[static_cast<size_t>(outcomes[i])].add(where(files, batch[i]));
      fate.push_back(outcomes[i]);
      if (locations) locations->add(batch[i].file, batch[i].line);
      if (spill)
        spill->add(options.exact_dedup && outcomes[i] == Outcome::kept, exact[i],
                   outcomes[i] == Outcome::kept && has_bands[i] ? &band_hashes[i * bands] : nullptr,
                   verify ? &sketches[i * sketch_bytes] : nullptr);
    }
    meter.update(reader.bytes_consumed(), text_bytes, report.documents_read);
  }
  meter.update(reader.bytes_consumed(), text_bytes, report.documents_read, /*final=*/true);
  return one;
}

// The join: global exact and near dedup (a collective). Marks the duplicates in fate, and returns (local index, where
// the document kept in its place was read) for each duplicate, in input order.
std::vector<std::pair<uint64_t, std::string>> join_duplicates(PrepareRun& run, PassOne& one) {
  std::vector<std::pair<uint64_t, std::string>> duplicate_of;
  if (!one.spill) return duplicate_of;
  const PrepareOptions& options = run.options;
  const std::vector<InputFile>& files = run.files;
  std::vector<Outcome>& fate = one.fate;
  const bool verify = options.near_dedup && options.near_verify > 0;
  const auto join_started = std::chrono::steady_clock::now();
  std::vector<uint32_t> kept_as;
  const std::vector<DedupVerdict> verdicts = one.spill->join(run.comm, options.near_dedup, options.dedup_memory_bytes,
                                                         run.threads, verify ? options.near_verify : 0, &kept_as);
  one.spill.reset();
  for (size_t i = 0; i < fate.size(); ++i)
    if (fate[i] == Outcome::kept && verdicts[i] != DedupVerdict::unique)
      fate[i] = verdicts[i] == DedupVerdict::exact_duplicate ? Outcome::exact_duplicate : Outcome::near_duplicate;
  const std::vector<KeptLocation> kept = locate_kept(run.comm, kept_as, fate, *one.locations);
  one.locations.reset();
  for (size_t i = 0; i < fate.size(); ++i)
    if (fate[i] == Outcome::exact_duplicate || fate[i] == Outcome::near_duplicate) {
      auto it = std::lower_bound(kept.begin(), kept.end(), kept_as[i],
                                 [](const KeptLocation& k, uint32_t id) { return k.id < id; });
      TUNA_CHECK(it != kept.end() && it->id == kept_as[i], "no location for kept document ", kept_as[i]);
      duplicate_of.emplace_back(i, it->line ? str(files[it->file].path, ":", it->line) : files[it->file].path);
    }
  if (run.progress)
    std::fprintf(stderr, "prepare: dedup join%s done in %.1f s\n", run.who.c_str(),
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - join_started).count());
  return duplicate_of;
}

// A kept document as the shards hold it: BOS, the prompt (context, masked out under --sft), the text, EOS; or a
// conversation through the chat template (only the assistant's turns train).
struct Tokenized {
  Outcome outcome = Outcome::kept;
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;
  std::vector<int32_t> rejected_tokens;  // a preference pair: tokens / mask are prompt + chosen, these + rejected
  std::vector<uint8_t> rejected_mask;
  uint64_t hash = 0;
  uint64_t dropped_bytes = 0;  // bytes of the text the tokenizer drops
  QualityMeasure measure;  // of a filtered document, for dropped.jsonl
};

// A conversation's completion: the prompt messages and the completion's rendered, the mask kept on the completion's
// assistant turns only (each turn's trained tokens are one run of 1s, as render_chat marks them; the prompt's own
// assistant turns, earlier runs, become context).
bool render_completion(const CachedEncoder& encoder, const Tokenizer& tokenizer, ChatFormat format,
                       const std::vector<ChatMessage>& prompt, const std::vector<ChatMessage>& completion,
                       std::vector<int32_t>* tokens, std::vector<uint8_t>* mask, std::string* why) {
  std::vector<ChatMessage> whole = prompt;
  whole.insert(whole.end(), completion.begin(), completion.end());
  RenderedChat r;
  if (!render_chat(encoder, tokenizer, format, whole, &r, why)) return false;
  size_t keep = completion.size(), runs = 0;
  for (size_t i = r.mask.size(); i-- > 0;) {
    if (r.mask[i] && (i + 1 == r.mask.size() || !r.mask[i + 1])) ++runs;  // the end of a run, walking back
    if (runs > keep) r.mask[i] = 0;
  }
  *tokens = std::move(r.tokens), *mask = std::move(r.mask);
  return true;
}

// A preference record's two documents (data/prepare.h), or over_seq_len when they do not fit one window together.
void tokenize_pair(const Document& doc, const Tokenizer& tokenizer, const CachedEncoder& encoder,
                   const ChatSetup& chat, int64_t seq_len, Tokenized& t) {
  if (doc.conversational) {
    std::string why;
    if (!render_completion(encoder, tokenizer, chat.format, doc.messages, doc.chosen_messages, &t.tokens, &t.mask, &why) ||
        !render_completion(encoder, tokenizer, chat.format, doc.messages, doc.rejected_messages, &t.rejected_tokens,
                           &t.rejected_mask, &why))
      throw Error(why);
  } else {
    std::vector<int32_t> prompt;
    if (tokenizer.bos_id() >= 0) prompt.push_back(tokenizer.bos_id());
    encoder.encode(doc.prompt, &prompt);
    for (int half = 0; half < 2; ++half) {
      std::vector<int32_t>& tokens = half == 0 ? t.tokens : t.rejected_tokens;
      std::vector<uint8_t>& mask = half == 0 ? t.mask : t.rejected_mask;
      tokens = prompt;
      encoder.encode(half == 0 ? doc.chosen : doc.rejected, &tokens);
      if (tokenizer.eos_id() >= 0) tokens.push_back(tokenizer.eos_id());
      mask.assign(tokens.size(), 1);
      std::fill(mask.begin(), mask.begin() + static_cast<int64_t>(prompt.size()), 0);
    }
  }
  if (seq_len > 0 && static_cast<int64_t>(t.tokens.size() + t.rejected_tokens.size()) > seq_len)
    t.outcome = Outcome::over_seq_len;
}

void tokenize_document(const Document& doc, const Tokenizer& tokenizer, const CachedEncoder& encoder,
                       const ChatSetup& chat, bool sft, Tokenized& t, int64_t seq_len = 0) {
  t.hash = exact_hash(doc);
  try {
    if (doc.pair) return tokenize_pair(doc, tokenizer, encoder, chat, seq_len, t);
    if (!doc.messages.empty()) {
      RenderedChat chat_tokens;
      std::string why;
      if (!render_chat(encoder, tokenizer, chat.format, doc.messages, &chat_tokens, &why))
        throw Error(why);
      t.tokens = std::move(chat_tokens.tokens);
      t.mask = std::move(chat_tokens.mask);
      if (encoder.drops_bytes()) {  // the template encodes some text twice: each message's bytes counted once here
        std::vector<int32_t> ignored;
        for (const ChatMessage& m : doc.messages) encoder.encode(m.content, &ignored, SpecialTokens::as_text, &t.dropped_bytes);
      }
      return;
    }
    if (chat.bos >= 0) t.tokens.push_back(chat.bos);
    if (!doc.prompt.empty()) encoder.encode(doc.prompt, &t.tokens, SpecialTokens::as_text, &t.dropped_bytes);
    const size_t prompt_end = t.tokens.size();
    encoder.encode(doc.text, &t.tokens, SpecialTokens::as_text, &t.dropped_bytes);
    if (chat.eos >= 0) t.tokens.push_back(chat.eos);
    if (sft) {
      // Only predicting the response (and EOS) trains: BOS and the prompt are context.
      t.mask.assign(t.tokens.size(), 1);
      if (!doc.joined.empty()) std::fill(t.mask.begin(), t.mask.begin() + static_cast<int64_t>(prompt_end), 0);
    }
  } catch (const std::exception&) {
    t.outcome = Outcome::tokenize_failed;
    t.tokens.clear();
  }
}

// Pass 2: tokenize and write what is kept; every dropped document goes to dropped.jsonl with its reason.
void tokenize_and_write(PrepareRun& run, const Tokenizer& tokenizer, const ChatSetup& chat, int64_t model_vocab,
                        const std::vector<Outcome>& fate,
                        const std::vector<std::pair<uint64_t, std::string>>& duplicate_of) {
  const PrepareOptions& options = run.options;
  const std::vector<InputFile>& files = run.files;
  PrepareReport& report = run.report;
  const CachedEncoder encoder(tokenizer);
  // Shards declare the ids that can occur: the model's vocabulary when the tokenizer has unused ids above it.
  const uint32_t vocab = static_cast<uint32_t>(model_vocab > 0 ? std::min<int64_t>(tokenizer.vocab_size(), model_vocab)
                                                                : tokenizer.vocab_size());
  char prefix[16] = "";
  if (run.ranks > 1) std::snprintf(prefix, sizeof prefix, "-r%05d", run.rank);
  const uint64_t fingerprint = tokenizer.fingerprint();
  const bool masked = options.sft || options.preference;
  SplitWriter train(options.out_dir, str("train", prefix), vocab, fingerprint, options.shard_tokens, masked,
                    &report.train, options.preference);
  SplitWriter val(options.out_dir, str("val", prefix), vocab, fingerprint, options.shard_tokens, masked, &report.val,
                  options.preference);
  {
    RecordReader records(files, run.first, run.last, options, nullptr);
    Prefetcher reader(records);
    Progress meter(run.progress, str("pass 2/2 (tokenize, write)", run.who), run.share_bytes, options.progress_seconds);
    DroppedList dropped((fs::path(options.out_dir) / (run.ranks > 1 ? str("dropped", prefix, ".jsonl") : std::string("dropped.jsonl"))).string());
    size_t next_duplicate = 0;  // into duplicate_of
    std::vector<Record> batch;
    std::vector<Tokenized> out;
    size_t next = 0;  // local index of batch[0]
    uint64_t documents = 0;
    uint64_t text_bytes = 0;
    while (reader.next(batch)) {
      for (const Record& record : batch) text_bytes += record.bytes.size();
      const size_t n = batch.size();
      if (next + n > fate.size())
        fail("prepare: the inputs changed during the run (pass 2 reads more documents than pass 1 did)");
      out.assign(n, Tokenized{});
#pragma omp parallel for num_threads(run.threads) schedule(dynamic, 4)
      for (int64_t i = 0; i < static_cast<int64_t>(n); ++i) {
        Tokenized& t = out[i];
        t.outcome = fate[next + i];
        Document doc;
        CleanResult flags;
        if (is_filter_outcome(t.outcome))
          decode(files[batch[i].file], batch[i], options, &doc, &flags, /*filter=*/true, &chat, &t.measure);
        if (t.outcome != Outcome::kept) continue;
        if (decode(files[batch[i].file], batch[i], options, &doc, &flags, /*filter=*/false) != Outcome::kept) {
          t.outcome = Outcome::count_;  // pass 1 kept it: the file changed under us
          continue;
        }
        tokenize_document(doc, tokenizer, encoder, chat, options.sft, t, options.seq_len);
      }
      for (size_t i = 0; i < n; ++i) {
        Tokenized& t = out[i];
        if (t.outcome == Outcome::count_)
          fail("prepare: the inputs changed during the run: ", where(files, batch[i]), " reads differently in pass 2");
        if (t.outcome == Outcome::kept) {
          SplitWriter& split = unit(t.hash) < options.val_fraction ? val : train;
          if (options.preference)
            split.add_pair(t.tokens, t.mask, t.rejected_tokens, t.rejected_mask);
          else
            split.add(t.tokens, t.mask);
          report.outcome[static_cast<size_t>(Outcome::kept)].add(where(files, batch[i]));
          if (t.dropped_bytes) {
            report.dropped_bytes += t.dropped_bytes;
            report.dropped_byte_documents.add(where(files, batch[i]));
          }
        } else if (t.outcome == Outcome::exact_duplicate || t.outcome == Outcome::near_duplicate ||
                   t.outcome == Outcome::tokenize_failed || t.outcome == Outcome::over_seq_len) {
          // Decided after pass 1 read the record: counted here, where its location is at hand.
          report.outcome[static_cast<size_t>(t.outcome)].add(where(files, batch[i]));
        }
        if (t.outcome != Outcome::kept) {
          nlohmann::json line{{"where", where(files, batch[i])}, {"reason", outcome_name(t.outcome)}};
          if (is_filter_outcome(t.outcome))
            line.update({{"measure", t.measure.name}, {"value", t.measure.value}, {"limit", t.measure.limit}});
          if (next_duplicate < duplicate_of.size() && duplicate_of[next_duplicate].first == next + i)
            line["duplicate_of"] = duplicate_of[next_duplicate++].second;
          dropped.add(line);
        }
        t = Tokenized{};
      }
      next += n;
      documents += n;
      meter.update(reader.bytes_consumed(), text_bytes, documents);
    }
    if (next != fate.size())
      fail("prepare: the inputs changed during the run (pass 2 reads ", next, " documents, pass 1 read ", fate.size(), ")");
    meter.update(reader.bytes_consumed(), text_bytes, documents, /*final=*/true);
    report.dropped_lists.push_back(dropped.finish());
  }
  train.finish();
  val.finish();
}

}  // namespace

// BOS and EOS of every plain document: the tokenizer's, or the options'. A tokenizer without them (a tokenizer.json
// whose post-processor adds no BOS, beside no config that names one) is refused in one line that says what to do,
// rather than writing documents the trainer cannot tell apart.
static void frame_documents(const PrepareOptions& options, const Tokenizer& tokenizer, ChatSetup* chat) {
  if (options.no_bos_eos) {
    if (!options.bos.empty() || !options.eos.empty()) fail("options --no_bos_eos and --bos/--eos contradict each other");
    return;
  }
  auto named = [&](const std::string& name, const char* option, int32_t fallback) {
    if (name.empty()) return fallback;
    const int32_t id = tokenizer.token_id(name);
    if (id < 0) fail("option --", option, ": '", name, "' is not a token of ", tokenizer.path());
    return id;
  };
  chat->bos = named(options.bos, "bos", tokenizer.bos_id());
  chat->eos = named(options.eos, "eos", tokenizer.eos_id());
  if (chat->bos < 0 || chat->eos < 0)
    fail("tokenizer ", tokenizer.path(), " names no ", chat->bos < 0 && chat->eos < 0 ? "BOS and no EOS" : chat->bos < 0 ? "BOS" : "EOS",
         " (no post-processor template, tokenizer_config.json or config.json gives ", chat->bos < 0 && chat->eos < 0 ? "them" : "it",
         "), and every document is framed BOS + text + EOS: name ", chat->bos < 0 && chat->eos < 0 ? "them" : "it", " with ",
         chat->bos < 0 && chat->eos < 0 ? "--bos TOKEN --eos TOKEN" : chat->bos < 0 ? "--bos TOKEN" : "--eos TOKEN",
         " (the model's, e.g. --eos '<|endoftext|>'), or pass --no_bos_eos to write documents without them");
}

PrepareReport prepare_corpus(const PrepareOptions& options) {
  const auto started = std::chrono::steady_clock::now();
  check_options(options);
  LocalComm local_comm;
  PrepareComm& comm = options.comm ? *options.comm : local_comm;
  PrepareRun run{options, comm, comm.rank(), comm.size()};
  run.threads = options.threads > 0 ? options.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  run.progress = !options.quiet && run.rank == 0;
  run.who = run.ranks > 1 ? str(" (rank 0 of ", run.ranks, ")") : std::string();
  PrepareReport& report = run.report;
  report.ranks = run.ranks;
  report.threads = run.threads;
  report.lsh_threshold = minhash_threshold(options.minhash);
  report.near_verify = options.near_dedup ? options.near_verify : 0;
  list_run_inputs(run);
  int64_t model_vocab = 0;
  const Tokenizer tokenizer = open_out_dir_and_tokenizer(run, &model_vocab);
  report.tokenizer_path = tokenizer.path();
  report.tokenizer_format = format_name(tokenizer.format());
  report.tokenizer_fingerprint = tokenizer.fingerprint();
  report.vocab_size = tokenizer.vocab_size();
  // Those that UTF-8 text can hold (prepare's text always is): 0xC0, 0xC1 and 0xF5..0xFF never occur in it, and
  // GPT-2-family vocabularies often lack them.
  for (char c : tokenizer.impl().missing_bytes()) {
    const uint8_t b = static_cast<uint8_t>(c);
    if (b != 0xC0 && b != 0xC1 && b < 0xF5) report.missing_bytes.push_back(c);
  }
  ChatSetup chat = chat_setup(options, tokenizer, report);
  frame_documents(options, tokenizer, &chat);
  report.bos_id = chat.bos;
  report.eos_id = chat.eos;

  PassOne one = clean_filter_hash(run, chat);
  const std::vector<std::pair<uint64_t, std::string>> duplicate_of = join_duplicates(run, one);
  tokenize_and_write(run, tokenizer, chat, model_vocab, one.fate, duplicate_of);
  check_accounting(report, str("rank ", run.rank).c_str());

  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  PrepareReport merged = merge_reports(run.comm, report, options);
  check_accounting(merged, "all ranks");
  // report.json last: its presence marks a finished run.
  if (run.rank == 0)
    write_text_atomically((fs::path(options.out_dir) / "report.json").string(),
                          report_json(merged, options).dump(2) + "\n");
  run.comm.all_gather(nullptr, 0);
  return merged;
}

}  // namespace tuna
