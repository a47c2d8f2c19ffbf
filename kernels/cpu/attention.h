// Causal self-attention with grouped-query heads. CPU twin of kernels/attention.cuh: the same
// FlashAttention contract (the seq x seq matrix is never kept; the backward recomputes it from lse).
#pragma once
#include <cstdint>

namespace tuna::cpu {

// q, out: [batch, seq_len, n_heads, head_dim]; k, v: [batch, seq_len, n_kv_heads, head_dim];
// query head h reads kv head h / (n_heads / n_kv_heads). Scores are (q . k) / sqrt(head_dim), causal
// (key position <= query position). lse: [batch, n_heads, seq_len], the natural-log logsumexp of each
// query's scaled scores, kept for the backward. Overwrites out and lse.
template <typename T>
void attention_fwd(T* out, T* lse, const T* q, const T* k, const T* v, int64_t batch, int64_t seq_len,
                   int64_t n_heads, int64_t n_kv_heads, int64_t head_dim);

// Gradients given dout, with out and lse from the forward. Overwrites dq, dk, dv (each kv head sums the
// gradients of all its query heads). Deterministic.
template <typename T>
void attention_bwd(T* dq, T* dk, T* dv, const T* dout, const T* out, const T* lse, const T* q,
                   const T* k, const T* v, int64_t batch, int64_t seq_len, int64_t n_heads,
                   int64_t n_kv_heads, int64_t head_dim);

}  // namespace tuna::cpu
