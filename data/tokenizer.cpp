// Tokenizer: sentencepiece behind tuna's types and errors.
#include "data/tokenizer.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <filesystem>
#include <thread>
#include <atomic>
#include <unordered_map>

#include "core/error.h"

namespace tuna {

Tokenizer::Tokenizer() = default;
Tokenizer::Tokenizer(const std::string& model_path) { load(model_path); }
Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

void Tokenizer::load(const std::string& model_path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(model_path, ec))
    fail("tokenizer ", model_path, ": no such file (expected a sentencepiece .model file)");
  auto processor = std::make_unique<sentencepiece::SentencePieceProcessor>();
  const auto status = processor->Load(model_path);
  if (!status.ok()) fail("tokenizer ", model_path, ": not a valid sentencepiece model: ", status.ToString());
  if (processor->GetPieceSize() <= 0) fail("tokenizer ", model_path, ": the model has no pieces");
  processor_ = std::move(processor);
  path_ = model_path;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  TUNA_CHECK(processor_, "encode on a tokenizer that is not loaded");
  std::vector<int> ids;
  const auto status = processor_->Encode(text, &ids);
  if (!status.ok()) fail("tokenizer ", path_, ": cannot encode text: ", status.ToString());
  return std::vector<int32_t>(ids.begin(), ids.end());
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  TUNA_CHECK(processor_, "decode on a tokenizer that is not loaded");
  const int32_t vocab = vocab_size();
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= vocab)
      fail("tokenizer ", path_, ": cannot decode id ", ids[i], " at position ", i,
           ": outside the vocabulary [0, ", vocab, ")");
  std::string text;
  const auto status = processor_->Decode(std::vector<int>(ids.begin(), ids.end()), &text);
  if (!status.ok()) fail("tokenizer ", path_, ": cannot decode: ", status.ToString());
  return text;
}

int32_t Tokenizer::vocab_size() const {
  TUNA_CHECK(processor_, "tokenizer not loaded");
  return processor_->GetPieceSize();
}
int32_t Tokenizer::bos_id() const {
  TUNA_CHECK(processor_, "tokenizer not loaded");
  return processor_->bos_id();
}
int32_t Tokenizer::eos_id() const {
  TUNA_CHECK(processor_, "tokenizer not loaded");
  return processor_->eos_id();
}
int32_t Tokenizer::unk_id() const {
  TUNA_CHECK(processor_, "tokenizer not loaded");
  return processor_->unk_id();
}
int32_t Tokenizer::pad_id() const {
  TUNA_CHECK(processor_, "tokenizer not loaded");
  return processor_->pad_id();
}
std::string Tokenizer::piece(int32_t id) const {
  TUNA_CHECK(processor_, "tokenizer not loaded");
  if (id < 0 || id >= vocab_size())
    fail("tokenizer ", path_, ": id ", id, " is outside the vocabulary [0, ", vocab_size(), ")");
  return processor_->IdToPiece(id);
}

namespace {
std::atomic<uint64_t> next_encoder_id{1};
constexpr size_t kMaxCachedWordBytes = 48;  // longer words (URLs, runs of digits) go straight to the model
}  // namespace

CachedEncoder::CachedEncoder(const Tokenizer& tokenizer, size_t max_words_per_thread)
    : tokenizer_(&tokenizer), max_words_(max_words_per_thread), id_(next_encoder_id++) {
  // 1. No piece continues across a word start: "▁" (E2 96 81) only as a prefix of the piece.
  const std::string space = "\xE2\x96\x81";
  bool crosses = false;
  for (int32_t id = 0; id < tokenizer.vocab_size() && !crosses; ++id) {
    const std::string piece = tokenizer.piece(id);
    size_t lead = 0;
    while (piece.compare(lead, space.size(), space) == 0) lead += space.size();
    crosses = piece.find(space, lead) != std::string::npos;
  }
  // 2. Cut pieces encode alone as they do in context (the dummy prefix stands in for the dropped space).
  bool same = !crosses;
  for (const char* probe : {"Hello world", "a  b c", "x\ny z.\n\nNext para", " lead", "trail ", "two  ",
                            "The  quick\tbrown fox, 1234.56 (b) \xC3\xBC" "ber stra\xC3\x9F" "e"}) {
    if (!same) break;
    word_split_ = true;
    same = encode_by_words(probe) == tokenizer.encode(probe);
  }
  word_split_ = same;
}

