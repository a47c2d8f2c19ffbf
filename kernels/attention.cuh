// Causal grouped-query attention on the GPU. Contract of kernels/cpu/attention.h with bf16 tensors and an fp32
// lse. Two implementations of head dims 64 and 128 (8, 16, 32 always take the plain kernels of
// attention_small.cu):
//   mma:    FlashAttention-2 style, tensor cores through mma.sync, cp.async (sm_80 and later). The default.
//   hopper: FlashAttention-3 style, wgmma, TMA, mbarrier pipelines, warp specialisation (sm_90a only).
//           Off by default until a GPU run passes (kHopperByDefault, attention_path.h).
// The trainer passes its --attention option; tests and benches name the path explicitly.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/attention_path.h"  // AttentionPath, kHopperByDefault

namespace tuna::cuda {

// kDefault (auto) resolved for the current device; other paths as given.
AttentionPath resolve_attention_path(AttentionPath path);
const char* attention_path_name(AttentionPath path);
// Whether the hopper path can run here: the current device is sm_90 and this build has sm_90a code.
bool attention_hopper_available();

// q, out: [batch, seq_len, n_heads, head_dim]; k, v: [batch, seq_len, n_kv_heads, head_dim] (query head h
// reads kv head h / (n_heads / n_kv_heads), no copies); lse: [batch, n_heads, seq_len] fp32, the natural-log
// logsumexp of each query's scaled scores. Scores (q . k) / sqrt(head_dim), causal and inside each query's
// document: doc_start [batch, seq_len] device int32 (kernels/cpu/attention.h: each row's document start, checked
// by the caller on the host), or null for one document per row. Key blocks outside a query block's documents are
// skipped (both paths). OVERWRITES out and lse. head_dim 64 or 128 (tensor cores), or 8, 16, 32 (a plain fp32
// kernel for tiny models); any seq_len. tile_counter: the hopper path's work counter, one device int that is 0 and
// that every launch leaves 0 (the model's, from its arena), used by launches on one stream only; null: a counter the
// launching thread allocates for the stream at its first launch (tests, benches).
void attention_fwd(__nv_bfloat16* out, float* lse, const __nv_bfloat16* q, const __nv_bfloat16* k,
                   const __nv_bfloat16* v, int64_t batch, int64_t seq_len, int64_t n_heads, int64_t n_kv_heads,
                   int64_t head_dim, const int32_t* doc_start, cudaStream_t stream,
                   AttentionPath path = AttentionPath::kDefault, int* tile_counter = nullptr);

// Floats of scratch attention_bwd needs. mma: D = rowsum(dout * out), [batch, n_heads, seq_len]. hopper: also
// the fp32 dQ accumulator and its ordering flags, which depend on head_dim (the default, 128, bounds 64).
int64_t attention_bwd_scratch_floats(int64_t batch, int64_t seq_len, int64_t n_heads, int64_t head_dim = 128,
                                     AttentionPath path = AttentionPath::kDefault);

// RoPE tables ([>= seq_len, head_dim / 2] fp32, as kernels/rope.cuh takes them) whose backward attention_bwd
// applies to dq and dk on the way out, so that they are the gradients of q and k before rotation (what
// rope_bwd after attention_bwd gives). hopper fuses it into its dQ and dK epilogues; mma runs rope_bwd after.
struct AttentionRope {
  const float* cos_table = nullptr;  // null: no rotation
  const float* sin_table = nullptr;
  const int32_t* positions = nullptr;  // rope_bwd's positions (null: t), e.g. restarted at each document
};

// Gradients given dout and the forward's out and lse (and the forward's doc_start). OVERWRITES dq, dk, dv (dk, dv sum over the query heads
// of their group). Deterministic, bit for bit run to run: mma computes dK/dV and dQ in separate kernels, each
// output element owned by one thread; hopper adds each key block's dQ share in a fixed order (attention_sm90_
// kernels.cuh).
void attention_bwd(__nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, const __nv_bfloat16* dout,
                   const __nv_bfloat16* out, const float* lse, const __nv_bfloat16* q, const __nv_bfloat16* k,
                   const __nv_bfloat16* v, float* scratch, int64_t batch, int64_t seq_len, int64_t n_heads,
                   int64_t n_kv_heads, int64_t head_dim, const int32_t* doc_start, cudaStream_t stream,
                   AttentionPath path = AttentionPath::kDefault, AttentionRope rope = {});

}  // namespace tuna::cuda
