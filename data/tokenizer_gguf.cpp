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

// SHA-256 (FIPS 180-4) of a short text, in hex: llama.cpp's converter names a pre-tokenizer by the SHA-256 of
// its ids for a fixed text.
std::string sha256_hex(std::string_view text) {
  static constexpr uint32_t k[64] = {
      0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5, 0xd807aa98,
      0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786,
      0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8,
      0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13,
      0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819,
      0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a,
      0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
      0xc67178f2};
  uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  std::string msg(text);
  const uint64_t bits = uint64_t(text.size()) * 8;
  msg.push_back(static_cast<char>(0x80));
  while (msg.size() % 64 != 56) msg.push_back('\0');
  for (int i = 7; i >= 0; --i) msg.push_back(static_cast<char>(bits >> (8 * i)));
  auto rotr = [](uint32_t x, int n) { return (x >> n) | (x << (32 - n)); };
  for (size_t block = 0; block < msg.size(); block += 64) {
    uint32_t w[64];
    for (int i = 0; i < 16; ++i)
      w[i] = (uint32_t(uint8_t(msg[block + 4 * i])) << 24) | (uint32_t(uint8_t(msg[block + 4 * i + 1])) << 16) |
             (uint32_t(uint8_t(msg[block + 4 * i + 2])) << 8) | uint32_t(uint8_t(msg[block + 4 * i + 3]));
    for (int i = 16; i < 64; ++i) {
      const uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      const uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
    for (int i = 0; i < 64; ++i) {
      const uint32_t t1 = hh + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + k[i] + w[i];
      const uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      hh = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
    }
    h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e, h[5] += f, h[6] += g, h[7] += hh;
  }
  std::string hex;
  for (uint32_t x : h)
    for (int i = 28; i >= 0; i -= 4) hex.push_back("0123456789abcdef"[(x >> i) & 15]);
  return hex;
}

struct PreType {
  const char* sha256;
  const char* name;
};
constexpr PreType kPreTypes[] = {
#include "data/gguf_pre_types.inc"
};

// The text llama.cpp's converter encodes to tell pre-tokenizers apart (convert_hf_to_gguf.py, get_vocab_base_pre).
constexpr const char* kChkTxt =
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n\U0001F680 (normal) \U0001F636\u200D\U0001F32B"
    "\uFE0F (multiple emojis concatenated) \u2705 \U0001F999\U0001F999 3 33 333 3333 33333 333333 3333333"
    " 33333333 3.3 3..3 3...3 \u1780\u17B6\u1793\u17CB\u178F\u17C2\u1796\u17B7\u179F\u17C1\u179F\u17A2"
    "\u17B6\u1785\U0001F601 ?\u6211\u60F3\u5728apple\u5DE5\u4F5C1314151\u5929\uFF5E ------======= \u043D"
    "\u0435\u0449\u043E \u043D\u0430 \u0411\u044A\u043B\u0433\u0430\u0440\u0441\u043A\u0438 ''''''```````"
    "\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D yo"
    "u like some tea? We'Ve a'lL";

}  // namespace

std::string gguf_pre_type(const Tokenizer& tokenizer) {
  const TokenizerImpl& impl = tokenizer.impl();
  const ByteBpeModel* m = impl.bpe_model();
  TUNA_CHECK(m, "gguf_pre_type of a tokenizer that is not BPE");
  bool byte_level = false;
  for (const PreTokenizerStep& p : m->pre_tokenizers) byte_level |= p.kind == PreTokenizerStep::Kind::byte_level;
  if (!byte_level)
    fail("tokenizer ", tokenizer.path(), ": tuna writes GGUF for byte-level BPE tokenizers (llama.cpp's 'gpt2' model); "
         "this is a sentencepiece-style BPE (", describe_pipeline(*m),
         "): convert the model's tokenizer.model, which llama.cpp reads as its 'llama' model");
  // What transformers' tokenizer.encode gives: the post-processor's special tokens around the text.
  std::vector<int32_t> ids = m->frame_before;
  for (int32_t id : tokenizer.encode(kChkTxt, SpecialTokens::parse)) ids.push_back(id);
  ids.insert(ids.end(), m->frame_after.begin(), m->frame_after.end());
  std::string list = "[";
  for (size_t i = 0; i < ids.size(); ++i) list += (i ? ", " : "") + std::to_string(ids[i]);
  list += "]";
  const std::string hash = sha256_hex(list);
  for (const PreType& t : kPreTypes)
    if (hash == t.sha256) return t.name;
  fail("tokenizer ", tokenizer.path(), ": llama.cpp has no pre-tokenizer type for this tokenizer's pipeline (",
       describe_pipeline(*m), "; its converter's hash ", hash.substr(0, 16),
       "... is not in its table), so a GGUF file would tokenize differently in llama.cpp; tuna writes none");
}

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
    v.model = "gpt2";
    v.pre = gguf_pre_type(tokenizer);
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
