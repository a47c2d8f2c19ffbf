// Shared by the prepare benches: a synthetic legal-sounding corpus generated on the fly from the demo
// corpus (a word bigram chain over demo/corpus/text), and a tokenizer trained on the demo corpus.
#pragma once

#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "data/tokenizer.h"

namespace tuna::bench_prepare {

inline std::filesystem::path demo_corpus() {
  for (auto dir = std::filesystem::current_path(); !dir.empty(); dir = dir.parent_path()) {
    if (std::filesystem::is_directory(dir / "demo/corpus/text")) return dir / "demo/corpus/text";
    if (dir == dir.root_path()) break;
  }
  throw std::runtime_error("demo/corpus/text not found above the working directory (run from the repository)");
}

// Words of the demo corpus with their successors: a bigram chain generates text with the corpus's phrases
// (so documents share boilerplate n-grams, as real filings do) but no two documents alike.
class Chain {
 public:
  Chain() {
    std::vector<std::filesystem::path> files;
    for (const auto& e : std::filesystem::recursive_directory_iterator(demo_corpus()))
      if (e.is_regular_file()) files.push_back(e.path());
    std::sort(files.begin(), files.end());
    std::string prev;
    for (const auto& f : files) {
      std::ifstream in(f);
      std::string w;
      while (in >> w) {
        const uint32_t id = intern(w);
        if (!prev.empty()) next_[intern(prev)].push_back(id);
        prev = w;
      }
    }
  }
  // A document of n words, one line (no '\n', so that spm_encode's line input sees the same text).
  std::string document(std::mt19937_64& rng, int n) const {
    std::string out;
    uint32_t w = static_cast<uint32_t>(rng() % words_.size());
    for (int i = 0; i < n; ++i) {
      if (i) out += ' ';
      out += words_[w];
      auto it = next_.find(w);
      w = it == next_.end() || rng() % 16 == 0 ? static_cast<uint32_t>(rng() % words_.size())
                                                : it->second[rng() % it->second.size()];
    }
    return out;
  }
  const std::string& random_word(std::mt19937_64& rng) const { return words_[rng() % words_.size()]; }

 private:
  uint32_t intern(const std::string& w) {
    auto [it, added] = ids_.emplace(w, static_cast<uint32_t>(words_.size()));
    if (added) words_.push_back(w);
    return it->second;
  }
  std::vector<std::string> words_;
  std::unordered_map<std::string, uint32_t> ids_;
  std::unordered_map<uint32_t, std::vector<uint32_t>> next_;
};

// A BPE tokenizer trained (once per directory) on the demo corpus, LLaMA's settings.
inline std::string demo_tokenizer(const std::filesystem::path& dir, int vocab) {
  const std::string prefix = (dir / ("tok" + std::to_string(vocab))).string();
  if (!std::filesystem::exists(prefix + ".model")) {
    std::vector<std::string> files;
    for (const auto& e : std::filesystem::recursive_directory_iterator(demo_corpus()))
      if (e.is_regular_file()) files.push_back(e.path().string());
    std::sort(files.begin(), files.end());
    train_tokenizer(files, prefix, vocab, {});
  }
  return prefix + ".model";
}

}  // namespace tuna::bench_prepare
