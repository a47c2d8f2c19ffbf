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
// block per kRowsPerBlock rows; each thread owns fixed column vectors, so it keeps that block's dweight
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
constexpr int kBwdThreads = 256;
constexpr int kRowsPerBlock = 64;

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

// kVecs: 8-wide column vectors per thread (dim <= kBwdThreads * 8 * kVecs).
template <int kVecs>
__global__ void __launch_bounds__(kBwdThreads) rmsnorm_bwd_kernel(bf16* dinp, float* partial, const bf16* dout,
                                                                  const bf16* inp, const bf16* weight,
                                                                  const float* rstd, int64_t n, int64_t dim) {
  __shared__ float scratch[kBwdThreads / 32];
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock;
  const int64_t row_end = min(n, row0 + kRowsPerBlock);
  float dw[kVecs][8] = {};
  float w[kVecs][8];
#pragma unroll
  for (int v = 0; v < kVecs; ++v) {
    const int64_t c = (static_cast<int64_t>(v) * kBwdThreads + threadIdx.x) * 8;
    if (c < dim) {
      const Bf16x8 wv = load8(weight + c);
#pragma unroll
      for (int j = 0; j < 8; ++j) w[v][j] = __bfloat162float(wv.v[j]);
    }
  }
  for (int64_t row = row0; row < row_end; ++row) {
    const float r = rstd[row];
    float g[kVecs][8], x[kVecs][8];
    float dot = 0.0f;
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const int64_t c = (static_cast<int64_t>(v) * kBwdThreads + threadIdx.x) * 8;
      if (c < dim) {
        const Bf16x8 gv = load8(dout + row * dim + c), xv = load8(inp + row * dim + c);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          g[v][j] = __bfloat162float(gv.v[j]);
          x[v][j] = __bfloat162float(xv.v[j]);
          dot += w[v][j] * g[v][j] * x[v][j];
          dw[v][j] += g[v][j] * x[v][j] * r;
        }
      }
    }
    dot = block_sum(dot, scratch);
    const float correction = r * r * dot / static_cast<float>(dim);
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const int64_t c = (static_cast<int64_t>(v) * kBwdThreads + threadIdx.x) * 8;
      if (c < dim) {
        Bf16x8 d = load8(dinp + row * dim + c);
#pragma unroll
        for (int j = 0; j < 8; ++j)
          d.v[j] = __float2bfloat16(__bfloat162float(d.v[j]) + r * (w[v][j] * g[v][j] - x[v][j] * correction));
        store8(dinp + row * dim + c, d);
      }
    }
  }
#pragma unroll
  for (int v = 0; v < kVecs; ++v) {
    const int64_t c = (static_cast<int64_t>(v) * kBwdThreads + threadIdx.x) * 8;
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
  const int64_t vecs = ceil_div(dim, kBwdThreads * 8);
  const unsigned grid = static_cast<unsigned>(n_blocks);
  if (vecs <= 1)
    launch_kernel(rmsnorm_bwd_kernel<1>, grid, kBwdThreads, 0, stream, dinp, scratch, dout, inp, weight, rstd, n, dim);
  else if (vecs <= 2)
    launch_kernel(rmsnorm_bwd_kernel<2>, grid, kBwdThreads, 0, stream, dinp, scratch, dout, inp, weight, rstd, n, dim);
  else if (vecs <= 4)
    launch_kernel(rmsnorm_bwd_kernel<4>, grid, kBwdThreads, 0, stream, dinp, scratch, dout, inp, weight, rstd, n, dim);
  else  // 8 vectors per thread (dim 16384, LLaMA 405B) would spill: needs a wider block first.
    fail("rmsnorm_bwd: dim ", dim, " exceeds the supported ", kBwdThreads * 8 * 4);
  TUNA_CUDA_CHECK_LAUNCH();
  launch_kernel(rmsnorm_dweight_kernel, static_cast<unsigned>(ceil_div(dim, 256)), 256, 0, stream, dweight, scratch,
                n_blocks, dim);
  TUNA_CUDA_CHECK_LAUNCH();
}

}  // namespace tuna::cuda
