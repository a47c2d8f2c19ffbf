// Rotary position embedding (HF rotate-half pairing) on the GPU, the twin of kernels/cpu/rope.cpp.
//
//   x: [batch, seq_len, n_heads, head_dim] bf16, row t at position t; tables [seq, head_dim/2] fp32.
//   forward:  out[i] = x[i] c - x[i+h] s;   out[i+h] = x[i+h] c + x[i] s          OVERWRITTEN, may alias
//   backward: the same with s -> -s (a rotation's transpose)                      OVERWRITTEN, may alias
//
// One thread rotates 8 pairs: 16-byte loads of x[i..i+8) and x[i+h..i+h+8) and 32-byte table loads, all
// read before anything is written (so in-place is safe). Rotation math in fp32. A head_dim that is not a
// multiple of 16 (tiny test models) takes a one-pair-per-thread kernel.
#include "kernels/rope.cuh"

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common.cuh"

namespace tuna::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void rope_kernel(bf16* out, const bf16* inp, const float* cos_table, const float* sin_table,
                            int64_t n_rows, int64_t seq_len, int64_t n_heads, int64_t half, float sign) {
  const int64_t vecs_per_row = half / 8;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (idx >= n_rows * vecs_per_row) return;
  const int64_t row = idx / vecs_per_row;
  const int64_t i = (idx % vecs_per_row) * 8;
  const int64_t t = (row / n_heads) % seq_len;
  const bf16* x = inp + row * 2 * half;
  const Bf16x8 first = load8(x + i), second = load8(x + i + half);
  const float4* c4 = reinterpret_cast<const float4*>(cos_table + t * half + i);
  const float4* s4 = reinterpret_cast<const float4*>(sin_table + t * half + i);
  const float4 c_lo = c4[0], c_hi = c4[1], s_lo = s4[0], s_hi = s4[1];
  const float c[8] = {c_lo.x, c_lo.y, c_lo.z, c_lo.w, c_hi.x, c_hi.y, c_hi.z, c_hi.w};
  const float s[8] = {s_lo.x, s_lo.y, s_lo.z, s_lo.w, s_hi.x, s_hi.y, s_hi.z, s_hi.w};
  Bf16x8 y_first, y_second;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float a = __bfloat162float(first.v[j]), b = __bfloat162float(second.v[j]);
    const float signed_sin = sign * s[j];
    y_first.v[j] = __float2bfloat16(a * c[j] - b * signed_sin);
    y_second.v[j] = __float2bfloat16(b * c[j] + a * signed_sin);
  }
  bf16* y = out + row * 2 * half;
  store8(y + i, y_first);
  store8(y + i + half, y_second);
}

// Any even head_dim (tiny test models): one thread per pair.
__global__ void rope_pair_kernel(bf16* out, const bf16* inp, const float* cos_table, const float* sin_table,
                                 int64_t n_rows, int64_t seq_len, int64_t n_heads, int64_t half, float sign) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (idx >= n_rows * half) return;
  const int64_t row = idx / half, i = idx % half;
  const int64_t t = (row / n_heads) % seq_len;
  const float c = cos_table[t * half + i], signed_sin = sign * sin_table[t * half + i];
  const float a = __bfloat162float(inp[row * 2 * half + i]), b = __bfloat162float(inp[row * 2 * half + i + half]);
  out[row * 2 * half + i] = __float2bfloat16(a * c - b * signed_sin);
  out[row * 2 * half + i + half] = __float2bfloat16(b * c + a * signed_sin);
}

void rope_launch(bf16* out, const bf16* inp, const float* cos_table, const float* sin_table, int64_t batch,
                 int64_t seq_len, int64_t n_heads, int64_t head_dim, float sign, cudaStream_t stream) {
  TUNA_CHECK(batch >= 0 && seq_len >= 0 && n_heads > 0 && head_dim > 0 && head_dim % 2 == 0, "batch ", batch,
             ", seq_len ", seq_len, ", n_heads ", n_heads, ", head_dim ", head_dim);
  const int64_t n_rows = batch * seq_len * n_heads;
  if (head_dim % 16 != 0) {
    const int64_t pairs = n_rows * (head_dim / 2);
    if (pairs == 0) return;
    launch_kernel(rope_pair_kernel, static_cast<unsigned>(ceil_div(pairs, kThreads)), kThreads, 0, stream, out, inp,
                  cos_table, sin_table, n_rows, seq_len, n_heads, head_dim / 2, sign);
    TUNA_CUDA_CHECK_LAUNCH();
    return;
  }
  const int64_t work = n_rows * (head_dim / 16);
  if (work == 0) return;
  launch_kernel(rope_kernel, static_cast<unsigned>(ceil_div(work, kThreads)), kThreads, 0, stream, out, inp, cos_table,
                sin_table, n_rows, seq_len, n_heads, head_dim / 2, sign);
  TUNA_CUDA_CHECK_LAUNCH();
}

}  // namespace

void rope_fwd(bf16* out, const bf16* inp, const float* cos_table, const float* sin_table, int64_t batch,
              int64_t seq_len, int64_t n_heads, int64_t head_dim, cudaStream_t stream) {
  rope_launch(out, inp, cos_table, sin_table, batch, seq_len, n_heads, head_dim, 1.0f, stream);
}

void rope_bwd(bf16* dinp, const bf16* dout, const float* cos_table, const float* sin_table, int64_t batch,
              int64_t seq_len, int64_t n_heads, int64_t head_dim, cudaStream_t stream) {
  rope_launch(dinp, dout, cos_table, sin_table, batch, seq_len, n_heads, head_dim, -1.0f, stream);
}

}  // namespace tuna::cuda
