// Softmax cross-entropy, forward and backward fused, in place: the twin of kernels/cpu/classifier.cpp.
//
//   logits: [n, vocab] bf16, targets: [n] int32, losses: [n] fp32
//   lse_i = max_i + log sum_j exp(logits[i, j] - max_i)                    (fp32, online: one read for both)
//   losses[i] = lse_i - logits[i, targets[i]]                              OVERWRITTEN; 0 for ignored rows
//   when dloss != 0: logits[i, j] = (exp(logits[i, j] - lse_i) - [j == t_i]) dloss     OVERWRITTEN in place
//
// Memory-bound, at best 4 bytes a logit (read once, gradient written once); but the gradient needs the row's
// logsumexp first, so one block per row makes two passes, and the second must not reread the row from DRAM:
// - pass 1 keeps the row's first `cached` logits in dynamic shared memory (as much as a block may have: 226 KB
//   on Hopper, 90% of a LLaMA-3 row), and pass 2 reads the rest first, while it is still in L2. Losses only
//   (dloss = 0) caches nothing: one pass, more blocks an SM.
// - each thread loads kUnroll 16-byte vectors before using any, and merges them into its running (max, sum of
//   exp) once per kUnroll x 8 logits.
// - pass 2 overwrites each logit with its gradient: the target's logit is saved in shared memory before the
//   barrier between the passes, so no overwrite races a read.
// The caller chunks rows (model/llama_gpu), so a 128k vocabulary never needs batch x seq x vocab values.
//
// Vocab-parallel (tensor parallelism, each rank holding columns of every row): the same two passes split around
// two reductions over the ranks (classifier.cuh): pass 1 writes each row's (max, sum of exp) of the rank's
// columns and its target logit if the rank has it; the caller takes the max over the ranks, each rank rescales
// its sums to that max, the caller sums them (and the target logits); pass 2 writes the loss and the gradient (or,
// weighted, the gradient alone, each row scaled by its weight).
#include "kernels/classifier.cuh"

#include <algorithm>
#include <cmath>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common.cuh"
#include "kernels/cpu/classifier.h"  // kIgnoreIndex

namespace tuna::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 8;                 // vectors a thread loads before using any
constexpr int kStaticSharedBytes = 1024;   // headroom for the kernel's static shared variables

// Merges two (max, sum of exp(x - max)) pairs.
__device__ __forceinline__ void merge(float& m, float& s, float other_m, float other_s) {
  const float new_m = fmaxf(m, other_m);
  if (new_m == -INFINITY) return;  // both empty
  s = s * __expf(m - new_m) + other_s * __expf(other_m - new_m);
  m = new_m;
}

