// Attention of new positions against a KV cache (generation). CPU twin of kernels/decode_attention.cuh.
#pragma once
#include <cstdint>

namespace tuna::cpu {

// Each of `batch` sequences has `past` positions in the cache and appends n_new: query i of a sequence is
// position past + i and attends to keys 0 .. past + i (causal), which the cache already holds.
//   q, out:            [batch, n_new, n_heads, head_dim]
//   k_cache, v_cache:  [batch, capacity, n_kv_heads, head_dim], positions 0 .. past + n_new - 1 filled
// Query head h reads kv head h / (n_heads / n_kv_heads); scores (q . k) / sqrt(head_dim). OVERWRITES out.
// The same function as attention_fwd's rows past .. past + n_new - 1 (no lse: nothing goes backward).
template <typename T>
void decode_attention_fwd(T* out, const T* q, const T* k_cache, const T* v_cache, int64_t batch, int64_t n_new,
                          int64_t past, int64_t capacity, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim);

}  // namespace tuna::cpu
