// Rotary position embedding (HF rotate-half pairing) on the GPU, the twin of kernels/cpu/rope.cpp.
//
//   x: [batch, seq_len, n_heads, head_dim] bf16, row (b, t) at position positions[b seq_len + t] (t when null:
//   packed documents restart theirs); tables [seq, head_dim/2] fp32. A position's
//   heads start a row stride apart, in and out each their own (q and k read from, and their gradients written
//   into, the model's fused q|k|v rows).
//   forward:  out[i] = x[i] c - x[i+h] s;   out[i+h] = x[i+h] c + x[i] s          OVERWRITTEN, may alias
//   backward: the same with s -> -s (a rotation's transpose)                      OVERWRITTEN, may alias
//
// Memory-bound (4 bytes an element); the tables hit in L1/L2. A thread rotates 8 pairs of kHeads consecutive
// heads of one position: it loads their 8 cosines and sines once and all 2 x kHeads 16-byte vectors of x before
// any math, so table traffic is a quarter of x's and 128 B of x are in flight per thread. Threads 0..7 of a
// group take a head's 8 column blocks, so a warp's access is 128-byte runs. Rotation math in fp32. A thread
// reads everything it writes first, so in place is safe. A head_dim that is not a multiple of 16 (tiny test
// models), or a stride or pointer off 16-byte alignment (tests), takes a one-pair-per-thread kernel.
#include "kernels/rope.cuh"

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common.cuh"

namespace tuna::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kHeads = 4;  // heads a thread rotates with one load of the tables

// idx -> (position p = b * seq_len + t, head group, column block i of the half); heads past n_heads are
// skipped (n_heads need not divide by kHeads: 3-head test models, 8 kv heads).
__global__ void __launch_bounds__(kThreads)
    rope_kernel(bf16* out, const bf16* inp, const float* __restrict__ cos_table, const float* __restrict__ sin_table,
                int64_t n_positions, int64_t seq_len, int64_t n_heads, int64_t half, int64_t out_stride,
                int64_t inp_stride, float sign, const int32_t* __restrict__ positions) {
  const int64_t vecs_per_half = half / 8, groups = (n_heads + kHeads - 1) / kHeads;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (idx >= n_positions * groups * vecs_per_half) return;
  const int64_t i = (idx % vecs_per_half) * 8;
  const int64_t group = (idx / vecs_per_half) % groups;
  const int64_t position = idx / vecs_per_half / groups;
  const int64_t t = positions ? positions[position] : position % seq_len;
  Packed8 first[kHeads], second[kHeads];
#pragma unroll
  for (int k = 0; k < kHeads; ++k) {
    const int64_t head = group * kHeads + k;
    const bf16* x = inp + position * inp_stride + head * 2 * half;
    first[k] = head < n_heads ? load_packed_stream(x + i) : zeros_packed();
    second[k] = head < n_heads ? load_packed_stream(x + i + half) : zeros_packed();
  }
  const float4* c4 = reinterpret_cast<const float4*>(cos_table + t * half + i);
  const float4* s4 = reinterpret_cast<const float4*>(sin_table + t * half + i);
  const float4 c_lo = c4[0], c_hi = c4[1], s_lo = s4[0], s_hi = s4[1];
  const float c[8] = {c_lo.x, c_lo.y, c_lo.z, c_lo.w, c_hi.x, c_hi.y, c_hi.z, c_hi.w};
  const float s[8] = {s_lo.x, s_lo.y, s_lo.z, s_lo.w, s_hi.x, s_hi.y, s_hi.z, s_hi.w};
#pragma unroll
  for (int k = 0; k < kHeads; ++k) {
    const int64_t head = group * kHeads + k;
    if (head >= n_heads) break;
    float y_first[8], y_second[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float a = unpack(first[k], j), b = unpack(second[k], j);
      const float signed_sin = sign * s[j];
      y_first[j] = a * c[j] - b * signed_sin;
      y_second[j] = b * c[j] + a * signed_sin;
    }
    bf16* y = out + position * out_stride + head * 2 * half;
    store_packed(y + i, pack8(y_first));
    store_packed(y + i + half, pack8(y_second));
  }
}

