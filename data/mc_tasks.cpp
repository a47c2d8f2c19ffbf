// Multiple-choice task records: data/mc_tasks.h.
#include "data/mc_tasks.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <variant>

#include "core/error.h"
#include "core/json.h"  // read_json_file
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

// A string or a list of strings (at least one when `required`), for "until" and "target".
std::vector<std::string> string_list(const nlohmann::json& j, const char* name, bool required) {
  auto it = j.find(name);
  if (it == j.end()) {
    if (required) throw BadRecord{str("no \"", name, "\""), str("field \"", name, "\" is missing")};
    return {};
  }
  if (it->is_string()) return {it->get<std::string>()};
  if (!it->is_array())
    throw BadRecord{str("\"", name, "\" not a string"),
                    str("field \"", name, "\" should be a string or a list of strings, found ", it->type_name())};
  std::vector<std::string> out;
  for (size_t k = 0; k < it->size(); k++) {
    if (!(*it)[k].is_string())
      throw BadRecord{str("\"", name, "\" not a string"), str(name, "[", k, "] should be a string, found ", (*it)[k].type_name())};
    out.push_back((*it)[k].get<std::string>());
  }
  if (required && out.empty()) throw BadRecord{str("no \"", name, "\""), str("field \"", name, "\" is an empty list")};
  return out;
}

GenRecord parse_generative(const nlohmann::json& j, std::string task) {
  if (j.contains("choices") || j.contains("gold"))
    throw BadRecord{"both target and choices", "a record has either \"target\" (generative) or \"choices\" and "
                    "\"gold\" (multiple choice), found both"};
  GenRecord r;
  r.task = std::move(task);
  r.context = string_field(j, "context", true);
  if (r.context.empty()) throw BadRecord{"empty context", "field \"context\" is empty"};
  r.targets = string_list(j, "target", true);
  for (size_t k = 0; k < r.targets.size(); k++)
    if (r.targets[k].empty()) throw BadRecord{"empty target", r.targets.size() == 1 ? std::string("field \"target\" is empty")
                                                                                    : str("target[", k, "] is empty")};
  r.until = string_list(j, "until", false);
  for (size_t k = 0; k < r.until.size(); k++)
    // lm-eval's stop check finds "" in any text: generation would end after one token.
    if (r.until[k].empty()) throw BadRecord{"empty stop string", str("until[", k, "] is empty")};
  if (auto m = j.find("max_gen_toks"); m != j.end()) {
    if (!m->is_number_integer() || m->get<int64_t>() < 1)
      throw BadRecord{"max_gen_toks not positive", str("field \"max_gen_toks\" should be a positive integer, found ", m->dump())};
    r.max_gen_toks = m->get<int64_t>();
  }
  if (auto id = j.find("id"); id != j.end()) r.id = id->dump();
  return r;
}

// One line: a multiple-choice record, or (with "target" or "until") a generative one.
std::variant<McRecord, GenRecord> parse_record(const std::string& line) {
  if (!is_valid_utf8(line)) throw BadRecord{"not UTF-8", "the line is not valid UTF-8"};
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(line);
  } catch (const nlohmann::json::exception& e) {  // parse_error, and out_of_range for a number like 1e400
    throw BadRecord{"not JSON", str("not a JSON object (", e.what(), ")")};
  }
  if (!j.is_object()) throw BadRecord{"not JSON", str("a JSON object was expected, found ", j.type_name())};
  McRecord r;
  r.task = string_field(j, "task", true);
  if (r.task.empty()) throw BadRecord{"empty task", "field \"task\" is empty"};
  if (j.contains("target") || j.contains("until")) return parse_generative(j, std::move(r.task));
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
        std::variant<McRecord, GenRecord> parsed = parse_record(line);
        const bool generative = std::holds_alternative<GenRecord>(parsed);
        const std::string& task = generative ? std::get<GenRecord>(parsed).task : std::get<McRecord>(parsed).task;
        // A task is scored one way: its first record says which (lm-eval's output_type).
        auto& own = generative ? out.generative_tasks : out.tasks;
        const auto& other = generative ? out.tasks : out.generative_tasks;
        if (std::find(other.begin(), other.end(), task) != other.end())
          throw BadRecord{"task of both kinds", str("task \"", task, "\" has ", generative ? "multiple-choice" : "generative",
                                                    " records before this ", generative ? "generative" : "multiple-choice",
                                                    " one; a task is of one kind")};
        if (std::find(own.begin(), own.end(), task) == own.end()) own.push_back(task);
        if (generative) {
          GenRecord& r = std::get<GenRecord>(parsed);
          r.file = file, r.line = number;
          out.generative.push_back(std::move(r));
        } else {
          McRecord& r = std::get<McRecord>(parsed);
          r.file = file, r.line = number;
          out.records.push_back(std::move(r));
        }
      } catch (const BadRecord& bad) {
        if (!skip_bad)
          fail(file, ":", number, ": ", bad.detail, " (a task record is {\"task\", \"context\", \"choices\", \"gold\"}, "
               "or {\"task\", \"context\", \"until\", \"target\"} for generation; --skip_bad_records counts and skips "
               "such records)");
        out.skipped[bad.reason]++;
      }
    }
    if (in.bad()) fail(file, ": read error");
  }
  if (out.records.empty() && out.generative.empty())
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

