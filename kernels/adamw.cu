// AdamW over a whole flat parameter buffer in one launch, the twin of kernels/cpu/adamw.cpp.
//
//   g = grad * grad_scale
//   master *= 1 - lr * weight_decay(segment)
//   m = beta1 m + (1 - beta1) g;   v = beta2 v + (1 - beta2) g^2
//   master -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//   param_bf16 = bf16(master)                     master, m, v, param_bf16: UPDATED IN PLACE
//
// Memory-bound: per element it reads grad, master, m, v and writes master, m, v, param (28 bytes with fp32
// moments, 20 with bf16). Each thread handles 4 consecutive elements with 16-byte accesses; the weight decay of
// those elements comes from a binary search of the segment table (a few hundred sorted starts, cached in L1),
// which is what lets one launch cover every tensor. Bias corrections are computed on the host in double.
//
// sum_of_squares: a fixed grid (a function of n only) of per-thread double sums, then one block adds the
// block partials in order: the gradient norm is bit-identical across runs and devices.
#include "kernels/adamw.cuh"

#include <cmath>

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

__device__ __forceinline__ float load_moment(float x) { return x; }
__device__ __forceinline__ float load_moment(bf16 x) { return __bfloat162float(x); }

__device__ __forceinline__ void store_bf16(bf16* p, float x, bool stochastic, uint32_t seed, uint64_t index) {
  *p = stochastic ? bf16_stochastic(x, hash_u32(seed, index)) : __float2bfloat16(x);
}
__device__ __forceinline__ void store_moment(float* p, float x, bool, uint32_t, uint64_t) { *p = x; }
__device__ __forceinline__ void store_moment(bf16* p, float x, bool stochastic, uint32_t seed, uint64_t index) {
  store_bf16(p, x, stochastic, seed, index);
}

__device__ __forceinline__ bool segment_decays(const AdamWSegments& segments, int64_t i) {
  int lo = 0, hi = segments.n_segments - 1;  // the last start <= i
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (__ldg(segments.starts + mid) <= i) lo = mid;
    else hi = mid - 1;
  }
  return __ldg(segments.decays + lo) != 0;
}

template <typename M>
__global__ void __launch_bounds__(kThreads) adamw_kernel(float* master, bf16* param_bf16, const float* grad, M* m,
                                                         M* v, int64_t n, AdamWSegments segments, Coefficients c) {
  const int64_t i0 = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * 4;
  if (i0 >= n) return;
  const float4 g4 = __ldcs(reinterpret_cast<const float4*>(grad + i0));
  float4 p4 = *reinterpret_cast<float4*>(master + i0);
  float g[4] = {g4.x, g4.y, g4.z, g4.w}, p[4] = {p4.x, p4.y, p4.z, p4.w};
  // A tensor boundary may fall inside these 4 elements only if a tensor's size is not a multiple of 4; then
  // each element looks its own segment up.
  const bool uniform = segment_decays(segments, i0) == segment_decays(segments, i0 + 3);
  const bool decays0 = segment_decays(segments, i0);
  // Distinct random streams for the parameters and the two moments, per step.
  const uint32_t seed_p = c.seed * 3u + 0u, seed_m = c.seed * 3u + 1u, seed_v = c.seed * 3u + 2u;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const bool decays = uniform ? decays0 : segment_decays(segments, i0 + k);
    const float gk = g[k] * c.grad_scale;
    const float m_new = c.beta1 * load_moment(m[i0 + k]) + (1.0f - c.beta1) * gk;
    const float v_new = c.beta2 * load_moment(v[i0 + k]) + (1.0f - c.beta2) * gk * gk;
    const float denom = sqrtf(v_new) / c.bias_correction2_sqrt + c.eps;
    const float decay = decays ? 1.0f - c.lr * c.weight_decay : 1.0f;
    p[k] = p[k] * decay - c.step_size * (m_new / denom);
    store_moment(m + i0 + k, m_new, c.stochastic_rounding, seed_m, i0 + k);
    store_moment(v + i0 + k, v_new, c.stochastic_rounding, seed_v, i0 + k);
    if (param_bf16 != nullptr) store_bf16(param_bf16 + i0 + k, p[k], c.stochastic_rounding, seed_p, i0 + k);
  }
  *reinterpret_cast<float4*>(master + i0) = make_float4(p[0], p[1], p[2], p[3]);
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
  for (const void* p : {static_cast<const void*>(master), static_cast<const void*>(grad)})
    TUNA_CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0, "adamw buffers must be 16-byte aligned");
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
