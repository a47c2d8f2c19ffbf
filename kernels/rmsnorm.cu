// RMSNorm (HF LlamaRMSNorm) on the GPU, the twin of kernels/cpu/rmsnorm.cpp, with the residual add fused
// into the forward.
//
//   forward:  x = inp + delta (delta optional; then resid_out = x, OVERWRITTEN)
//             rstd[i] = 1 / sqrt(mean_j x[i, j]^2 + eps)                  rstd: [n] fp32, OVERWRITTEN
//             out[i, j] = w[j] * (x[i, j] * rstd[i])                       out: [n, dim] bf16, OVERWRITTEN
//   backward: dinp[i, j] += r (w[j] g[i, j] - x[i, j] r^2 mean_k w[k] g[i, k] x[i, k])   bf16, ACCUMULATED
//             dweight[j] += sum_i g[i, j] x[i, j] r[i]                                 fp32, ACCUMULATED
//
// Forward: one warp per row, 16-byte accesses; the second pass re-reads the row from L1/L2. Backward: one
// block (256 or 512 threads, by dim) per kRowsPerBlock rows; each thread owns fixed column vectors, so it keeps that block's dweight
// partial sums in registers across rows, writes them to scratch, and a second kernel adds the row blocks'
// partials in block order: no atomics, the same rounding on every run.
#include "kernels/rmsnorm.cuh"

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common.cuh"
#include "kernels/scratch.h"

namespace tuna::cuda {
namespace {

constexpr int kFwdWarps = 4;
constexpr int kRowsPerBlock = 64;
// The backward's threads own up to 4 vectors of 8 columns each (more would spill): 256 threads cover rows up to
// 8192 wide (LLaMA 70B), 512 up to 16384 (405B).
constexpr int kMaxBwdVecs = 4;

__global__ void rmsnorm_fwd_kernel(bf16* out, float* rstd, bf16* resid_out, const bf16* inp, const bf16* delta,
                                   const bf16* weight, int64_t n, int64_t dim, float eps) {
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kFwdWarps + threadIdx.x / 32;
  if (row >= n) return;
  const bf16* x_row = inp + row * dim;
  float sum_sq = 0.0f;
  for (int64_t c = lane * 8; c < dim; c += 32 * 8) {
    Bf16x8 x = load8(x_row + c);
    if (delta != nullptr) {
      const Bf16x8 d = load8(delta + row * dim + c);
#pragma unroll
      for (int j = 0; j < 8; ++j) x.v[j] = __float2bfloat16(__bfloat162float(x.v[j]) + __bfloat162float(d.v[j]));
      store8(resid_out + row * dim + c, x);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float v = __bfloat162float(x.v[j]);
      sum_sq += v * v;
    }
  }
  sum_sq = warp_sum(sum_sq);
  const float r = rsqrtf(sum_sq / static_cast<float>(dim) + eps);
  if (lane == 0) rstd[row] = r;
  // The row the norm reads is the one written above (the same thread wrote each vector it re-reads).
  const bf16* src = delta != nullptr ? resid_out + row * dim : x_row;
  for (int64_t c = lane * 8; c < dim; c += 32 * 8) {
    const Bf16x8 x = load8(src + c);
    const Bf16x8 w = load8(weight + c);
    Bf16x8 y;
#pragma unroll
    for (int j = 0; j < 8; ++j)
      y.v[j] = __float2bfloat16(__bfloat162float(w.v[j]) * (__bfloat162float(x.v[j]) * r));
    store8(out + row * dim + c, y);
  }
}

__device__ __forceinline__ void load_f32x8(const bf16* p, float (&out)[8]) {
  const Bf16x8 v = load8(p);
#pragma unroll
  for (int j = 0; j < 8; ++j) out[j] = __bfloat162float(v.v[j]);
}

// kVecs: 8-wide column vectors per thread (dim <= kBwdThreads * 8 * kVecs). kHold: keep the weight and the row's
// g and x in registers between the two phases of a row (rows up to 8192 wide at 256 threads); without, re-read
// them from L1/L2 (wider rows at 512 threads, which have half the registers per thread). Same arithmetic.
template <int kVecs, int kBwdThreads, bool kHold>
__global__ void __launch_bounds__(kBwdThreads) rmsnorm_bwd_kernel(bf16* dinp, float* partial, const bf16* dout,
                                                                  const bf16* inp, const bf16* weight,
                                                                  const float* rstd, int64_t n, int64_t dim) {
  constexpr int kHeld = kHold ? kVecs : 1;
  __shared__ float scratch[kBwdThreads / 32];
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock;
  const int64_t row_end = min(n, row0 + kRowsPerBlock);
  const auto column = [](int v) { return (static_cast<int64_t>(v) * kBwdThreads + threadIdx.x) * 8; };
  float dw[kVecs][8] = {};
  float w[kHeld][8], g[kHeld][8], x[kHeld][8];
  if constexpr (kHold) {
#pragma unroll
    for (int v = 0; v < kVecs; ++v)
      if (column(v) < dim) load_f32x8(weight + column(v), w[v]);
  }
  for (int64_t row = row0; row < row_end; ++row) {
    const float r = rstd[row];
    float dot = 0.0f;
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const int64_t c = column(v);
      if (c >= dim) continue;
      const int h = kHold ? v : 0;
      if constexpr (!kHold) load_f32x8(weight + c, w[h]);
      load_f32x8(dout + row * dim + c, g[h]);
      load_f32x8(inp + row * dim + c, x[h]);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        dot += w[h][j] * g[h][j] * x[h][j];
        dw[v][j] += g[h][j] * x[h][j] * r;
      }
    }
    dot = block_sum(dot, scratch);
    const float correction = r * r * dot / static_cast<float>(dim);
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const int64_t c = column(v);
      if (c >= dim) continue;
      const int h = kHold ? v : 0;
      if constexpr (!kHold) {
        load_f32x8(weight + c, w[h]);
        load_f32x8(dout + row * dim + c, g[h]);
        load_f32x8(inp + row * dim + c, x[h]);
      }
      Bf16x8 d = load8(dinp + row * dim + c);
#pragma unroll
      for (int j = 0; j < 8; ++j)
        d.v[j] = __float2bfloat16(__bfloat162float(d.v[j]) + r * (w[h][j] * g[h][j] - x[h][j] * correction));
      store8(dinp + row * dim + c, d);
    }
  }
