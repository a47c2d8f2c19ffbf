// BPE as Hugging Face tokenizers composes it: the model behind every tokenizer.json tuna reads (Llama 3's, GPT-2's,
// the sentencepiece-style byte-fallback BPE of LLaMA-2-family repositories) and behind Llama 3's tiktoken file.
//
// encode(text), in the library's order:
//   1. added tokens: those not `normalized` are matched in the text as written (leftmost-longest; lstrip, rstrip and
//      single_word as the library applies them); special ones only when the caller parses special tokens;
//   2. each stretch between them is normalized (NFC/NFKC/NFD/NFKD, Lowercase, Replace, Prepend, Strip, ...), and the
//      `normalized` added tokens are matched in the result;
//   3. the pre-tokenizers cut each stretch into pieces (Split, ByteLevel, Digits, Metaspace, Whitespace, ...);
//   4. the BPE model encodes each piece: its characters (or, for a byte-level vocabulary, its bytes) start as one
//      symbol each (an unknown one becomes byte-fallback tokens, the unk token, or nothing, as the model says), and
//      adjacent symbols merge, lowest rank first (leftmost on ties), until no adjacent pair has a rank.
// decode(ids) runs the tokenizer.json's decoders (ByteLevel, Metaspace, ByteFallback, Fuse, Strip, Replace).
//
// Pieces are what the word cache keys on (data/tokenizer_impl.h). A vocabulary in GPT-2's byte-level alphabet is
// encoded over raw bytes (the alphabet is a bijection), so the common pipelines never build the mapped text; every
// other pipeline works on the model's own strings. Regexes are PCRE2 (UTF, Unicode properties), compiled once per
// tokenizer and JIT-compiled; empty matches follow Oniguruma's rules, the library's regex engine.
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

// A Split or Replace pattern: a regex, or a literal string.
struct TextPattern {
  bool regex = false;
  std::string text;
};

// How a split keeps what its pattern matched (Hugging Face's SplitDelimiterBehavior).
enum class SplitBehavior : uint8_t { removed, isolated, merged_with_previous, merged_with_next, contiguous };

struct NormalizerStep {
  enum class Kind : uint8_t { nfc, nfd, nfkc, nfkd, lowercase, replace, prepend, strip, strip_accents, byte_level };
  explicit NormalizerStep(Kind k) : kind(k) {}
  Kind kind;
  TextPattern pattern;               // replace
  std::string content;               // replace: the replacement; prepend: what is put before non-empty text
  bool left = false, right = false;  // strip
};

struct PreTokenizerStep {
  enum class Kind : uint8_t { split, byte_level, digits, metaspace, whitespace, whitespace_split, punctuation };
  enum class Prepend : uint8_t { always, first, never };
  explicit PreTokenizerStep(Kind k) : kind(k) {}
  Kind kind;
  TextPattern pattern;                                // split
  SplitBehavior behavior = SplitBehavior::isolated;  // split, punctuation
  bool invert = false;                                // split
  bool add_prefix_space = false, use_regex = true;    // byte_level
  bool individual_digits = false;                     // digits
  std::string replacement = "\xE2\x96\x81";           // metaspace ("▁")
  Prepend prepend = Prepend::always;                  // metaspace
  bool split = true;                                  // metaspace
};

struct DecoderStep {
  enum class Kind : uint8_t { byte_level, metaspace, byte_fallback, fuse, strip, replace, bpe_suffix };
  explicit DecoderStep(Kind k) : kind(k) {}
  Kind kind;
  std::string content;  // metaspace: the replacement; strip: the character; replace: the replacement; bpe: suffix
  TextPattern pattern;  // replace
  size_t start = 0, stop = 0;  // strip
  bool prepend = true;         // metaspace: prepend_scheme is not "never"
};

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool special = false, normalized = false, lstrip = false, rstrip = false, single_word = false;
};

struct ByteBpeModel {
  std::string path;  // the file, for errors
  TokenizerFormat format;
  // id -> the model's string for it: tokenizer.json's vocab key (in GPT-2's byte-level alphabet for a byte-level
  // vocabulary), tiktoken's bytes in that alphabet. Empty for an id the vocabulary does not hold.
  std::vector<std::string> vocab;
  std::vector<bool> in_vocab;
  std::vector<AddedToken> added;  // ids may repeat vocabulary ids (GPT-2's <|endoftext|> is in both)
  // Merge rules: the pair (left id, right id) becomes `merged`, at this rank (lower merges first).
  struct Merge {
    int32_t left, right, rank, merged;
  };
  std::vector<Merge> merges;
  std::vector<NormalizerStep> normalizers;
  std::vector<PreTokenizerStep> pre_tokenizers;
  std::vector<DecoderStep> decoders;
  bool has_decoder = false;  // without one, decode joins the tokens with spaces (the library's default)
  // The BPE model's options.
  bool ignore_merges = false;  // a piece that is a whole token is that token, before any merge
  bool byte_fallback = false;  // an unknown character becomes its bytes' <0xNN> tokens
  bool fuse_unk = false;       // consecutive unknown characters become one unk token
  int32_t unk = -1;            // the unk token's id, or none: an unknown character is dropped
  std::string continuing_subword_prefix, end_of_word_suffix;
  int32_t bos = -1, eos = -1;  // the format's own, when it names them
  // The special tokens the post-processor puts before and after a text (Hugging Face's add_special_tokens).
  std::vector<int32_t> frame_before, frame_after;
};

// Llama 3's pre-tokenizer regex (its tokenizer.json's Split pattern; tiktoken's cl100k_base pattern) and GPT-2's
// (a ByteLevel pre-tokenizer's own regex).
extern const char* const kLlama3Pattern;
extern const char* const kGpt2Pattern;

std::unique_ptr<TokenizerImpl> make_byte_bpe(ByteBpeModel model);
// "normalizer NFKC; pre_tokenizer ByteLevel": the pipeline's components by their tokenizer.json names.
std::string describe_pipeline(const ByteBpeModel& model);

// Ids no token has are allowed (a hole in the id space), up to kMaxUnusedTokenIds of them: a file that names
// id 2^30 - 1 beside a few hundred tokens is refused before a table of 2^30 tokens is allocated. `ids` is one
// more than the largest id, `defined` how many tokens the file defines; `field` names where the ids are.
inline constexpr int64_t kMaxUnusedTokenIds = int64_t{1} << 16;
void check_token_id_space(int64_t ids, int64_t defined, const std::string& path, const char* field);

// The byte-level alphabet of GPT-2 and Llama 3's tokenizer.json: byte b is written as one printable code
// point (printable ASCII and Latin-1 bytes as themselves, the other 68 bytes as U+0100 + k).
std::string byte_level_encode(std::string_view bytes);
// The inverse; false when text holds a code point outside the alphabet.
bool byte_level_decode(std::string_view text, std::string* bytes);

}  // namespace tuna
