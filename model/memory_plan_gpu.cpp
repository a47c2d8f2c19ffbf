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
  if (l.tp > 1)
    fail("--tp ", l.tp, " with --device cuda: tensor parallelism runs on the CPU backend only so far; on cuda use "
         "--tp 1 (data parallel over all ranks)");
  if (!l.master_weights) fail("the CUDA engine keeps an fp32 master copy of the weights (no master: not implemented)");
  (void)c;
}

// The largest unit of the (tensor-parallel-local) layout, in elements: what a gather or gradient buffer holds.
int64_t largest_unit(const ParamLayout& layout) {
  int64_t largest = 0;
  for (int u = 0; u < layout.num_units(); u++)
    largest = std::max(largest, layout.unit_range(u).second - layout.unit_range(u).first);
  return largest;
}

}  // namespace

bool gpu_keeps_activation(const std::string& field, Recompute recompute) {
  static const char* const kFields[] = {"resid_in", "norm1", "rstd1", "q", "k", "v", "att", "lse",
                                        "resid_mid", "norm2", "rstd2", "gate", "up", "act"};
  TUNA_CHECK(std::find(std::begin(kFields), std::end(kFields), field) != std::end(kFields),
             "unknown layer activation '", field, "'");
  switch (recompute) {
    case Recompute::None: return true;
    case Recompute::Selective: return field != "norm1" && field != "norm2" && field != "act";
    case Recompute::Full: return field == "resid_in";
  }
  return true;
}

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

  // Parameters, gradients, optimizer state. ZeRO-0 holds everything whole; 1 shards master and moments; 2 also the
  // gradient (unit gradients live in a few unit-sized buffers until reduce-scattered); 3 also the bf16 weights
  // (gathered a unit at a time into unit-sized buffers).
  const bool tied = layout.lm_head_unit() == 0;
  if (optimizer && l.zero == 0) b.add("fp32 master weights", MemoryKind::Master, P, kF32);
  if (l.zero <= 2 || !l.training) b.add("bf16 weights", MemoryKind::Weights, P, kBf16);
  if (l.training && l.zero <= 1) b.add("fp32 gradients", MemoryKind::Gradients, P, kF32);
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
    int64_t shard = 0, largest_piece = 0;
    for (const Segment& s : pieces) shard += s.size, largest_piece = std::max(largest_piece, s.size);
    const int64_t padded = (shard + 3) / 4 * 4;
    const int64_t tables = std::max<int64_t>(1, static_cast<int64_t>(shard_pieces(layout, pieces).size()));
    b.add("fp32 master weights (shard)", MemoryKind::Master, padded, kF32);
    b.add("fp32 gradients (shard)", MemoryKind::Gradients, padded, kF32);
    b.add("AdamW m (shard)", MemoryKind::Moments, padded, moment_bytes);
    b.add("AdamW v (shard)", MemoryKind::Moments, padded, moment_bytes);
    b.add("AdamW segment starts (shard)", MemoryKind::Workspace, tables, kI64);
    b.add("AdamW segment decays (shard)", MemoryKind::Workspace, tables, 1);
    if (l.zero >= 2) {
      // The update writes the bf16 weights of the shard, which ZeRO-2 gathers whole and ZeRO-3 unit by unit.
      b.add("bf16 weights (shard)", MemoryKind::Weights, padded, kBf16);
      // Unit gradients until reduce-scattered: two alternate (one filling, one in flight); a tied head's
      // embedding gradient stays open from the head to the embedding's backward, a third.
      const int gradient_buffers = tied ? 3 : 2;
      for (int i = 0; i < gradient_buffers; i++)
        b.add(str("gradient buffer ", i), MemoryKind::Gradients, largest_unit(layout), kF32);
      if (l.dp > 1) b.add("reduce-scatter output", MemoryKind::Communication, largest_piece, kF32);
    }
  }
  if (l.training && l.zero == 3) {
    // Gathered unit weights: the one computing and, with prefetch, the next arriving; a tied head needs the
    // embedding and the head unit at once.
    const int gather_buffers = l.zero_prefetch || tied ? 2 : 1;
    for (int i = 0; i < gather_buffers; i++)
      b.add(str("weight gather buffer ", i), MemoryKind::Communication, largest_unit(layout), kBf16);
  }
  if (optimizer) {
    b.add("gradient norm scratch", MemoryKind::Workspace, gpu_scratch::sum_of_squares_doubles(), kF64);
    b.add("gradient norm", MemoryKind::Workspace, 1, kF64);
  }

  // Activations for (micro_batch, seq_len): the layers' kept ones (by the recompute mode), one working set for
  // the rest, the head's, and the backward's gradients of activations.
  const Recompute recompute = l.training ? l.recompute : Recompute::Full;  // a forward alone keeps layer inputs
  b.add("RoPE cos", MemoryKind::Workspace, l.seq_len * c.head_dim / 2, kF32);
  b.add("RoPE sin", MemoryKind::Workspace, l.seq_len * c.head_dim / 2, kF32);
  const std::pair<const char*, std::pair<int64_t, int64_t>> fields[] = {
      {"resid_in", {n * C, kBf16}},   {"norm1", {n * C, kBf16}}, {"rstd1", {n, kF32}},
      {"q", {n * qd, kBf16}},         {"k", {n * kvd, kBf16}},   {"v", {n * kvd, kBf16}},
      {"att", {n * qd, kBf16}},       {"lse", {n * H, kF32}},    {"resid_mid", {n * C, kBf16}},
      {"norm2", {n * C, kBf16}},      {"rstd2", {n, kF32}},      {"gate", {n * F, kBf16}},
      {"up", {n * F, kBf16}},         {"act", {n * F, kBf16}}};
  for (int64_t layer = 0; layer < c.num_hidden_layers; layer++)
    for (const auto& [field, size] : fields)
      if (gpu_keeps_activation(field, recompute))
        b.add(str("layer ", layer, " ", field), MemoryKind::Activations, size.first, size.second);
  for (const auto& [field, size] : fields)
    if (!gpu_keeps_activation(field, recompute))
      b.add(str("working ", field), MemoryKind::Activations, size.first, size.second);
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
    const int64_t chunk = (largest_unit(layout) + l.dp - 1) / l.dp;
    b.add_outside_arena("NCCL padding scratch (the comm's own)", MemoryKind::Communication,
                        (chunk * l.dp + chunk) * kF32);
  }
  return b.plan;
}

}  // namespace tuna
