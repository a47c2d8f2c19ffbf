// Hugging Face tokenizer.json -> ByteBpeModel (data/byte_bpe.h): every BPE pipeline the library composes from
//   normalizer     none, Sequence (empty too), NFC, NFD, NFKC, NFKD, Lowercase, Replace, Prepend, Strip,
//                  StripAccents, ByteLevel
//   pre_tokenizer  none, Sequence, Split (Regex or String; every behavior; invert), ByteLevel (with or without its
//                  regex, add_prefix_space, anywhere in a Sequence), Digits, Metaspace (every prepend_scheme),
//                  Whitespace, WhitespaceSplit, Punctuation
//   model          BPE: vocab, merges ("a b" strings or [a, b] pairs), byte_fallback, ignore_merges,
//                  continuing_subword_prefix, end_of_word_suffix, unk_token, fuse_unk
//   added_tokens   special or not, normalized, lstrip, rstrip, single_word; ids as the library gives them (an added
//                  token that repeats a vocabulary entry takes that entry's id)
//   post_processor TemplateProcessing (its leading special token is the format's BOS), Bert/RobertaProcessing,
//                  ByteLevel, Sequence
//   decoder        ByteLevel, Metaspace, ByteFallback, Fuse, Strip, Replace, BPEDecoder, Sequence
// What the library reads and tuna does not (a WordPiece, Unigram or WordLevel model, BPE dropout, the Precompiled
// and Bert normalizers, ...) is refused by name. Every structure error names where in the file it is
// ("pre_tokenizer.pretokenizers[1].pattern").
#include <fstream>
#include <functional>
#include <climits>
#include <map>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "core/error.h"
#include "core/json.h"  // read_json_file
#include "data/byte_bpe.h"
#include "data/clean.h"  // is_valid_utf8
#include "data/tokenizer.h"

namespace tuna {

namespace {

using nlohmann::json;

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
    if (parent.is_object()) {
      // JSON would silently keep one of the two values (core/json.h refuses the same)
      if (parent.contains(key_)) fail("tokenizer ", path_, ": key '", key_, "' appears twice in one object");
      return &(parent[key_] = std::move(v));
    }
    parent.push_back(std::move(v));
    return &parent.back();
  }

  std::string path_;
  std::vector<Frame> frames_;
  std::string key_;
  std::vector<std::string> pair_;
};

const json kNull;
const json kEmptyList = json::array();

// A JSON value and where it is in the file: every accessor checks the type and fails naming the place.
class Field {
 public:
  Field(const json& j, std::string where, const std::string& path) : j_(j), where_(std::move(where)), path_(path) {}
  const json& value() const { return j_; }
  const std::string& where() const { return where_; }
  [[noreturn]] void bad(const std::string& expected) const {
    std::string found = j_.dump();
    if (found.size() > 80) found = found.substr(0, 77) + "...";
    fail("tokenizer ", path_, ": ", where_, ": expected ", expected, ", found ", found);
  }
  [[noreturn]] void unsupported(const std::string& what, const std::string& why) const {
    fail("tokenizer ", path_, ": ", where_, ": ", what, " is not supported", why.empty() ? "" : " (", why,
         why.empty() ? "" : ")");
  }
  bool null() const { return j_.is_null(); }
  bool has(const char* key) const { return j_.is_object() && j_.contains(key) && !j_[key].is_null(); }
  Field at(const char* key) const {
    if (!j_.is_object()) bad("an object");
    auto it = j_.find(key);
    if (it == j_.end()) fail("tokenizer ", path_, ": ", where_, ": no '", key, "'");
    return Field(*it, child(key), path_);
  }
  Field at(size_t i) const { return Field(j_[i], str(where_, "[", i, "]"), path_); }
  size_t size() const {
    if (!j_.is_array()) bad("a list");
    return j_.size();
  }
  std::string string() const {
    if (!j_.is_string()) bad("a string");
    return j_.get<std::string>();
  }
  bool boolean() const {
    if (!j_.is_boolean()) bad("true or false");
    return j_.get<bool>();
  }
  int64_t integer() const {
    if (!j_.is_number_integer()) bad("an integer");
    return j_.get<int64_t>();
  }
  std::string string_or(const char* key, const std::string& fallback) const {
    return has(key) ? at(key).string() : fallback;
  }
  bool bool_or(const char* key, bool fallback) const { return has(key) ? at(key).boolean() : fallback; }
  std::string type() const {
    if (!j_.is_object()) bad("an object with a \"type\"");
    return at("type").string();
  }

