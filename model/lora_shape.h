// Adapters (LoRA) and the storage of a frozen base: the shapes that the memory plan, build/plan and the trainer
// share, so that what is planned is what is allocated.
//
// An adapter on a Linear W [out, in] adds (alpha / r) B A x, with A [r, in] and B [out, r]. Under tensor
// parallelism the adapter follows its Linear's Megatron split, so that each rank's product stays local:
//   column-parallel (q, k, v, gate, up: out split): A [r, in] whole on every tp rank, B [out / tp, r];
//   row-parallel (o, down: in split): A [r, in / tp], B [out, r] whole on every tp rank.
// The replicated factor's gradient needs a sum over tp of an r-wide product (the only extra tp traffic).
// With adapters the base is frozen: no gradient, no fp32 master, no moments. QLoRA stores the decoder's Linear
// weights in 4-bit NormalFloat (bitsandbytes' layout); the embedding, the norms and lm_head stay bf16.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/layout.h"
#include "model/lora.h"  // LoraTarget, kAllLoraTargets, parse_lora_targets

namespace tuna {

// How the frozen base is stored on the GPU (the CPU backend keeps fp32 unless quantized the same way).
enum class BaseQuant { None, Nf4, Int8 };
// "none" | "nf4" | "int8"; anything else is a tuna::Error naming `source`.
BaseQuant parse_base_quant(const std::string& text, const std::string& source);
const char* base_quant_name(BaseQuant q);


// The adapters of a run (model/lora.h's LoraConfig: rank 0 is a full fine-tune) and how its frozen base is stored.
struct LoraPlan : LoraConfig {
  BaseQuant base_quant = BaseQuant::None;
  bool targets_module(size_t i) const { return (targets >> i) & 1u; }
};

// "LoRA r16 on all 7 modules", "QLoRA (nf4) r8 on q_proj,v_proj", "full fine-tune".
std::string describe_lora(const LoraPlan& lora);
// Refuses a plan the model cannot take, naming `source`: a rank above the smaller dimension of a target, no
// targets, a dropout outside [0, 1). (A quantized base without adapters is the support table's, model/support.h.)
void check_lora_plan(const LlamaConfig& config, const LoraPlan& lora, const std::string& source);

// One target's adapter on one tp rank.
struct LoraTargetShape {
  std::string module;            // "q_proj"
  int64_t in = 0, out = 0;       // the Linear's features on this tp rank (in split for row-parallel, out for column)
  bool column_parallel = true;   // q, k, v, gate, up
  int64_t a_rows = 0, a_cols = 0, b_rows = 0, b_cols = 0;  // A [r, in] and B [out, r], local
  int64_t params() const { return a_rows * a_cols + b_rows * b_cols; }
};
// The targeted modules of one decoder layer on tp rank 0 of `tp` (the largest share when ffn splits unevenly).
std::vector<LoraTargetShape> lora_layer_shapes(const LlamaConfig& config, const LoraPlan& lora, int64_t tp);
// Adapter parameters of one layer / of the model, on one tp rank.
int64_t lora_layer_params(const LlamaConfig& config, const LoraPlan& lora, int64_t tp);
int64_t lora_params(const LlamaConfig& config, const LoraPlan& lora, int64_t tp);

// Whether the base stores this tensor quantized: the decoder layers' Linear weights (2-D, in a layer).
bool base_tensor_quantized(const ParamTensor& t);
// Bytes of one frozen base tensor of `numel` elements in `rows` rows, stored as `quant`:
//   none: bf16, 2 bytes each;
//   nf4 (bitsandbytes, blocksize 64, double-quantized absmax): numel / 2 bytes of codes, one 8-bit absmax per 64
//       elements, one fp32 scale per 256 absmax and one fp32 mean per tensor (0.127 extra bits per element);
//   int8: one byte each and one fp32 absmax per row.
// The code tables (16 and 256 floats) are constants shared by every tensor, not counted.
int64_t base_tensor_bytes(int64_t numel, int64_t rows, BaseQuant quant);
// A frozen base tensor's bytes as the plan stores it: quantized when base_tensor_quantized, else bf16.
int64_t base_storage_bytes(const ParamTensor& t, BaseQuant quant);

}  // namespace tuna