// Any even head_dim and stride (tiny test models, unaligned rows): one thread per pair.
__global__ void rope_pair_kernel(bf16* out, const bf16* inp, const float* cos_table, const float* sin_table,
                                 int64_t n_rows, int64_t seq_len, int64_t n_heads, int64_t half, int64_t out_stride,
                                 int64_t inp_stride, float sign, const int32_t* positions) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (idx >= n_rows * half) return;
  const int64_t row = idx / half, i = idx % half;
  const int64_t position = row / n_heads, head = row % n_heads;
  const int64_t t = positions ? positions[position] : position % seq_len;
  const float c = cos_table[t * half + i], signed_sin = sign * sin_table[t * half + i];
  const bf16* x = inp + position * inp_stride + head * 2 * half;
  bf16* y = out + position * out_stride + head * 2 * half;
  const float a = __bfloat162float(x[i]), b = __bfloat162float(x[i + half]);
  y[i] = __float2bfloat16(a * c - b * signed_sin);
  y[i + half] = __float2bfloat16(b * c + a * signed_sin);
}

void rope_launch(bf16* out, const bf16* inp, const float* cos_table, const float* sin_table, int64_t batch,
                 int64_t seq_len, int64_t n_heads, int64_t head_dim, int64_t out_stride, int64_t inp_stride,
                 float sign, const int32_t* positions, cudaStream_t stream) {
  TUNA_CHECK(batch >= 0 && seq_len >= 0 && n_heads > 0 && head_dim > 0 && head_dim % 2 == 0 &&
                 out_stride >= n_heads * head_dim && inp_stride >= n_heads * head_dim,
             "batch ", batch, ", seq_len ", seq_len, ", n_heads ", n_heads, ", head_dim ", head_dim, ", out_stride ",
             out_stride, ", inp_stride ", inp_stride);
  const int64_t n_rows = batch * seq_len * n_heads;
  const bool vectors = head_dim % 16 == 0 && out_stride % 8 == 0 && inp_stride % 8 == 0 && aligned16(out) &&
                       aligned16(inp);
  if (!vectors) {
    const int64_t pairs = n_rows * (head_dim / 2);
    if (pairs == 0) return;
    launch_kernel(rope_pair_kernel, static_cast<unsigned>(ceil_div(pairs, kThreads)), kThreads, 0, stream, out, inp,
                  cos_table, sin_table, n_rows, seq_len, n_heads, head_dim / 2, out_stride, inp_stride, sign,
                  positions);
    TUNA_CUDA_CHECK_LAUNCH();
    return;
  }
  const int64_t n_positions = batch * seq_len;
  const int64_t work = n_positions * ceil_div(n_heads, kHeads) * (head_dim / 16);
  if (work == 0) return;
  launch_kernel(rope_kernel, static_cast<unsigned>(ceil_div(work, kThreads)), kThreads, 0, stream, out, inp, cos_table,
                sin_table, n_positions, seq_len, n_heads, head_dim / 2, out_stride, inp_stride, sign, positions);
  TUNA_CUDA_CHECK_LAUNCH();
}

}  // namespace

void rope_fwd(bf16* out, const bf16* inp, const float* cos_table, const float* sin_table, int64_t batch,
              int64_t seq_len, int64_t n_heads, int64_t head_dim, int64_t out_stride, int64_t inp_stride,
              const int32_t* positions, cudaStream_t stream) {
  rope_launch(out, inp, cos_table, sin_table, batch, seq_len, n_heads, head_dim, out_stride, inp_stride,
              /*sign=*/1.0f, positions, stream);
}

void rope_bwd(bf16* dinp, const bf16* dout, const float* cos_table, const float* sin_table, int64_t batch,
              int64_t seq_len, int64_t n_heads, int64_t head_dim, int64_t dinp_stride, int64_t dout_stride,
              const int32_t* positions, cudaStream_t stream) {
  rope_launch(dinp, dout, cos_table, sin_table, batch, seq_len, n_heads, head_dim, dinp_stride, dout_stride,
              /*sign=*/-1.0f, positions, stream);
}

}  // namespace tuna::cuda
