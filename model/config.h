// LlamaConfig: the model's shape, read from a Hugging Face config.json.
//
// tuna trains what LlamaForCausalLM computes: pre-norm decoder layers (RMSNorm, grouped-query attention
// with rotary positions, SwiGLU MLP), no biases. Fields that would change that function and that tuna
// does not implement (attention_bias, mlp_bias, a rope type other than default/llama3/linear/dynamic/yarn, another
// activation) are refused with an error that names the field, rather than trained wrongly.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cpu/rope.h"  // RopeScaling

namespace tuna {

struct LlamaConfig {
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  cpu::RopeScaling rope_scaling;  // type "default" when config.json has none
  bool tie_word_embeddings = false;
  int64_t bos_token_id = -1;               // -1: not given
  std::vector<int64_t> eos_token_ids;      // Llama 3 instruct configs list several
  std::string torch_dtype = "float32";     // the dtype the weights were published in

  // Parses and validates; `source` (a path) prefixes every error message.
  static LlamaConfig from_json(const nlohmann::json& j, const std::string& source);
  // Reads a config.json file, or DIR/config.json when given a directory.
  static LlamaConfig load(const std::string& path);
  // A config.json that transformers reads back as the same model.
  nlohmann::json to_json() const;

  int64_t q_dim() const { return num_attention_heads * head_dim; }
  int64_t kv_dim() const { return num_key_value_heads * head_dim; }
  int64_t n_params() const;
  // The longest sequence the model is meant for: max_position_embeddings, which for dynamic and yarn rope
  // scaling is the original context (transformers scales from it), so for those max_position_embeddings x factor.
  int64_t max_context() const;
};

// Fails when seq_len (option `option`) exceeds max_context(): positions the model was never trained on. A run
// that extends the context scales the rope (--rope_scaling, apply_rope_scaling), which the config then
// carries, so that every checkpoint and the export say what the model was trained for (servers such as vLLM
// take their maximum length from it).
void check_seq_len(const LlamaConfig& config, int64_t seq_len, const std::string& option,
                   const std::string& config_path);

// --rope_scaling TYPE:FACTOR (linear, dynamic or yarn, FACTOR > 1): scales an unscaled rope to train a context
// FACTOR times longer, in `config` and in `config_json` (the config.json every checkpoint and export carries, so
// that transformers and llama.cpp run what was trained). linear also multiplies max_position_embeddings by FACTOR;
// dynamic and yarn keep it, as the original context they scale from. A config that already has this scaling (a
// resumed run) is left as it is; one with another scaling is refused. Empty spec: nothing.
void apply_rope_scaling(LlamaConfig& config, nlohmann::json& config_json, const std::string& spec,
                        const std::string& option, const std::string& config_path);

// Model FLOPs of one trained token (forward + backward), the numerator of MFU: 6 per matmul weight (the
// lm_head included; the embedding lookup not, unless tied, when the head's product counts it) plus causal
// attention's 6 * seq * q_dim per layer (QK^T and PV over seq/2 keys on average, 2 FLOPs per multiply-add,
// backward twice the forward).
double model_flops_per_token(const LlamaConfig& config, int64_t seq);

}  // namespace tuna
