// Attention for small head dims (8, 16, 32): the kernels, a plain fp32 kernel, one thread per query row
// (forward, dQ) or per key row (dK/dV), with the FlashAttention contract (online softmax, lse kept, no
// seq x seq storage). Launched by attention_small.cu, the only file that includes it; a header of its own
// since the host emulator (tests/kernels/emulator) compiled the kernels alone, before it could compile the
// launchers too. Internal to kernels/. Documents (p.doc_start): a query walks keys from its document's start,
// a key walks queries until the first one of a later document.
#pragma once

#include <cmath>

#include "kernels/attention_params.cuh"
#include "kernels/common.cuh"

namespace tuna::cuda::small_attention {

constexpr int kThreads = 128;

template <int kHd>
__device__ __forceinline__ void load_row(float (&dst)[kHd], const bf16* src) {
#pragma unroll
  for (int d = 0; d < kHd; ++d) dst[d] = __bfloat162float(src[d]);
}

template <int kHd>
__device__ __forceinline__ float dot_row(const float (&a)[kHd], const bf16* b) {
  float sum = 0.0f;
#pragma unroll
  for (int d = 0; d < kHd; ++d) sum += a[d] * __bfloat162float(b[d]);
  return sum;
}

// The sequence, position, query head and kv head of row `row` of q ([batch, seq, heads] order).
struct QueryRow {
  int b, t, h, kvh;
};
__device__ __forceinline__ QueryRow query_of_row(const AttentionParams& p, int64_t row) {
  const int h = static_cast<int>(row % p.n_heads);
  const int t = static_cast<int>((row / p.n_heads) % p.seq_len);
  const int b = static_cast<int>(row / (static_cast<int64_t>(p.n_heads) * p.seq_len));
  return {b, t, h, h / (p.n_heads / p.n_kv_heads)};
}

// Thread per (b, t, h) in the [batch, seq, heads] order of q's rows.
template <int kHd>
__global__ void small_fwd_kernel(AttentionParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (row >= static_cast<int64_t>(p.batch) * p.seq_len * p.n_heads) return;
  const auto [b, t, h, kvh] = query_of_row(p, row);
  float q[kHd], acc[kHd] = {};
  load_row<kHd>(q, p.q + row * kHd);
  float row_max = -INFINITY, row_sum = 0.0f;
  const int first = p.doc_start ? p.doc_start[static_cast<int64_t>(b) * p.seq_len + t] : 0;
  for (int j = first; j <= t; ++j) {
    const int64_t kv = ((static_cast<int64_t>(b) * p.seq_len + j) * p.n_kv_heads + kvh) * kHd;
    const float s = dot_row<kHd>(q, p.k + kv) * p.scale;
    const float new_max = fmaxf(row_max, s);
    const float correction = expf(row_max - new_max), weight = expf(s - new_max);
    row_sum = row_sum * correction + weight;
#pragma unroll
    for (int d = 0; d < kHd; ++d) acc[d] = acc[d] * correction + weight * __bfloat162float(p.v[kv + d]);
    row_max = new_max;
  }
#pragma unroll
  for (int d = 0; d < kHd; ++d) p.out[row * kHd + d] = __float2bfloat16(acc[d] / row_sum);
  p.lse[(static_cast<int64_t>(b) * p.n_heads + h) * p.seq_len + t] = row_max + logf(row_sum);
}

// Thread per query row: delta = dout . out, then dq.
template <int kHd>
__global__ void small_dq_kernel(AttentionParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (row >= static_cast<int64_t>(p.batch) * p.seq_len * p.n_heads) return;
  const auto [b, t, h, kvh] = query_of_row(p, row);
  const int64_t stat = (static_cast<int64_t>(b) * p.n_heads + h) * p.seq_len + t;
  float q[kHd], g[kHd], dq[kHd] = {};
  load_row<kHd>(q, p.q + row * kHd);
  load_row<kHd>(g, p.dout + row * kHd);
  const float delta = dot_row<kHd>(g, p.out + row * kHd);
  p.delta[stat] = delta;
  const float lse = p.lse[stat];
  const int first = p.doc_start ? p.doc_start[static_cast<int64_t>(b) * p.seq_len + t] : 0;
  for (int j = first; j <= t; ++j) {
    const int64_t kv = ((static_cast<int64_t>(b) * p.seq_len + j) * p.n_kv_heads + kvh) * kHd;
    const float prob = expf(dot_row<kHd>(q, p.k + kv) * p.scale - lse);
    const float ds = prob * (dot_row<kHd>(g, p.v + kv) - delta);
#pragma unroll
    for (int d = 0; d < kHd; ++d) dq[d] += ds * __bfloat162float(p.k[kv + d]);
  }
#pragma unroll
  for (int d = 0; d < kHd; ++d) p.dq[row * kHd + d] = __float2bfloat16(dq[d] * p.scale);
}

// Thread per (b, j, kvh) key row: walks every query head of the group and every query t >= j, in order.
template <int kHd>
__global__ void small_dkdv_kernel(AttentionParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (row >= static_cast<int64_t>(p.batch) * p.seq_len * p.n_kv_heads) return;
  const int kvh = static_cast<int>(row % p.n_kv_heads);
  const int j = static_cast<int>((row / p.n_kv_heads) % p.seq_len);
  const int b = static_cast<int>(row / (static_cast<int64_t>(p.n_kv_heads) * p.seq_len));
  const int group = p.n_heads / p.n_kv_heads;
  float k[kHd], v[kHd], dk[kHd] = {}, dv[kHd] = {};
  load_row<kHd>(k, p.k + row * kHd);
  load_row<kHd>(v, p.v + row * kHd);
  // Queries t >= j of j's document: up to the first one whose document starts after j.
  const int32_t* doc = p.doc_start ? p.doc_start + static_cast<int64_t>(b) * p.seq_len : nullptr;
  int end = j + 1;
  while (end < p.seq_len && (doc == nullptr || doc[end] <= j)) ++end;
  for (int h = kvh * group; h < (kvh + 1) * group; ++h)
    for (int t = j; t < end; ++t) {
      const int64_t qrow = ((static_cast<int64_t>(b) * p.seq_len + t) * p.n_heads + h) * kHd;
      const int64_t stat = (static_cast<int64_t>(b) * p.n_heads + h) * p.seq_len + t;
      const float prob = expf(dot_row<kHd>(k, p.q + qrow) * p.scale - p.lse[stat]);
      const float ds = prob * (dot_row<kHd>(v, p.dout + qrow) - p.delta[stat]);
#pragma unroll
      for (int d = 0; d < kHd; ++d) {
        dk[d] += ds * __bfloat162float(p.q[qrow + d]);
        dv[d] += prob * __bfloat162float(p.dout[qrow + d]);
      }
    }
#pragma unroll
  for (int d = 0; d < kHd; ++d) {
    p.dk[row * kHd + d] = __float2bfloat16(dk[d] * p.scale);
    p.dv[row * kHd + d] = __float2bfloat16(dv[d]);
  }
}

}  // namespace tuna::cuda::small_attention