// Every thread's (max, sum of exp) merged over the block, in a fixed order (warp shuffles, then the warps in
// order), into every thread's m and s. Its barrier also publishes what the block wrote to shared memory before.
__device__ __forceinline__ void block_merge(float& m, float& s, float* shared_m, float* shared_s) {
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

// The gradient of 8 logits starting at column j0.
__device__ __forceinline__ Packed8 gradient8(const Packed8& x, int64_t j0, float lse, int32_t target, float dloss,
                                             float bad) {
  float g[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const float p = __expf(unpack(x, k) - lse);
    g[k] = (p - (j0 + k == target ? 1.0f : 0.0f)) * dloss + bad;
  }
  return pack8(g);
}

// kVec: vocab % 8 == 0 and 16-byte aligned rows (the vector path, with `cached` leading logits, a multiple
// of 8, kept in dynamic shared memory); otherwise one logit at a time, nothing cached.
// weights (the weighted backward, classifier.cuh): each row's dloss instead of `dloss`, a gradient always written
// (zeros for a row of weight 0, as for an ignored one), and losses may be null.
template <bool kVec>
__global__ void __launch_bounds__(kThreads) classifier_kernel(bf16* logits, float* losses, const int32_t* targets,
                                                              int64_t vocab, float dloss, const float* weights,
                                                              int64_t cached) {
  __shared__ float shared_m[kWarps], shared_s[kWarps];
  __shared__ float target_logit;
  const int64_t row = blockIdx.x;
  bf16* x = logits + row * vocab;
  const int32_t target = targets[row];
  const bool grad = weights != nullptr || dloss != 0.0f;
  if (weights) dloss = weights[row];
  const bool ignored = target == cpu::kIgnoreIndex || (weights && dloss == 0.0f);
  const bool valid = !ignored && target >= 0 && target < vocab;
  if (ignored) {
    if (threadIdx.x == 0 && losses) losses[row] = 0.0f;
    if (!grad) return;
    if constexpr (kVec) {
      for (int64_t v = threadIdx.x; v < vocab / 8; v += kThreads) store_packed(x + v * 8, zeros_packed());
    } else {
      for (int64_t j = threadIdx.x; j < vocab; j += kThreads) x[j] = __float2bfloat16(0.0f);
    }
    return;
  }
  if (threadIdx.x == 0) target_logit = valid ? __bfloat162float(x[target]) : NAN;

  Packed8* cache = reinterpret_cast<Packed8*>(dynamic_shared_memory());
  const int64_t n_vec = vocab / 8, cached_vec = cached / 8;
  float m = -INFINITY, s = 0.0f;
  if constexpr (kVec) {
    for (int64_t v0 = 0; v0 < n_vec; v0 += kThreads * kUnroll) {
      Packed8 chunk[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + u * kThreads + threadIdx.x;
        chunk[u] = v < n_vec ? load_packed(x + v * 8) : zeros_packed();
      }
      float local_m = -INFINITY;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (v0 + u * kThreads + threadIdx.x < n_vec)
#pragma unroll
          for (int k = 0; k < 8; ++k) local_m = fmaxf(local_m, unpack(chunk[u], k));
      float local_s = 0.0f;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + u * kThreads + threadIdx.x;
        if (v >= n_vec) continue;
#pragma unroll
        for (int k = 0; k < 8; ++k) local_s += __expf(unpack(chunk[u], k) - local_m);
        if (v < cached_vec) cache[v] = chunk[u];
      }
      merge(m, s, local_m, local_s);
    }
  } else {
    for (int64_t j = threadIdx.x; j < vocab; j += kThreads) merge(m, s, __bfloat162float(x[j]), 1.0f);
  }
  block_merge(m, s, shared_m, shared_s);  // also publishes target_logit (and the cached row) before pass 2
  const float lse = m + logf(s);
  if (threadIdx.x == 0 && losses) losses[row] = valid ? lse - target_logit : NAN;
  if (!grad) return;
  const float bad = valid ? 0.0f : NAN;  // an invalid target poisons its row's gradient too
  if constexpr (kVec) {
    // The uncached tail first, from L2 while it is fresh; then the cached head from shared memory.
    for (int64_t v0 = cached_vec; v0 < n_vec; v0 += kThreads * kUnroll) {
      Packed8 chunk[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + u * kThreads + threadIdx.x;
        chunk[u] = v < n_vec ? load_packed(x + v * 8) : zeros_packed();
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + u * kThreads + threadIdx.x;
        if (v < n_vec) store_packed(x + v * 8, gradient8(chunk[u], v * 8, lse, target, dloss, bad));
      }
    }
    for (int64_t v = threadIdx.x; v < cached_vec; v += kThreads)
      store_packed(x + v * 8, gradient8(cache[v], v * 8, lse, target, dloss, bad));
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
  block_merge(m, s, shared_m, shared_s);
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

// Vocab-parallel step 3: the loss from the reduced statistics, and the gradient of this rank's columns. weights (the
// weighted backward, classifier.cuh): each row's dloss instead of `dloss`, a gradient always written (zeros for a row
// of weight 0, as for an ignored one), and losses may be null.
template <bool kVec>
__global__ void __launch_bounds__(kThreads) parallel_fwd_bwd_kernel(bf16* logits, float* losses,
                                                                    const int32_t* targets, const float* global_max,
                                                                    const float* sum_and_target, int64_t n,
                                                                    int64_t count, int64_t vocab_begin, float dloss,
                                                                    const float* weights) {
  const int64_t row = blockIdx.x;
  bf16* x = logits + row * count;
  const int32_t target = targets[row];
  const bool grad = weights != nullptr || dloss != 0.0f;
  if (weights) dloss = weights[row];
  if (target == cpu::kIgnoreIndex || (weights && dloss == 0.0f)) {
    if (threadIdx.x == 0 && losses) losses[row] = 0.0f;
    if (grad)
      for (int64_t j = threadIdx.x; j < count; j += kThreads) x[j] = __float2bfloat16(0.0f);
    return;
  }
  const float lse = global_max[row] + logf(sum_and_target[row]);
  if (threadIdx.x == 0 && losses) losses[row] = lse - sum_and_target[n + row];
  if (!grad) return;
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

namespace {

void launch_classifier(bf16* logits, float* losses, const int32_t* targets, int64_t n, int64_t vocab, float dloss,
                       const float* weights, cudaStream_t stream) {
  if (n == 0) return;
  TUNA_CHECK(n < (int64_t(1) << 31), "n ", n);
  const bool vec = vocab % 8 == 0 && aligned16(logits);
  if (vec) {
    // As much of the row as the device lets one block keep (the attribute is per device: ask each time).
    int device = 0, optin_bytes = 0;
    TUNA_CUDA_CHECK(cudaGetDevice(&device));
    TUNA_CUDA_CHECK(cudaDeviceGetAttribute(&optin_bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    const int64_t cached = dloss == 0.0f && !weights
                               ? 0
                               : std::min<int64_t>(vocab, (optin_bytes - kStaticSharedBytes) / 2 / 8 * 8);
    const int smem = static_cast<int>(cached * 2);
    TUNA_CUDA_CHECK(cudaFuncSetAttribute(classifier_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    launch_kernel(classifier_kernel<true>, static_cast<unsigned>(n), kThreads, smem, stream, logits, losses, targets,
                  vocab, dloss, weights, cached);
  } else {
    launch_kernel(classifier_kernel<false>, static_cast<unsigned>(n), kThreads, 0, stream, logits, losses, targets,
                  vocab, dloss, weights, int64_t{0});
  }
  TUNA_CUDA_CHECK_LAUNCH();
}

}  // namespace

void classifier_fwd_bwd(bf16* logits, float* losses, const int32_t* targets, int64_t n, int64_t vocab, float dloss,
                        cudaStream_t stream) {
  TUNA_CHECK(n >= 0 && vocab > 0 && losses != nullptr, "n ", n, ", vocab ", vocab);
  launch_classifier(logits, losses, targets, n, vocab, dloss, nullptr, stream);
}

void classifier_weighted_bwd(bf16* logits, const int32_t* targets, const float* weights, int64_t n, int64_t vocab,
                             cudaStream_t stream) {
  TUNA_CHECK(n >= 0 && vocab > 0 && weights != nullptr, "n ", n, ", vocab ", vocab);
  launch_classifier(logits, nullptr, targets, n, vocab, 0.0f, weights, stream);
}

void classifier_partial_stats(const bf16* logits, float* stats, const int32_t* targets, int64_t n, int64_t count,
                              int64_t vocab_begin, int64_t vocab, cudaStream_t stream) {
  TUNA_CHECK(n >= 0 && count > 0 && vocab_begin >= 0 && vocab_begin + count <= vocab, "n ", n, ", slice [",
             vocab_begin, ", +", count, ") of ", vocab);
  if (n == 0) return;
  TUNA_CHECK(n < (int64_t(1) << 31), "n ", n);
  if (count % 8 == 0 && aligned16(logits))
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

namespace {

void launch_parallel(bf16* logits, float* losses, const int32_t* targets, const float* global_max,
                     const float* sum_and_target, int64_t n, int64_t count, int64_t vocab_begin, float dloss,
                     const float* weights, cudaStream_t stream) {
  if (n == 0) return;
  TUNA_CHECK(n < (int64_t(1) << 31), "n ", n);
  if (count % 8 == 0 && aligned16(logits))
    launch_kernel(parallel_fwd_bwd_kernel<true>, static_cast<unsigned>(n), kThreads, 0, stream, logits, losses,
                  targets, global_max, sum_and_target, n, count, vocab_begin, dloss, weights);
  else
    launch_kernel(parallel_fwd_bwd_kernel<false>, static_cast<unsigned>(n), kThreads, 0, stream, logits, losses,
                  targets, global_max, sum_and_target, n, count, vocab_begin, dloss, weights);
  TUNA_CUDA_CHECK_LAUNCH();
}

}  // namespace

void classifier_parallel_fwd_bwd(bf16* logits, float* losses, const int32_t* targets, const float* global_max,
                                 const float* sum_and_target, int64_t n, int64_t count, int64_t vocab_begin,
                                 float dloss, cudaStream_t stream) {
  TUNA_CHECK(n >= 0 && count > 0 && losses != nullptr, "n ", n, ", count ", count);
  launch_parallel(logits, losses, targets, global_max, sum_and_target, n, count, vocab_begin, dloss, nullptr, stream);
}

void classifier_parallel_weighted_bwd(bf16* logits, const int32_t* targets, const float* global_max,
                                      const float* sum_and_target, const float* weights, int64_t n, int64_t count,
                                      int64_t vocab_begin, cudaStream_t stream) {
  TUNA_CHECK(n >= 0 && count > 0 && weights != nullptr, "n ", n, ", count ", count);
  launch_parallel(logits, nullptr, targets, global_max, sum_and_target, n, count, vocab_begin, 0.0f, weights, stream);
}

void loss_sum(double* total, const float* losses, int64_t n, cudaStream_t stream) {
  TUNA_CHECK(n >= 0, "n ", n);
  launch_kernel(loss_sum_kernel, 1, kThreads, 0, stream, total, losses, n);
  TUNA_CUDA_CHECK_LAUNCH();
}

}  // namespace tuna::cuda
