// The memory model: what one rank allocates for a model, a parallel layout and a batch shape. One model serves
// two readers, so that they cannot drift apart:
//   * the trainer, which sizes its allocations from it and refuses a run that won't fit before allocating;
//   * build/plan, which prices a cluster that isn't here.
//
// The contract, shared by both backends:
//   plan_gpu_memory(config, layout) lists every device buffer the CUDA engine allocates for this layout, by
//   name, each with its kind and byte count; the CUDA engine's arena is laid out from this same list (so the
//   list is exact, not an estimate). plan_cpu_memory does the same for the CPU engine's host allocations
//   (Llama + Zero), where the allocator adds its own overhead: the trainer's measured peak resident memory is
//   compared against it in the tests.
// With adapters (MemoryLayout::lora) the list holds the frozen base (bf16 or quantized), the adapters with their
// master, gradients and moments, and their activations, by the names the CUDA engine's adapter path takes.
// With pipeline stages (pp > 1) the list is one stage's (MemoryLayout::pp_rank): its layers' weights and state, the
// embedding on the first stage, the final norm and lm_head on the last (model/pipeline.h's split), the activations
// of the micro-batches 1F1B keeps in flight there (pp - s on stage s, for a step of at least pp micro-batches), and
// the point-to-point buffers. With sp the norm and residual region holds seq / tp rows, as the CUDA engine lays it
// out. The CUDA engine runs pipeline stages at ZeRO 0 and 1: a plan of pp with ZeRO-2 or 3 is the design.
// Items are per rank. Transients (a buffer that lives only during a checkpoint save or a collective) are listed
// with kind Transient, so that a plan's peak is honest.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernels/attention_path.h"  // AttentionPath (plain C++)
#include "model/config.h"
#include "model/fp8.h"  // Fp8Mode
#include "model/layout.h"
#include "model/lora_shape.h"  // LoraPlan

namespace tuna {

enum class Recompute { None, Selective, Full };
// "none" | "selective" | "full"; anything else is a tuna::Error naming `source`.
Recompute parse_recompute(const std::string& text, const std::string& source);
const char* recompute_name(Recompute r);

// What decides one rank's memory, and so what one rank computes: the parallel layout, the batch shape and the
// switches that change buffers. engine_memory_layout (engine/engine.h) builds it once from the run's options and
// mesh; the memory plan and the CUDA model both take it whole.
struct MemoryLayout {
  int64_t dp = 1, tp = 1, pp = 1;  // world = dp x pp x tp (comm/comm.h Mesh)
  int64_t dp_rank = 0, tp_rank = 0;  // whose plan: rank 0's pieces are the largest (shard_range), so its plan
                                     // is the one to print and to fit
  int64_t pp_rank = 0;          // the pipeline stage whose plan this is (stages differ: embedding first, head last)
  bool sp = false;              // sequence parallelism over the tp group (Megatron's): norm and residual regions
                                // hold seq / tp rows
  int zero = 0;                 // ZeRO stage over dp: 0..3
  bool zero_prefetch = true;    // ZeRO-3: a second gather buffer so the next unit's gather overlaps
  Recompute recompute = Recompute::None;
  bool bf16_moments = false;    // cuda: AdamW moments in bf16
  bool master_weights = true;   // cuda: an fp32 master copy (false: bf16 weights updated with stochastic rounding)
  bool training = true;         // false: the forward pass alone (eval, sample): weights and activations only
  AttentionPath attention = AttentionPath::kDefault;  // cuda: the attention kernels (their scratch differs)
  Fp8Mode fp8 = Fp8Mode::Off;   // --fp8: the seven projections' GEMMs with FP8 operands (model/fp8.h)
  bool fp8_forward_codes = false;  // --fp8_weight_codes forward: the weights' transposed codes cast at each use
  int64_t micro_batch = 1, seq_len = 1;
  // Adapters (rank 0: a full fine-tune). With adapters the base is frozen and ZeRO acts on the adapters' master,
  // gradients and moments; ZeRO-3 also shards the frozen base (gathered a unit at a time), below it the base is
  // whole on every dp rank. A LoraPlan is the run's LoraConfig and how the base is stored.
  LoraPlan lora;

