// The one interface behind tuna::Tokenizer (data/tokenizer.h), and its three makers. Internal to data/:
// callers use Tokenizer.
//
// An implementation cuts text into segments whose ids, encoded one by one, concatenate to the ids of the
// whole text: sentencepiece at word starts and around newlines (where no piece of the model crosses, checked
// at load), byte-level BPE at its pre-tokenizer's splits (the definition of the format). CachedEncoder
// (data/tokenizer.h) keeps the ids of each segment it has seen; the encoder itself does not cache.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tuna {

enum class SpecialTokens : uint8_t;
enum class TokenizerFormat : uint8_t;
struct ByteBpeModel;

// What an id stands for, for the vocabulary fingerprint and for decoding.
enum class TokenKind : uint8_t {
  normal = 0,   // ordinary text
  special = 1,  // a control token (<s>, <|eot_id|>): its text is its name
  added = 2,    // an added token that is not special: matched in text like a word
  byte = 3,     // sentencepiece byte fallback (<0x0A>)
  unknown = 4,  // sentencepiece <unk>
  unused = 5,   // a hole in the id space, or sentencepiece's unused pieces
};

class TokenizerImpl {
 public:
  virtual ~TokenizerImpl() = default;
  virtual TokenizerFormat format() const = 0;
  virtual const std::string& path() const = 0;  // the file the tokenizer was read from

  // The reference encoding of the whole text (no BOS/EOS added): what the format's own library gives.
  virtual void encode(std::string_view text, SpecialTokens specials, std::vector<int32_t>* out) const = 0;
  // The same without the dummy prefix sentencepiece puts before a text's first word: for text that continues
  // a sequence (a chat template's pieces). Other formats have no such prefix.
  virtual void encode_continuation(std::string_view text, std::vector<int32_t>* out) const {
    encode(text, SpecialTokens{}, out);
  }

  // Segments (see above). segment() calls on_text(segment) for a run of text to encode with encode_segment,
  // and on_token(id) for a special token recognized in the text. segments_exact() is false when the model
  // failed the load-time checks: then segment() must not be used.
  virtual bool segments_exact() const = 0;
  virtual const char* segment_encoder() const = 0;  // how encode_segment works, for logs and tests
  virtual void segment(std::string_view text, SpecialTokens specials,
                       const std::function<void(std::string_view)>& on_text,
                       const std::function<void(int32_t)>& on_token) const = 0;
  virtual void encode_segment(std::string_view segment, std::vector<int32_t>* out) const = 0;

  virtual std::string decode(std::span<const int32_t> ids) const = 0;
  virtual int32_t vocab_size() const = 0;
  // The id of a token whose text is exactly `text` (a special token's name, a piece, a byte-level token's
  // bytes), or -1.
  virtual int32_t token_id(std::string_view text) const = 0;
  // Kind and text of an id: the piece for sentencepiece, the bytes for BPE, the name of a special token.
  virtual TokenKind kind(int32_t id) const = 0;
  virtual std::string token_text(int32_t id) const = 0;

  // Ids the format itself defines (-1: none); Tokenizer may override them from the model's config.
  virtual int32_t default_bos() const = 0;
  virtual int32_t default_eos() const = 0;
  virtual int32_t unk_id() const { return -1; }
  virtual int32_t pad_id() const { return -1; }

  // What a GGUF vocabulary needs beyond kind() and token_text() (data/tokenizer_gguf.cpp). Sentencepiece: each
  // piece's score and piece types (sentencepiece's numbers: 1 normal ... 4 user-defined ... 6 byte). Byte-level
  // BPE: the merge rules in rank order (data/tokenizer.h: gguf_vocabulary), the pre-tokenizer's regexes in order
  // and whether a space is put before the text.
  virtual float score(int32_t id) const { return 0.0f; }
  virtual std::vector<int> piece_types() const { return {}; }
  virtual std::vector<std::pair<int32_t, int32_t>> merge_list() const { return {}; }
  // BPE (tokenizer.json, tiktoken): the pipeline as read, for the GGUF export; null for other formats.
  virtual const ByteBpeModel* bpe_model() const { return nullptr; }
  // The bytes a byte-level vocabulary has no token for (its trainer never saw them alone), and no byte fallback or unk
  // token stands for: Hugging Face's BPE drops them from the text it encodes, and so does tuna; prepare counts them
  // (CachedEncoder::encode). Empty for every other tokenizer. Such a tokenizer's segments are raw bytes.
  virtual std::string missing_bytes() const { return {}; }
  // Sentencepiece: why llama.cpp's `llama` tokenizer (sentencepiece BPE over text it does not normalize, spaces
  // as "▁") would encode differently, or empty; *dummy_prefix: whether a space is put before the text.
  virtual std::string llama_spm_difference(bool* dummy_prefix) const { return "not a sentencepiece model"; }
};

// The model config file `name` (tokenizer_config.json, config.json) that belongs with the tokenizer file at
// path: beside it, or one directory up when the file sits in a Hugging Face download's original/ directory.
// Empty when there is none.
std::string model_config_file(const std::string& tokenizer_path, const char* name);

// Makers; each fails with a tuna::Error naming the path and what was wrong.
std::unique_ptr<TokenizerImpl> load_sentencepiece(const std::string& path);
std::unique_ptr<TokenizerImpl> load_tokenizer_json(const std::string& path);
std::unique_ptr<TokenizerImpl> load_tiktoken(const std::string& path);

}  // namespace tuna
