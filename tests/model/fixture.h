// The transformers fixtures of tools/reference/make_fixtures.py, read once for every model test (CPU and GPU).
#pragma once

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/optimizer.h"
#include "ckpt/safetensors.h"

namespace tuna::testing_util {

// ||ours * scale - ref|| / ||ref||: the error measure of every parity test.
inline double rel_err_norm(const float* ours, const double* ref, int64_t n, double scale = 1.0) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; i++) {
    const double d = double(ours[i]) * scale - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// Greedy decoding: extends `tokens` to `length` tokens, each the argmax of the logits that
// last_logits(tokens, n_new) returns for the last position after the sequence grew by n_new tokens (the whole
// prompt first, then 1 at a time). The model tests run it with and without a KV cache.
template <typename LastLogits>
std::vector<int32_t> greedy_tokens(std::vector<int32_t> tokens, int64_t length, int64_t vocab, LastLogits&& last_logits) {
  int64_t n_new = static_cast<int64_t>(tokens.size());
  while (static_cast<int64_t>(tokens.size()) < length) {
    const float* row = last_logits(tokens, n_new);
    tokens.push_back(static_cast<int32_t>(std::max_element(row, row + vocab) - row));
    n_new = 1;
  }
  return tokens;
}

// greedy_tokens' logits by rerunning the whole context: any model with forward_logits(tokens, batch, seq, out);
// `logits` holds [length, vocab].
template <typename Model>
auto whole_context_logits(Model& model, std::vector<float>& logits, int64_t vocab) {
  return [&model, &logits, vocab](const std::vector<int32_t>& tokens, int64_t) {
    const int64_t n = static_cast<int64_t>(tokens.size());
    model.forward_logits(tokens.data(), 1, n, logits.data());
    return logits.data() + (n - 1) * vocab;
  };
}

// tests/fixtures/<name>: the HF model directory, its batch, and reference.json's hyperparameters.
struct Fixture {
  std::filesystem::path dir;
  LlamaConfig config;
  int64_t batch = 0, seq = 0;
  std::vector<int32_t> inputs, targets;
  nlohmann::json meta;

  explicit Fixture(const std::string& name) : dir(std::filesystem::path("tests/fixtures") / name) {
    config = LlamaConfig::load(dir.string());
    SafetensorsFile ref(dir / "reference.safetensors");
    const TensorInfo* info = ref.find("input_ids");
    if (!info) throw std::runtime_error("fixture has no input_ids");
    batch = info->shape[0];
    seq = info->shape[1];
    inputs.resize(batch * seq);
    targets.resize(batch * seq);
    ref.read_i32("input_ids", {batch, seq}, inputs.data());
    ref.read_i32("targets", {batch, seq}, targets.data());
    std::ifstream in(dir / "reference.json");
    meta = nlohmann::json::parse(in);
  }

  // The AdamW and schedule settings the 10 reference steps used.
  OptimizerConfig optimizer() const {
    OptimizerConfig oc;
    oc.lr = meta.at("lr");
    oc.min_lr = meta.at("min_lr");
    oc.warmup_steps = meta.at("warmup_steps");
    oc.schedule = meta.at("schedule");
    oc.beta1 = meta.at("beta1");
    oc.beta2 = meta.at("beta2");
    oc.eps = meta.at("eps");
    oc.weight_decay = meta.at("weight_decay");
    oc.grad_clip = meta.at("grad_clip");
    return oc;
  }
};

}  // namespace tuna::testing_util
