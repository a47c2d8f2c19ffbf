// Multiple-choice task records: data/mc_tasks.h.
#include "data/mc_tasks.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/byte_bpe.h"       // ByteBpeModel: the post-processor's special tokens
#include "data/clean.h"          // is_valid_utf8
#include "data/tokenizer_impl.h"
#include "data/unicode.h"  // next_code_point, is_whitespace

namespace tuna {
namespace fs = std::filesystem;

namespace {

// Python's str.isspace: Unicode White_Space plus U+001C..U+001F (bidirectional class B or S), what lm-eval's
// context.rstrip() removes.
bool python_space(uint32_t cp) { return unicode::is_whitespace(cp) || (cp >= 0x1c && cp <= 0x1f); }

int64_t code_points(std::string_view text) {
  int64_t n = 0;
  for (size_t at = 0; at < text.size(); n++) unicode::next_code_point(text, &at);
  return n;
}

// Byte offset where the context's trailing Python whitespace begins.
size_t trailing_space_start(std::string_view text) {
  size_t keep = 0;
  for (size_t at = 0; at < text.size();) {
    const uint32_t cp = unicode::next_code_point(text, &at);
    if (!python_space(cp)) keep = at;
  }
  return keep;
}

// A bad record: thrown inside parse_record, counted or rethrown with the file and line by the reader.
struct BadRecord {
  std::string reason, detail;
};

std::string string_field(const nlohmann::json& j, const char* name, bool required) {
  auto it = j.find(name);
  if (it == j.end()) {
    if (required) throw BadRecord{str("no \"", name, "\""), str("field \"", name, "\" is missing")};
    return {};
  }
  if (!it->is_string())
    throw BadRecord{str("\"", name, "\" not a string"), str("field \"", name, "\" should be a string, found ", it->type_name())};
  return it->get<std::string>();
}

McRecord parse_record(const std::string& line) {
  if (!is_valid_utf8(line)) throw BadRecord{"not UTF-8", "the line is not valid UTF-8"};
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(line);
  } catch (const nlohmann::json::parse_error& e) {
    throw BadRecord{"not JSON", str("not a JSON object (", e.what(), ")")};
  }
  if (!j.is_object()) throw BadRecord{"not JSON", str("a JSON object was expected, found ", j.type_name())};
  McRecord r;
  r.task = string_field(j, "task", true);
  if (r.task.empty()) throw BadRecord{"empty task", "field \"task\" is empty"};
  auto choices = j.find("choices");
  if (choices == j.end() || !choices->is_array())
    throw BadRecord{"no choices", choices == j.end() ? "field \"choices\" is missing"
                                                     : str("field \"choices\" should be a list, found ", choices->type_name())};
  if (choices->empty()) throw BadRecord{"no choices", "field \"choices\" is an empty list"};
  for (size_t k = 0; k < choices->size(); k++) {
    const nlohmann::json& c = (*choices)[k];
    if (!c.is_string()) throw BadRecord{"choice not a string", str("choices[", k, "] should be a string, found ", c.type_name())};
    if (c.get_ref<const std::string&>().empty()) throw BadRecord{"empty choice", str("choices[", k, "] is empty")};
    r.choices.push_back(c.get<std::string>());
  }
  auto context = j.find("context");
  if (context == j.end()) throw BadRecord{"no context", "field \"context\" is missing"};
  if (context->is_string()) {
    r.contexts.push_back(context->get<std::string>());
  } else if (context->is_array()) {
    if (context->size() != r.choices.size())
      throw BadRecord{"contexts not one per choice", str("field \"context\" is a list of ", context->size(),
                                                         " but there are ", r.choices.size(), " choices")};
    for (size_t k = 0; k < context->size(); k++) {
      if (!(*context)[k].is_string())
        throw BadRecord{"context not a string", str("context[", k, "] should be a string, found ", (*context)[k].type_name())};
      r.contexts.push_back((*context)[k].get<std::string>());
    }
  } else {
    throw BadRecord{"context not a string", str("field \"context\" should be a string or a list of strings, found ",
                                                context->type_name())};
  }
  for (size_t k = 0; k < r.contexts.size(); k++)
    if (r.contexts[k].empty()) throw BadRecord{"empty context", r.contexts.size() == 1 ? std::string("field \"context\" is empty")
                                                                                       : str("context[", k, "] is empty")};
  auto gold = j.find("gold");
  if (gold == j.end()) throw BadRecord{"no gold", "field \"gold\" is missing"};
  if (!gold->is_number_integer())
    throw BadRecord{"gold not an integer", str("field \"gold\" should be an integer index, found ", gold->dump())};
  r.gold = gold->get<int64_t>();
  if (r.gold < 0 || r.gold >= static_cast<int64_t>(r.choices.size()))
    throw BadRecord{"gold out of range", str("gold ", r.gold, " is not an index of the ", r.choices.size(), " choices")};
  if (j.contains("delimiter")) r.delimiter = string_field(j, "delimiter", true);
  if (auto id = j.find("id"); id != j.end()) r.id = id->dump();
  return r;
}

std::vector<std::string> task_files(const std::vector<std::string>& specs) {
  std::vector<std::string> files;
  for (const std::string& spec : specs) {
    std::error_code ec;
    if (fs::is_directory(spec, ec)) {
      std::vector<std::string> found;
      for (fs::directory_iterator it(spec, ec), end; !ec && it != end; it.increment(ec))
        if (it->path().extension() == ".jsonl" && it->is_regular_file(ec)) found.push_back(it->path().string());
      if (ec) fail(spec, ": cannot list the directory (", ec.message(), ")");
      if (found.empty()) fail(spec, ": no *.jsonl task file in this directory");
      std::sort(found.begin(), found.end());
      files.insert(files.end(), found.begin(), found.end());
    } else if (fs::exists(spec, ec)) {
      files.push_back(spec);
    } else {
      fail(spec, ": no such task file or directory");
    }
  }
  return files;
}

}  // namespace

