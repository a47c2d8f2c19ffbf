// Device-side fills: normal(0, stddev) from a counter-based hash, and constants. Memory-bound, one element
// per thread; the random draw of element i depends on (seed, i) only, so fills are reproducible.
#include "kernels/init.cuh"

#include <cmath>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common.cuh"

namespace tuna::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void fill_normal_kernel(float* x, int64_t n, uint32_t seed_lo, uint32_t seed_hi, float stddev) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= n) return;
  // Two independent 24-bit uniforms in (0, 1], then Box-Muller's cosine branch.
  const uint32_t a = hash_u32(seed_lo, 2 * static_cast<uint64_t>(i)) ^ seed_hi;
  const uint32_t b = hash_u32(seed_lo ^ 0x5bd1e995u, 2 * static_cast<uint64_t>(i) + 1) ^ seed_hi;
  const float u1 = (static_cast<float>(a >> 8) + 1.0f) * (1.0f / 16777216.0f);
  const float u2 = static_cast<float>(b >> 8) * (1.0f / 16777216.0f);
  x[i] = stddev * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
}

__global__ void fill_constant_kernel(float* x, int64_t n, float value) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < n) x[i] = value;
}

}  // namespace

void fill_normal(float* x, int64_t n, uint64_t seed, float stddev, cudaStream_t stream) {
  TUNA_CHECK(n >= 0, "n ", n);
  if (n == 0) return;
  launch_kernel(fill_normal_kernel, static_cast<unsigned>(ceil_div(n, kThreads)), kThreads, 0, stream, x, n,
                static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32), stddev);
  TUNA_CUDA_CHECK_LAUNCH();
}

void fill_constant(float* x, int64_t n, float value, cudaStream_t stream) {
  TUNA_CHECK(n >= 0, "n ", n);
  if (n == 0) return;
  launch_kernel(fill_constant_kernel, static_cast<unsigned>(ceil_div(n, kThreads)), kThreads, 0, stream, x, n, value);
  TUNA_CUDA_CHECK_LAUNCH();
}

}  // namespace tuna::cuda
