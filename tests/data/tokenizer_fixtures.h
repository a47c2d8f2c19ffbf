// The real tokenizers of tests/fixtures/tokenizers (tools/reference/make_tokenizer_fixtures.py), unpacked once
// per test process into a temporary directory laid out as a Hugging Face download:
//   llama3/tokenizer.json, llama3/tokenizer_config.json, llama3/original/tokenizer.model (tiktoken)
//   spm/tokenizer.model
// and the reference ids that Hugging Face `tokenizers` and sentencepiece gave on real text.
#pragma once

#include <zstd.h>

#include <filesystem>
#include <memory>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "data/tokenizer.h"
#include "tests/data/data_test_util.h"

namespace tuna::testing_data {

inline std::filesystem::path repository_file(const std::string& relative) {
  for (auto dir = std::filesystem::current_path(); !dir.empty(); dir = dir.parent_path()) {
    if (std::filesystem::exists(dir / relative)) return dir / relative;
    if (dir == dir.root_path()) break;
  }
  throw std::runtime_error(relative + " not found above the working directory");
}

// A zstd file's content (frames written with --long=27 need the larger window).
inline std::string unzstd(const std::filesystem::path& path) {
  const std::string packed = read_file(path.string());
  ZSTD_DCtx* ctx = ZSTD_createDCtx();
  ZSTD_DCtx_setParameter(ctx, ZSTD_d_windowLogMax, 27);
  std::string out;
  std::string buffer(1 << 20, '\0');
  ZSTD_inBuffer in{packed.data(), packed.size(), 0};
  while (in.pos < in.size) {
    ZSTD_outBuffer o{buffer.data(), buffer.size(), 0};
    const size_t rc = ZSTD_decompressStream(ctx, &o, &in);
    if (ZSTD_isError(rc)) throw std::runtime_error(path.string() + ": " + ZSTD_getErrorName(rc));
    out.append(buffer.data(), o.pos);
  }
  ZSTD_freeDCtx(ctx);
  return out;
}

class TokenizerFixtures {
 public:
  static const TokenizerFixtures& get() {
    static const TokenizerFixtures fixtures;
    return fixtures;
  }
  std::string llama3_dir() const { return (dir_.path() / "llama3").string(); }
  std::string llama3_json() const { return (dir_.path() / "llama3/tokenizer.json").string(); }
  std::string llama3_tiktoken() const { return (dir_.path() / "llama3/original/tokenizer.model").string(); }
  std::string spm_model() const { return (dir_.path() / "spm/tokenizer.model").string(); }
  // Loaded once per process (a Llama 3 tokenizer takes a fraction of a second to load).
  const Tokenizer& llama3() const { return loaded(llama3_, llama3_json()); }
  const Tokenizer& llama3_from_tiktoken() const { return loaded(tiktoken_, llama3_tiktoken()); }
  const Tokenizer& spm() const { return loaded(spm_, spm_model()); }
  // The tokenizer.json pipelines of pipelines.json.zst (gpt_neox, mistral, starcoder, claude, deepseek_coder, and
  // llama3 on the same texts): each a model directory (tokenizer.json, and tokenizer_config.json where the package
  // ships one).
  std::vector<std::string> pipelines() const {
    std::vector<std::string> names;
    for (const auto& [name, ids] : pipelines_.at("ids").items()) names.push_back(name);
    return names;
  }
  std::string pipeline_dir(const std::string& name) const { return (dir_.path() / name).string(); }
  // Texts, probes, then the random slices; the library's ids of each, and its decoded text of each (the text itself
  // unless the reference says otherwise).
  const std::vector<std::string>& pipeline_texts() const { return pipeline_texts_; }
  const std::vector<std::string>& slice_bytes() const { return slice_bytes_; }
  std::vector<std::vector<int32_t>> pipeline_ids(const std::string& name) const {
    return pipelines_.at("ids").at(name).get<std::vector<std::vector<int32_t>>>();
  }
  std::vector<std::string> pipeline_decoded(const std::string& name) const {
    std::vector<std::string> out = pipeline_texts_;
    for (const auto& d : pipelines_.at("decoded").at(name)) out[d.at(0).get<size_t>()] = d.at(1).get<std::string>();
    return out;
  }
  // Texts then probes, and the reference ids of each under `key` (llama3_text, llama3_special, spm).
  const std::vector<std::string>& texts() const { return texts_; }
  std::vector<std::vector<int32_t>> ids(const std::string& key) const {
    return reference_.at("ids").at(key).get<std::vector<std::vector<int32_t>>>();
  }
  size_t real_texts() const { return reference_.at("texts").size(); }
  // The conversations of the chat-template references (ids under chat_llama3, chat_llama2).
  std::vector<std::vector<std::pair<std::string, std::string>>> chats() const {
    std::vector<std::vector<std::pair<std::string, std::string>>> out;
    for (const auto& chat : reference_.at("chats")) {
      out.emplace_back();
      for (const auto& m : chat) out.back().emplace_back(m.at("role").get<std::string>(), m.at("content").get<std::string>());
    }
    return out;
  }

 private:
  TokenizerFixtures() {
    const auto root = repository_file("tests/fixtures/tokenizers");
    for (const char* file : {"llama3/tokenizer.json", "llama3/tokenizer_config.json", "llama3/original/tokenizer.model"})
      write_file((dir_.path() / file).string(), unzstd(root / (std::string(file) + ".zst")));
    std::filesystem::create_directories(dir_.path() / "spm");
    std::filesystem::copy_file(root / "spm/tokenizer.model", dir_.path() / "spm/tokenizer.model");
    reference_ = nlohmann::json::parse(unzstd(root / "reference.json.zst"));
    for (const auto& t : reference_.at("texts")) texts_.push_back(t.at("text").get<std::string>());
    for (const auto& p : reference_.at("probes")) texts_.push_back(p.get<std::string>());
    pipelines_ = nlohmann::json::parse(unzstd(root / "pipelines.json.zst"));
    pipeline_texts_ = texts_;
    for (const auto& slice : pipelines_.at("slices")) {
      pipeline_texts_.push_back(slice.at("text").get<std::string>());
      const std::string hex = slice.at("raw").get<std::string>();
      std::string bytes;
      for (size_t i = 0; i + 1 < hex.size(); i += 2) bytes.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
      slice_bytes_.push_back(bytes);
    }
    for (const auto& [name, ids] : pipelines_.at("ids").items()) {
      if (name == "llama3") continue;
      std::filesystem::create_directories(dir_.path() / name);
      for (const char* file : {"tokenizer.json", "tokenizer_config.json"})
        if (std::filesystem::exists(root / name / (std::string(file) + ".zst")))
          write_file((dir_.path() / name / file).string(), unzstd(root / name / (std::string(file) + ".zst")));
    }
  }
  const Tokenizer& loaded(std::unique_ptr<Tokenizer>& slot, const std::string& path) const {
    if (!slot) slot = std::make_unique<Tokenizer>(path);  // tests load from one thread
    return *slot;
  }
  TempDir dir_;
  mutable std::unique_ptr<Tokenizer> llama3_, tiktoken_, spm_;
  nlohmann::json reference_, pipelines_;
  std::vector<std::string> texts_, pipeline_texts_, slice_bytes_;
};

}  // namespace tuna::testing_data
