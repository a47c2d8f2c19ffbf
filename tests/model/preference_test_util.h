// Helpers of the preference tests (tests/model/test_objective.cpp on the CPU model, tests/engine/
// test_engine_preference_gpu.cpp on the engines): the TRL fixtures (tests/fixtures/preference_*, made by
// tools/reference/make_preference_fixtures.py), their cases' objective settings, and their pairs packed into windows.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kernels/cpu/classifier.h"  // kIgnoreIndex
#include "model/objective.h"

namespace tuna::testing_util {

inline ObjectiveConfig config_of(const nlohmann::json& c) {
  const bool lora = c.at("lora");
  return make_objective_config(c.at("objective"), c.at("beta"), c.at("loss_type"), c.at("simpo_gamma"),
                               c.at("rpo_alpha"), lora ? "adapters" : "auto", lora);
}

// The fixture's three pairs, packed into rows of T tokens: a pair per row (T = the longest pair), or all in one row.
struct PackedPairs {
  int64_t batch = 0, seq = 0, pairs = 0;
  std::vector<int32_t> inputs, targets, positions, sequence;
  std::vector<uint8_t> completion;
  PairRows rows() const { return PairRows{sequence.data(), completion.data(), batch * seq, pairs}; }
};

inline PackedPairs pack(const nlohmann::json& pairs, bool one_row) {
  PackedPairs out;
  out.pairs = static_cast<int64_t>(pairs.size());
  std::vector<std::vector<int32_t>> docs;  // 2p chosen, 2p + 1 rejected: prompt + completion
  std::vector<size_t> prompt_len;
  int64_t longest = 0, total = 0;
  for (const auto& p : pairs) {
    const std::vector<int32_t> prompt = p.at("prompt");
    int64_t both = 0;
    for (const char* key : {"chosen", "rejected"}) {
      std::vector<int32_t> doc = prompt;
      for (int32_t t : p.at(key)) doc.push_back(t);
      both += static_cast<int64_t>(doc.size());
      docs.push_back(doc), prompt_len.push_back(prompt.size());
    }
    longest = std::max(longest, both), total += both;
  }
  out.batch = one_row ? 1 : out.pairs;
  out.seq = one_row ? total + 5 : longest + 2;  // some padding either way
  const int64_t n = out.batch * out.seq;
  out.inputs.assign(n, 0), out.targets.assign(n, cpu::kIgnoreIndex), out.positions.assign(n, 0);
  out.sequence.assign(n, -1), out.completion.assign(n, 0);
  int64_t at = 0;
  for (size_t d = 0; d < docs.size(); ++d) {
    if (!one_row && d % 2 == 0) at = static_cast<int64_t>(d / 2) * out.seq;
    for (size_t j = 0; j < docs[d].size(); ++j, ++at) {
      out.inputs[at] = docs[d][j];
      out.positions[at] = static_cast<int32_t>(j);
      out.sequence[at] = static_cast<int32_t>(d);  // 2p or 2p + 1 (pairs numbered across rows)
      if (j + 1 < docs[d].size()) {
        out.targets[at] = docs[d][j + 1];
        out.completion[at] = j + 1 >= prompt_len[d];
      }
    }
  }
  return out;
}

struct PreferenceFixture {
  std::string base;
  std::filesystem::path dir;
  nlohmann::json meta;
  explicit PreferenceFixture(const std::string& base_name)
      : base(base_name), dir(std::filesystem::path("tests/fixtures") / ("preference_" + base_name)) {
    std::ifstream in(dir / "reference.json");
    meta = nlohmann::json::parse(in);
  }
  const nlohmann::json& cases() const { return meta.at("cases"); }
};

}  // namespace tuna::testing_util