 private:
  std::string child(const char* key) const { return where_.empty() ? std::string(key) : str(where_, ".", key); }
  const json& j_;
  std::string where_;
  std::string path_;
};

TextPattern read_pattern(const Field& f) {
  const Field p = f.at("pattern");
  if (p.has("Regex")) return {true, p.at("Regex").string()};
  if (p.has("String")) return {false, p.at("String").string()};
  p.bad("{\"Regex\": ...} or {\"String\": ...}");
}

SplitBehavior read_behavior(const Field& f) {
  const std::string b = f.string();
  if (b == "Removed") return SplitBehavior::removed;
  if (b == "Isolated") return SplitBehavior::isolated;
  if (b == "MergedWithPrevious") return SplitBehavior::merged_with_previous;
  if (b == "MergedWithNext") return SplitBehavior::merged_with_next;
  if (b == "Contiguous") return SplitBehavior::contiguous;
  f.bad("Removed, Isolated, MergedWithPrevious, MergedWithNext or Contiguous");
}

PreTokenizerStep::Prepend read_prepend_scheme(const Field& f) {
  // Files written before prepend_scheme existed say add_prefix_space; false means "never".
  if (f.has("add_prefix_space") && !f.at("add_prefix_space").boolean()) return PreTokenizerStep::Prepend::never;
  if (!f.has("prepend_scheme")) return PreTokenizerStep::Prepend::always;
  const Field s = f.at("prepend_scheme");
  const std::string v = s.string();
  if (v == "always") return PreTokenizerStep::Prepend::always;
  if (v == "first") return PreTokenizerStep::Prepend::first;
  if (v == "never") return PreTokenizerStep::Prepend::never;
  s.bad("always, first or never");
}

std::string read_char(const Field& f) {
  const std::string c = f.string();
  const uint8_t lead = c.empty() ? 0 : static_cast<uint8_t>(c[0]);
  const size_t len = lead < 0x80 ? 1 : lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : 2;
  if (c.empty() || c.size() != len || !is_valid_utf8(c)) f.bad("one character");
  return c;
}

void read_normalizer(const Field& f, std::vector<NormalizerStep>* out) {
  if (f.null()) return;
  const std::string type = f.type();
  using K = NormalizerStep::Kind;
  if (type == "Sequence") {
    const Field list = f.at("normalizers");
    for (size_t i = 0; i < list.size(); ++i) read_normalizer(list.at(i), out);
    return;
  }
  static const std::map<std::string, K> plain = {{"NFC", K::nfc}, {"NFD", K::nfd}, {"NFKC", K::nfkc}, {"NFKD", K::nfkd},
                                                  {"Lowercase", K::lowercase}, {"StripAccents", K::strip_accents},
                                                  {"ByteLevel", K::byte_level}};
  if (auto it = plain.find(type); it != plain.end()) {
    out->push_back(NormalizerStep(it->second));
    return;
  }
  NormalizerStep n{K::replace};
  if (type == "Replace") {
    n.pattern = read_pattern(f);
    n.content = f.at("content").string();
  } else if (type == "Prepend") {
    n.kind = K::prepend;
    n.content = f.at("prepend").string();
  } else if (type == "Strip") {
    n.kind = K::strip;
    n.left = f.bool_or("strip_left", false);
    n.right = f.bool_or("strip_right", false);
  } else {
    f.unsupported(str("normalizer '", type, "'"),
                  "tuna reads Sequence, NFC, NFD, NFKC, NFKD, Lowercase, Replace, Prepend, Strip, StripAccents and "
                  "ByteLevel; a sentencepiece model's Precompiled normalizer: use its tokenizer.model");
  }
  out->push_back(std::move(n));
}

