// Causal grouped-query attention on the GPU, FlashAttention-2 style (tensor cores through mma.sync, sm_80+).
// Contract of kernels/cpu/attention.h with bf16 tensors and an fp32 lse.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace tuna::cuda {

// q, out: [batch, seq_len, n_heads, head_dim]; k, v: [batch, seq_len, n_kv_heads, head_dim] (query head h
// reads kv head h / (n_heads / n_kv_heads), no copies); lse: [batch, n_heads, seq_len] fp32, the natural-log
// logsumexp of each query's scaled scores. Scores (q . k) / sqrt(head_dim), causal. OVERWRITES out and lse.
// head_dim 64 or 128 (tensor cores), or 8, 16, 32 (a plain fp32 kernel for tiny models); any seq_len.
void attention_fwd(__nv_bfloat16* out, float* lse, const __nv_bfloat16* q, const __nv_bfloat16* k,
                   const __nv_bfloat16* v, int64_t batch, int64_t seq_len, int64_t n_heads, int64_t n_kv_heads,
                   int64_t head_dim, cudaStream_t stream);

// Floats of scratch attention_bwd needs: D = rowsum(dout * out), [batch, n_heads, seq_len].
int64_t attention_bwd_scratch_floats(int64_t batch, int64_t seq_len, int64_t n_heads);

// Gradients given dout and the forward's out and lse. OVERWRITES dq, dk, dv (dk, dv sum over the query heads
// of their group). Deterministic: no atomics (dk/dv and dq are computed by separate kernels, each output
// element owned by one thread).
void attention_bwd(__nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, const __nv_bfloat16* dout,
                   const __nv_bfloat16* out, const float* lse, const __nv_bfloat16* q, const __nv_bfloat16* k,
                   const __nv_bfloat16* v, float* scratch, int64_t batch, int64_t seq_len, int64_t n_heads,
                   int64_t n_kv_heads, int64_t head_dim, cudaStream_t stream);

}  // namespace tuna::cuda
