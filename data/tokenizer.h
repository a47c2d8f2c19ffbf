// Tokenizer: a thin wrapper over a sentencepiece model (LLaMA's tokenizer.model is one), and training of
// a new one.
//
// Ids are int32 everywhere in tuna; sentencepiece's are int, the same on every platform we build for.
// encode() adds no BOS/EOS: the caller frames documents (prepare writes BOS + tokens + EOS).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace tuna {

class Tokenizer {
 public:
  Tokenizer();
  // Same as Tokenizer() followed by load(model_path).
  explicit Tokenizer(const std::string& model_path);
  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;

  // Loads a sentencepiece model file. A missing file or one that is not a model is a tuna::Error naming
  // the path and sentencepiece's reason.
  void load(const std::string& model_path);
  bool loaded() const { return processor_ != nullptr; }
  const std::string& path() const { return path_; }

  // Safe to call from several threads at once (sentencepiece's encode is const and stateless).
  std::vector<int32_t> encode(std::string_view text) const;
  std::string decode(std::span<const int32_t> ids) const;

  int32_t vocab_size() const;
  int32_t bos_id() const;  // -1 when the model has none
  int32_t eos_id() const;  // -1 when the model has none
  int32_t unk_id() const;
  int32_t pad_id() const;               // -1 when the model has none (LLaMA's has none)
  std::string piece(int32_t id) const;  // the piece text of an id, e.g. "▁the" or "<0x0A>"

 private:
  std::unique_ptr<sentencepiece::SentencePieceProcessor> processor_;
  std::string path_;
};

// Encodes many documents fast and exactly as Tokenizer::encode would. Text is cut before every space that
// follows a non-space: no piece of the model crosses such a boundary (checked at construction: no piece has
// "▁" after a non-"▁" character), so BPE merges and unigram segmentations on either side are independent,
// and each cut piece encodes alone to the same ids once its leading space is left to the model's dummy
// prefix (also checked, on probe strings). Each word's ids then come from a per-thread cache: legal and
// financial text repeats its words, so most words cost one hash lookup instead of a sentencepiece call.
// A model that fails either check is encoded whole, document by document (exact() says which).
class CachedEncoder {
 public:
  // max_words_per_thread bounds each cache (about 150 bytes a word: 40 MB at the default); a full cache
  // starts over.
  explicit CachedEncoder(const Tokenizer& tokenizer, size_t max_words_per_thread = size_t{1} << 18);
  bool exact() const { return word_split_; }
  // Appends the ids of text to *out. Thread-safe (the caches are per thread).
  void encode(std::string_view text, std::vector<int32_t>* out) const;
  // The same without the cache, cut into words: what tests compare against Tokenizer::encode.
  std::vector<int32_t> encode_by_words(std::string_view text) const;

 private:
  template <typename Fn>
  void for_each_word(std::string_view text, Fn&& fn) const;

  const Tokenizer* tokenizer_;
  size_t max_words_;
  bool word_split_ = false;
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
// writes model_prefix + ".model" and model_prefix + ".vocab". A failure (no input, a vocab_size the text
// cannot support, ...) is a tuna::Error carrying sentencepiece's reason.
void train_tokenizer(const std::vector<std::string>& input_files, const std::string& model_prefix,
                     int vocab_size, const TokenizerTrainOptions& options = {});

}  // namespace tuna