void read_pre_tokenizer(const Field& f, std::vector<PreTokenizerStep>* out) {
  if (f.null()) return;
  const std::string type = f.type();
  using K = PreTokenizerStep::Kind;
  if (type == "Sequence") {
    const Field list = f.at("pretokenizers");
    for (size_t i = 0; i < list.size(); ++i) read_pre_tokenizer(list.at(i), out);
    return;
  }
  PreTokenizerStep p{K::split};
  if (type == "Split") {
    p.pattern = read_pattern(f);
    p.behavior = read_behavior(f.at("behavior"));
    p.invert = f.bool_or("invert", false);
  } else if (type == "ByteLevel") {
    p.kind = K::byte_level;
    p.add_prefix_space = f.bool_or("add_prefix_space", true);
    p.use_regex = f.bool_or("use_regex", true);
  } else if (type == "Digits") {
    p.kind = K::digits;
    p.individual_digits = f.bool_or("individual_digits", false);
  } else if (type == "Metaspace") {
    p.kind = K::metaspace;
    p.replacement = read_char(f.at("replacement"));
    p.prepend = read_prepend_scheme(f);
    p.split = f.bool_or("split", true);
  } else if (type == "Whitespace") {
    p.kind = K::whitespace;
  } else if (type == "WhitespaceSplit") {
    p.kind = K::whitespace_split;
  } else if (type == "Punctuation") {
    p.kind = K::punctuation;
    p.behavior = f.has("behavior") ? read_behavior(f.at("behavior")) : SplitBehavior::isolated;
  } else {
    f.unsupported(str("pre_tokenizer '", type, "'"),
                  "tuna reads Sequence, Split, ByteLevel, Digits, Metaspace, Whitespace, WhitespaceSplit and Punctuation");
  }
  out->push_back(std::move(p));
}

void read_decoder(const Field& f, std::vector<DecoderStep>* out) {
  if (f.null()) return;
  const std::string type = f.type();
  using K = DecoderStep::Kind;
  if (type == "Sequence") {
    const Field list = f.at("decoders");
    for (size_t i = 0; i < list.size(); ++i) read_decoder(list.at(i), out);
    return;
  }
  DecoderStep d{K::byte_level};
  if (type == "ByteLevel") {
  } else if (type == "Metaspace") {
    d.kind = K::metaspace;
    d.content = read_char(f.at("replacement"));
    d.prepend = read_prepend_scheme(f) != PreTokenizerStep::Prepend::never;
  } else if (type == "ByteFallback") {
    d.kind = K::byte_fallback;
  } else if (type == "Fuse") {
    d.kind = K::fuse;
  } else if (type == "Strip") {
    d.kind = K::strip;
    d.content = read_char(f.at("content"));
    const int64_t start = f.at("start").integer(), stop = f.at("stop").integer();
    if (start < 0 || stop < 0) f.at(start < 0 ? "start" : "stop").bad("a count of characters, 0 or more");
    d.start = static_cast<size_t>(start), d.stop = static_cast<size_t>(stop);
  } else if (type == "Replace") {
    d.kind = K::replace;
    d.pattern = read_pattern(f);
    d.content = f.at("content").string();
  } else if (type == "BPEDecoder") {
    d.kind = K::bpe_suffix;
    d.content = f.string_or("suffix", "</w>");
  } else {
    f.unsupported(str("decoder '", type, "'"),
                  "tuna reads ByteLevel, Metaspace, ByteFallback, Fuse, Strip, Replace, BPEDecoder and Sequence");
  }
  out->push_back(std::move(d));
}

