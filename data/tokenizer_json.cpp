// Hugging Face tokenizer.json -> ByteBpeModel (data/byte_bpe.h). What tuna reads is what Llama 3 (and GPT-2
// style byte-level BPE) uses:
//   normalizer     null
//   pre_tokenizer  Split(Regex, behavior Isolated) and ByteLevel steps, alone or in a Sequence
//   model          BPE over the byte-level alphabet: vocab, merges ("a b" strings or [a, b] pairs),
//                  ignore_merges; no dropout, no subword prefix or suffix, no byte fallback
//   added_tokens   special or not; lstrip, rstrip and single_word refused (tuna does not implement them)
//   post_processor TemplateProcessing's leading special token is the format's BOS
// Anything else is refused by name: a WordPiece or Unigram model, a sentencepiece-style BPE (Metaspace,
// byte fallback: use the model's tokenizer.model), a normalizer.
#include <fstream>
#include <functional>
#include <climits>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "core/error.h"
#include "data/byte_bpe.h"
#include "data/tokenizer.h"

namespace tuna {

namespace {

using nlohmann::json;

const json& field(const json& j, const char* name, const std::string& path, const char* where) {
  auto it = j.find(name);
  if (it == j.end()) fail("tokenizer ", path, ": ", where, " has no '", name, "'");
  return *it;
}

// The GPT-2 pattern a ByteLevel pre-tokenizer with use_regex splits by.
const char* const kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

void read_pre_tokenizer(const json& p, const std::string& path, ByteBpeModel* m, bool* byte_level, bool first) {
  if (p.is_null()) return;
  const std::string type = p.value("type", "");
  if (type == "Sequence") {
    bool is_first = first;
    for (const json& step : field(p, "pretokenizers", path, "pre_tokenizer Sequence")) {
      read_pre_tokenizer(step, path, m, byte_level, is_first);
      is_first = false;
    }
    return;
  }
  if (type == "Split") {
    const json& pattern = field(p, "pattern", path, "pre_tokenizer Split");
    if (!pattern.contains("Regex"))
      fail("tokenizer ", path, ": pre_tokenizer Split with a String pattern is not supported (tuna reads Regex)");
    const std::string behavior = p.value("behavior", "");
    if (behavior != "Isolated")
      fail("tokenizer ", path, ": pre_tokenizer Split with behavior '", behavior,
           "' is not supported (tuna reads Isolated, Llama 3's)");
    if (p.value("invert", false)) fail("tokenizer ", path, ": pre_tokenizer Split with invert is not supported");
    m->patterns.push_back(pattern["Regex"].get<std::string>());
    return;
  }
  if (type == "ByteLevel") {
    *byte_level = true;
    if (p.value("add_prefix_space", false)) {
      if (!first)
        fail("tokenizer ", path, ": pre_tokenizer ByteLevel with add_prefix_space after another step is not supported");
      m->add_prefix_space = true;
    }
    if (p.value("use_regex", true)) m->patterns.push_back(kGpt2Pattern);
    return;
  }
  fail("tokenizer ", path, ": pre_tokenizer '", type,
       "' is not supported (tuna reads byte-level BPE: Split and ByteLevel pre-tokenizers, as Llama 3's)");
}



// tokenizer.json is mostly model.vocab (128k entries for Llama 3) and model.merges (280k): those stream
// straight into vectors; the rest becomes a small DOM. Nesting deeper than kMaxDepth is refused (a crafted
// file must not exhaust the stack).
class TokenizerJsonReader : public nlohmann::json_sax<json> {
 public:
  static constexpr size_t kMaxDepth = 64;
  explicit TokenizerJsonReader(const std::string& path) : path_(path) {}

  json root;
  std::vector<std::pair<std::string, int64_t>> vocab;  // in file order
  std::vector<std::pair<std::string, std::string>> merges;
  bool has_vocab = false, has_merges = false;