int64_t McRecord::norm_length(size_t choice) const {
  if (contexts.size() > 1) return code_points(contexts[choice]);
  std::string_view c = choices[choice];
  if (!delimiter.empty() && c.starts_with(delimiter)) c.remove_prefix(delimiter.size());
  return code_points(c);
}

int64_t McTasks::skipped_total() const {
  int64_t n = 0;
  for (const auto& [why, count] : skipped) n += count;
  return n;
}

McTasks read_mc_tasks(const std::vector<std::string>& specs, bool skip_bad) {
  McTasks out;
  out.files = task_files(specs);
  for (const std::string& file : out.files) {
    std::ifstream in(file, std::ios::binary);
    if (!in) fail(file, ": cannot open the task file");
    std::string line;
    for (int64_t number = 1; std::getline(in, line); number++) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.find_first_not_of(" \t") == std::string::npos) continue;  // blank lines are not records
      try {
        McRecord r = parse_record(line);
        r.file = file;
        r.line = number;
        if (std::find(out.tasks.begin(), out.tasks.end(), r.task) == out.tasks.end()) out.tasks.push_back(r.task);
        out.records.push_back(std::move(r));
      } catch (const BadRecord& bad) {
        if (!skip_bad)
          fail(file, ":", number, ": ", bad.detail, " (a task record is {\"task\", \"context\", \"choices\", \"gold\"}; "
               "--skip_bad_records counts and skips such records)");
        out.skipped[bad.reason]++;
      }
    }
    if (in.bad()) fail(file, ": read error");
  }
  if (out.records.empty())
    fail(specs.empty() ? std::string("--tasks") : out.files.front(), ": no task record to evaluate",
         out.skipped.empty() ? "" : str(" (", out.skipped_total(), " bad records skipped)"));
  return out;
}

SpecialFrame special_frame(const Tokenizer& tokenizer) {
  SpecialFrame f;
  if (const ByteBpeModel* m = tokenizer.impl().bpe_model()) {
    f.before = m->frame_before, f.after = m->frame_after;
  } else if (tokenizer.bos_id() >= 0) {
    f.before = {tokenizer.bos_id()};  // sentencepiece: LlamaTokenizer's add_bos_token, true by default
  }
  const int32_t prefix = tokenizer.bos_id() >= 0 ? tokenizer.bos_id() : tokenizer.eos_id();
  if (prefix >= 0) f.prefix_text = tokenizer.piece(prefix);
  return f;
}

void encode_mc_pair(const Tokenizer& tokenizer, const std::string& context, const std::string& continuation,
                    bool special_tokens, std::vector<int32_t>* context_ids, std::vector<int32_t>* continuation_ids) {
  const SpecialFrame frame = special_tokens ? special_frame(tokenizer) : SpecialFrame{};
  auto encode = [&](const std::string& text) {
    const bool framed = special_tokens && !(!frame.prefix_text.empty() && text.starts_with(frame.prefix_text));
    std::vector<int32_t> ids = framed ? frame.before : std::vector<int32_t>();
    const std::vector<int32_t> body = tokenizer.encode(text, SpecialTokens::parse);
    ids.insert(ids.end(), body.begin(), body.end());
    if (framed) ids.insert(ids.end(), frame.after.begin(), frame.after.end());
    return ids;
  };
  const size_t cut = trailing_space_start(context);
  const std::string head = context.substr(0, cut);
  const std::vector<int32_t> whole = encode(head + context.substr(cut) + continuation);
  *context_ids = encode(head);
  const size_t n = std::min(context_ids->size(), whole.size());
  continuation_ids->assign(whole.begin() + static_cast<std::ptrdiff_t>(n), whole.end());
}

std::vector<McRequest> encode_mc_requests(const McTasks& tasks, const Tokenizer& tokenizer, bool special_tokens,
                                          int64_t max_tokens, int64_t* truncated) {
  std::vector<McRequest> requests;
  int64_t cut = 0;
  std::vector<int32_t> context, continuation;
  for (size_t i = 0; i < tasks.records.size(); i++) {
    const McRecord& r = tasks.records[i];
    for (size_t k = 0; k < r.choices.size(); k++) {
      encode_mc_pair(tokenizer, r.context(k), r.choices[k], special_tokens, &context, &continuation);
      if (continuation.empty())
        fail(r.file, ":", r.line, ": choice ", k, " (\"", r.choices[k], "\") encodes to no token after its context");
      if (static_cast<int64_t>(continuation.size()) > max_tokens)
        fail(r.file, ":", r.line, ": choice ", k, " alone is ", continuation.size(), " tokens, more than the ", max_tokens,
             " a window holds (--seq_len)");
      McRequest q;
      q.record = static_cast<int64_t>(i);
      q.choice = static_cast<int32_t>(k);
      q.continuation = static_cast<int32_t>(continuation.size());
      q.tokens = context;
      q.tokens.insert(q.tokens.end(), continuation.begin(), continuation.end());
      if (static_cast<int64_t>(q.tokens.size()) > max_tokens + 1) {
        q.tokens.erase(q.tokens.begin(), q.tokens.end() - (max_tokens + 1));
        cut++;
      }
      requests.push_back(std::move(q));
    }
  }
  if (truncated) *truncated = cut;
  return requests;
}

}  // namespace tuna