// The special tokens the post-processor puts around a single text (Hugging Face's add_special_tokens): before
// (the first of them is the BOS) and after.
void read_post_processor(const Field& f, const std::function<int32_t(const std::string&)>& special_id,
                         std::vector<int32_t>* before, std::vector<int32_t>* after) {
  if (f.null()) return;
  const std::string type = f.type();
  if (type == "Sequence") {
    const Field list = f.at("processors");
    for (size_t i = 0; i < list.size(); ++i) read_post_processor(list.at(i), special_id, before, after);
    return;
  }
  if (type == "TemplateProcessing") {
    const Field single = f.at("single");
    std::map<std::string, std::vector<int32_t>> ids;  // special_tokens: name -> ids
    if (f.has("special_tokens")) {
      const Field specials = f.at("special_tokens");
      if (!specials.value().is_object()) specials.bad("an object of name -> {id, ids, tokens}");
      for (const auto& [name, value] : specials.value().items()) {
        std::vector<int32_t>& list = ids[name];
        const Field id_list = specials.at(name.c_str()).at("ids");
        for (size_t i = 0; i < id_list.size(); ++i) {
          const int64_t id = id_list.at(i).integer();
          if (id < 0 || id >= (int64_t{1} << 30)) id_list.at(i).bad("a token id in [0, 2^30)");
          list.push_back(static_cast<int32_t>(id));
        }
      }
    }
    bool seen_text = false;
    for (size_t i = 0; i < single.size(); ++i) {
      const Field item = single.at(i);
      if (item.has("Sequence")) {
        seen_text = true;
        continue;
      }
      if (!item.has("SpecialToken")) item.bad("{\"SpecialToken\": ...} or {\"Sequence\": ...}");
      const Field name_field = item.at("SpecialToken").at("id");
      const std::string name = name_field.string();
      std::vector<int32_t> list;
      if (auto it = ids.find(name); it != ids.end()) {
        list = it->second;
      } else {
        const int32_t id = special_id(name);
        if (id < 0) name_field.bad("a token of the tokenizer (a name in special_tokens or added_tokens)");
        list = {id};
      }
      (seen_text ? after : before)->insert((seen_text ? after : before)->end(), list.begin(), list.end());
    }
    return;
  }
  if (type == "BertProcessing" || type == "RobertaProcessing") {
    for (const char* key : {"cls", "sep"}) {
      const Field pair = f.at(key);
      if (pair.size() != 2) pair.bad("[token, id]");
      const int64_t id = pair.at(1).integer();
      if (id < 0 || id >= (int64_t{1} << 30)) pair.at(1).bad("a token id in [0, 2^30)");
      (std::string(key) == "cls" ? before : after)->push_back(static_cast<int32_t>(id));
    }
    return;
  }
  if (type == "ByteLevel") return;  // offsets only
  f.unsupported(str("post_processor '", type, "'"),
                "tuna reads TemplateProcessing, BertProcessing, RobertaProcessing, ByteLevel and Sequence");
}

// Added tokens, with the ids the library gives them: the id of the same content added before, else of the same
// string in the vocabulary, else the next free id (file order). A file the library wrote has those ids. Returns the
// id space they need, which may pass the vocabulary's: the caller grows m.vocab to it only once `index`, whose views
// point into m.vocab's strings, is no longer read.
int64_t read_added_tokens(const Field& added, const TokenIndex& index, int64_t model_vocab_size, ByteBpeModel* model) {
  ByteBpeModel& m = *model;
  const size_t added_count = added.size();
  int64_t id_space = static_cast<int64_t>(m.vocab.size());
  std::unordered_map<std::string, size_t> by_content;
  int64_t max_added = -1;
  for (size_t i = 0; i < added_count; ++i) {
    const Field a = added.at(i);
    AddedToken t;
    t.content = a.at("content").string();
    t.special = a.bool_or("special", false);
    t.normalized = a.bool_or("normalized", !t.special);
    t.lstrip = a.bool_or("lstrip", false);
    t.rstrip = a.bool_or("rstrip", false);
    t.single_word = a.bool_or("single_word", false);
    if (t.content.empty()) continue;  // the library ignores an empty added token
    if (auto it = by_content.find(t.content); it != by_content.end()) {
      t.id = m.added[it->second].id;
      m.added[it->second] = t;
      continue;
    }
    const int32_t in_vocab = index.find(t.content);
    if (in_vocab >= 0) {
      t.id = in_vocab;
    } else {
      const int64_t next = max_added < 0 ? model_vocab_size
                           : (max_added >= model_vocab_size || model_vocab_size == 0) ? max_added + 1
                                                                                     : model_vocab_size;
      t.id = static_cast<int32_t>(next);
    }
    if (t.id >= id_space) {  // the file's ids had a hole the library filled
      if (t.id >= (int64_t{1} << 30)) a.at("id").bad("an id the library can give");
      id_space = t.id + 1;
    }
    max_added = std::max<int64_t>(max_added, t.id);
    by_content[t.content] = m.added.size();
    m.added.push_back(std::move(t));
  }
  std::vector<bool> taken(id_space);
  for (const AddedToken& t : m.added) {
    if (taken[t.id]) fail("tokenizer ", m.path, ": added_tokens: two tokens get id ", t.id);
    taken[t.id] = true;
  }
  return id_space;
}

