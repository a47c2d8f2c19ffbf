// Softmax cross-entropy, forward and backward fused, in place: the twin of kernels/cpu/classifier.cpp.
//
//   logits: [n, vocab] bf16, targets: [n] int32, losses: [n] fp32
//   lse_i = max_i + log sum_j exp(logits[i, j] - max_i)                    (fp32, online: one read for both)
//   losses[i] = lse_i - logits[i, targets[i]]                              OVERWRITTEN; 0 for ignored rows
//   when dloss != 0: logits[i, j] = (exp(logits[i, j] - lse_i) - [j == t_i]) dloss     OVERWRITTEN in place
//
// One block per row, two passes over the row (the second mostly from L2: a 128k-vocabulary row is 256 KB):
// pass 1 keeps a running (max, sum of exp) per thread and merges them across the block; the target's logit
// is read into shared memory before the block barrier that precedes pass 2, so overwriting cannot race it.
// The caller chunks rows (model/llama_gpu), so a 128k vocabulary never needs batch x seq x vocab values.
//
// Vocab-parallel (tensor parallelism, each rank holding columns of every row): the same two passes split around
// two reductions over the ranks (classifier.cuh): pass 1 writes each row's (max, sum of exp) of the rank's
// columns and its target logit if the rank has it; the caller takes the max over the ranks, each rank rescales
// its sums to that max, the caller sums them (and the target logits); pass 2 writes the loss and the gradient.
#include "kernels/classifier.cuh"

#include <cmath>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common.cuh"
#include "kernels/cpu/classifier.h"  // kIgnoreIndex

namespace tuna::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

// Merges two (max, sum of exp(x - max)) pairs.
__device__ __forceinline__ void merge(float& m, float& s, float other_m, float other_s) {
  const float new_m = fmaxf(m, other_m);
  if (new_m == -INFINITY) return;  // both empty
  s = s * __expf(m - new_m) + other_s * __expf(other_m - new_m);
  m = new_m;
}

template <bool kVec>
__global__ void __launch_bounds__(kThreads) classifier_kernel(bf16* logits, float* losses, const int32_t* targets,
                                                              int64_t vocab, float dloss) {
  __shared__ float shared_m[kWarps], shared_s[kWarps];
  __shared__ float target_logit;
  const int64_t row = blockIdx.x;
  bf16* x = logits + row * vocab;
  const int32_t target = targets[row];
  const bool ignored = target == cpu::kIgnoreIndex;
  const bool valid = !ignored && target >= 0 && target < vocab;
  if (ignored) {
    if (threadIdx.x == 0) losses[row] = 0.0f;
    if (dloss != 0.0f)
      for (int64_t j = threadIdx.x; j < vocab; j += kThreads) x[j] = __float2bfloat16(0.0f);
    return;
  }
  if (threadIdx.x == 0) target_logit = valid ? __bfloat162float(x[target]) : NAN;

  float m = -INFINITY, s = 0.0f;
  if constexpr (kVec) {
    for (int64_t j = threadIdx.x * 8; j < vocab; j += kThreads * 8) {
      const Bf16x8 v = load8(x + j);
      float local_m = -INFINITY;
#pragma unroll
      for (int k = 0; k < 8; ++k) local_m = fmaxf(local_m, __bfloat162float(v.v[k]));
      float local_s = 0.0f;
#pragma unroll
      for (int k = 0; k < 8; ++k) local_s += __expf(__bfloat162float(v.v[k]) - local_m);
      merge(m, s, local_m, local_s);
    }
  } else {
    for (int64_t j = threadIdx.x; j < vocab; j += kThreads) merge(m, s, __bfloat162float(x[j]), 1.0f);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float other_m = __shfl_xor_sync(0xffffffffu, m, offset);
    const float other_s = __shfl_xor_sync(0xffffffffu, s, offset);
    merge(m, s, other_m, other_s);
  }
  if (threadIdx.x % 32 == 0) shared_m[threadIdx.x / 32] = m, shared_s[threadIdx.x / 32] = s;
  __syncthreads();  // also publishes target_logit before pass 2 overwrites the row
  m = shared_m[0], s = shared_s[0];
  for (int w = 1; w < kWarps; ++w) merge(m, s, shared_m[w], shared_s[w]);
  const float lse = m + logf(s);
  if (threadIdx.x == 0) losses[row] = valid ? lse - target_logit : NAN;
  if (dloss == 0.0f) return;
  const float bad = valid ? 0.0f : NAN;  // an invalid target poisons its row's gradient too
  if constexpr (kVec) {
    for (int64_t j = threadIdx.x * 8; j < vocab; j += kThreads * 8) {
      const Bf16x8 v = load8(x + j);
      Bf16x8 g;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float p = __expf(__bfloat162float(v.v[k]) - lse);
        g.v[k] = __float2bfloat16((p - (j + k == target ? 1.0f : 0.0f)) * dloss + bad);
      }
      store8(x + j, g);
    }
  } else {
    for (int64_t j = threadIdx.x; j < vocab; j += kThreads) {
      const float p = __expf(__bfloat162float(x[j]) - lse);
      x[j] = __float2bfloat16((p - (j == target ? 1.0f : 0.0f)) * dloss + bad);
    }
  }
}

