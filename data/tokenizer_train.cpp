// train_tokenizer (data/tokenizer.h): sentencepiece's trainer with LLaMA's settings. A file of its own so that
// a binary that only reads tokenizers does not link the trainer's library.
#include <sentencepiece_trainer.h>

#include <algorithm>
#include <filesystem>
#include <thread>
#include <unordered_map>

#include "core/error.h"
#include "data/tokenizer.h"

namespace tuna {

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
