// Tokenizer: sentencepiece behind tuna's types and errors.
#include "data/tokenizer.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <filesystem>
#include <thread>
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