// The row's (max, sum of exp(x - max)) over `count` values, merged across the block (every thread gets it).
template <bool kVec>
__device__ void row_max_and_sum(const bf16* x, int64_t count, float* shared_m, float* shared_s, float& m, float& s) {
  m = -INFINITY, s = 0.0f;
  if constexpr (kVec) {
    for (int64_t j = threadIdx.x * 8; j < count; j += kThreads * 8) {
      const Bf16x8 v = load8(x + j);
      float local_m = -INFINITY;
#pragma unroll
      for (int k = 0; k < 8; ++k) local_m = fmaxf(local_m, __bfloat162float(v.v[k]));
      float local_s = 0.0f;
#pragma unroll
      for (int k = 0; k < 8; ++k) local_s += __expf(__bfloat162float(v.v[k]) - local_m);
      merge(m, s, local_m, local_s);
    }
  } else {
    for (int64_t j = threadIdx.x; j < count; j += kThreads) merge(m, s, __bfloat162float(x[j]), 1.0f);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float other_m = __shfl_xor_sync(0xffffffffu, m, offset);
    const float other_s = __shfl_xor_sync(0xffffffffu, s, offset);
    merge(m, s, other_m, other_s);
  }
  if (threadIdx.x % 32 == 0) shared_m[threadIdx.x / 32] = m, shared_s[threadIdx.x / 32] = s;
  __syncthreads();
  m = shared_m[0], s = shared_s[0];
  for (int w = 1; w < kWarps; ++w) merge(m, s, shared_m[w], shared_s[w]);
}

// Vocab-parallel step 1 (classifier.cuh): stats [3, n] of this rank's columns.
template <bool kVec>
__global__ void __launch_bounds__(kThreads) partial_stats_kernel(const bf16* logits, float* stats,
                                                                 const int32_t* targets, int64_t n, int64_t count,
                                                                 int64_t vocab_begin, int64_t vocab) {
  __shared__ float shared_m[kWarps], shared_s[kWarps];
  const int64_t row = blockIdx.x;
  const bf16* x = logits + row * count;
  const int32_t target = targets[row];
  if (target == cpu::kIgnoreIndex) {
    if (threadIdx.x == 0) stats[row] = stats[n + row] = stats[2 * n + row] = 0.0f;
    return;
  }
  float m, s;
  row_max_and_sum<kVec>(x, count, shared_m, shared_s, m, s);
  if (threadIdx.x != 0) return;
  const int64_t t = static_cast<int64_t>(target) - vocab_begin;
  const bool valid = target >= 0 && target < vocab;  // an invalid target poisons its row (callers validate first)
  stats[row] = m;
  stats[n + row] = s;
  stats[2 * n + row] = !valid ? NAN : t >= 0 && t < count ? __bfloat162float(x[t]) : 0.0f;
}

__global__ void rescale_sums_kernel(float* stats, const float* global_max, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < n) stats[n + i] *= __expf(stats[i] - global_max[i]);
}

// Vocab-parallel step 3: the loss from the reduced statistics, and the gradient of this rank's columns.
template <bool kVec>
__global__ void __launch_bounds__(kThreads) parallel_fwd_bwd_kernel(bf16* logits, float* losses,
                                                                    const int32_t* targets, const float* global_max,
                                                                    const float* sum_and_target, int64_t n,
                                                                    int64_t count, int64_t vocab_begin, float dloss) {
  const int64_t row = blockIdx.x;
  bf16* x = logits + row * count;
  const int32_t target = targets[row];
  if (target == cpu::kIgnoreIndex) {
    if (threadIdx.x == 0) losses[row] = 0.0f;
    if (dloss != 0.0f)
      for (int64_t j = threadIdx.x; j < count; j += kThreads) x[j] = __float2bfloat16(0.0f);
    return;
  }
  const float lse = global_max[row] + logf(sum_and_target[row]);
  if (threadIdx.x == 0) losses[row] = lse - sum_and_target[n + row];
  if (dloss == 0.0f) return;
  const int64_t t = static_cast<int64_t>(target) - vocab_begin;
  if constexpr (kVec) {
    for (int64_t j = threadIdx.x * 8; j < count; j += kThreads * 8) {
      const Bf16x8 v = load8(x + j);
      Bf16x8 g;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float p = __expf(__bfloat162float(v.v[k]) - lse);
        g.v[k] = __float2bfloat16((p - (j + k == t ? 1.0f : 0.0f)) * dloss);
      }
      store8(x + j, g);
    }
  } else {
    for (int64_t j = threadIdx.x; j < count; j += kThreads) {
      const float p = __expf(__bfloat162float(x[j]) - lse);
      x[j] = __float2bfloat16((p - (j == t ? 1.0f : 0.0f)) * dloss);
    }
  }
}

