// gguf_vocabulary (data/tokenizer.h): the tokenizer as llama.cpp's GGUF metadata holds it.
#include <algorithm>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json.h"
#include "data/byte_bpe.h"  // byte_level_encode, kLlama3Pattern
#include "data/tokenizer.h"
#include "data/tokenizer_impl.h"

namespace tuna {

namespace {

// llama.cpp's token types.
enum : int32_t { kNormal = 1, kControl = 3, kUserDefined = 4, kUnused = 5 };

}  // namespace

GgufVocabulary gguf_vocabulary(const Tokenizer& tokenizer, int64_t model_vocab_size) {
  const TokenizerImpl& impl = tokenizer.impl();
  const std::string& path = tokenizer.path();
  const int32_t n = tokenizer.vocab_size();
  if (n > model_vocab_size)
    fail("tokenizer ", path, " has ", n, " ids, more than the model's vocab_size (", model_vocab_size,
         "): llama.cpp needs an embedding row for every token");
  GgufVocabulary v;
  v.tokens.reserve(model_vocab_size);
  v.types.reserve(model_vocab_size);
  if (tokenizer.format() == TokenizerFormat::sentencepiece) {
    const std::string difference = impl.llama_spm_difference(&v.add_space_prefix);
    if (!difference.empty())
      fail("tokenizer ", path, ": llama.cpp cannot reproduce this sentencepiece model: ", difference);
    v.model = "llama";
    const std::vector<int> types = impl.piece_types();
    for (int32_t id = 0; id < n; ++id) {
      v.tokens.push_back(impl.token_text(id));
      v.scores.push_back(impl.score(id));
      v.types.push_back(types[id]);
    }
  } else {
    const std::vector<std::string> patterns = impl.pretokenizer_patterns();
    if (patterns != std::vector<std::string>{kLlama3Pattern} || impl.adds_prefix_space())
      fail("tokenizer ", path, ": llama.cpp cannot reproduce this byte-level BPE: its pre-tokenizer is not Llama 3's "
           "(tuna writes GGUF for Llama 3's, llama.cpp's 'llama-bpe')");
    v.model = "gpt2";
    v.pre = "llama-bpe";
    for (int32_t id = 0; id < n; ++id) {
      switch (impl.kind(id)) {
        case TokenKind::normal:
          v.tokens.push_back(byte_level_encode(impl.token_text(id)));
          v.types.push_back(kNormal);
          break;
        case TokenKind::special:
          v.tokens.push_back(impl.token_text(id));
          v.types.push_back(kControl);
          break;
        case TokenKind::added:
          v.tokens.push_back(impl.token_text(id));
          v.types.push_back(kUserDefined);
          break;
        default:
          v.tokens.push_back("[PAD" + std::to_string(id) + "]");
          v.types.push_back(kUnused);
          break;
      }
    }
    const auto merges = impl.merge_list();
    v.merges.reserve(merges.size());
    for (const auto& [left, right] : merges)
      v.merges.push_back(byte_level_encode(impl.token_text(left)) + " " + byte_level_encode(impl.token_text(right)));
  }
  for (int64_t id = n; id < model_vocab_size; ++id) {
    v.tokens.push_back("[PAD" + std::to_string(id) + "]");
    v.types.push_back(kUnused);
    if (!v.scores.empty()) v.scores.push_back(0.0f);
  }
  v.bos = tokenizer.bos_id();
  v.eos = tokenizer.eos_id();
  v.unk = tokenizer.unk_id();
  v.pad = tokenizer.pad_id();
  v.add_bos = v.bos >= 0;
  const std::string config_file = model_config_file(path, "tokenizer_config.json");
  if (!config_file.empty()) {
    const nlohmann::json c = read_json_file(config_file, config_file);
    if (c.is_object()) {
      // Hugging Face pads with pad_token where the tokenizer itself names none (Llama 3's <|finetune_right_pad_id|>).
      if (v.pad < 0 && c.contains("pad_token")) {
        const nlohmann::json& p = c["pad_token"];
        const std::string name = p.is_string() ? p.get<std::string>()
                                 : p.is_object() && p.contains("content") && p["content"].is_string()
                                     ? p["content"].get<std::string>()
                                     : std::string();
        if (!name.empty()) {
          v.pad = impl.token_id(name);
          if (v.pad < 0) fail(config_file, ": field 'pad_token': '", name, "' is not a token of ", path);
        }
      }
      if (c.contains("add_bos_token") && c["add_bos_token"].is_boolean()) v.add_bos = c["add_bos_token"].get<bool>();
      if (c.contains("add_eos_token") && c["add_eos_token"].is_boolean()) v.add_eos = c["add_eos_token"].get<bool>();
      if (c.contains("chat_template")) {
        const nlohmann::json& t = c["chat_template"];
        if (t.is_string()) {
          v.chat_template = t.get<std::string>();
        } else if (t.is_array()) {  // named templates: llama.cpp's key holds the default one
          for (const nlohmann::json& named : t)
            if (named.is_object() && named.value("name", "") == "default" && named.contains("template") &&
                named["template"].is_string())
              v.chat_template = named["template"].get<std::string>();
        } else if (!t.is_null()) {
          fail(config_file, ": field 'chat_template': expected a string or a list of named templates, found ", t.dump());
        }
      }
    }
  }
  return v;
}

}  // namespace tuna
