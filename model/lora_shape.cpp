// Adapter shapes and the frozen base's storage (model/lora_shape.h).
#include "model/lora_shape.h"


#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "kernels/cpu/nf4.h"

namespace tuna {

BaseQuant parse_base_quant(const std::string& text, const std::string& source) {
  if (text == "none") return BaseQuant::None;
  if (text == "nf4") return BaseQuant::Nf4;
  if (text == "int8") return BaseQuant::Int8;
  fail(source, ": expected none, nf4 or int8, found '", text, "'");
}

const char* base_quant_name(BaseQuant q) {
  switch (q) {
    case BaseQuant::None: return "none";
    case BaseQuant::Nf4: return "nf4";
    case BaseQuant::Int8: return "int8";
  }
  return "?";
}

std::string describe_lora(const LoraPlan& lora) {
  if (!lora.enabled()) return "full fine-tune";
  std::string targets;
  if ((lora.targets & kAllLoraTargets) == kAllLoraTargets) {
    targets = "all 7 modules";
  } else {
    for (size_t i = 0; i < kLoraTargets; i++)
      if (lora.targets_module(i)) targets += (targets.empty() ? "" : ",") + std::string(lora_target_name(static_cast<LoraTarget>(i)));
  }
  const std::string method =
      lora.base_quant == BaseQuant::None ? "LoRA" : str("QLoRA (", base_quant_name(lora.base_quant), ")");
  return str(method, " r", lora.rank, " on ", targets, lora.dropout > 0 ? str(", dropout ", lora.dropout) : "");
}

void check_lora_plan(const LlamaConfig& c, const LoraPlan& lora, const std::string& source) {
  if (lora.rank < 0) fail(source, ": lora_rank must be >= 0 (0: a full fine-tune), found ", lora.rank);
  if (!lora.enabled()) return;  // a quantized base without adapters: the support table's (model/support.h)
  if ((lora.targets & kAllLoraTargets) == 0) fail(source, ": lora_rank ", lora.rank, " with no lora_targets");
  if (!std::isfinite(lora.dropout) || lora.dropout < 0 || lora.dropout >= 1)
    fail(source, ": lora_dropout must be in [0, 1), found ", lora.dropout);
  for (const LoraTargetShape& t : lora_layer_shapes(c, lora, 1)) {
    const int64_t smaller = std::min(t.in, t.out);
    if (lora.rank > smaller)
      fail(source, ": lora_rank ", lora.rank, " is more than ", t.module, "'s smaller dimension ", smaller, " (",
           t.out, " x ", t.in, "): a rank above it adds parameters and no capacity");
  }
}

std::vector<LoraTargetShape> lora_layer_shapes(const LlamaConfig& c, const LoraPlan& lora, int64_t tp) {
  std::vector<LoraTargetShape> shapes;
  if (!lora.enabled()) return shapes;
  const ParamLayout layout(c, 0, static_cast<int>(tp));  // refuses a tp that splits kv groups, naming it
  const TpDims& d = layout.tp();
  const int64_t C = c.hidden_size, r = lora.rank;
  struct Linear {
    const char* module;
    int64_t in, out;
    bool column;
  };
  const Linear linears[] = {{"q_proj", C, d.q_dim, true},    {"k_proj", C, d.kv_dim, true},
                            {"v_proj", C, d.kv_dim, true},   {"o_proj", d.q_dim, C, false},
                            {"gate_proj", C, d.ffn, true},   {"up_proj", C, d.ffn, true},
                            {"down_proj", d.ffn, C, false}};
  for (size_t i = 0; i < kLoraTargets; i++) {
    const Linear& l = linears[i];
    if (!lora.targets_module(i)) continue;
    LoraTargetShape s;
    s.module = l.module, s.in = l.in, s.out = l.out, s.column_parallel = l.column;
    s.a_rows = r, s.a_cols = l.in;   // column: in is whole; row: in is this rank's slice
    s.b_rows = l.out, s.b_cols = r;  // column: out is this rank's slice; row: out is whole
    shapes.push_back(s);
  }
  return shapes;
}

int64_t lora_layer_params(const LlamaConfig& c, const LoraPlan& lora, int64_t tp) {
  int64_t n = 0;
  for (const LoraTargetShape& s : lora_layer_shapes(c, lora, tp)) n += s.params();
  return n;
}

int64_t lora_params(const LlamaConfig& c, const LoraPlan& lora, int64_t tp) {
  return c.num_hidden_layers * lora_layer_params(c, lora, tp);
}

bool base_tensor_quantized(const ParamTensor& t) { return t.layer >= 0 && t.shape.size() == 2; }

int64_t base_tensor_bytes(int64_t numel, int64_t rows, BaseQuant quant) {
  TUNA_CHECK(numel >= 0 && rows >= 1, "numel ", numel, ", rows ", rows);
  switch (quant) {
    case BaseQuant::None: return 2 * numel;
    case BaseQuant::Nf4: return cpu::nf4_sizes(numel).bytes();  // what QuantizedWeights allocates
    case BaseQuant::Int8: return numel + 4 * rows;
  }
  return 0;
}

int64_t base_storage_bytes(const ParamTensor& t, BaseQuant quant) {
  if (!base_tensor_quantized(t)) return 2 * t.numel;
  return base_tensor_bytes(t.numel, t.shape[0], quant);
}

}  // namespace tuna
