// AdamW over a whole flat parameter buffer in one launch, the twin of kernels/cpu/adamw.cpp.
//
//   g = grad * grad_scale
//   master *= 1 - lr * weight_decay(segment)
//   m = beta1 m + (1 - beta1) g;   v = beta2 v + (1 - beta2) g^2
//   master -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//   param_bf16 = bf16(master)                     master, m, v, param_bf16: UPDATED IN PLACE
//
// Memory-bound: per element it reads grad, master, m, v and writes master, m, v, param (30 bytes with fp32
// moments, 22 with bf16). Each thread handles 4 consecutive elements, each array as one vector access (16 bytes
// of fp32, 8 of bf16), all loads before any store; the weight decay of those elements comes from one binary
// search of the segment table (a few hundred sorted starts, cached in L1) per thread, which is what lets one
// launch cover every tensor. Bias corrections are computed on the host in double.
//
// sum_of_squares: a fixed grid (a function of n only) of per-thread double sums, then one block adds the
// block partials in order: the gradient norm is bit-identical across runs and devices.
#include "kernels/adamw.cuh"

#include <cmath>
#include <utility>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common.cuh"
#include "kernels/scratch.h"

namespace tuna::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kNormBlocks = 1024;

struct Coefficients {
  float lr, beta1, beta2, eps, weight_decay, step_size, bias_correction2_sqrt, grad_scale;
  bool stochastic_rounding;
  uint32_t seed;
};

// Four consecutive elements as one access: 16 bytes of fp32, 8 bytes of bf16.
struct alignas(8) Bf16x4 {
  bf16 v[4];
};

__device__ __forceinline__ void load4(const float* __restrict__ p, float out[4]) {
  const float4 x = *reinterpret_cast<const float4*>(p);
  out[0] = x.x, out[1] = x.y, out[2] = x.z, out[3] = x.w;
}
__device__ __forceinline__ void load4(const bf16* __restrict__ p, float out[4]) {
  const Bf16x4 x = *reinterpret_cast<const Bf16x4*>(p);
#pragma unroll
  for (int k = 0; k < 4; ++k) out[k] = __bfloat162float(x.v[k]);
}

__device__ __forceinline__ bf16 round_bf16(float x, bool stochastic, uint32_t seed, uint64_t index) {
  return stochastic ? bf16_stochastic(x, hash_u32(seed, index)) : __float2bfloat16(x);
}
// Elements i0 .. i0 + 3; bf16 stores round each element with its own random bits (a function of its index).
__device__ __forceinline__ void store4(float* __restrict__ p, const float x[4], bool, uint32_t, uint64_t) {
  *reinterpret_cast<float4*>(p) = make_float4(x[0], x[1], x[2], x[3]);
}
__device__ __forceinline__ void store4(bf16* __restrict__ p, const float x[4], bool stochastic, uint32_t seed,
                                       uint64_t i0) {
  Bf16x4 out;
#pragma unroll
  for (int k = 0; k < 4; ++k) out.v[k] = round_bf16(x[k], stochastic, seed, i0 + k);
  *reinterpret_cast<Bf16x4*>(p) = out;
}

