// Rotary position embedding on the GPU. Contract of kernels/cpu/rope.h: bf16 q/k, fp32 tables. The tables
// come from cpu::rope_inv_freq and cpu::rope_table (host, double math) uploaded once, so both backends
// rotate by the same angles, llama3 scaling included.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace tuna::cuda {

// x: [batch, seq_len, n_heads, head_dim]; cos_table, sin_table: [>= seq_len, head_dim / 2] fp32.
// out[i] = x[i] c - x[i+h] s;  out[i+h] = x[i+h] c + x[i] s  (h = head_dim / 2). OVERWRITES out; out == inp
// allowed. Any even head_dim (multiples of 16 take the 16-byte path).
void rope_fwd(__nv_bfloat16* out, const __nv_bfloat16* inp, const float* cos_table, const float* sin_table,
              int64_t batch, int64_t seq_len, int64_t n_heads, int64_t head_dim, cudaStream_t stream);

// The transpose rotation (sin negated). OVERWRITES dinp; dinp == dout allowed.
void rope_bwd(__nv_bfloat16* dinp, const __nv_bfloat16* dout, const float* cos_table, const float* sin_table,
              int64_t batch, int64_t seq_len, int64_t n_heads, int64_t head_dim, cudaStream_t stream);

}  // namespace tuna::cuda
