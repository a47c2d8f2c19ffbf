// Tokenizer: one interface over the three formats a user brings, named by file or by model directory:
//   - sentencepiece `.model` (LLaMA 2's tokenizer.model; what build/prepare --train-tokenizer writes);
//   - Hugging Face `tokenizer.json` with a BPE model, read by tuna itself with the library's pipeline
//     (data/byte_bpe.h): normalizers, pre-tokenizers, byte-level or sentencepiece-style (byte fallback) BPE,
//     added tokens, decoders;
//   - tiktoken BPE ranks (Llama 3's original/tokenizer.model: base64 token and rank per line), with Llama 3's
//     pre-tokenizer and special tokens.
// Ids equal the reference libraries' (sentencepiece; Hugging Face `tokenizers`), checked by the tests on
// real text against ids those libraries wrote (tests/fixtures/tokenizers, tools/reference).
//
// Ids are int32 everywhere in tuna. encode() adds no BOS/EOS: the caller frames documents (prepare writes
// BOS + tokens + EOS, with BOS and EOS as the model's config names them).
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace tuna {

class TokenizerImpl;

enum class TokenizerFormat : uint8_t { sentencepiece, hf_bpe, tiktoken };
const char* format_name(TokenizerFormat format);  // "sentencepiece", "Hugging Face BPE" (byte-level or not), "tiktoken BPE"

// What encode() does with a special token's name (<|eot_id|>, <s>) written in the text.
enum class SpecialTokens : uint8_t {
  as_text,  // encode it as ordinary text: a document cannot forge a control token (prepare, the default)
  parse,    // emit the special token's id (Hugging Face's default; build/sample's prompts). Sentencepiece
            // models encode as their library does, which never reads a control token from text.
};

class Tokenizer {
 public:
  Tokenizer();
  // Same as Tokenizer() followed by load(path).
  explicit Tokenizer(const std::string& path);
  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;

  // Loads a tokenizer file of any of the three formats (recognized by content, not by name), or a model
  // directory's tokenizer: its tokenizer.json (what transformers' AutoTokenizer reads), else its tokenizer.model
  // (sentencepiece or tiktoken), else original/tokenizer.model. BOS and EOS come from the model's config beside
  // the file (tokenizer_config.json's bos_token / eos_token, else config.json's ids), else the format's own.
  // A missing path, a directory without a tokenizer, a file in none of the formats (the error names each
  // format tried) or a tokenizer.json whose model is not BPE (WordPiece, Unigram: refused by name) is
  // a tuna::Error naming the path.
  void load(const std::string& path);
  bool loaded() const { return impl_ != nullptr; }
  const std::string& path() const;  // the tokenizer file read
  TokenizerFormat format() const;
  std::string describe() const;  // "ckpt/base/tokenizer.json (Hugging Face BPE, 128256 tokens)"

  // Safe to call from several threads at once. Text must be valid UTF-8 for the BPE formats (a tuna::Error
  // otherwise); sentencepiece takes any bytes.
  std::vector<int32_t> encode(std::string_view text, SpecialTokens specials = SpecialTokens::as_text) const;
  // Text that continues a sequence at a word boundary: without sentencepiece's dummy prefix (the space it
  // puts before a text's first word). The same as encode for the BPE formats.
  std::vector<int32_t> encode_continuation(std::string_view text) const;
  // Bytes of the ids, special tokens as their names. decode(encode(text)) == text for valid UTF-8 text.
  std::string decode(std::span<const int32_t> ids) const;

  int32_t vocab_size() const;  // one more than the largest id (special tokens included)
  int32_t bos_id() const;      // -1 when the model has none
  int32_t eos_id() const;      // -1 when the model has none
  int32_t unk_id() const;      // -1 when the model has none (byte-level BPE never needs one)
  int32_t pad_id() const;      // -1 when the model has none (LLaMA's has none)
  // The id of the token whose text is exactly `text` (a special token's name such as "<|eot_id|>", a
  // sentencepiece piece, a BPE token's bytes), or -1.
  int32_t token_id(std::string_view text) const;
  // The text of an id as the format writes it: "▁the" or "<0x0A>" (sentencepiece), the token's bytes (BPE),
  // a special token's name.
  std::string piece(int32_t id) const;
  // XXH3-64 of the vocabulary (every id's kind and text, in id order): equal for the same tokenizer in
  // another format (Llama 3's tokenizer.json and its tiktoken file), different for another vocabulary.
  // Token shards record it (data/shard.h) so that the trainer refuses shards of another tokenizer.
  uint64_t fingerprint() const;

  const TokenizerImpl& impl() const { return *impl_; }

 private:
  std::unique_ptr<TokenizerImpl> impl_;
  int32_t bos_ = -1, eos_ = -1;
  uint64_t fingerprint_ = 0;
};

// The files of a model directory that belong to its tokenizer (or its generation config), copied along
// with the weights by checkpoints and conversions, in this order when present.
inline constexpr const char* kTokenizerFileNames[] = {"tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                                                      "special_tokens_map.json", "generation_config.json"};

// A file a tokenizer needs, and the name it takes in a checkpoint or export directory.
struct TokenizerFile {
  std::filesystem::path source;
  std::string name;  // "tokenizer.model", "tokenizer.json", "tokenizer_config.json", ...
};
// The files that carry exactly the tokenizer `path` names (a file or a model directory), so that
// Tokenizer(checkpoint_dir) loads the same tokenizer: a sentencepiece or tiktoken file as tokenizer.model, a
// tokenizer.json as tokenizer.json, each with the model config files beside it that name its BOS/EOS
// (tokenizer_config.json, special_tokens_map.json); for a directory, every tokenizer file in it (and its
// generation_config.json). The tokenizer is loaded first: a path that does not exist or does not parse is a
// tuna::Error. Empty for a directory that holds no tokenizer only when allow_none. loaded: receives the
// tokenizer read on the way.
std::vector<TokenizerFile> tokenizer_files(const std::string& path, bool allow_none = false, Tokenizer* loaded = nullptr);
// The trainer's tokenizer: what its checkpoints carry, and the fingerprint its shards must have been written
// with (data/shard.h). `named` (--tokenizer: a file or directory) must exist and parse; without it, the model
// directory's tokenizer (none is fine: training from scratch), whose files are carried even when tuna cannot
// read them (then nothing is checked, and note says why). A tokenizer with more ids than the model's
// vocab_size is an error.
struct ModelTokenizer {
  std::vector<TokenizerFile> files;  // empty: no tokenizer
  uint64_t fingerprint = 0;          // 0: nothing to check shards against
  std::string description;           // Tokenizer::describe(), or what was found
  std::string note;                  // why a carried tokenizer is not checked
};
ModelTokenizer model_tokenizer(const std::string& named, const std::string& model_dir, int64_t model_vocab_size);

// A tokenizer against the model it serves (the model's vocab_size, from its config.json). Ids at or above
// vocab_size have no embedding. When they are all special tokens that are neither BOS nor EOS (Meta's reserved
// and vision tokens: Llama 3.2's tokenizer.json carries <|image|> at id 128256 for a vocab_size of 128256), no
// text encoded with SpecialTokens::as_text can produce them, so the tokenizer is accepted with a warning (the
// returned text; empty when every id fits) and a tool that parses special tokens (build/sample's prompt) refuses
// those ids at encode time (check_ids_fit). Any other id above the limit (a vocabulary token, an added token
// matched in text, BOS or EOS) is an error naming the ids and what to do. `model` names the config for messages.
std::string check_tokenizer_fits(const Tokenizer& tokenizer, int64_t model_vocab_size, const std::string& model);
// The model's vocab_size from the config.json beside a tokenizer (the directory named, or the file's own
// directory, or above original/), or 0 when there is none; *config_path receives the file read.
int64_t model_vocab_beside(const std::string& tokenizer_path, std::string* config_path);
// Fails naming the first id at or above model_vocab_size (a special token parsed from text that the model has
// no embedding for), and what it is.
void check_ids_fit(const Tokenizer& tokenizer, std::span<const int32_t> ids, int64_t model_vocab_size,
                   const std::string& what);

// Copies them into dir (overwriting), fsyncing nothing; fails naming the file that could not be copied.
void copy_tokenizer_files(const std::vector<TokenizerFile>& files, const std::filesystem::path& dir);
// True when a model directory holds a tokenizer file (tokenizer.model, tokenizer.json or
// original/tokenizer.model), whether or not it parses.
bool has_tokenizer(const std::filesystem::path& dir);

// Completes the tokenizer files of an exported Hugging Face directory (its own, copied from the checkpoint,
// are kept) so that transformers' AutoTokenizer loads it with as few packages as possible: tokenizer_config.json
// (PreTrainedTokenizerFast over tokenizer.json: `tokenizers` only; LlamaTokenizer over a sentencepiece model:
// the sentencepiece package), special_tokens_map.json, generation_config.json (BOS/EOS ids from config, the
// model's config.json). A tiktoken file alone gets no tokenizer_config.json, and *warning says why (transformers
// would need the tiktoken package). Returns the names of the files written.
std::vector<std::string> complete_hf_tokenizer_files(const std::filesystem::path& dir, const nlohmann::json& config,
                                                     std::string* warning);

// The tokenizer as llama.cpp's GGUF metadata holds it (ckpt/gguf.h writes it), so that llama.cpp encodes text
// to tuna's ids:
//   - sentencepiece -> model "llama": every piece with its score and type (llama.cpp's types are
//     sentencepiece's: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte);
//   - byte-level BPE (tokenizer.json, tiktoken) -> model "gpt2" with pre-tokenizer "llama-bpe": tokens in the
//     byte-level alphabet, special tokens as control (3), added ones as user-defined (4), the merges in rank
//     order ("left right"); a tiktoken file's are every split of a token into two tokens, ordered by the token's
//     rank, then the halves' (Hugging Face's conversion of tiktoken files: Llama 3's tokenizer.json lists exactly
//     those).
// Ids past the tokenizer's up to the model's vocab_size are "[PADn]", unused. BOS/EOS as the tokenizer names
// them; add_bos_token from tokenizer_config.json, else whether the model has a BOS (tuna frames every document
// BOS + text + EOS); the chat template from tokenizer_config.json. Fails naming what llama.cpp's tokenizers
// cannot reproduce (a normalizing sentencepiece model, a pre-tokenizer other than Llama 3's) and a tokenizer
// with more ids than the model has rows.
struct GgufVocabulary {
  std::string model;  // "llama" or "gpt2"
  std::string pre;    // "llama-bpe" for gpt2
  std::vector<std::string> tokens;
  std::vector<float> scores;   // llama only
  std::vector<int32_t> types;
  std::vector<std::string> merges;  // gpt2 only
  int32_t bos = -1, eos = -1, unk = -1, pad = -1;
  bool add_bos = false, add_eos = false;
  bool add_space_prefix = true;  // llama: sentencepiece's dummy prefix
  std::string chat_template;
};
GgufVocabulary gguf_vocabulary(const Tokenizer& tokenizer, int64_t model_vocab_size);
// The tokenizer.ggml.pre type llama.cpp gives a byte-level BPE tokenizer's pipeline, found as llama.cpp's converter
// finds it: the SHA-256 of the ids (with the post-processor's special tokens) of a fixed text, looked up in its
// table (data/gguf_pre_types.inc). Fails naming the pipeline where llama.cpp has no type for it, and for a
// sentencepiece-style tokenizer.json (exported from its tokenizer.model instead).
std::string gguf_pre_type(const Tokenizer& tokenizer);

// Encodes many documents fast and exactly as Tokenizer::encode would: text is cut into the segments the
// tokenizer's own pre-tokenization makes (see data/tokenizer_impl.h: sentencepiece words and newlines,
// checked at load; byte-level BPE's regex splits), and each segment's ids come from a per-thread cache:
// legal and financial text repeats its words, so most segments cost one hash lookup instead of a merge loop.
// A sentencepiece model that fails the load-time checks is encoded whole, document by document (exact()
// says which).
class CachedEncoder {
 public:
  // max_words_per_thread bounds each cache (about 100 bytes a segment: 25 MB at the default); a full cache
  // starts over.
  explicit CachedEncoder(const Tokenizer& tokenizer, size_t max_words_per_thread = size_t{1} << 18);
  bool exact() const;
  const char* segment_encoder() const;  // what encodes a segment missing from the cache
  bool drops_bytes() const { return drops_; }  // the tokenizer drops some bytes (TokenizerImpl::missing_bytes)
  // Appends the ids of text to *out. Thread-safe (the caches are per thread). dropped_bytes, when given, is
  // increased by the number of bytes of text the tokenizer drops (TokenizerImpl::missing_bytes).
  void encode(std::string_view text, std::vector<int32_t>* out, SpecialTokens specials = SpecialTokens::as_text,
              uint64_t* dropped_bytes = nullptr) const;
  // The same without the cache, segment by segment: what tests compare against Tokenizer::encode.
  std::vector<int32_t> encode_by_words(std::string_view text) const;

 private:
  const Tokenizer* tokenizer_;
  std::array<bool, 256> dropped_{};  // the bytes the tokenizer drops
  bool drops_ = false;
  size_t max_words_;
  uint64_t id_;  // tells this encoder's cache apart from another's on the same thread
};

// How train_tokenizer shapes the model. The defaults follow LLaMA's tokenizer: BPE, byte fallback (any
// text encodes, unknown characters become <0xNN> byte pieces), digits split, no text normalization,
// whitespace kept as is, unk = 0, bos = 1, eos = 2, no pad.
struct TokenizerTrainOptions {
  std::string model_type = "bpe";      // "bpe" or "unigram"
  double character_coverage = 0.9995;  // rarer characters go to byte fallback
  // Bounded sample: sentencepiece keeps at most this many input lines, drawn uniformly when
  // shuffle_input_sentence is on, so training time does not grow with the corpus.
  uint64_t input_sentence_size = 2'000'000;
  bool shuffle_input_sentence = true;
  int max_sentence_length = 16384;  // bytes; longer lines are skipped by the trainer
  int num_threads = 0;              // 0: all hardware threads
  uint32_t seed = 0x7475'6e61;      // sentencepiece's sampling seed, so that training is repeatable
  bool quiet = true;                // silence sentencepiece's progress log (errors still reach tuna::Error)
};

// Trains a sentencepiece model on plain-text files (one sentence per line, sentencepiece's own format) and
// writes model_prefix + ".model" and model_prefix + ".vocab". Training is sentencepiece only (a BPE
// tokenizer.json is not trained by tuna). A failure (no input, a vocab_size the text cannot support, ...) is
// a tuna::Error carrying sentencepiece's reason.
void train_tokenizer(const std::vector<std::string>& input_files, const std::string& model_prefix,
                     int vocab_size, const TokenizerTrainOptions& options = {});

}  // namespace tuna
