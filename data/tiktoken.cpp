// tiktoken BPE ranks -> ByteBpeModel (data/byte_bpe.h). The file (Llama 3's original/tokenizer.model) holds one
// "base64(token bytes) rank" line per token, ranks 0..n-1; a pair of tokens merges into their concatenation
// at that token's rank. The file carries neither the pre-tokenizer nor the special tokens: tiktoken users
// supply them in code. tuna supplies Llama 3's (Meta's reference tokenizer.py: the regex of kLlama3Pattern,
// 256 special tokens from rank 128000: <|begin_of_text|>, <|end_of_text|>, ..., <|eot_id|>, reserved ones),
// so it reads Llama 3's vocabulary only (recognized by its fingerprint) and refuses another by name. A
// tokenizer_config.json beside the file (or above original/) overrides the special tokens with the model's
// own added_tokens_decoder, as Hugging Face's copy of the same model has them.
#include <fstream>
#include <nlohmann/json.hpp>
#include <xxhash.h>

#include "core/error.h"
#include "core/json.h"
#include "data/byte_bpe.h"
#include "data/tokenizer.h"

namespace tuna {

namespace {

// XXH3-64 of Llama 3's 128,000 token byte strings in rank order, each preceded by its length (u32).
constexpr uint64_t kLlama3RanksHash = 0xe0c22a522bea2e79ull;
constexpr size_t kLlama3Ranks = 128000;

int base64_value(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

bool base64_decode(std::string_view in, std::string* out) {
  out->clear();
  if (in.empty() || in.size() % 4 != 0) return false;
  for (size_t i = 0; i < in.size(); i += 4) {
    int v[4];
    int pad = 0;
    for (int k = 0; k < 4; ++k) {
      if (in[i + k] == '=') {
        if (i + 4 != in.size() || k < 2) return false;
        v[k] = 0, ++pad;
      } else {
        if (pad) return false;
        v[k] = base64_value(in[i + k]);
        if (v[k] < 0) return false;
      }
    }
    const uint32_t triple = (v[0] << 18) | (v[1] << 12) | (v[2] << 6) | v[3];
    out->push_back(static_cast<char>(triple >> 16));
    if (pad < 2) out->push_back(static_cast<char>((triple >> 8) & 0xFF));
    if (pad < 1) out->push_back(static_cast<char>(triple & 0xFF));
  }
  return true;
}

// Meta's Llama 3 special tokens (llama/tokenizer.py of Llama 3.1 and later; 3.0 named 128004, 128005, 128008
// and 128010 reserved tokens), from id 128000 on.
std::vector<std::string> llama3_special_tokens() {
  std::vector<std::string> names = {"<|begin_of_text|>",  "<|end_of_text|>",        "<|reserved_special_token_0|>",
                                    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
                                    "<|start_header_id|>", "<|end_header_id|>",     "<|eom_id|>",
                                    "<|eot_id|>",          "<|python_tag|>"};
  for (int i = 2; names.size() < 256; ++i) names.push_back(str("<|reserved_special_token_", i, "|>"));
  return names;
}

uint64_t tiktoken_ranks_hash(const std::vector<std::string>& tokens, size_t count) {
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  for (size_t i = 0; i < count; ++i) {
    const uint32_t n = static_cast<uint32_t>(tokens[i].size());
    XXH3_64bits_update(state, &n, sizeof n);
    XXH3_64bits_update(state, tokens[i].data(), tokens[i].size());
  }
  const uint64_t h = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return h;
}

}  // namespace

std::unique_ptr<TokenizerImpl> load_tiktoken(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("tokenizer ", path, ": cannot open");
  ByteBpeModel m;
  std::vector<std::string> tokens;  // id -> the rank's bytes, or a special token's name
  std::vector<TokenKind> kinds;
  m.path = path;
  m.format = TokenizerFormat::tiktoken;
  std::string line, bytes;
  for (size_t number = 1; std::getline(in, line); ++number) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    const size_t space = line.find(' ');
    int64_t rank = -1;
    if (space != std::string::npos && space + 1 < line.size() && line.size() - space - 1 <= 9 &&
        line.find_first_not_of("0123456789", space + 1) == std::string::npos)
      rank = std::stoll(line.substr(space + 1));
    if (rank < 0 || !base64_decode(std::string_view(line).substr(0, space), &bytes))
      fail("tokenizer ", path, ":", number, ": expected 'base64 rank', found '", line.substr(0, 80), "'");
    if (rank != static_cast<int64_t>(tokens.size()))
      fail("tokenizer ", path, ":", number, ": rank ", rank, " where ", tokens.size(), " was expected (ranks 0, 1, ... in order)");
    tokens.push_back(bytes);
  }
  if (tokens.empty()) fail("tokenizer ", path, ": no ranks");
  if (tokens.size() != kLlama3Ranks || tiktoken_ranks_hash(tokens, tokens.size()) != kLlama3RanksHash)
    fail("tokenizer ", path, ": a tiktoken file of ", tokens.size(),
         " ranks that is not Llama 3's vocabulary; a tiktoken file carries neither its pre-tokenizer nor its "
         "special tokens, and tuna knows Llama 3's only: use the model's tokenizer.json");
  kinds.assign(tokens.size(), TokenKind::normal);

