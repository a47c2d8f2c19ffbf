// complete_hf_tokenizer_files: what transformers' AutoTokenizer needs beside an exported model (see
// data/tokenizer.h).
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/tokenizer.h"

namespace tuna {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

void write_json_file(const fs::path& path, const json& j) {
  std::ofstream out(path, std::ios::trunc);
  out << j.dump(2) << "\n";
  out.flush();
  if (!out) fail(path.string(), ": cannot write (disk full?)");
}

bool is_file(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

}  // namespace

std::vector<std::string> complete_hf_tokenizer_files(const fs::path& dir, const json& config, std::string* warning) {
  std::vector<std::string> written;
  // generation_config.json: BOS and EOS ids as the model's config.json has them (Llama 3 instruct: a list).
  auto generation = [&](int32_t bos, int32_t eos) {
    if (is_file(dir / "generation_config.json")) return;
    json g = {{"_from_model_config", true}};
    if (config.contains("bos_token_id") && !config["bos_token_id"].is_null()) g["bos_token_id"] = config["bos_token_id"];
    else if (bos >= 0) g["bos_token_id"] = bos;
    if (config.contains("eos_token_id") && !config["eos_token_id"].is_null()) g["eos_token_id"] = config["eos_token_id"];
    else if (eos >= 0) g["eos_token_id"] = eos;
    write_json_file(dir / "generation_config.json", g);
    written.push_back("generation_config.json");
  };
  if (!has_tokenizer(dir)) {
    generation(-1, -1);
    return written;
  }
  const Tokenizer tokenizer(dir.string());
  generation(tokenizer.bos_id(), tokenizer.eos_id());
  auto token = [&](int32_t id) { return id >= 0 ? json(tokenizer.piece(id)) : json(); };
  if (!is_file(dir / "tokenizer_config.json")) {
    json c;
    if (tokenizer.format() == TokenizerFormat::sentencepiece) {
      // The slow class reads tokenizer.model with the sentencepiece package alone.
      c = {{"tokenizer_class", "LlamaTokenizer"}, {"add_bos_token", tokenizer.bos_id() >= 0}, {"add_eos_token", false},
           {"legacy", false}, {"unk_token", token(tokenizer.unk_id())}};
    } else if (is_file(dir / "tokenizer.json")) {
      // tokenizer.json alone: transformers needs only its `tokenizers` dependency.
      c = {{"tokenizer_class", "PreTrainedTokenizerFast"}};
    } else {
      *warning = str(dir.string(), " carries a tiktoken tokenizer.model without a tokenizer.json: transformers reads it "
                     "only with the tiktoken package; copy the model's tokenizer.json beside it");
      return written;
    }
    c["bos_token"] = token(tokenizer.bos_id());
    c["eos_token"] = token(tokenizer.eos_id());
    c["clean_up_tokenization_spaces"] = false;
    c["model_input_names"] = {"input_ids", "attention_mask"};
    if (config.contains("max_position_embeddings")) c["model_max_length"] = config["max_position_embeddings"];
    write_json_file(dir / "tokenizer_config.json", c);
    written.push_back("tokenizer_config.json");
  }
  if (!is_file(dir / "special_tokens_map.json")) {
    json m = json::object();
    if (tokenizer.bos_id() >= 0) m["bos_token"] = tokenizer.piece(tokenizer.bos_id());
    if (tokenizer.eos_id() >= 0) m["eos_token"] = tokenizer.piece(tokenizer.eos_id());
    if (tokenizer.unk_id() >= 0) m["unk_token"] = tokenizer.piece(tokenizer.unk_id());
    write_json_file(dir / "special_tokens_map.json", m);
    written.push_back("special_tokens_map.json");
  }
  return written;
}

}  // namespace tuna
