// LoRA adapters (Hu et al. 2021) as Hugging Face PEFT defines them: a targeted Linear layer computes
// W x + (alpha / r) B A dropout(x), with A [r, in] and B [out, r] trained and W frozen.
//
// The adapters of a model live in one flat buffer described by a ParamLayout of their own (lora_layout): PEFT's
// tensor names ("base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"), one unit per decoder layer.
// So AdamW, ZeRO's pieces and the rank-file checkpoints work on adapters exactly as on a whole model.
//
// Tensor parallelism splits them consistently with Megatron's layers (model/layout.h): for the column-parallel
// projections (q, k, v, gate, up) A is replicated and B is split by rows like W; for the row-parallel ones (o,
// down) A is split by columns like W and B is replicated. Each rank then holds its share, and the adapter's
// r-wide intermediate A x is whole on every rank (row-parallel: after a sum over tp).
#pragma once

#include <nlohmann/json.hpp>

#include <array>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/layout.h"

namespace tuna {

// PEFT's module names for the seven projections of a LLaMA decoder layer, in forward order.
enum class LoraTarget : int { Q, K, V, O, Gate, Up, Down };
inline constexpr int kLoraTargets = 7;
inline constexpr uint32_t kAllLoraTargets = (1u << kLoraTargets) - 1;
const char* lora_target_name(LoraTarget t);  // "q_proj", ..., "down_proj"
// "self_attn" or "mlp": the module the projection sits in (PEFT's key names carry it).
const char* lora_target_module(LoraTarget t);
// Row-parallel under tp (o, down): the input is split, so A is split by columns and B replicated.
bool lora_target_row_parallel(LoraTarget t);

struct LoraConfig {
  int64_t rank = 0;       // r; 0: no adapters (a full fine-tune)
  double alpha = 0;       // lora_alpha; the update is scaled by alpha / r
  double dropout = 0;     // lora_dropout, on the adapter's input only
  uint32_t targets = kAllLoraTargets;  // bit i: LoraTarget(i) has an adapter

  bool enabled() const { return rank > 0; }
  bool has(LoraTarget t) const { return (targets >> static_cast<int>(t)) & 1u; }
  double scale() const { return alpha / static_cast<double>(rank); }
};

// "q_proj,v_proj" -> bits; fails naming option 'lora_targets', the unknown name and the valid ones.
uint32_t parse_lora_targets(const std::string& list);
std::string lora_targets_string(uint32_t targets);  // in forward order, comma-separated
// A projection's [out, in] in the whole model.
std::array<int64_t, 2> lora_target_shape(const LlamaConfig& config, LoraTarget t);
// Fails naming the option: rank < 1 or above a targeted layer's smaller dimension, alpha <= 0 or not finite,
// dropout not in [0, 1), no targets.
void validate_lora(const LoraConfig& lora, const LlamaConfig& config);

// Where one layer's adapters are in the adapter buffer; -1 where the projection has none.
struct LoraOffsets {
  std::array<int64_t, kLoraTargets> a, b;
};
// PEFT's key of an adapter tensor: which = 'A' or 'B'.
std::string lora_tensor_name(int64_t layer, LoraTarget t, char which);

struct LoraLayout {
  ParamLayout params;                // PEFT names, one unit per decoder layer, this tp rank's blocks
  std::vector<LoraOffsets> layers;   // per decoder layer
};
LoraLayout lora_layout(const LlamaConfig& config, const LoraConfig& lora, int tp_rank = 0, int tp_size = 1);

// PEFT's adapter_config.json for these adapters on the base model at base_path.
nlohmann::json peft_adapter_config(const LoraConfig& lora, const std::string& base_path);
// An adapter_config.json (a file, or DIR/adapter_config.json): rank, alpha, dropout and targets. Fails naming the
// file and field for what tuna does not train as PEFT would (a peft_type other than LORA, bias other than "none",
// rslora, DoRA, per-module rank or alpha patterns, modules_to_save, targets that are not the seven projections).
LoraConfig read_peft_adapter_config(const std::filesystem::path& path);

}  // namespace tuna
