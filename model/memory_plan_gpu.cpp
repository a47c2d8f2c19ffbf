// plan_gpu_memory: every device buffer of the CUDA engine (model/llama_gpu.cpp, model/engine_gpu.cpp) for one
// rank, by name, in the order of its one device arena. The engine lays its arena out from this list and takes
// each buffer by name with its element count (DeviceArena::take checks the bytes), and fails at construction if
// a listed buffer is not taken: the plan is the allocation, not an estimate of it. Plain C++, in every build.
#include "model/memory_plan.h"

#include <algorithm>

#include "core/error.h"
#include "dist/zero.h"  // dp_unit_pieces
#include "kernels/scratch.h"
#include "model/layout.h"
#include "model/optimizer.h"  // shard_pieces

namespace tuna {

namespace {

// Bytes of one GPU element type, as the engine stores it.
constexpr int64_t kBf16 = 2, kF32 = 4, kF64 = 8, kI32 = 4, kI64 = 8;
// cuBLASLt's workspace (kernels/matmul.cuh MatmulContext's default).
constexpr int64_t kMatmulWorkspaceBytes = int64_t(32) << 20;

class PlanBuilder {
 public:
  void add(std::string name, MemoryKind kind, int64_t count, int64_t element_bytes) {
    TUNA_CHECK(count >= 0, name, ": ", count, " elements");
    plan.items.push_back({std::move(name), kind, device_arena_bytes(count * element_bytes), true});
  }
  void add_outside_arena(std::string name, MemoryKind kind, int64_t bytes) {
    plan.items.push_back({std::move(name), kind, bytes, false});
  }
  MemoryPlan plan;
};

void check_layout(const LlamaConfig& c, const MemoryLayout& l) {
  TUNA_CHECK(l.dp >= 1 && l.tp >= 1 && l.dp_rank >= 0 && l.dp_rank < l.dp && l.tp_rank >= 0 && l.tp_rank < l.tp,
             "dp rank ", l.dp_rank, " of ", l.dp, ", tp rank ", l.tp_rank, " of ", l.tp);
  if (l.micro_batch < 1 || l.seq_len < 1)
    fail("memory plan: micro_batch and seq_len must be >= 1 (found ", l.micro_batch, " and ", l.seq_len, ")");
  if (l.zero < 0 || l.zero > 3) fail("option 'zero': expected 0, 1, 2 or 3, found ", l.zero);
  if (l.zero > 1)
    fail("--zero ", l.zero, " with --device cuda: the CUDA backend shards the optimizer state (ZeRO-1) but not yet "
         "the gradients or the weights; use --zero 1 or 0, or --device cpu for ZeRO ", l.zero);
  if (l.tp > 1)
    fail("--tp ", l.tp, " with --device cuda: tensor parallelism runs on the CPU backend only so far; on cuda use "
         "--tp 1 (data parallel over all ranks)");
  if (l.recompute != Recompute::None)
    fail("--recompute ", recompute_name(l.recompute), " with --device cuda: not implemented yet (use none)");
  if (!l.master_weights) fail("the CUDA engine keeps an fp32 master copy of the weights (no master: not implemented)");
  (void)c;
}

}  // namespace

int64_t gpu_head_chunk_rows(int64_t vocab, int64_t rows) {
  constexpr int64_t kMinRows = 2048, kChunkElements = int64_t(32) << 20;
  TUNA_CHECK(vocab > 0 && rows > 0, "vocab ", vocab, ", rows ", rows);
  return std::clamp<int64_t>(std::max(kMinRows, kChunkElements / vocab), 1, rows);
}

MemoryPlan plan_gpu_memory(const LlamaConfig& c, const MemoryLayout& l) {
  check_layout(c, l);
  const ParamLayout layout(c, static_cast<int>(l.tp_rank), static_cast<int>(l.tp));
  const int64_t P = layout.total(), n = l.micro_batch * l.seq_len, C = c.hidden_size;
  const TpDims& d = layout.tp();
  const int64_t F = d.ffn, qd = d.q_dim, kvd = d.kv_dim, H = d.heads, V = d.vocab;
  const int64_t moment_bytes = l.bf16_moments ? kBf16 : kF32;
  const bool optimizer = l.training;  // a training rank runs AdamW over what it owns
  PlanBuilder b;

  // Parameters, gradients, optimizer state.
  if (optimizer && l.zero == 0) b.add("fp32 master weights", MemoryKind::Master, P, kF32);
  b.add("bf16 weights", MemoryKind::Weights, P, kBf16);
  if (l.training) b.add("fp32 gradients", MemoryKind::Gradients, P, kF32);
  if (optimizer && l.zero == 0) {
    b.add("AdamW m", MemoryKind::Moments, P, moment_bytes);
    b.add("AdamW v", MemoryKind::Moments, P, moment_bytes);
    const int64_t tables = static_cast<int64_t>(layout.tensors().size());
    b.add("AdamW segment starts", MemoryKind::Workspace, tables, kI64);
    b.add("AdamW segment decays", MemoryKind::Workspace, tables, 1);
  }
  if (optimizer && l.zero >= 1) {
    // This rank's piece of every unit, padded to the fused AdamW's 4 elements per thread.
    const std::vector<Segment> pieces = dp_unit_pieces(layout, static_cast<int>(l.dp_rank), static_cast<int>(l.dp));
    int64_t shard = 0;
    for (const Segment& s : pieces) shard += s.size;
    const int64_t padded = (shard + 3) / 4 * 4;
    const int64_t tables = std::max<int64_t>(1, static_cast<int64_t>(shard_pieces(layout, pieces).size()));
    b.add("fp32 master weights (shard)", MemoryKind::Master, padded, kF32);
    b.add("fp32 gradients (shard)", MemoryKind::Gradients, padded, kF32);
    b.add("AdamW m (shard)", MemoryKind::Moments, padded, moment_bytes);
    b.add("AdamW v (shard)", MemoryKind::Moments, padded, moment_bytes);
    b.add("AdamW segment starts (shard)", MemoryKind::Workspace, tables, kI64);
    b.add("AdamW segment decays (shard)", MemoryKind::Workspace, tables, 1);
  }
  if (optimizer) {
    b.add("gradient norm scratch", MemoryKind::Workspace, gpu_scratch::sum_of_squares_doubles(), kF64);
    b.add("gradient norm", MemoryKind::Workspace, 1, kF64);
  }

  // Activations for (micro_batch, seq_len), every layer's kept for the backward.
  b.add("RoPE cos", MemoryKind::Workspace, l.seq_len * c.head_dim / 2, kF32);
  b.add("RoPE sin", MemoryKind::Workspace, l.seq_len * c.head_dim / 2, kF32);
  for (int64_t layer = 0; layer < c.num_hidden_layers; layer++) {
    const auto add = [&](const char* what, int64_t count, int64_t bytes) {
      b.add(str("layer ", layer, " ", what), MemoryKind::Activations, count, bytes);
    };
    add("resid_in", n * C, kBf16);
    add("norm1", n * C, kBf16);
    add("rstd1", n, kF32);
    add("q", n * qd, kBf16);
    add("k", n * kvd, kBf16);
    add("v", n * kvd, kBf16);
    add("att", n * qd, kBf16);
    add("lse", n * H, kF32);
    add("resid_mid", n * C, kBf16);
    add("norm2", n * C, kBf16);
    add("rstd2", n, kF32);
    add("gate", n * F, kBf16);
    add("up", n * F, kBf16);
    add("act", n * F, kBf16);
  }
  b.add("final residual", MemoryKind::Activations, n * C, kBf16);
  b.add("final norm", MemoryKind::Activations, n * C, kBf16);
  b.add("final rstd", MemoryKind::Activations, n, kF32);
  b.add("logits chunk", MemoryKind::Activations, gpu_head_chunk_rows(V, n) * V, kBf16);
  b.add("per-token losses", MemoryKind::Activations, n, kF32);
  if (l.training) {
    for (const char* g : {"d_resid", "d_norm", "d_final_norm"}) b.add(g, MemoryKind::Activations, n * C, kBf16);
    for (const char* g : {"d_q", "d_att"}) b.add(g, MemoryKind::Activations, n * qd, kBf16);
    for (const char* g : {"d_k", "d_v"}) b.add(g, MemoryKind::Activations, n * kvd, kBf16);
    for (const char* g : {"d_gate", "d_up", "d_act"}) b.add(g, MemoryKind::Activations, n * F, kBf16);
    b.add("rmsnorm backward scratch", MemoryKind::Workspace, gpu_scratch::rmsnorm_bwd_floats(n, C), kF32);
    b.add("attention backward scratch", MemoryKind::Workspace,
          gpu_scratch::attention_bwd_floats(l.micro_batch, l.seq_len, H), kF32);
  }
  b.add("loss total", MemoryKind::Workspace, 1, kF64);
  b.add("token ids", MemoryKind::Workspace, n, kI32);
  b.add("targets", MemoryKind::Workspace, n, kI32);
  b.add("embedding group positions", MemoryKind::Workspace, n, kI32);
  b.add("embedding group tokens", MemoryKind::Workspace, n, kI32);
  b.add("embedding group offsets", MemoryKind::Workspace, n + 1, kI32);
  b.add("cuBLASLt workspace", MemoryKind::Workspace, kMatmulWorkspaceBytes, 1);

  // NCCL pads a unit it reduce-scatters or gathers to a multiple of dp in a scratch buffer of its own
  // (dist/comm_nccl.cpp), allocated on first use.
  if (l.dp > 1) {
    int64_t largest = 0;
    for (int u = 0; u < layout.num_units(); u++)
      largest = std::max(largest, layout.unit_range(u).second - layout.unit_range(u).first);
    const int64_t chunk = (largest + l.dp - 1) / l.dp;
    b.add_outside_arena("NCCL padding scratch (the comm's own)", MemoryKind::Communication,
                        (chunk * l.dp + chunk) * kF32);
  }
  return b.plan;
}

}  // namespace tuna