  bool null() override { return value(json()); }
  bool boolean(bool b) override { return value(b); }
  bool number_integer(number_integer_t n) override { return number(n); }
  bool number_unsigned(number_unsigned_t n) override {
    return number(n > static_cast<number_unsigned_t>(INT64_MAX) ? -1 : static_cast<int64_t>(n));
  }
  bool number_float(number_float_t d, const string_t&) override {
    if (in(Mode::vocab)) fail("tokenizer ", path_, ": model.vocab['", key_, "']: expected an integer id, found ", d);
    return value(d);
  }
  bool string(string_t& text) override {
    if (in(Mode::merges)) {
      const size_t space = text.find(' ');
      if (space == std::string::npos || text.find(' ', space + 1) != std::string::npos)
        fail("tokenizer ", path_, ": model.merges[", merges.size(), "]: expected two tokens separated by one space, found '",
             text, "'");
      merges.emplace_back(text.substr(0, space), text.substr(space + 1));
      return true;
    }
    if (in(Mode::merge_pair)) {
      pair_.push_back(std::move(text));
      return true;
    }
    if (in(Mode::vocab)) fail("tokenizer ", path_, ": model.vocab['", key_, "']: expected an integer id, found a string");
    return value(std::move(text));
  }
  bool binary(binary_t&) override { fail("tokenizer ", path_, ": unexpected binary value"); }
  bool start_object(std::size_t) override {
    if (in(Mode::vocab) || in(Mode::merges) || in(Mode::merge_pair))
      fail("tokenizer ", path_, ": model.", in(Mode::vocab) ? "vocab" : "merges", ": unexpected object");
    if (depth_check(); model_child("vocab")) {
      has_vocab = true;
      frames_.push_back({Mode::vocab, nullptr});
      return true;
    }
    json* node = place(json::object());
    const bool model = frames_.size() == 1 && key_ == "model";
    frames_.push_back({model ? Mode::model : Mode::dom, node});
    return true;
  }
  bool key(string_t& k) override {
    key_ = std::move(k);
    return true;
  }
  bool end_object() override {
    frames_.pop_back();
    return true;
  }
  bool start_array(std::size_t) override {
    depth_check();
    if (model_child("merges")) {
      has_merges = true;
      frames_.push_back({Mode::merges, nullptr});
      return true;
    }
    if (in(Mode::merges)) {
      pair_.clear();
      frames_.push_back({Mode::merge_pair, nullptr});
      return true;
    }
    if (in(Mode::vocab) || in(Mode::merge_pair)) fail("tokenizer ", path_, ": model.vocab or merges: unexpected array");
    frames_.push_back({Mode::dom, place(json::array())});
    return true;
  }
  bool end_array() override {
    if (in(Mode::merge_pair)) {
      if (pair_.size() != 2)
        fail("tokenizer ", path_, ": model.merges[", merges.size(), "]: expected [\"a\", \"b\"], found ", pair_.size(),
             " string(s)");
      merges.emplace_back(std::move(pair_[0]), std::move(pair_[1]));
    }
    frames_.pop_back();
    return true;
  }
  bool parse_error(std::size_t position, const std::string&, const nlohmann::detail::exception& e) override {
    fail("tokenizer ", path_, ": not valid JSON (byte ", position, "): ", e.what());
  }

 private:
  enum class Mode { dom, model, vocab, merges, merge_pair };
  struct Frame {
    Mode mode;
    json* node;
  };
  bool in(Mode mode) const { return !frames_.empty() && frames_.back().mode == mode; }
  bool model_child(const char* name) const { return in(Mode::model) && key_ == name; }
  void depth_check() const {
    if (frames_.size() >= kMaxDepth) fail("tokenizer ", path_, ": JSON nested deeper than ", kMaxDepth, " levels");
  }
  bool number(int64_t n) {
    if (in(Mode::vocab)) {
      vocab.emplace_back(key_, n);
      return true;
    }
    return value(n);
  }
  bool value(json v) {
    if (in(Mode::vocab) || in(Mode::merges) || in(Mode::merge_pair))
      fail("tokenizer ", path_, ": model.", in(Mode::vocab) ? "vocab" : "merges", ": unexpected value ", v.dump());
    place(std::move(v));
    return true;
  }
  // Puts v where the parser is (the root, the current key of an object, the end of an array).
  json* place(json v) {
    if (frames_.empty()) {
      root = std::move(v);
      return &root;
    }
    json& parent = *frames_.back().node;
    if (parent.is_object()) return &(parent[key_] = std::move(v));
    parent.push_back(std::move(v));
    return &parent.back();
  }

