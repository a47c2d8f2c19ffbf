// The support table (model/support.h): every rule of what runs where, in the order they are asked.
#include "model/support.h"

#include "core/error.h"
#include "kernels/attention_path.h"  // attention_path_option
#include "kernels/cpu/nf4.h"         // nf4_sizes
#include "model/layout.h"
#include "model/lora_shape.h"  // base_tensor_quantized, base_quant_name
#include "model/objective.h"   // ObjectiveConfig: the preference objectives
#include "model/pipeline.h"

namespace tuna {

const char* device_name(Device device) { return device == Device::Cuda ? "cuda" : "cpu"; }

namespace {

template <typename... Args>
Support invalid(const Args&... reason) {
  return {Support::Verdict::Invalid, str(reason...)};
}
template <typename... Args>
Support not_implemented(const Args&... reason) {
  return {Support::Verdict::NotImplemented, str(reason...)};
}

// The layout itself, on any device: its dimensions, its ZeRO stage, what sp and a quantized base need.
Support layout_support(const LlamaConfig& c, const MemoryLayout& l) {
  if (l.dp < 1 || l.tp < 1) return invalid("dp and tp must be >= 1, found dp ", l.dp, ", tp ", l.tp);
  TUNA_CHECK(l.dp_rank >= 0 && l.dp_rank < l.dp && l.tp_rank >= 0 && l.tp_rank < l.tp, "dp rank ", l.dp_rank, " of ",
             l.dp, ", tp rank ", l.tp_rank, " of ", l.tp);
  if (l.pp < 1) return invalid("option 'pp': expected at least 1 pipeline stage, found ", l.pp);
  if (l.pp > c.num_hidden_layers)
    return invalid("option 'pp': expected 1 to ", c.num_hidden_layers, " stages (the model's decoder layers; each stage ",
                   "runs at least one), found ", l.pp);
  if (l.pp_rank < 0 || l.pp_rank >= l.pp)
    return invalid("memory plan: pipeline stage ", l.pp_rank, " of ", l.pp, ": expected a stage in [0, pp) (option 'pp')");
  if (l.zero < 0 || l.zero > 3) return invalid("option 'zero': expected 0, 1, 2 or 3, found ", l.zero);
  if (l.micro_batch < 1 || l.seq_len < 1)
    return invalid("memory plan: micro_batch and seq_len must be >= 1 (found ", l.micro_batch, " and ", l.seq_len, ")");
  if (l.sp && l.tp < 2)
    return invalid("option 'sp' splits each micro-batch's tokens over the tensor-parallel ranks: it needs --tp 2 or more, "
                   "found --tp ", l.tp);
  return base_quant_support(l.lora);
}

// What a training step of either engine does not do yet with pipeline stages and ZeRO.
bool zero3_over_stages(const MemoryLayout& l) { return l.training && l.pp > 1 && l.zero == 3; }
bool quantized_base_sharded(const MemoryLayout& l) {
  return l.training && l.lora.enabled() && l.lora.base_quant != BaseQuant::None && l.zero == 3;
}

// The CPU engine (Llama + Zero): fp32, every parallel mode but two pipeline combinations; the options that change the
// numbers or the activations kept are the CUDA engine's.
Support cpu_support(const LlamaConfig& c, const MemoryLayout& l) {
  if (l.recompute != Recompute::None)
    return not_implemented("option 'recompute' is ", recompute_name(l.recompute), " with --device cpu: activation "
                           "recompute is a CUDA engine feature (GPU memory is what it saves); the CPU backend keeps "
                           "every activation: use --recompute none");
  if (l.bf16_moments) return not_implemented("option 'bf16_moments' is for --device cuda (the CPU backend keeps fp32 moments)");
  if (!l.master_weights)
    return not_implemented("option 'master_weights' false is for --device cuda (the CPU backend trains fp32 weights)");
  if (l.attention != AttentionPath::kDefault)
    return not_implemented("--attention ", attention_path_option(l.attention), " with --device cpu: the attention kernels "
                           "are the CUDA engine's (the CPU backend has one attention): use --attention auto");
  if (zero3_over_stages(l))
    return not_implemented("--zero 3 with --pp ", l.pp, ": not implemented (ZeRO-3 would shard each stage's parameters ",
                           "over dp); use --zero 0, 1 or 2");
  if (l.zero >= 2 && l.tied_across_stages(c))
    return not_implemented("--zero ", l.zero, " with --pp and tied embeddings: not implemented (the first and last ",
                           "stages sum the table's gradient whole); use --zero 0 or 1");
  if (quantized_base_sharded(l))
    return not_implemented("option 'base_quant' ", base_quant_name(l.lora.base_quant), " with --zero 3: sharding a "
                           "quantized base is not implemented; use --zero 0, 1 or 2 (the quantized base is small), or "
                           "--base_quant none");
  return {};
}

// The bytes of the NF4 codes of this stage's projections (tp 1): the CUDA model keeps them in one buffer, after which
// its fp32 statistics must start 4-byte aligned.
int64_t nf4_code_bytes(const LlamaConfig& c, const MemoryLayout& l) {
  const ParamLayout layout = l.pp > 1 ? ParamLayout(c, 0, 1, l.stage()) : ParamLayout(c, 0, 1);
  int64_t packed = 0;
  for (const ParamTensor& t : layout.tensors())
    if (base_tensor_quantized(t)) packed += cpu::nf4_sizes(t.numel).packed_bytes;
  return packed;
}

// What the CUDA engine's design needs of the layout: whole rows per tp rank with sp (Megatron's split: each
// sequence's rows go to the tp ranks in equal runs). (What its kernels need of the model's shapes, the memory plan
// and the model check: model/memory_plan_gpu.cpp, model/llama_gpu.cpp.)
Support cuda_validity(const MemoryLayout& l) {
  if (l.sp && l.seq_len % l.tp != 0)
    return invalid("option 'sp': sequence parallelism splits each sequence over the ", l.tp, " tp ranks; seq_len ",
                   l.seq_len, " does not split evenly (--seq_len ", l.seq_len, " is not a multiple of ", l.tp, ")");
  return {};
}

// --fp8 on the CUDA engine (model/llama_gpu.h): every layout of the bf16 engine (dp at any ZeRO stage, tp with or
// without sp, pp, adapters on a bf16 or nf4 base), where cuBLASLt's FP8 GEMMs take the shapes.
Support cuda_fp8_support(const LlamaConfig& c, const MemoryLayout& l) {
  const std::string fp8 = str("--fp8 ", fp8_mode_name(l.fp8), " with --device cuda");
  // cuBLASLt's FP8 GEMMs take each dimension in multiples of 16 (kernels/matmul.cuh check_fp8_shape).
  const std::pair<int64_t, const char*> dims[] = {{c.hidden_size, "hidden_size"},
                                                  {c.intermediate_size, "intermediate_size"},
                                                  {c.q_dim(), "num_attention_heads x head_dim"},
                                                  {c.kv_dim(), "num_key_value_heads x head_dim"}};
  for (const auto& [dim, name] : dims)
    if (dim % 16 != 0)
      return not_implemented(fp8, ": ", name, " ", dim, " (config.json) is not a multiple of 16, which cuBLASLt's ",
                             "FP8 GEMMs need; use --fp8 off, or --device cpu");
  if (l.micro_batch * l.seq_len % 16 != 0)
    return not_implemented(fp8, ": micro_batch ", l.micro_batch, " x seq_len ", l.seq_len, " = ",
                           l.micro_batch * l.seq_len, " tokens a pass, not a multiple of 16, which cuBLASLt's FP8 GEMMs ",
                           "need; change --micro_batch or --seq_len");
  // With sp the row-parallel GEMMs run in three pieces split at this rank's rows (the residual added to its own).
  if (l.sp && l.micro_batch * l.seq_len % (16 * l.tp) != 0)
    return not_implemented(fp8, " and --sp: micro_batch ", l.micro_batch, " x seq_len ", l.seq_len, " = ",
                           l.micro_batch * l.seq_len, " tokens a pass give each of the ", l.tp, " tp ranks ",
                           l.micro_batch * l.seq_len / l.tp, " rows, not a multiple of 16, which cuBLASLt's FP8 GEMMs ",
                           "need; change --micro_batch or --seq_len");
  return {};
}

// The CUDA engine (LlamaGpu with the GPU ZeRO): pipeline stages at ZeRO 0 and 1, and a quantized base in nf4 at tp 1,
// below ZeRO-3.
Support cuda_support(const LlamaConfig& c, const MemoryLayout& l) {
  if (l.training && l.fp8 != Fp8Mode::Off)  // a forward alone (eval, sample) runs in bf16
    if (Support fp8 = cuda_fp8_support(c, l); !fp8.runs()) return fp8;
  if (l.training && l.pp > 1 && l.zero >= 2)
    return not_implemented("option 'pp' ", l.pp, " with --device cuda and --zero ", l.zero, ": the CUDA engine runs ",
                           "pipeline stages with ZeRO 0 and 1 only (--pp with --zero 2 or 3 is the design); use --zero ",
                           "0 or 1, or --device cpu");
  if (!l.lora.enabled() || l.lora.base_quant == BaseQuant::None) return {};
  const char* quant = base_quant_name(l.lora.base_quant);
  if (l.lora.base_quant == BaseQuant::Int8)
    return not_implemented("option 'base_quant' int8 with --device cuda: an int8 frozen base is not implemented on the ",
                           "CUDA engine; use --base_quant nf4 (QLoRA) or none (a bf16 base), or --device cpu");
  if (l.tp > 1)
    return not_implemented("option 'base_quant' ", quant, " with --tp ", l.tp, " and --device cuda: not implemented (the ",
                           "CUDA model quantizes its own block of each tensor, a base that would depend on tp; the CPU ",
                           "engine quantizes whole tensors); use --tp 1, or --device cpu");
  if (quantized_base_sharded(l))
    return not_implemented("--base_quant ", quant, " with --device cuda and --zero 3: sharding a quantized base over dp ",
                           "is not implemented; use --zero 2 (the base whole on every rank) or a bf16 base");
  if (const int64_t packed = nf4_code_bytes(c, l); packed % 4 != 0)
    return not_implemented("--base_quant nf4 with --device cuda: the NF4 codes of this model's projections take ", packed,
                           " bytes, not a multiple of 4 (a projection with an odd number of elements), which the ",
                           "device layout does not take");
  return {};
}

}  // namespace

namespace {
Support validity(const LlamaConfig& config, const MemoryLayout& layout, Device device) {
  if (Support s = layout_support(config, layout); !s.runs()) return s;
  return device == Device::Cuda ? cuda_validity(layout) : Support{};
}
}  // namespace

Support base_quant_support(const LoraPlan& lora, bool option_given) {
  if (lora.enabled() || (lora.base_quant == BaseQuant::None && !option_given)) return {};
  return invalid("option 'base_quant' is for LoRA runs: base_quant ", base_quant_name(lora.base_quant), " holds the base ",
                 "frozen, which only adapters train around; give --lora_rank (or --resume a LoRA checkpoint), or ",
                 lora.base_quant == BaseQuant::None ? "leave base_quant out" : "--base_quant none", " for a full fine-tune");
}

Support support(const LlamaConfig& config, const MemoryLayout& layout, Device device) {
  if (Support s = validity(config, layout, device); !s.runs()) return s;
  const MemoryLayout l = place_layout(config, layout);
  return device == Device::Cpu ? cpu_support(config, l) : cuda_support(config, l);
}

Support objective_support(const ObjectiveConfig& objective, const MemoryLayout& l, Device device) {
  if (!objective.preference()) return {};
  // Every layout runs on both devices: dp (ZeRO 0-3), tp (sp too) and pp. The step's pairs, NLL tokens and metrics are
  // summed over dp, the vocab-parallel log-probs give every tp rank the whole sums, and a pipeline's last stage
  // computes the loss and its token weights and broadcasts the sums to the stages (dist/pipeline_pairs.h).
  return {};
}

Support eval_tasks_support(const MemoryLayout& l, Device device) {
  // The CUDA engine scores from whole-vocabulary logits of the whole model (LlamaGpu::forward_target_logps): dp and
  // every ZeRO stage, not tp (the logits are split by vocabulary) or pp (the head is on the last stage).
  if (device == Device::Cuda && (l.tp > 1 || l.pp > 1))
    return not_implemented("--eval_tasks with --device cuda and --", l.tp > 1 ? "tp " : "pp ", l.tp > 1 ? l.tp : l.pp,
                           ": not implemented yet (the CUDA engine scores tasks from whole-vocabulary logits of the ",
                           "whole model, on dp and ZeRO layouts); score a checkpoint with build/eval --tasks, or train ",
                           "with --device cpu");
  return {};
}

void require_objective_support(const ObjectiveConfig& objective, const MemoryLayout& layout, Device device) {
  if (const Support s = objective_support(objective, layout, device); !s.runs()) fail(s.reason);
}

void require_support(const LlamaConfig& config, const MemoryLayout& layout, Device device) {
  if (const Support s = support(config, layout, device); !s.runs()) fail(s.reason);
}

void require_valid(const LlamaConfig& config, const MemoryLayout& layout, Device device) {
  if (const Support s = validity(config, layout, device); !s.runs()) fail(s.reason);
}

MemoryLayout place_layout(const LlamaConfig& config, MemoryLayout layout) {
  if (layout.placed()) return layout;
  if (const Support s = layout_support(config, layout); !s.runs()) fail(s.reason);
  layout.stages = pipeline_stages(config, layout.pp, layout.seq_len);
  return layout;
}

}  // namespace tuna
