// Causal self-attention with grouped-query heads. CPU twin of kernels/attention.cuh: the same
// FlashAttention contract (the seq x seq matrix is never kept; the backward recomputes it from lse).
//
// Documents. A packed window holds several documents; attention must not cross them. The boundaries travel
// as a per-row document start, doc_start: [batch, seq_len] int32, doc_start[b, t] = the position in the
// window of the first token of t's document, so query t sees keys doc_start[b, t] <= j <= t. Null: one
// document per row (doc_start = 0). Rather than cu_seqlens, because every kernel asks "where does this row's
// document begin": here that is one load, and since doc_start never decreases along a row, a block of queries
// [t0, t1) needs keys from doc_start[t0] only (one load bounds the block; earlier key blocks are skipped).
#pragma once
#include <cstdint>

namespace tuna::cpu {

// Fails unless every row of doc_start is a valid document start: doc_start[b, 0] = 0, and each next entry
// either stays (same document) or equals its own position (a new document begins there).
void check_doc_starts(const int32_t* doc_start, int64_t batch, int64_t seq_len);

// doc_start of a window from the loader's positions (DataLoader::next: each token's position inside its
// document, which may have begun in an earlier window): doc_start[t] = t - min(positions[t], t).
void doc_starts_from_positions(int32_t* doc_start, const int32_t* positions, int64_t batch, int64_t seq_len);

// q, out: [batch, seq_len, n_heads, head_dim]; k, v: [batch, seq_len, n_kv_heads, head_dim];
// query head h reads kv head h / (n_heads / n_kv_heads). Scores are (q . k) / sqrt(head_dim), causal and
// within the document: query t sees keys doc_start[t] <= j <= t (doc_start null: 0 <= j <= t). lse:
// [batch, n_heads, seq_len], the natural-log logsumexp of each query's scaled scores, kept for the backward.
// Overwrites out and lse.
template <typename T>
void attention_fwd(T* out, T* lse, const T* q, const T* k, const T* v, int64_t batch, int64_t seq_len,
                   int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, const int32_t* doc_start = nullptr);

// Gradients given dout, with out and lse from the forward (with the same doc_start). Overwrites dq, dk, dv
// (each kv head sums the gradients of all its query heads). Deterministic.
template <typename T>
void attention_bwd(T* dq, T* dk, T* dv, const T* dout, const T* out, const T* lse, const T* q,
                   const T* k, const T* v, int64_t batch, int64_t seq_len, int64_t n_heads,
                   int64_t n_kv_heads, int64_t head_dim, const int32_t* doc_start = nullptr);

}  // namespace tuna::cpu
