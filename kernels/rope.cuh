// Rotary position embedding on the GPU. Contract of kernels/cpu/rope.h: bf16 q/k, fp32 tables. The tables
// come from cpu::rope_inv_freq and cpu::rope_table (host, double math) uploaded once, so both backends
// rotate by the same angles, llama3 scaling included.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace tuna::cuda {

// x: [batch, seq_len, n_heads, head_dim]; cos_table, sin_table: [>= seq_len, head_dim / 2] fp32.
// out[i] = x[i] c - x[i+h] s;  out[i+h] = x[i+h] c + x[i] s  (h = head_dim / 2). Position (b, t)'s n_heads *
// head_dim values start at inp + (b seq_len + t) inp_stride and out + (b seq_len + t) out_stride (each stride
// >= n_heads * head_dim: q or k read out of a fused q|k|v row). OVERWRITES out; out == inp allowed with equal
// strides. positions: [batch, seq_len] device int32, row (b, t)'s position (each below the tables' rows), or null
// (position t). Any even head_dim; head_dim a multiple of 16 with strides multiples of 8 and 16-byte aligned
// pointers take the 16-byte path.
void rope_fwd(__nv_bfloat16* out, const __nv_bfloat16* inp, const float* cos_table, const float* sin_table,
              int64_t batch, int64_t seq_len, int64_t n_heads, int64_t head_dim, int64_t out_stride,
              int64_t inp_stride, const int32_t* positions, cudaStream_t stream);

// The transpose rotation (sin negated), strides and positions as rope_fwd's (dinp_stride wider: gradients written into a fused
// q|k|v row). OVERWRITES dinp; dinp == dout allowed with equal strides.
void rope_bwd(__nv_bfloat16* dinp, const __nv_bfloat16* dout, const float* cos_table, const float* sin_table,
              int64_t batch, int64_t seq_len, int64_t n_heads, int64_t head_dim, int64_t dinp_stride,
              int64_t dout_stride, const int32_t* positions, cudaStream_t stream);

}  // namespace tuna::cuda