// The segment holding element i: the last start <= i (binary search of a few hundred sorted starts, in L1).
__device__ __forceinline__ int segment_of(const AdamWSegments& segments, int64_t i) {
  int lo = 0, hi = segments.n_segments - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (__ldg(segments.starts + mid) <= i) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// One thread, four consecutive elements: every load is issued before any store (the moments, master and
// gradient of the group are in flight together), and the segment table is searched once per thread; a tensor
// boundary inside the group (a tensor whose size is not a multiple of 4) moves to the next segment by a step.
template <typename M>
__global__ void __launch_bounds__(kThreads) adamw_kernel(float* __restrict__ master, bf16* __restrict__ param_bf16,
                                                         const float* __restrict__ grad, M* __restrict__ m,
                                                         M* __restrict__ v, int64_t n, AdamWSegments segments,
                                                         Coefficients c) {
  const int64_t i0 = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * 4;
  if (i0 >= n) return;
  float g[4], p[4], m4[4], v4[4];
  const float4 g4 = __ldcs(reinterpret_cast<const float4*>(grad + i0));  // read once: evict first
  g[0] = g4.x, g[1] = g4.y, g[2] = g4.z, g[3] = g4.w;
  load4(master + i0, p);
  load4(m + i0, m4);
  load4(v + i0, v4);
  int segment = segment_of(segments, i0);
  int64_t next_start = segment + 1 < segments.n_segments ? __ldg(segments.starts + segment + 1) : INT64_MAX;
  // Distinct random streams for the parameters and the two moments, per step.
  const uint32_t seed_p = c.seed * 3u + 0u, seed_m = c.seed * 3u + 1u, seed_v = c.seed * 3u + 2u;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    while (i0 + k >= next_start) {
      segment++;
      next_start = segment + 1 < segments.n_segments ? __ldg(segments.starts + segment + 1) : INT64_MAX;
    }
    const float gk = g[k] * c.grad_scale;
    m4[k] = c.beta1 * m4[k] + (1.0f - c.beta1) * gk;
    v4[k] = c.beta2 * v4[k] + (1.0f - c.beta2) * gk * gk;
    const float denom = sqrtf(v4[k]) / c.bias_correction2_sqrt + c.eps;
    const float decay = __ldg(segments.decays + segment) != 0 ? 1.0f - c.lr * c.weight_decay : 1.0f;
    p[k] = p[k] * decay - c.step_size * (m4[k] / denom);
  }
  store4(m + i0, m4, c.stochastic_rounding, seed_m, i0);
  store4(v + i0, v4, c.stochastic_rounding, seed_v, i0);
  store4(master + i0, p, /*stochastic=*/false, /*seed=*/0, i0);
  if (param_bf16 != nullptr) store4(param_bf16 + i0, p, c.stochastic_rounding, seed_p, i0);
}

__global__ void __launch_bounds__(kThreads) sum_of_squares_partial_kernel(double* partial, const float* x,
                                                                          int64_t n) {
  __shared__ double scratch[kThreads / 32];
  double sum = 0.0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    const double value = x[i];
    sum += value * value;
  }
  sum = block_sum(sum, scratch);
  if (threadIdx.x == 0) partial[blockIdx.x] = sum;
}

__global__ void __launch_bounds__(kThreads) sum_partials_kernel(double* total, const double* partial, int n) {
  __shared__ double scratch[kThreads / 32];
  double sum = 0.0;
  for (int i = threadIdx.x; i < n; i += kThreads) sum += partial[i];
  sum = block_sum(sum, scratch);
  if (threadIdx.x == 0) *total = sum;
}

__global__ void accumulate_kernel(float* dst, const float* src, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < n) dst[i] += src[i];
}

__global__ void f32_to_bf16_kernel(bf16* out, const float* in, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < n) out[i] = __float2bfloat16(in[i]);
}

// The parameters' stream of adamw_kernel (seed_p) for the same coefficients seed.
__global__ void f32_to_bf16_stochastic_kernel(bf16* out, const float* in, int64_t n, uint32_t step_seed) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < n) out[i] = bf16_stochastic(in[i], hash_u32(step_seed * 3u + 0u, static_cast<uint64_t>(i)));
}

// The per-step seed of the stochastic rounding streams: a pure function of (seed, step).
uint32_t step_seed(const AdamWArgs& a) { return a.seed * 0x9E3779B1u + static_cast<uint32_t>(a.step); }