template <typename Fn>
void CachedEncoder::for_each_word(std::string_view text, Fn&& fn) const {
  // Word k > 0 starts at a space that follows a non-space and runs to the next such space; it is handed over
  // without that one space. Spaces at the very end stay with the last word (alone they would encode to
  // nothing, where in context they are pieces).
  const size_t last_word_char = text.find_last_not_of(' ');
  size_t start = 0;
  bool first = true;
  for (size_t i = 1; i <= text.size(); ++i) {
    const bool cut = i == text.size() || (text[i] == ' ' && text[i - 1] != ' ' && i < last_word_char);
    if (!cut) continue;
    fn(first ? text.substr(start, i - start) : text.substr(start + 1, i - start - 1));
    first = false;
    start = i;
  }
}

std::vector<int32_t> CachedEncoder::encode_by_words(std::string_view text) const {
  if (!word_split_) return tokenizer_->encode(text);
  std::vector<int32_t> out;
  if (text.empty()) return out;
  for_each_word(text, [&](std::string_view word) {
    std::vector<int32_t> ids = tokenizer_->encode(word);
    out.insert(out.end(), ids.begin(), ids.end());
  });
  return out;
}

void CachedEncoder::encode(std::string_view text, std::vector<int32_t>* out) const {
  if (!word_split_ || text.empty()) {
    std::vector<int32_t> ids = tokenizer_->encode(text);
    out->insert(out->end(), ids.begin(), ids.end());
    return;
  }
  struct Cache {
    uint64_t owner = 0;
    std::unordered_map<std::string, std::vector<int32_t>> words;
  };
  thread_local Cache cache;
  if (cache.owner != id_) cache.words.clear(), cache.owner = id_;
  thread_local std::string key;
  for_each_word(text, [&](std::string_view word) {
    if (word.size() > kMaxCachedWordBytes) {
      std::vector<int32_t> ids = tokenizer_->encode(word);
      out->insert(out->end(), ids.begin(), ids.end());
      return;
    }
    key.assign(word);
    auto it = cache.words.find(key);
    if (it == cache.words.end()) {
      if (cache.words.size() >= max_words_) cache.words.clear();  // bounded: start over rather than grow
      it = cache.words.emplace(key, tokenizer_->encode(word)).first;
    }
    out->insert(out->end(), it->second.begin(), it->second.end());
  });
}

void train_tokenizer(const std::vector<std::string>& input_files, const std::string& model_prefix,
                     int vocab_size, const TokenizerTrainOptions& options) {
  if (input_files.empty()) fail("tokenizer training (", model_prefix, "): no input files");
  std::string inputs;
  for (const std::string& file : input_files) {
    if (!std::filesystem::is_regular_file(file))
      fail("tokenizer training (", model_prefix, "): input ", file, " is not a file");
    // sentencepiece takes its inputs as one comma-separated flag.
    if (file.find(',') != std::string::npos)
      fail("tokenizer training (", model_prefix, "): input file name ", file,
           " contains a comma, which sentencepiece cannot take");
    inputs += (inputs.empty() ? "" : ",") + file;
  }
  if (vocab_size < 1)
    fail("tokenizer training (", model_prefix, "): vocab_size must be positive, found ", vocab_size);
  if (options.model_type != "bpe" && options.model_type != "unigram")
    fail("tokenizer training (", model_prefix, "): model_type must be bpe or unigram, found ",
         options.model_type);
  const int threads =
      options.num_threads > 0 ? options.num_threads : std::max(1u, std::thread::hardware_concurrency());

  const std::unordered_map<std::string, std::string> args = {
      {"input", inputs},
      {"model_prefix", model_prefix},
      {"vocab_size", std::to_string(vocab_size)},
      {"model_type", options.model_type},
      {"character_coverage", std::to_string(options.character_coverage)},
      {"input_sentence_size", std::to_string(options.input_sentence_size)},
      {"shuffle_input_sentence", options.shuffle_input_sentence ? "true" : "false"},
      {"max_sentence_length", std::to_string(options.max_sentence_length)},
      {"num_threads", std::to_string(threads)},
      // LLaMA's choices: keep the text as it is (no NFKC, no whitespace folding), so decode(encode(x))
      // gives x back; any byte encodes through the 256 byte pieces.
      {"normalization_rule_name", "identity"},
      {"remove_extra_whitespaces", "false"},
      {"add_dummy_prefix", "true"},
      {"byte_fallback", "true"},
      {"split_digits", "true"},
      {"allow_whitespace_only_pieces", "true"},
      {"unk_id", "0"},
      {"bos_id", "1"},
      {"eos_id", "2"},
      {"pad_id", "-1"},
      {"minloglevel", options.quiet ? "2" : "0"},
  };
  sentencepiece::SetRandomGeneratorSeed(options.seed);
  const auto status = sentencepiece::SentencePieceTrainer::Train(args);
  if (!status.ok())
    fail("tokenizer training (", model_prefix, ", vocab_size ", vocab_size, "): ", status.ToString());
}

}  // namespace tuna