// Merges, in rank order: "a b" -> the token a + b (b without the continuing_subword_prefix).
void read_merges(const std::string& path, const std::vector<std::pair<std::string, std::string>>& merges,
                 const TokenIndex& index, ByteBpeModel* model) {
  ByteBpeModel& m = *model;
  const size_t prefix = m.continuing_subword_prefix.size();
  m.merges.reserve(merges.size());
  std::string joined;
  for (size_t i = 0; i < merges.size(); ++i) {
    const auto& [left, right] = merges[i];
    const int32_t l = index.find(left), r = index.find(right);
    if (l < 0 || r < 0)
      fail("tokenizer ", path, ": model.merges[", i, "]: token '", l < 0 ? left : right, "' is not in model.vocab");
    if (right.size() < prefix)
      fail("tokenizer ", path, ": model.merges[", i, "]: token '", right, "' is shorter than the continuing_subword_prefix");
    joined.assign(left).append(right, prefix);
    const int32_t merged = index.find(joined);
    if (merged < 0)
      fail("tokenizer ", path, ": model.merges[", i, "]: the merge of '", left, "' and '", right, "' makes '", joined,
           "', which is not in model.vocab");
    m.merges.push_back({l, r, static_cast<int32_t>(i), merged});
  }
}

}  // namespace