#pragma unroll
  for (int v = 0; v < kVecs; ++v) {
    const int64_t c = column(v);
    if (c < dim) {
      float4* dst = reinterpret_cast<float4*>(partial + blockIdx.x * dim + c);
      dst[0] = make_float4(dw[v][0], dw[v][1], dw[v][2], dw[v][3]);
      dst[1] = make_float4(dw[v][4], dw[v][5], dw[v][6], dw[v][7]);
    }
  }
}

// dweight[j] += sum over row blocks b, in order, of partial[b, j].
__global__ void rmsnorm_dweight_kernel(float* dweight, const float* partial, int64_t n_blocks, int64_t dim) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= dim) return;
  float sum = 0.0f;
  for (int64_t b = 0; b < n_blocks; ++b) sum += partial[b * dim + j];
  dweight[j] += sum;
}

}  // namespace

void rmsnorm_fwd(bf16* out, float* rstd, bf16* resid_out, const bf16* inp, const bf16* residual_delta,
                 const bf16* weight, int64_t n, int64_t dim, double eps, cudaStream_t stream) {
  TUNA_CHECK(n >= 0 && dim > 0 && dim % 8 == 0, "n ", n, ", dim ", dim, " (dim must be a multiple of 8)");
  TUNA_CHECK(residual_delta == nullptr || resid_out != nullptr, "a residual add needs resid_out");
  if (n == 0) return;
  launch_kernel(rmsnorm_fwd_kernel, static_cast<unsigned>(ceil_div(n, kFwdWarps)), kFwdWarps * 32, 0, stream, out, rstd,
                resid_out, inp, residual_delta, weight, n, dim, static_cast<float>(eps));
  TUNA_CUDA_CHECK_LAUNCH();
}

int64_t rmsnorm_bwd_scratch_floats(int64_t n, int64_t dim) {
  static_assert(kRowsPerBlock == 64, "kernels/scratch.h sizes the scratch for blocks of 64 rows");
  return gpu_scratch::rmsnorm_bwd_floats(n, dim);
}

void rmsnorm_bwd(bf16* dinp, float* dweight, const bf16* dout, const bf16* inp, const bf16* weight,
                 const float* rstd, float* scratch, int64_t n, int64_t dim, cudaStream_t stream) {
  TUNA_CHECK(n >= 0 && dim > 0 && dim % 8 == 0, "n ", n, ", dim ", dim, " (dim must be a multiple of 8)");
  if (n == 0) return;
  const int64_t n_blocks = ceil_div(n, kRowsPerBlock);
  const unsigned grid = static_cast<unsigned>(n_blocks);
  // Up to 8192 columns: 256 threads holding 1, 2 or 4 vectors each in registers; up to 16384: 512 threads
  // re-reading 4 vectors each.
  const int64_t vecs = ceil_div(dim, 256 * 8);
  const auto args = [&](auto kernel, int threads) {
    launch_kernel(kernel, grid, threads, 0, stream, dinp, scratch, dout, inp, weight, rstd, n, dim);
  };
  if (vecs <= 1) args(rmsnorm_bwd_kernel<1, 256, true>, 256);
  else if (vecs <= 2) args(rmsnorm_bwd_kernel<2, 256, true>, 256);
  else if (vecs <= 4) args(rmsnorm_bwd_kernel<4, 256, true>, 256);
  else if (dim <= 512 * 8 * kMaxBwdVecs) args(rmsnorm_bwd_kernel<4, 512, false>, 512);
  else fail("rmsnorm_bwd: dim ", dim, " exceeds the supported ", 512 * 8 * kMaxBwdVecs);
  TUNA_CUDA_CHECK_LAUNCH();
  launch_kernel(rmsnorm_dweight_kernel, static_cast<unsigned>(ceil_div(dim, 256)), 256, 0, stream, dweight, scratch,
                n_blocks, dim);
  TUNA_CUDA_CHECK_LAUNCH();
}

}  // namespace tuna::cuda