__global__ void loss_sum_kernel(double* total, const float* losses, int64_t n) {
  __shared__ double scratch[kWarps];
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) sum += losses[i];
  sum = block_sum(sum, scratch);
  if (threadIdx.x == 0) *total = sum;
}

}  // namespace

void classifier_fwd_bwd(bf16* logits, float* losses, const int32_t* targets, int64_t n, int64_t vocab, float dloss,
                        cudaStream_t stream) {
  TUNA_CHECK(n >= 0 && vocab > 0 && losses != nullptr, "n ", n, ", vocab ", vocab);
  if (n == 0) return;
  TUNA_CHECK(n < (int64_t(1) << 31), "n ", n);
  const bool vec = vocab % 8 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0;
  if (vec)
    launch_kernel(classifier_kernel<true>, static_cast<unsigned>(n), kThreads, 0, stream, logits, losses, targets,
                  vocab, dloss);
  else
    launch_kernel(classifier_kernel<false>, static_cast<unsigned>(n), kThreads, 0, stream, logits, losses, targets,
                  vocab, dloss);
  TUNA_CUDA_CHECK_LAUNCH();
}

void classifier_partial_stats(const bf16* logits, float* stats, const int32_t* targets, int64_t n, int64_t count,
                              int64_t vocab_begin, int64_t vocab, cudaStream_t stream) {
  TUNA_CHECK(n >= 0 && count > 0 && vocab_begin >= 0 && vocab_begin + count <= vocab, "n ", n, ", slice [",
             vocab_begin, ", +", count, ") of ", vocab);
  if (n == 0) return;
  TUNA_CHECK(n < (int64_t(1) << 31), "n ", n);
  if (count % 8 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0)
    launch_kernel(partial_stats_kernel<true>, static_cast<unsigned>(n), kThreads, 0, stream, logits, stats, targets, n,
                  count, vocab_begin, vocab);
  else
    launch_kernel(partial_stats_kernel<false>, static_cast<unsigned>(n), kThreads, 0, stream, logits, stats, targets, n,
                  count, vocab_begin, vocab);
  TUNA_CUDA_CHECK_LAUNCH();
}

void classifier_rescale_sums(float* stats, const float* global_max, int64_t n, cudaStream_t stream) {
  TUNA_CHECK(n >= 0, "n ", n);
  if (n == 0) return;
  launch_kernel(rescale_sums_kernel, static_cast<unsigned>(ceil_div(n, kThreads)), kThreads, 0, stream, stats,
                global_max, n);
  TUNA_CUDA_CHECK_LAUNCH();
}

void classifier_parallel_fwd_bwd(bf16* logits, float* losses, const int32_t* targets, const float* global_max,
                                 const float* sum_and_target, int64_t n, int64_t count, int64_t vocab_begin,
                                 float dloss, cudaStream_t stream) {
  TUNA_CHECK(n >= 0 && count > 0 && losses != nullptr, "n ", n, ", count ", count);
  if (n == 0) return;
  TUNA_CHECK(n < (int64_t(1) << 31), "n ", n);
  if (count % 8 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0)
    launch_kernel(parallel_fwd_bwd_kernel<true>, static_cast<unsigned>(n), kThreads, 0, stream, logits, losses,
                  targets, global_max, sum_and_target, n, count, vocab_begin, dloss);
  else
    launch_kernel(parallel_fwd_bwd_kernel<false>, static_cast<unsigned>(n), kThreads, 0, stream, logits, losses,
                  targets, global_max, sum_and_target, n, count, vocab_begin, dloss);
  TUNA_CUDA_CHECK_LAUNCH();
}

void loss_sum(double* total, const float* losses, int64_t n, cudaStream_t stream) {
  TUNA_CHECK(n >= 0, "n ", n);
  launch_kernel(loss_sum_kernel, 1, kThreads, 0, stream, total, losses, n);
  TUNA_CUDA_CHECK_LAUNCH();
}

}  // namespace tuna::cuda
