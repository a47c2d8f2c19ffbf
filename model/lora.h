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

#include "kernels/cpu/lora.h"  // lora_dropout_keeps: the one definition of the mask
#include "model/config.h"
#include "model/layout.h"
#include "model/optimizer.h"  // Segment

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

// The inputs the projections read: q, k and v the attention's normed input, o the attention's output, gate and up the
// MLP's normed input, down the SwiGLU's output. The adapters on one input share its GEMMs: one down-projection for
// all their A's stacked, one product for their input gradient (model/llama.cpp), so x is read and packed once.
enum class LoraInput : int { Attention, AttentionOut, Mlp, MlpOut };
inline constexpr int kLoraInputs = 4;
LoraInput lora_target_input(LoraTarget t);
// The projections that read input g, in forward order.
std::vector<LoraTarget> lora_input_targets(LoraInput g);

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
// With a pipeline stage (--pp): the adapters of the stage's layers only, under their global names and random streams
// (so a stage starts from the whole model's adapters and its checkpoint pieces are global tensors); the units of the
// other stages' layers stay in the numbering, empty, and their offsets -1.
LoraLayout lora_layout(const LlamaConfig& config, const LoraConfig& lora, int tp_rank = 0, int tp_size = 1,
                       const PipelineStage* stage = nullptr);

// The adapters PEFT starts from (init_lora_weights=True): A kaiming-uniform with a = sqrt(5), which is U(-1/sqrt(in),
// 1/sqrt(in)) with `in` the whole layer's in_features, and B zero, so the model starts as the base. Elements
// [piece.begin, piece.begin + piece.size) of the adapter layout (any tp rank's) into out: each A is drawn whole, in
// order, from its own stream (seed, tensor index) and cut to this rank's block, so every tp and dp layout starts
// from the same adapters.
void init_lora_weights_piece(const ParamLayout& adapters, uint64_t seed, const Segment& piece, float* out);

// Dropout on the adapter's input, reproducible: whether element `index` of a target's input survives is a pure
// function of (run seed, step, micro-batch, dp rank, layer, target, index), a counter-based stream (splitmix64 at
// that counter), so the backward regenerates the forward's mask instead of keeping it, and a restarted run draws the
// same masks. The index is the element's place in the whole layer's input (row * in_features + column), so the
// tensor-parallel split of a row-parallel input (o, down) does not change the mask.
uint64_t lora_dropout_key(uint64_t seed, int64_t step, int64_t micro_batch, int dp_rank);
uint64_t lora_dropout_stream(uint64_t key, int64_t layer, LoraTarget t);
// lora_dropout_keeps (kernels/cpu/lora.h): whether an element survives, by its stream and index.

// Trainable parameters of the adapters in the whole model (every tp rank's together).
int64_t lora_parameter_count(const LlamaConfig& config, const LoraConfig& lora);
// Model FLOPs of one trained token with adapters (MFU's numerator, as model_flops_per_token for a full fine-tune):
// the frozen base's matmul weights cost 4 each (the forward and the input gradient; no weight gradient), attention
// the same as there, and each adapter weight 6 (both of its products train).
double lora_flops_per_token(const LlamaConfig& config, const LoraConfig& lora, int64_t seq);

// PEFT's adapter_config.json for these adapters on the base model at base_path.
nlohmann::json peft_adapter_config(const LoraConfig& lora, const std::string& base_path);
// An adapter_config.json (a file, or DIR/adapter_config.json): rank, alpha, dropout and targets. Fails naming the
// file and field for what tuna does not train as PEFT would (a peft_type other than LORA, bias other than "none",
// rslora, DoRA, per-module rank or alpha patterns, modules_to_save, targets that are not the seven projections).
LoraConfig read_peft_adapter_config(const std::filesystem::path& path);

}  // namespace tuna
