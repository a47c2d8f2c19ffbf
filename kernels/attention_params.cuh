// The argument block of the attention kernels and the per-head-dim launchers that attention.cu dispatches
// to (each instantiated in its own .cu so that CI compiles them in parallel). Internal to kernels/.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace tuna::cuda {

struct AttentionParams {
  const __nv_bfloat16* q;     // [batch, seq_len, n_heads, head_dim]
  const __nv_bfloat16* k;     // [batch, seq_len, n_kv_heads, head_dim]
  const __nv_bfloat16* v;     // [batch, seq_len, n_kv_heads, head_dim]
  __nv_bfloat16* out;         // [batch, seq_len, n_heads, head_dim]     forward output / backward input
  float* lse;                 // [batch, n_heads, seq_len], natural log   forward output / backward input
  const __nv_bfloat16* dout;  // like out                                backward only
  __nv_bfloat16* dq;          // like q                                  backward output
  __nv_bfloat16* dk;          // like k                                  backward output
  __nv_bfloat16* dv;          // like v                                  backward output
  float* delta;               // [batch, n_heads, seq_len]: rowsum(dout * out), backward scratch
  int batch, seq_len, n_heads, n_kv_heads;
  float scale;                // 1 / sqrt(head_dim)
  float scale_log2;           // scale * log2(e): scores go straight into exp2
  // [batch, seq_len]: the first position of each row's document (kernels/cpu/attention.h), or null: one
  // document per row. Query t sees keys doc_start[t] <= j <= t. Never decreases along a row, so a query block's
  // first row bounds the whole block's keys.
  const int32_t* doc_start;
  // The hopper forward's tile counter: one int, 0, left 0 by every launch; null: one the launching thread keeps for
  // the stream (attention_sm90_launch.cuh fwd_tile_counter). The model passes one of its own arena.
  int* tile_counter;
};

void attention_fwd_hd64(const AttentionParams& p, cudaStream_t stream);
void attention_fwd_hd128(const AttentionParams& p, cudaStream_t stream);
void attention_bwd_hd64(const AttentionParams& p, cudaStream_t stream);
void attention_bwd_hd128(const AttentionParams& p, cudaStream_t stream);
// The sm_90a kernels (attention_sm90_*.cu).
// Whether this build's image of the sm_90a kernels, on the current device, is sm_90a code.
bool attention_sm90_image_present();
void attention_sm90_fwd_hd64(const AttentionParams& p, cudaStream_t stream);
void attention_sm90_fwd_hd128(const AttentionParams& p, cudaStream_t stream);
// rope_cos, rope_sin: null, or the tables whose backward to apply to dQ and dK, at rope_positions (null: each
// row's index) (attention.cuh's AttentionRope).
void attention_sm90_bwd_hd64(const AttentionParams& p, float* scratch, const float* rope_cos, const float* rope_sin,
                             const int32_t* rope_positions, cudaStream_t stream);
void attention_sm90_bwd_hd128(const AttentionParams& p, float* scratch, const float* rope_cos, const float* rope_sin,
                              const int32_t* rope_positions, cudaStream_t stream);
// head_dim 8, 16 or 32 (attention_small.cu): forward, or the whole backward (delta included).
void attention_small(const AttentionParams& p, int head_dim, bool backward, cudaStream_t stream);

}  // namespace tuna::cuda
