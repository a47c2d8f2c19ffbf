// Attention of new positions against a KV cache on the GPU, the twin of kernels/cpu/decode_attention.cpp.
//
//   q, out: [batch, n_new, n_heads, head_dim];  k_cache, v_cache: [batch, capacity, n_kv_heads, head_dim]
//   query i of sequence b is position t = past + i:
//     s[j] = (q . k_j) / sqrt(head_dim) for j <= t;  p = softmax(s);  out = sum_j p[j] v_j      out: OVERWRITTEN
//
// Generation runs it once over the prompt and then once per token, where a query row is a few hundred bytes
// against a cache of megabytes: the work is reading the cache once. One block per query row (b, i, h) walks
// the keys in chunks of kThreads, a key per thread (its score from 16-byte loads of the key row), with the
// online softmax of FlashAttention across chunks: the chunk's max and sum are block reductions, and thread d
// (< head_dim) accumulates sum_j p_j v_j[d] over the chunk from the weights in shared memory, rescaling its
// running sum when the max grows. Scores, softmax and sums in fp32; every reduction in a fixed order, so the
// result is deterministic. The tensor-core kernels (kernels/attention*) serve training; this serves decoding.
#include "kernels/decode_attention.cuh"

#include <cmath>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common.cuh"

namespace tuna::cuda {
namespace {

constexpr int kThreads = 128;         // keys per chunk; also the largest head_dim (a thread per feature)
constexpr int kWarps = kThreads / 32;

struct DecodeAttentionParams {
  bf16* out;           // [batch, n_new, n_heads, head_dim]
  const bf16* q;       // same layout as out
  const bf16* k_cache;  // [batch, capacity, n_kv_heads, head_dim]
  const bf16* v_cache;  // same layout as k_cache
  int64_t n_new;       // query positions per sequence
  int64_t past;        // cached positions before the first query
  int64_t capacity;    // positions per sequence in the cache
  int n_heads, n_kv_heads, head_dim;
  float scale;         // 1 / sqrt(head_dim)
};

__device__ __forceinline__ float block_max(float x, float* scratch) {
  x = warp_max(x);
  __syncthreads();  // scratch may still be read by a previous reduction
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
  __syncthreads();
  float m = scratch[0];
  for (int w = 1; w < kWarps; ++w) m = fmaxf(m, scratch[w]);
  return m;
}

__global__ void __launch_bounds__(kThreads) decode_attention_kernel(DecodeAttentionParams p) {
  __shared__ float query[kThreads];    // the query row in fp32 (head_dim values)
  __shared__ float weights[kThreads];  // p_j of the current chunk
  __shared__ float scratch[kWarps];
  const int64_t row = blockIdx.x;  // (b, i, h) in q's row order
  const int h = static_cast<int>(row % p.n_heads);
  const int64_t i = (row / p.n_heads) % p.n_new, b = row / (static_cast<int64_t>(p.n_heads) * p.n_new);
  const int64_t last = p.past + i;  // the query's own position: keys 0..last
  const int64_t stride = static_cast<int64_t>(p.n_kv_heads) * p.head_dim;
  const int64_t head_offset = (b * p.capacity * p.n_kv_heads + h / (p.n_heads / p.n_kv_heads)) * p.head_dim;
  const bf16* keys = p.k_cache + head_offset;
  const bf16* values = p.v_cache + head_offset;
  const int tid = threadIdx.x;
  if (tid < p.head_dim) query[tid] = __bfloat162float(p.q[row * p.head_dim + tid]);
  __syncthreads();

  float running_max = -INFINITY, running_sum = 0.0f, acc = 0.0f;
  for (int64_t chunk = 0; chunk <= last; chunk += kThreads) {
    const int64_t j = chunk + tid;
    float score = -INFINITY;
    if (j <= last) {
      const bf16* key = keys + j * stride;
      float dot = 0.0f;
      for (int d = 0; d < p.head_dim; d += 8) {
        const Bf16x8 k8 = load8(key + d);
#pragma unroll
        for (int e = 0; e < 8; ++e) dot += query[d + e] * __bfloat162float(k8.v[e]);
      }
      score = dot * p.scale;
    }
    const float new_max = fmaxf(running_max, block_max(score, scratch));  // finite: key `chunk` is <= last
    const float rescale = expf(running_max - new_max);                     // 0 on the first chunk
    const float weight = j <= last ? expf(score - new_max) : 0.0f;
    weights[tid] = weight;
    running_sum = running_sum * rescale + block_sum(weight, scratch);  // block_sum's barriers publish weights
    if (tid < p.head_dim) {
      const int64_t count = last - chunk + 1 < kThreads ? last - chunk + 1 : kThreads;
      float chunk_acc = 0.0f;
      for (int64_t jj = 0; jj < count; ++jj)
        chunk_acc += weights[jj] * __bfloat162float(values[(chunk + jj) * stride + tid]);
      acc = acc * rescale + chunk_acc;
    }
    running_max = new_max;
    __syncthreads();  // the next chunk overwrites weights
  }
  if (tid < p.head_dim) p.out[row * p.head_dim + tid] = __float2bfloat16(acc / running_sum);
}

}  // namespace

void decode_attention_fwd(bf16* out, const bf16* q, const bf16* k_cache, const bf16* v_cache, int64_t batch,
                          int64_t n_new, int64_t past, int64_t capacity, int64_t n_heads, int64_t n_kv_heads,
                          int64_t head_dim, cudaStream_t stream) {
  TUNA_CHECK(batch >= 0 && n_new >= 0 && past >= 0 && n_heads > 0 && n_kv_heads > 0, "batch ", batch, ", n_new ",
             n_new, ", past ", past, ", n_heads ", n_heads, ", n_kv_heads ", n_kv_heads);
  TUNA_CHECK(n_heads % n_kv_heads == 0, "n_heads ", n_heads, " is not a multiple of n_kv_heads ", n_kv_heads);
  TUNA_CHECK(head_dim > 0 && head_dim % 8 == 0 && head_dim <= kThreads, "decode attention: head_dim ", head_dim,
             " (a multiple of 8, at most ", kThreads, ")");
  TUNA_CHECK(past + n_new <= capacity, "past ", past, " + n_new ", n_new, " exceeds the cache's ", capacity,
             " positions");
  const int64_t rows = batch * n_new * n_heads;
  if (rows == 0) return;
  TUNA_CHECK(rows <= 0x7fffffff, "decode attention: ", rows, " query rows exceed one grid");
  const DecodeAttentionParams p{out,
                                q,
                                k_cache,
                                v_cache,
                                n_new,
                                past,
                                capacity,
                                static_cast<int>(n_heads),
                                static_cast<int>(n_kv_heads),
                                static_cast<int>(head_dim),
                                1.0f / std::sqrt(static_cast<float>(head_dim))};
  launch_kernel(decode_attention_kernel, static_cast<unsigned>(rows), kThreads, 0, stream, p);
  TUNA_CUDA_CHECK_LAUNCH();
}

}  // namespace tuna::cuda
