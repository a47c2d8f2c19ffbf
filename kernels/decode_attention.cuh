// Attention of new positions against a KV cache on the GPU (generation). Contract of
// kernels/cpu/decode_attention.h with bf16 tensors.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace tuna::cuda {

// q, out: [batch, n_new, n_heads, head_dim]; k_cache, v_cache: [batch, capacity, n_kv_heads, head_dim] with
// positions 0 .. past + n_new - 1 filled. Query i of a sequence is position past + i and attends to keys
// 0 .. past + i; query head h reads kv head h / (n_heads / n_kv_heads); scores (q . k) / sqrt(head_dim).
// OVERWRITES out. head_dim a multiple of 8, at most 128. Deterministic (fixed reduction order).
void decode_attention_fwd(__nv_bfloat16* out, const __nv_bfloat16* q, const __nv_bfloat16* k_cache,
                          const __nv_bfloat16* v_cache, int64_t batch, int64_t n_new, int64_t past, int64_t capacity,
                          int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, cudaStream_t stream);

}  // namespace tuna::cuda