template <typename M>
void adamw_launch(float* master, bf16* param_bf16, const float* grad, M* m, M* v, int64_t n,
                  const AdamWSegments& segments, const AdamWArgs& a, cudaStream_t stream) {
  TUNA_CHECK(n >= 0 && n % 4 == 0, "n ", n, " (must be a multiple of 4)");
  TUNA_CHECK(a.step >= 1, "AdamW step is 1-based, got ", a.step);
  TUNA_CHECK(segments.n_segments >= 1, "no segments");
  // Each array is read and written 4 elements at a time: aligned to 4 of its elements.
  const std::pair<const void*, size_t> arrays[] = {
      {master, 16}, {grad, 16}, {m, 4 * sizeof(M)}, {v, 4 * sizeof(M)}, {param_bf16, 8}};
  for (const auto& [p, alignment] : arrays)
    TUNA_CHECK(reinterpret_cast<uintptr_t>(p) % alignment == 0, "adamw buffers must be aligned to 4 elements");
  if (n == 0) return;
  Coefficients c;
  c.lr = static_cast<float>(a.lr);
  c.beta1 = static_cast<float>(a.beta1);
  c.beta2 = static_cast<float>(a.beta2);
  c.eps = static_cast<float>(a.eps);
  c.weight_decay = static_cast<float>(a.weight_decay);
  c.step_size = static_cast<float>(a.lr / (1.0 - std::pow(a.beta1, static_cast<double>(a.step))));
  c.bias_correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(a.beta2, static_cast<double>(a.step))));
  c.grad_scale = static_cast<float>(a.grad_scale);
  c.stochastic_rounding = a.stochastic_rounding;
  c.seed = step_seed(a);
  launch_kernel(adamw_kernel<M>, static_cast<unsigned>(ceil_div(n / 4, kThreads)), kThreads, 0, stream, master,
                param_bf16, grad, m, v, n, segments, c);
  TUNA_CUDA_CHECK_LAUNCH();
}

}  // namespace

void adamw_update(float* master, bf16* param_bf16, const float* grad, float* m, float* v, int64_t n,
                  const AdamWSegments& segments, const AdamWArgs& args, cudaStream_t stream) {
  adamw_launch(master, param_bf16, grad, m, v, n, segments, args, stream);
}

void adamw_update(float* master, bf16* param_bf16, const float* grad, bf16* m, bf16* v, int64_t n,
                  const AdamWSegments& segments, const AdamWArgs& args, cudaStream_t stream) {
  adamw_launch(master, param_bf16, grad, m, v, n, segments, args, stream);
}

int64_t sum_of_squares_scratch_doubles() {
  static_assert(kNormBlocks == 1024, "kernels/scratch.h sizes the scratch for 1024 blocks");
  return gpu_scratch::sum_of_squares_doubles();
}

void sum_of_squares(double* total, const float* x, int64_t n, double* scratch, cudaStream_t stream) {
  TUNA_CHECK(n >= 0, "n ", n);
  // Blocks: a function of n alone (at least 64k elements per block before the grid reaches its cap).
  const int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(kNormBlocks, ceil_div(n, 65536))));
  launch_kernel(sum_of_squares_partial_kernel, blocks, kThreads, 0, stream, scratch, x, n);
  TUNA_CUDA_CHECK_LAUNCH();
  launch_kernel(sum_partials_kernel, 1, kThreads, 0, stream, total, scratch, blocks);
  TUNA_CUDA_CHECK_LAUNCH();
}

void accumulate(float* dst, const float* src, int64_t n, cudaStream_t stream) {
  TUNA_CHECK(n >= 0, "n ", n);
  if (n == 0) return;
  launch_kernel(accumulate_kernel, static_cast<unsigned>(ceil_div(n, kThreads)), kThreads, 0, stream, dst, src, n);
  TUNA_CUDA_CHECK_LAUNCH();
}

void f32_to_bf16(bf16* out, const float* in, int64_t n, cudaStream_t stream) {
  TUNA_CHECK(n >= 0, "n ", n);
  if (n == 0) return;
  launch_kernel(f32_to_bf16_kernel, static_cast<unsigned>(ceil_div(n, kThreads)), kThreads, 0, stream, out, in, n);
  TUNA_CUDA_CHECK_LAUNCH();
}

void bf16_params_as_updated(bf16* out, const float* master, int64_t n, const AdamWArgs& args, cudaStream_t stream) {
  TUNA_CHECK(n >= 0, "n ", n);
  if (!args.stochastic_rounding) return f32_to_bf16(out, master, n, stream);
  TUNA_CHECK(args.step >= 1, "AdamW step is 1-based, got ", args.step);
  if (n == 0) return;
  launch_kernel(f32_to_bf16_stochastic_kernel, static_cast<unsigned>(ceil_div(n, kThreads)), kThreads, 0, stream, out,
                master, n, step_seed(args));
  TUNA_CUDA_CHECK_LAUNCH();
}

}  // namespace tuna::cuda
