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
// Items are per rank. Transients (a buffer that lives only during a checkpoint save or a collective) are listed
// with kind Transient, so that a plan's peak is honest.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/config.h"

namespace tuna {

enum class Recompute { None, Selective, Full };
// "none" | "selective" | "full"; anything else is a tuna::Error naming `source`.
Recompute parse_recompute(const std::string& text, const std::string& source);
const char* recompute_name(Recompute r);

// What decides one rank's memory.
struct MemoryLayout {
  int64_t dp = 1, tp = 1;       // world = dp x tp
  int64_t dp_rank = 0, tp_rank = 0;  // whose plan: rank 0's pieces are the largest (shard_range), so its plan
                                     // is the one to print and to fit
  int zero = 0;                 // ZeRO stage over dp: 0..3
  bool zero_prefetch = true;    // ZeRO-3: a second gather buffer so the next unit's gather overlaps
  Recompute recompute = Recompute::None;
  bool bf16_moments = false;    // cuda: AdamW moments in bf16
  bool master_weights = true;   // cuda: an fp32 master copy (false: bf16 weights updated with stochastic rounding)
  bool training = true;         // false: the forward pass alone (eval, sample): weights and activations only
  int64_t micro_batch = 1, seq_len = 1;
};

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
// rstd1, q, k, v, att, lse, resid_mid, norm2, rstd2, gate, up, act. none keeps all; selective all but the two
// norms' outputs and SwiGLU's (cheap to recompute; the GEMM and attention outputs are not); full only resid_in.
bool gpu_keeps_activation(const std::string& field, Recompute recompute);

// The per-rank table the trainer prints at start: bytes per kind (and the largest items of each), the total,
// the peak with transients, and, when capacity_bytes > 0, what is left of it.
std::string format_memory_table(const MemoryPlan& plan, int64_t capacity_bytes, const std::string& title);
// {"items": [{"name", "kind", "bytes"}...], "total": bytes, "peak": bytes}: the plan in metrics.jsonl (the run
// report's memory table and planned line).
nlohmann::json memory_plan_json(const MemoryPlan& plan);

// model/memory_plan_cpu.cpp
MemoryPlan plan_cpu_memory(const LlamaConfig& config, const MemoryLayout& layout);
// model/memory_plan_gpu.cpp: plain C++, in every build (build/plan prices GPUs on any machine)
MemoryPlan plan_gpu_memory(const LlamaConfig& config, const MemoryLayout& layout);

}  // namespace tuna