  // Every split of a token into two tokens merges into it, at its rank.
  TokenIndex ids;
  ids.reserve(tokens.size());
  for (int32_t id = 0; id < static_cast<int32_t>(tokens.size()); ++id) ids.insert(tokens[id], id);
  for (int32_t id = 0; id < static_cast<int32_t>(tokens.size()); ++id) {
    const std::string_view t = tokens[id];
    for (size_t k = 1; k < t.size(); ++k) {
      const int32_t left = ids.find(t.substr(0, k));
      if (left < 0) continue;
      const int32_t right = ids.find(t.substr(k));
      if (right >= 0) m.merges.push_back({left, right, id, id});
    }
  }

  // Special tokens: the model's tokenizer_config.json, else Meta's list.
  const std::string config = model_config_file(path, "tokenizer_config.json");
  struct Special {
    int64_t id;
    std::string name;
    bool special;
  };
  std::vector<Special> specials;
  if (!config.empty()) {
    const nlohmann::json c = read_json_file(config, config);  // depth, size and repeated keys bounded
    auto decoder = c.is_object() ? c.find("added_tokens_decoder") : c.end();
    if (decoder == c.end() || !decoder->is_object())
      fail("tokenizer ", config, ": field 'added_tokens_decoder': expected an object of id -> token, the special "
           "tokens of ", path);
    for (const auto& [id, token] : decoder->items()) {
      const std::string where = str("tokenizer ", config, ": added_tokens_decoder['", id, "']");
      if (id.empty() || id.size() > 10 || id.find_first_not_of("0123456789") != std::string::npos)
        fail(where, ": expected a decimal id");
      const int64_t n = std::stoll(id);
      if (n < static_cast<int64_t>(tokens.size())) fail(where, ": the id overlaps the ranks of ", path);
      if (n >= (int64_t{1} << 30)) fail(where, ": expected an id below 2^30");
      if (!token.is_object() || !token.contains("content") || !token["content"].is_string() ||
          (token.contains("special") && !token["special"].is_boolean()))
        fail(where, ": expected {\"content\": string, \"special\": bool}, found ", token.dump());
      specials.push_back({n, token["content"].get<std::string>(), token.value("special", true)});
    }
    int64_t ids = static_cast<int64_t>(tokens.size());
    for (const Special& s : specials) ids = std::max(ids, s.id + 1);
    check_token_id_space(ids, static_cast<int64_t>(tokens.size() + specials.size()), config,
                         "the ranks and added_tokens_decoder");
  } else {
    const std::vector<std::string> names = llama3_special_tokens();
    for (size_t i = 0; i < names.size(); ++i) specials.push_back({static_cast<int64_t>(kLlama3Ranks + i), names[i], true});
  }
  for (const auto& [id, name, special] : specials) {
    if (id >= static_cast<int64_t>(tokens.size())) {
      tokens.resize(id + 1);
      kinds.resize(id + 1, TokenKind::unused);
    }
    tokens[id] = name;
    kinds[id] = special ? TokenKind::special : TokenKind::added;
  }
  // Llama 3's pipeline, as its tokenizer.json spells it: the Split regex, then ByteLevel without its own regex.
  PreTokenizerStep split{PreTokenizerStep::Kind::split};
  split.pattern = {true, kLlama3Pattern};
  PreTokenizerStep byte_level{PreTokenizerStep::Kind::byte_level};
  byte_level.use_regex = false;
  m.pre_tokenizers = {split, byte_level};
  m.decoders = {DecoderStep{DecoderStep::Kind::byte_level}};
  m.has_decoder = true;
  // The model's strings: ranks' bytes in the byte-level alphabet; special tokens are added tokens.
  m.vocab.resize(tokens.size());
  m.in_vocab.assign(tokens.size(), false);
  for (size_t id = 0; id < tokens.size(); ++id) {
    if (kinds[id] == TokenKind::normal) {
      m.vocab[id] = byte_level_encode(tokens[id]);
      m.in_vocab[id] = true;
    } else if (kinds[id] != TokenKind::unused) {
      m.added.push_back({tokens[id], static_cast<int32_t>(id), kinds[id] == TokenKind::special});
    }
  }
  for (size_t id = kLlama3Ranks; id < tokens.size(); ++id) {
    if (tokens[id] == "<|begin_of_text|>") m.bos = static_cast<int32_t>(id);
    if (tokens[id] == "<|end_of_text|>") m.eos = static_cast<int32_t>(id);
  }
  // Meta's tokenizer.json of the same model puts <|begin_of_text|> before a text (its TemplateProcessing): what
  // llama.cpp's converter hashes to name the pre-tokenizer ("llama-bpe"; without it, "smaug-bpe").
  if (m.bos >= 0) m.frame_before = {m.bos};
  return make_byte_bpe(std::move(m));
}

}  // namespace tuna
