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

// The id of a pair's side: "Ġthe" -> its bytes -> id.
int32_t merge_side(const std::string& text, const std::unordered_map<std::string, int32_t>& vocab, size_t index,
                   const std::string& path) {
  const auto it = vocab.find(text);
  if (it == vocab.end())
    fail("tokenizer ", path, ": model.merges[", index, "]: token '", text, "' is not in the vocabulary");
  return it->second;
}

}  // namespace

std::unique_ptr<TokenizerImpl> load_tokenizer_json(const std::string& path) {
  json j;
  try {
    std::ifstream in(path, std::ios::binary);
    if (!in) fail("tokenizer ", path, ": cannot open");
    j = json::parse(in);
  } catch (const json::exception& e) {
    fail("tokenizer ", path, ": not valid JSON: ", e.what());
  }
  try {
    if (!j.is_object() || !j.contains("model") || !j["model"].is_object())
      fail("tokenizer ", path, ": JSON, but not a Hugging Face tokenizer.json (no 'model' object)");
    const json& model = j["model"];
    const std::string type = model.value("type", model.contains("merges") ? "BPE" : "");
    if (type != "BPE")
      fail("tokenizer ", path, ": a ", type.empty() ? std::string("untyped") : type,
           " model; tuna reads byte-level BPE tokenizers only (Llama 3's tokenizer.json)");
    if (j.contains("normalizer") && !j["normalizer"].is_null())
      fail("tokenizer ", path, ": normalizer '", j["normalizer"].value("type", "?"),
           "' is not supported (tuna reads byte-level BPE without a normalizer, as Llama 3's; for a sentencepiece "
           "model, use its tokenizer.model)");
    if (!model.value("dropout", json()).is_null() && model["dropout"].get<double>() != 0)
      fail("tokenizer ", path, ": BPE dropout is not supported");
    for (const char* unsupported : {"continuing_subword_prefix", "end_of_word_suffix"})
      if (model.contains(unsupported) && !model[unsupported].is_null() && model[unsupported] != "")
        fail("tokenizer ", path, ": model.", unsupported, " is not supported (not a byte-level BPE)");
    if (model.value("byte_fallback", false))
      fail("tokenizer ", path, ": a sentencepiece-style BPE (byte_fallback); use the model's tokenizer.model");

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
    const json& vocab = field(model, "vocab", path, "model");
    if (!vocab.is_object()) fail("tokenizer ", path, ": model.vocab is not an object");
    std::unordered_map<std::string, int32_t> by_string;
    by_string.reserve(vocab.size());
    int64_t size = 0;
    for (const auto& [text, id_json] : vocab.items()) {
      if (!id_json.is_number_integer() || id_json.get<int64_t>() < 0 || id_json.get<int64_t>() >= (int64_t{1} << 30))
        fail("tokenizer ", path, ": model.vocab['", text, "']: expected an id in [0, 2^30), found ", id_json.dump());
      const int64_t id = id_json.get<int64_t>();
      size = std::max(size, id + 1);
      by_string.emplace(text, static_cast<int32_t>(id));
    }
    const json& added = j.value("added_tokens", json::array());
    for (const json& a : added) size = std::max<int64_t>(size, field(a, "id", path, "added token").get<int64_t>() + 1);
    m.tokens.assign(size, std::string());
    m.kinds.assign(size, TokenKind::unused);
    std::string bytes;
    for (const auto& [text, id] : by_string) {
      if (!byte_level_decode(text, &bytes))
        fail("tokenizer ", path, ": model.vocab['", text, "'] (id ", id,
             ") holds a character outside the byte-level alphabet: not a byte-level BPE");
      if (m.kinds[id] != TokenKind::unused) fail("tokenizer ", path, ": model.vocab gives id ", id, " to two tokens");
      m.tokens[id] = bytes;
      m.kinds[id] = TokenKind::normal;
    }
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
    const json& merges = field(model, "merges", path, "model");
    m.merges.reserve(merges.size());
    for (size_t i = 0; i < merges.size(); ++i) {
      const json& merge = merges[i];
      std::string left, right;
      if (merge.is_string()) {
        const std::string s = merge.get<std::string>();
        const size_t space = s.find(' ');
        if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos)
          fail("tokenizer ", path, ": model.merges[", i, "]: expected two tokens separated by one space, found '", s, "'");
        left = s.substr(0, space), right = s.substr(space + 1);
      } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string()) {
        left = merge[0].get<std::string>(), right = merge[1].get<std::string>();
      } else {
        fail("tokenizer ", path, ": model.merges[", i, "]: expected \"a b\" or [\"a\", \"b\"], found ", merge.dump());
      }
      m.merges.push_back({merge_side(left, by_string, i, path), merge_side(right, by_string, i, path),
                          static_cast<int32_t>(i)});
    }

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