// transformers' LlamaTokenizerFast, the class the tokenizer_config.json of LLaMA-family models names, replaces the
// file's post-processor when it loads (its update_post_processor): BOS before a text unless add_bos_token is false,
// EOS after it when add_eos_token is true. That is what AutoTokenizer's encode gives, and what llama.cpp's converter
// hashes to name the pre-tokenizer (DeepSeek Coder's tokenizer.json has no BOS template; its config adds one).
static void llama_tokenizer_frame(const std::string& path, const std::function<int32_t(const std::string&)>& special_id,
                           std::vector<int32_t>* before, std::vector<int32_t>* after) {
  const std::string config = model_config_file(path, "tokenizer_config.json");
  if (config.empty()) return;
  const nlohmann::json c = read_json_file(config, config);
  if (!c.is_object() || !c.contains("tokenizer_class") || !c["tokenizer_class"].is_string()) return;
  const std::string cls = c["tokenizer_class"].get<std::string>();
  if (cls != "LlamaTokenizer" && cls != "LlamaTokenizerFast" && cls != "CodeLlamaTokenizer" && cls != "CodeLlamaTokenizerFast")
    return;
  auto flag = [&](const char* key, bool fallback) {
    if (!c.contains(key) || c[key].is_null()) return fallback;
    if (!c[key].is_boolean()) fail(config, ": field '", key, "': expected true or false, found ", c[key].dump());
    return c[key].get<bool>();
  };
  auto token = [&](const char* key, const char* flag_name) {
    const nlohmann::json v = c.contains(key) ? c[key] : nlohmann::json();
    std::string name;
    if (v.is_string()) name = v.get<std::string>();
    else if (v.is_object() && v.contains("content") && v["content"].is_string()) name = v["content"].get<std::string>();
    else fail(config, ": field '", flag_name, "' is true but '", key, "' names no token (found ", v.dump(), ")");
    const int32_t id = special_id(name);
    if (id < 0) fail(config, ": field '", key, "': '", name, "' is not a token of ", path);
    return id;
  };
  before->clear();
  after->clear();
  if (flag("add_bos_token", true)) before->push_back(token("bos_token", "add_bos_token"));
  if (flag("add_eos_token", false)) after->push_back(token("eos_token", "add_eos_token"));
}

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
    const Field root(j, "", path);
    const Field model = root.at("model");
    const std::string type = model.has("type") ? model.at("type").string() : reader.has_merges ? "BPE" : "";
    if (type != "BPE")
      fail("tokenizer ", path, ": model.type: a ", type.empty() ? std::string("untyped") : type,
           " model is not supported; tuna reads BPE tokenizer.json files (byte-level ones as Llama 3's and GPT-2's, "
           "sentencepiece-style ones with byte_fallback), and sentencepiece models as tokenizer.model");
    if (model.has("dropout")) {
      const Field dropout = model.at("dropout");
      if (!dropout.value().is_number()) dropout.bad("a number or null");
      if (dropout.value().get<double>() != 0)
        fail("tokenizer ", path, ": model.dropout: BPE dropout (", dropout.value().dump(),
             ") is not supported: tuna encodes deterministically; set it to null for training data");
    }
    if (!reader.has_vocab) fail("tokenizer ", path, ": model has no 'vocab' object");
    if (!reader.has_merges) fail("tokenizer ", path, ": model has no 'merges' list");

    ByteBpeModel m;
    m.path = path;
    m.format = TokenizerFormat::hf_bpe;
    m.ignore_merges = model.bool_or("ignore_merges", false);
    m.byte_fallback = model.bool_or("byte_fallback", false);
    m.fuse_unk = model.bool_or("fuse_unk", false);
    m.continuing_subword_prefix = model.string_or("continuing_subword_prefix", "");
    m.end_of_word_suffix = model.string_or("end_of_word_suffix", "");
    read_normalizer(root.has("normalizer") ? root.at("normalizer") : Field(kNull, "normalizer", path), &m.normalizers);
    read_pre_tokenizer(root.has("pre_tokenizer") ? root.at("pre_tokenizer") : Field(kNull, "pre_tokenizer", path),
                       &m.pre_tokenizers);
    m.has_decoder = root.has("decoder");
    if (m.has_decoder) read_decoder(root.at("decoder"), &m.decoders);

    // Vocabulary. The id space is bounded by the tokens the file defines (checked before it is allocated: one id
    // of 2^30 - 1 would otherwise cost 32 GB).
    int64_t size = 0;
    for (const auto& [text, id] : reader.vocab) {
      if (id < 0 || id >= (int64_t{1} << 30))
        fail("tokenizer ", path, ": model.vocab['", text, "']: expected an id in [0, 2^30), found ", id);
      size = std::max(size, id + 1);
    }
    const Field added = root.has("added_tokens") ? root.at("added_tokens") : Field(kEmptyList, "added_tokens", path);
    const size_t added_count = added.size();
    for (size_t i = 0; i < added_count; ++i) {
      const Field id = added.at(i).at("id");
      if (id.integer() < 0 || id.integer() >= (int64_t{1} << 30)) id.bad("an integer in [0, 2^30)");
      size = std::max<int64_t>(size, id.integer() + 1);
    }
    check_token_id_space(size, static_cast<int64_t>(reader.vocab.size() + added_count), path,
                         "model.vocab and added_tokens");
    m.vocab.assign(size, std::string());
    m.in_vocab.assign(size, false);
    for (auto& [text, id] : reader.vocab) {
      if (m.in_vocab[id]) fail("tokenizer ", path, ": model.vocab gives id ", id, " to two tokens");
      m.vocab[id] = std::move(text);
      m.in_vocab[id] = true;
    }
    const int64_t model_vocab_size = static_cast<int64_t>(reader.vocab.size());
    reader.vocab = {};
    TokenIndex index;  // the model's strings -> id (views of m.vocab, which no longer changes)
    index.reserve(m.vocab.size());
    for (size_t id = 0; id < m.vocab.size(); ++id)
      if (m.in_vocab[id] && !index.insert(m.vocab[id], static_cast<int32_t>(id)))
        fail("tokenizer ", path, ": model.vocab gives '", m.vocab[id], "' two ids");
    if (model.has("unk_token")) {
      const Field unk = model.at("unk_token");
      m.unk = index.find(unk.string());
      if (m.unk < 0) unk.bad("a token of model.vocab");
    }

    const int64_t id_space = read_added_tokens(added, index, model_vocab_size, &m);
    read_merges(path, reader.merges, index, &m);
    reader.merges = {};

    // The special tokens put around a text: the first one before it is the BOS (Llama 3: <|begin_of_text|>).
    auto special_id = [&](const std::string& name) {
      for (const AddedToken& t : m.added)
        if (t.content == name) return t.id;
      return index.find(name);
    };
    std::vector<int32_t> before, after;
    read_post_processor(root.has("post_processor") ? root.at("post_processor") : Field(kNull, "post_processor", path),
                        special_id, &before, &after);
    llama_tokenizer_frame(path, special_id, &before, &after);
    if (!before.empty()) m.bos = before[0];
    m.frame_before = std::move(before);
    m.frame_after = std::move(after);
    m.vocab.resize(id_space);  // index is done with: its views into m.vocab may go
    m.in_vocab.resize(id_space, false);
    return make_byte_bpe(std::move(m));
  } catch (const json::exception& e) {
    fail("tokenizer ", path, ": unexpected tokenizer.json structure: ", e.what());
  }
}

}  // namespace tuna