  std::string path_;
  std::vector<Frame> frames_;
  std::string key_;
  std::vector<std::string> pair_;
};

}  // namespace

std::unique_ptr<TokenizerImpl> load_tokenizer_json(const std::string& path) {
  TokenizerJsonReader reader(path);
  {
    std::ifstream in(path, std::ios::binary);
    if (!in) fail("tokenizer ", path, ": cannot open");
    json::sax_parse(in, &reader);
  }
  const json& j = reader.root;
  try {
    if (!j.is_object() || !j.contains("model") || !j["model"].is_object())
      fail("tokenizer ", path, ": JSON, but not a Hugging Face tokenizer.json (no 'model' object)");
    const json& model = j["model"];
    const std::string type = model.value("type", reader.has_merges ? "BPE" : "");
    if (type != "BPE")
      fail("tokenizer ", path, ": a ", type.empty() ? std::string("untyped") : type,
           " model; tuna reads byte-level BPE tokenizers only (Llama 3's tokenizer.json)");
    if (j.contains("normalizer") && !j["normalizer"].is_null())
      fail("tokenizer ", path, ": normalizer '", j["normalizer"].value("type", "?"),
           "' is not supported (tuna reads byte-level BPE without a normalizer, as Llama 3's; for a sentencepiece "
           "model, use its tokenizer.model)");
    if (model.contains("dropout") && !model["dropout"].is_null() && model["dropout"] != 0)
      fail("tokenizer ", path, ": BPE dropout is not supported");
    for (const char* unsupported : {"continuing_subword_prefix", "end_of_word_suffix"})
      if (model.contains(unsupported) && !model[unsupported].is_null() && model[unsupported] != "")
        fail("tokenizer ", path, ": model.", unsupported, " is not supported (not a byte-level BPE)");
    if (model.value("byte_fallback", false))
      fail("tokenizer ", path, ": a sentencepiece-style BPE (byte_fallback); use the model's tokenizer.model");
    if (!reader.has_vocab) fail("tokenizer ", path, ": model has no 'vocab' object");
    if (!reader.has_merges) fail("tokenizer ", path, ": model has no 'merges' list");

    ByteBpeModel m;
    m.path = path;
    m.format = TokenizerFormat::hf_bpe;
    m.ignore_merges = model.value("ignore_merges", false);
    bool byte_level = false;
    read_pre_tokenizer(j.value("pre_tokenizer", json()), path, &m, &byte_level, true);
    if (!byte_level)
      fail("tokenizer ", path, ": a BPE without a ByteLevel pre-tokenizer (sentencepiece-style?); tuna reads byte-level "
           "BPE tokenizer.json (Llama 3's), and sentencepiece models as tokenizer.model");

    // Vocabulary: byte-level strings -> bytes.
    int64_t size = 0;
    for (const auto& [text, id] : reader.vocab) {
      if (id < 0 || id >= (int64_t{1} << 30))
        fail("tokenizer ", path, ": model.vocab['", text, "']: expected an id in [0, 2^30), found ", id);
      size = std::max(size, id + 1);
    }
    const json added = j.value("added_tokens", json::array());
    if (!added.is_array()) fail("tokenizer ", path, ": added_tokens is not a list");
    for (const json& a : added) {
      const json& id = field(a, "id", path, "added token");
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= (int64_t{1} << 30))
        fail("tokenizer ", path, ": added token id ", id.dump(), ": expected an integer in [0, 2^30)");
      size = std::max<int64_t>(size, id.get<int64_t>() + 1);
    }
    m.tokens.assign(size, std::string());
    m.kinds.assign(size, TokenKind::unused);
    for (const auto& [text, id] : reader.vocab) {
      if (m.kinds[id] != TokenKind::unused) fail("tokenizer ", path, ": model.vocab gives id ", id, " to two tokens");
      if (!byte_level_decode(text, &m.tokens[id]))
        fail("tokenizer ", path, ": model.vocab['", text, "'] (id ", id,
             ") holds a character outside the byte-level alphabet: not a byte-level BPE");
      m.kinds[id] = TokenKind::normal;
    }
    TokenIndex index;
    index.reserve(reader.vocab.size());
    for (size_t id = 0; id < m.tokens.size(); ++id)
      if (m.kinds[id] == TokenKind::normal) index.insert(m.tokens[id], static_cast<int32_t>(id));
    reader.vocab = {};
    for (const json& a : added) {
      const int32_t id = a["id"].get<int32_t>();
      const std::string content = field(a, "content", path, "added token").get<std::string>();
      for (const char* flag : {"lstrip", "rstrip", "single_word"})
        if (a.value(flag, false))
          fail("tokenizer ", path, ": added token '", content, "' has ", flag, " = true, which tuna does not implement");
      m.tokens[id] = content;
      m.kinds[id] = a.value("special", false) ? TokenKind::special : TokenKind::added;
    }

    // Merges, in rank order.
    m.merges.reserve(reader.merges.size());
    std::string left, right;
    for (size_t i = 0; i < reader.merges.size(); ++i) {
      auto side = [&](const std::string& text, std::string* bytes) {
        const int32_t id = byte_level_decode(text, bytes) ? index.find(*bytes) : -1;
        if (id < 0) fail("tokenizer ", path, ": model.merges[", i, "]: token '", text, "' is not in the vocabulary");
        return id;
      };
      m.merges.push_back({side(reader.merges[i].first, &left), side(reader.merges[i].second, &right),
                          static_cast<int32_t>(i)});
    }
    reader.merges = {};

    // BOS: the leading special token of a TemplateProcessing post-processor (Llama 3: <|begin_of_text|>).
    std::function<void(const json&)> find_bos = [&](const json& p) {
      if (!p.is_object()) return;
      if (p.value("type", "") == "Sequence" && p.contains("processors"))
        for (const json& q : p["processors"]) find_bos(q);
      if (p.value("type", "") == "TemplateProcessing" && p.contains("single") && p["single"].is_array() &&
          !p["single"].empty() && p["single"][0].contains("SpecialToken")) {
        const std::string name = p["single"][0]["SpecialToken"].value("id", "");
        for (size_t id = 0; id < m.tokens.size(); ++id)
          if (m.kinds[id] == TokenKind::special && m.tokens[id] == name) m.bos = static_cast<int32_t>(id);
      }
    };
    find_bos(j.value("post_processor", json()));
    return make_byte_bpe(std::move(m));
  } catch (const json::exception& e) {
    fail("tokenizer ", path, ": unexpected tokenizer.json structure: ", e.what());
  }
}

}  // namespace tuna