std::vector<int32_t> encode_lm_eval(const Tokenizer& tokenizer, const std::string& text, bool special_tokens,
                                    const SpecialFrame& frame) {
  const bool framed = special_tokens && !(!frame.prefix_text.empty() && text.starts_with(frame.prefix_text));
  std::vector<int32_t> ids = framed ? frame.before : std::vector<int32_t>();
  const std::vector<int32_t> body = tokenizer.encode(text, SpecialTokens::parse);
  ids.insert(ids.end(), body.begin(), body.end());
  if (framed) ids.insert(ids.end(), frame.after.begin(), frame.after.end());
  return ids;
}

std::string hf_decode(const Tokenizer& tokenizer, std::span<const int32_t> ids, bool skip_special, bool clean_up) {
  std::string text;
  if (skip_special) {
    std::vector<int32_t> kept;
    for (int32_t id : ids)
      if (tokenizer.impl().kind(id) != TokenKind::special) kept.push_back(id);
    text = tokenizer.decode(kept);
  } else {
    text = tokenizer.decode(ids);
  }
  return clean_up ? clean_up_tokenization(std::move(text)) : text;
}

std::string clean_up_tokenization(std::string text) {
  // Each replacement over the whole text in turn, as Python's chained str.replace.
  static const std::pair<const char*, const char*> kRules[] = {{" .", "."},   {" ?", "?"},     {" !", "!"},
                                                               {" ,", ","},   {" ' ", "'"},    {" n't", "n't"},
                                                               {" 'm", "'m"}, {" 's", "'s"},   {" 've", "'ve"},
                                                               {" 're", "'re"}};
  for (const auto& [from, to] : kRules) {
    const std::string_view f(from), t(to);
    std::string out;
    size_t at = 0;
    for (size_t hit; (hit = text.find(f, at)) != std::string::npos; at = hit + f.size()) {
      out.append(text, at, hit - at);
      out.append(t);
    }
    out.append(text, at, std::string::npos);
    text = std::move(out);
  }
  return text;
}

bool clean_up_tokenization_spaces(const Tokenizer& tokenizer) {
  const std::string file = model_config_file(tokenizer.path(), "tokenizer_config.json");
  if (file.empty()) return false;
  const nlohmann::json c = read_json_file(file, file);
  auto it = c.find("clean_up_tokenization_spaces");
  if (it == c.end() || it->is_null()) return false;
  if (!it->is_boolean()) fail(file, ": field 'clean_up_tokenization_spaces': expected true or false, found ", it->dump());
  return it->get<bool>();
}

std::string_view python_strip(std::string_view text) {
  size_t begin = text.size();
  for (size_t at = 0; at < text.size();) {
    const size_t here = at;
    if (!python_space(unicode::next_code_point(text, &at))) {
      begin = here;
      break;
    }
  }
  const size_t end = trailing_space_start(text);
  return begin < end ? text.substr(begin, end - begin) : std::string_view();
}

void encode_mc_pair(const Tokenizer& tokenizer, const std::string& context, const std::string& continuation,
                    bool special_tokens, std::vector<int32_t>* context_ids, std::vector<int32_t>* continuation_ids) {
  const SpecialFrame frame = special_tokens ? special_frame(tokenizer) : SpecialFrame{};
  auto encode = [&](const std::string& text) { return encode_lm_eval(tokenizer, text, special_tokens, frame); };
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