  // What follows from the layout and the model, filled in once by place_layout (model/support.h), which the memory
  // plans, the models and the engines read: the pipeline split (model/pipeline.h), every stage's; at pp 1 one stage,
  // the whole model. Whoever changes pp, seq_len or the model of a placed layout places it again.
  std::vector<PipelineStage> stages;
  bool placed() const { return !stages.empty(); }
  const PipelineStage& stage() const;  // this rank's: stages[pp_rank]
  bool first_stage() const { return pp_rank == 0; }
  bool last_stage() const { return pp_rank == pp - 1; }
  // The micro-batches whose activations this stage keeps at once: under 1F1B stage s has run the forwards of pp - s
  // before the first backward reaches it (model/pipeline.h); a forward alone keeps one.
  int64_t in_flight() const { return training ? pp - pp_rank : 1; }
  // A full fine-tune's first and last stage with tied embeddings: each holds the table (the last as its lm_head) and
  // they sum its gradient between them (model/pipeline.h pipeline_stage_units).
  bool tied_across_stages(const LlamaConfig& config) const {
    return training && !lora.enabled() && pp > 1 && config.tie_word_embeddings && (first_stage() || last_stage());
  }
};

// One rank alone, on batches of up to micro_batch x seq_len; training false: the forward pass alone.
MemoryLayout single_rank_layout(int64_t micro_batch, int64_t seq_len, bool training = true);
// --fp8 on the CUDA engine: whether it keeps one layer's FP8 weight codes, cast at each use (ZeRO-3, whose point is to
// hold no whole model, and a quantized base, whose point is a base smaller than its bf16 copy), and the layers whose
// codes it keeps (model/memory_plan_gpu.cpp): the stage's, else one.
bool fp8_casts_at_each_use(const MemoryLayout& l);
int64_t fp8_cast_layers(const MemoryLayout& l);

enum class MemoryKind { Weights, Gradients, Master, Moments, Activations, Communication, Workspace, Transient };
const char* memory_kind_name(MemoryKind k);

struct MemoryItem {
  std::string name;  // e.g. "layer 3 activations", "bf16 weights (shard)", "all-gather buffer 0"
  MemoryKind kind;
  int64_t bytes = 0;
  // cuda: true for the buffers of the engine's one device arena (bytes as laid out there, 256-byte aligned);
  // false for a buffer a library allocates itself at most this size (NCCL's padding scratch).
  bool in_arena = true;
};

struct MemoryPlan {
  std::vector<MemoryItem> items;
  int64_t total() const;                 // every item but transients
  int64_t peak() const;                  // total() + the largest transient
  int64_t bytes(MemoryKind kind) const;  // the sum of one kind
};

// The bytes one buffer takes in a device arena: rounded up to 256 (cuBLASLt's preferred alignment; every
// buffer starts aligned). plan_gpu_memory's items and the arena (model/llama_gpu.h DeviceArena) both use it.
int64_t device_arena_bytes(int64_t bytes);

// cuda: rows of logits the loss head computes at once over `rows` tokens of a (tensor-parallel-local)
// vocabulary: at least 2048 rows (a GEMM that runs near peak), more while [rows, vocab] stays near 64 MB.
int64_t gpu_head_chunk_rows(int64_t vocab, int64_t rows);

// cuda: whether a recompute mode keeps one decoder layer's activation `field` for each layer (else one working
// copy serves every layer, refilled by the backward's recompute). Fields, in forward order: resid_in, norm1,
// rstd1, q, k, v, att, lse, resid_mid, norm2, rstd2, gate, up, act, and with adapters lora_ax (each target's
// r-wide s A x; dropout masks are drawn again, never kept). none keeps all; selective all but the two norms' outputs and
// SwiGLU's (cheap to recompute; the GEMM and attention outputs are not); full only resid_in.
bool gpu_keeps_activation(const std::string& field, Recompute recompute);

// The per-rank table the trainer prints at start: bytes per kind (and the largest items of each), the total,
// the peak with transients, and, when capacity_bytes > 0, the headroom kept beside the plan and what is left.
std::string format_memory_table(const MemoryPlan& plan, int64_t capacity_bytes, const std::string& title,
                                int64_t headroom_bytes = 0);
// "61.23 GB", "512.0 MB": bytes as the tables print them.
std::string format_bytes(int64_t bytes);

// cuda: what one rank's plan needs on a device that has capacity_bytes free: the plan's peak plus headroom for
// what no plan lists (the CUDA context's own allocations, cuBLASLt's handle, NCCL's internal buffers when there is
// more than one rank): an allowance, not a measurement.
int64_t gpu_headroom_bytes(const MemoryLayout& layout);
struct GpuFit {
  bool fits = false;
  std::string report;  // the per-GPU table, the verdict, and when it does not fit, a layout that would
};
// The verdict the CUDA engine checks before it allocates (and build/train --plan_only prints). When the plan does
// not fit, the report names the options that would make it fit, tried in this order and kept cumulatively: bf16
// moments, a higher ZeRO stage (at dp > 1), selective then full recompute, no fp32 master (with stochastic
// rounding), a smaller micro-batch, with adapters an nf4 base; or says that none does (more GPUs or tensor
// parallelism are needed).
GpuFit check_gpu_fit(const LlamaConfig& config, const MemoryLayout& layout, int64_t capacity_bytes);
// {"items": [{"name", "kind", "bytes"}...], "total": bytes, "peak": bytes}: the plan in metrics.jsonl (the run
// report's memory table and planned line).
nlohmann::json memory_plan_json(const MemoryPlan& plan);

// What Zero holds on dp rank `dp_rank` of `dp_size`, besides the model's own weights and gradients, in floats.
// The CPU memory plan is made of these figures; Zero's constructor (dist/zero.cpp) checks its
// allocations against them, and state_bytes() reports what it allocated.
struct ZeroBufferSizes {
  int64_t shard = 0;          // this rank's piece of every unit: the size of the moments, master and gradient shard
  int64_t moments = 0;        // each of the two AdamW moments (the whole layout at stage 0)
  int64_t master = 0;         // fp32 master weights: stage 3 (stages 0-2 update the model's fp32 weights in place)
  int64_t grad_shard = 0;     // stages 2-3 (stages 0-1 read the model's all-reduced gradient)
  int64_t unit = 0;           // the largest unit, the size of a gather or gradient buffer
  int weight_buffers = 0;     // stage 3: gathered units (the pair: one computing, one arriving)
  int grad_buffers = 0;       // stages 2-3: unit gradients alive at once in the backward
  int64_t scatter_out = 0;    // stages 2-3: one unit's reduce-scatter output
};
ZeroBufferSizes zero_buffer_sizes(const ParamLayout& layout, int stage, int dp_rank, int dp_size);

// model/memory_plan_cpu.cpp
MemoryPlan plan_cpu_memory(const LlamaConfig& config, const MemoryLayout& layout);
// model/memory_plan_gpu.cpp: plain C++, in every build (build/plan prices GPUs on any machine)
MemoryPlan plan_gpu_memory(const LlamaConfig& config, const MemoryLayout& layout);
// Generation's KV-cache decoder (model/decode_gpu.h) for `batch` sequences of up to `capacity` positions: the
// cache and one position-set's activations, laid out the same way (the weights are the model's, not listed).
MemoryPlan plan_gpu_decode_memory(const LlamaConfig& config, int64_t batch, int64_t capacity);

}  // namespace tuna
