// Attention for small head dims (8, 16, 32): a plain fp32 kernel, one thread per query row (forward, dQ) or
// per key row (dK/dV), with the FlashAttention contract (online softmax, lse kept, no seq x seq storage).
// It exists so that tiny models (the transformers fixtures have head_dim 8) run on the GPU backend end to
// end; it makes no attempt at speed. The tensor-core kernels (attention_kernels.cuh) serve 64 and 128.
#include <cmath>

#include "core/cuda_check.h"
#include "kernels/attention_params.cuh"
#include "kernels/common.cuh"

namespace tuna::cuda {
namespace {

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
  for (int j = 0; j <= t; ++j) {
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
  for (int j = 0; j <= t; ++j) {
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
  for (int h = kvh * group; h < (kvh + 1) * group; ++h)
    for (int t = j; t < p.seq_len; ++t) {
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

template <int kHd>
void launch(const AttentionParams& p, bool backward, cudaStream_t stream) {
  const int64_t q_rows = static_cast<int64_t>(p.batch) * p.seq_len * p.n_heads;
  const int64_t kv_rows = static_cast<int64_t>(p.batch) * p.seq_len * p.n_kv_heads;
  const unsigned q_grid = static_cast<unsigned>(ceil_div(q_rows, kThreads));
  if (!backward) {
    small_fwd_kernel<kHd><<<q_grid, kThreads, 0, stream>>>(p);
    TUNA_CUDA_CHECK_LAUNCH();
    return;
  }
  small_dq_kernel<kHd><<<q_grid, kThreads, 0, stream>>>(p);  // also writes delta, which dK/dV reads
  TUNA_CUDA_CHECK_LAUNCH();
  small_dkdv_kernel<kHd><<<static_cast<unsigned>(ceil_div(kv_rows, kThreads)), kThreads, 0, stream>>>(p);
  TUNA_CUDA_CHECK_LAUNCH();
}

}  // namespace

void attention_small(const AttentionParams& p, int head_dim, bool backward, cudaStream_t stream) {
  switch (head_dim) {
    case 8: launch<8>(p, backward, stream); break;
    case 16: launch<16>(p, backward, stream); break;
    case 32: launch<32>(p, backward, stream); break;
    default: TUNA_CHECK(false, "attention_small: head_dim ", head_dim);
  }
}

}  // namespace tuna::cuda
