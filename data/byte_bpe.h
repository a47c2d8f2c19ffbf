// Byte-level BPE, the model behind Llama 3's tokenizer.json and its tiktoken file: text is split by a
// pre-tokenizer regex, each piece's bytes start as one token per byte, and adjacent tokens merge, lowest
// rank first (leftmost on ties), until no adjacent pair has a rank. Special and added tokens written in the
// text are matched first (leftmost-longest) and never merge with their neighbours.
//
// The two file formats fill in a ByteBpeModel (data/tokenizer_json.cpp, data/tiktoken.cpp); this engine
// encodes, decodes and segments for the word cache (data/tokenizer_impl.h). The regex runs in PCRE2 with
// UTF and Unicode properties (\p{L}, \s, case-insensitive matching by Unicode case folding), JIT-compiled.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "data/tokenizer_impl.h"

namespace tuna {

// text -> id over strings that live elsewhere (and outlive the index): open addressing on XXH3 hashes,
// no allocation per lookup. A vocabulary of 128k tokens is indexed in milliseconds.
class TokenIndex {
 public:
  void reserve(size_t count);
  // False (and nothing changes) when text is already there.
  bool insert(std::string_view text, int32_t id);
  int32_t find(std::string_view text) const;  // -1 when absent
  size_t size() const { return size_; }

 private:
  struct Slot {
    uint64_t hash = 0;
    const char* data = nullptr;
    uint32_t length = 0;
    int32_t id = -1;
  };
  void grow();
  std::vector<Slot> slots_;
  size_t size_ = 0;
};

struct ByteBpeModel {
  std::string path;  // the file, for errors
  TokenizerFormat format;
  // id -> the token's bytes (normal tokens) or its text (special and added tokens); kinds[id] says which.
  // Ids no token has are unused (empty text).
  std::vector<std::string> tokens;
  std::vector<TokenKind> kinds;
  // Merge rules: the pair (left id, right id) becomes the token of their concatenated bytes, at this rank
  // (lower merges first). tokenizer.json: the merges list's order; tiktoken: the merged token's rank.
  struct Merge {
    int32_t left, right, rank;
  };
  std::vector<Merge> merges;
  bool ignore_merges = false;  // a piece that is a whole token is that token, before any merge (tokenizer.json)
  // Pre-tokenizer: each regex splits every piece of the previous one ("Isolated": matches and the text
  // between them are pieces). add_prefix_space: a space is put before text that does not start with one.
  std::vector<std::string> patterns;
  bool add_prefix_space = false;
  int32_t bos = -1, eos = -1;  // the format's own, when it names them
};

// Llama 3's pre-tokenizer regex (its tokenizer.json's Split pattern; tiktoken's cl100k_base pattern).
extern const char* const kLlama3Pattern;

std::unique_ptr<TokenizerImpl> make_byte_bpe(ByteBpeModel model);

// The byte-level alphabet of GPT-2 and Llama 3's tokenizer.json: byte b is written as one printable code
// point (printable ASCII and Latin-1 bytes as themselves, the other 68 bytes as U+0100 + k).
std::string byte_level_encode(std::string_view bytes);
// The inverse; false when text holds a code point outside the alphabet.
bool byte_level_decode(std::string_view text, std::string* bytes);

}  // namespace tuna
