// FlashAttention-2 kernels (forward, backward dK/dV, backward dQ) as templates over the head dim; included
// by attention_launch.cuh (and the host emulator) only. Internal to kernels/.
//
// Tensor cores through mma.sync.m16n8k16 (bf16 in, fp32 accumulate), operands staged in shared memory by
// cp.async and read by ldmatrix. Shared tiles are [rows][head_dim] bf16 with the 16-byte chunks of each row
// XOR-swizzled by (row % 8), so the 8 row addresses of every ldmatrix hit 8 different bank groups.
//
// Fragment layouts (PTX ISA, mma.m16n8k16, g = lane / 4, c = lane % 4):
//   A (16x16, 4 regs): a0 (g, 2c..2c+1), a1 (g+8, 2c..), a2 (g, 2c+8..), a3 (g+8, 2c+8..)
//   B (16x8, 2 regs):  b0 (k 2c..2c+1, n g), b1 (k 2c+8.., n g)
//   C (16x8, 4 f32):   c0, c1 (g, 2c..2c+1), c2, c3 (g+8, 2c..2c+1)
// Two C tiles side by side (n 0..15) are exactly the A fragment of a k-slice of 16: how P (and dS) feed the
// next product straight from registers, as in FlashAttention-2.
//
// Each warp owns 16 rows of the block's tile (queries in the forward and dQ kernels, keys in the dK/dV
// kernel) and never exchanges accumulators with other warps: rows are complete within a warp, so the row
// reductions of the softmax are 4-lane shuffles.
//
// Documents (p.doc_start, a per-row document start): query t sees keys doc_start[t] <= j <= t. doc_start never
// decreases along a row, so a query block starts its key loop at the block holding doc_start[first row] and a
// key block's queries end where a document starting after its last key begins: key blocks wholly outside the
// documents a block touches are never loaded, and a window of short documents costs about seq_len x document
// length. Inside the visited blocks the element mask adds key < doc_start[query].
//
// Masking: key > query (causal), key before the query's document, and rows past seq_len: loads of rows >=
// seq_len are zero-filled (cp.async with src-size 0), so no uninitialized value can meet a zero probability and
// make a NaN; their results are never stored.
//
// Three headers, so that the device code can also run on the host: the PTX helpers (cp.async, ldmatrix, mma)
// are in attention_ptx.cuh and the host launch sequences (cudaFuncSetAttribute, <<<>>>) in
// attention_launch.cuh. This one holds only device code, which the host emulator of the kernels
// (tests/kernels/emulator, built with -DTUNA_EMULATOR) compiles with g++ against its own versions of the PTX
// helpers and of the CUDA headers: CI checks fragment layouts, swizzle, cp.async ordering and barriers on
// every build, GPU or not.
#pragma once

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "kernels/attention_params.cuh"
#include "kernels/common.cuh"
// Under TUNA_EMULATOR, <cuda_bf16.h> above is the emulator's (its shim/ comes first on that build's include
// path) and already declares host versions of these helpers, so this header names no file of tests/.
#ifndef TUNA_EMULATOR
#include "kernels/attention_ptx.cuh"  // smem_address, cp_async16, cp_async4, cp_async_commit, cp_async_wait,
                                      // ldmatrix_x4, ldmatrix_x4_trans, mma
#endif

namespace tuna::cuda::attention {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerWarp = 16;
constexpr int kBlockRows = kWarps * kRowsPerWarp;  // 64: queries (fwd, dQ) or keys (dK/dV) per block

// Two floats as a bf16 pair, the first in the low half (the lower column of a fragment).
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

// Element offset of 16-byte chunk `chunk` of row `row` in a swizzled [rows][kDim] tile.
template <int kDim>
__device__ __forceinline__ int swizzle(int row, int chunk) {
  static_assert(kDim % 64 == 0, "the swizzle needs >= 8 chunks per row");
  return row * kDim + ((chunk ^ (row & 7)) * 8);
}

// Copies rows [row0, row0 + kRows) of a global [seq_len, row_stride] view into a swizzled tile; rows past
// seq_len become zeros. Asynchronous: the caller commits and waits.
template <int kRows, int kDim>
__device__ __forceinline__ void load_tile(__nv_bfloat16* tile, const __nv_bfloat16* base, int64_t row_stride,
                                          int row0, int seq_len) {
  constexpr int kChunks = kDim / 8;
#pragma unroll
  for (int idx = threadIdx.x; idx < kRows * kChunks; idx += kThreads) {
    const int r = idx / kChunks, chunk = idx % kChunks;
    const int row = row0 + r;
    const bool valid = row < seq_len;
    const __nv_bfloat16* src = base + static_cast<int64_t>(valid ? row : 0) * row_stride + chunk * 8;
    cp_async16(smem_address(tile + swizzle<kDim>(r, chunk)), src, valid);
  }
}

// A fragment of rows [row0, row0+16) x k-chunks [2kk, 2kk+2) of a row-major swizzled tile.
template <int kDim>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const __nv_bfloat16* tile, int row0, int kk, int lane) {
  ldmatrix_x4(a, smem_address(tile + swizzle<kDim>(row0 + lane % 16, 2 * kk + lane / 16)));
}
// B fragments of two n-tiles (n0..n0+15) at k-slice kk from a tile stored [n][k]: b[0], b[1] for n-tile 0,
// b[2], b[3] for n-tile 1.
template <int kDim>
__device__ __forceinline__ void load_b(uint32_t (&b)[4], const __nv_bfloat16* tile, int n0, int kk, int lane) {
  ldmatrix_x4(b, smem_address(tile + swizzle<kDim>(n0 + lane % 8 + 8 * (lane / 16), 2 * kk + (lane / 8) % 2)));
}
// The same from a tile stored [k][n] (transposed on load): k-slice rows k0..k0+15, n-tiles n0/8, n0/8 + 1.
template <int kDim>
__device__ __forceinline__ void load_b_trans(uint32_t (&b)[4], const __nv_bfloat16* tile, int k0, int n0,
                                             int lane) {
  ldmatrix_x4_trans(b, smem_address(tile + swizzle<kDim>(k0 + lane % 16, n0 / 8 + lane / 16)));
}

// acc[16 x 8*kNTiles] += A (16 rows of a_tile from a_row0, all kDim) x B^T (b_tile rows b_row0.., all kDim):
// the "scores" product q k^T (or k q^T, v dout^T): both operands stored row-major over the head dim.
template <int kDim, int kNTiles>
__device__ __forceinline__ void gemm_rows_by_rows(float (&acc)[kNTiles][4], const __nv_bfloat16* a_tile, int a_row0,
                                                  const __nv_bfloat16* b_tile, int b_row0, int lane) {
#pragma unroll
  for (int kk = 0; kk < kDim / 16; ++kk) {
    uint32_t a[4];
    load_a<kDim>(a, a_tile, a_row0, kk, lane);
#pragma unroll
    for (int np = 0; np < kNTiles / 2; ++np) {
      uint32_t b[4];
      load_b<kDim>(b, b_tile, b_row0 + np * 16, kk, lane);
      mma(acc[2 * np], a, b[0], b[1]);
      mma(acc[2 * np + 1], a, b[2], b[3]);
    }
  }
}

// acc[16 x kDim] += P (16 x 8*kPTiles, register C fragments, rounded to bf16) x B (b_tile rows 0..8*kPTiles,
// stored [k][kDim]): the "values" product p v (or p^T dout, ds^T q, ds k).
template <int kDim, int kPTiles>
__device__ __forceinline__ void gemm_regs_by_tile(float (&acc)[kDim / 8][4], const float (&p)[kPTiles][4],
                                                  const __nv_bfloat16* b_tile, int lane) {
#pragma unroll
  for (int kk = 0; kk < kPTiles / 2; ++kk) {
    const uint32_t a[4] = {pack_bf16(p[2 * kk][0], p[2 * kk][1]), pack_bf16(p[2 * kk][2], p[2 * kk][3]),
                           pack_bf16(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                           pack_bf16(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
    for (int dp = 0; dp < kDim / 16; ++dp) {
      uint32_t b[4];
      load_b_trans<kDim>(b, b_tile, kk * 16, dp * 16, lane);
      mma(acc[2 * dp], a, b[0], b[1]);
      mma(acc[2 * dp + 1], a, b[2], b[3]);
    }
  }
}

// Stores a warp's 16 x kDim fp32 accumulator times `scale` as bf16 rows row0.. (those < seq_len) of a global
// [seq_len, row_stride] view.
template <int kDim>
__device__ __forceinline__ void store_rows(__nv_bfloat16* base, int64_t row_stride, int row0, int seq_len,
                                           const float (&acc)[kDim / 8][4], float scale_lo, float scale_hi,
                                           int lane) {
  const int g = lane / 4, c = lane % 4;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + g + 8 * half;
    if (row >= seq_len) continue;
    const float s = half == 0 ? scale_lo : scale_hi;
    __nv_bfloat16* dst = base + static_cast<int64_t>(row) * row_stride;
#pragma unroll
    for (int nt = 0; nt < kDim / 8; ++nt) {
      const __nv_bfloat162 pair = __floats2bfloat162_rn(acc[nt][2 * half] * s, acc[nt][2 * half + 1] * s);
      *reinterpret_cast<__nv_bfloat162*>(dst + nt * 8 + 2 * c) = pair;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Forward. Grid (query blocks, n_heads, batch); the latest query blocks (most keys) start first. Shared: Q,
// K, V tiles of 64 x kHd. K and V are separate cp.async groups so that loading V_j overlaps computing S_j and
// loading K_{j+1} overlaps computing P_j V_j (FlashAttention-2's schedule).
// kDocs: p.doc_start is set. The instance without documents is the plain causal kernel and holds no document
// state. One kernel for both had 169 registers at hd128 and 130 at hd64 instead of the plain kernel's 168 and 127:
// a block per SM fewer (2 instead of 3, 3 instead of 4; registers are allocated per warp in units of 256). The
// launch bounds hold both instances at the plain kernel's blocks per SM: the instance with documents fits in them
// without spilling as written (each row's visible keys as one range, the warp's last document start fetched by a
// shuffle where a step needs it), and the build's -warn-spills (-Werror) fails if either stops fitting.
// kernels/registers.tsv records each kernel's registers and blocks per SM (tests/kernels/test_registers.cpp).
template <int kHd>
constexpr int kFwdBlocksPerSm = kHd == 128 ? 3 : 4;
template <int kHd, bool kDocs>
__global__ void __launch_bounds__(kThreads, kFwdBlocksPerSm<kHd>) fwd_kernel(AttentionParams p) {
  extern __shared__ __align__(128) unsigned char smem_bytes[];
  __nv_bfloat16* s_q = reinterpret_cast<__nv_bfloat16*>(smem_bytes);
  __nv_bfloat16* s_k = s_q + kBlockRows * kHd;
  __nv_bfloat16* s_v = s_k + kBlockRows * kHd;
  constexpr int kKeys = kBlockRows;  // keys per step
  constexpr int kSTiles = kKeys / 8;

  const int m_block = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int kvh = h / (p.n_heads / p.n_kv_heads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int64_t q_stride = static_cast<int64_t>(p.n_heads) * kHd, kv_stride = static_cast<int64_t>(p.n_kv_heads) * kHd;
  const __nv_bfloat16* q_base = p.q + static_cast<int64_t>(b) * p.seq_len * q_stride + h * kHd;
  const __nv_bfloat16* k_base = p.k + static_cast<int64_t>(b) * p.seq_len * kv_stride + kvh * kHd;
  const __nv_bfloat16* v_base = p.v + static_cast<int64_t>(b) * p.seq_len * kv_stride + kvh * kHd;
  const int q0 = m_block * kBlockRows;
  const int n_steps = (min(p.seq_len, q0 + kBlockRows) + kKeys - 1) / kKeys;
  const int row_lo = q0 + warp * kRowsPerWarp + g;  // this thread's rows: row_lo, row_lo + 8
  // Documents: the first key step and this thread's rows' first keys (rows past the sequence take the last row's
  // document: they are never stored).
  int first_step = 0, row_first_key[2] = {0, 0};
  if constexpr (kDocs) {
    const int32_t* doc = p.doc_start + static_cast<int64_t>(b) * p.seq_len;
    first_step = doc[q0] / kKeys;
    row_first_key[0] = doc[min(row_lo, p.seq_len - 1)];
    row_first_key[1] = doc[min(row_lo + 8, p.seq_len - 1)];
  }

  load_tile<kBlockRows, kHd>(s_q, q_base, q_stride, q0, p.seq_len);
  load_tile<kKeys, kHd>(s_k, k_base, kv_stride, first_step * kKeys, p.seq_len);
  cp_async_commit();
  load_tile<kKeys, kHd>(s_v, v_base, kv_stride, first_step * kKeys, p.seq_len);
  cp_async_commit();

  float o[kHd / 8][4] = {};
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};

  for (int j = first_step; j < n_steps; ++j) {
    const int key0 = j * kKeys;
    cp_async_wait<1>();  // Q and K_j have landed (V_j may still be in flight)
    __syncthreads();
    float s[kSTiles][4] = {};
    gemm_rows_by_rows<kHd, kSTiles>(s, s_q, warp * kRowsPerWarp, s_k, 0, lane);
    __syncthreads();  // every warp is done with K_j
    if (j + 1 < n_steps) load_tile<kKeys, kHd>(s_k, k_base, kv_stride, key0 + kKeys, p.seq_len);
    cp_async_commit();

    // Scale into log2 units and mask: causal (key > query), keys past the sequence, keys of earlier documents.
    // Each row sees keys [its document's start, min(row, seq_len - 1)]; with documents, the warp's last row's
    // start (lane 31's second row) is fetched each step rather than kept: a register fewer across the loop.
    const bool needs_mask = key0 + kKeys > q0 + warp * kRowsPerWarp || key0 + kKeys > p.seq_len ||
                            (kDocs && key0 < __shfl_sync(0xffffffffu, row_first_key[1], 31));
    if (needs_mask) {
      int lo[2], hi[2];  // the visible keys of the thread's two rows, relative to its first column of the step
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        lo[half] = row_first_key[half] - key0 - 2 * c;
        hi[half] = min(row_lo + 8 * half, p.seq_len - 1) - key0 - 2 * c;
      }
#pragma unroll
      for (int nt = 0; nt < kSTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = nt * 8 + (e & 1), half = e >> 1;
          s[nt][e] = (kDocs && key < lo[half]) || key > hi[half] ? -INFINITY : s[nt][e] * p.scale_log2;
        }
    } else {
#pragma unroll
      for (int nt = 0; nt < kSTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] *= p.scale_log2;
    }
    // Online softmax: new running max, rescale what was accumulated, exponentiate this step's scores.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float step_max = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < kSTiles; ++nt) step_max = fmaxf(step_max, fmaxf(s[nt][2 * half], s[nt][2 * half + 1]));
      step_max = fmaxf(step_max, __shfl_xor_sync(0xffffffffu, step_max, 1));
      step_max = fmaxf(step_max, __shfl_xor_sync(0xffffffffu, step_max, 2));
      // With documents, a row whose document starts in a later step has seen only masked keys (max -inf):
      // subtracting 0 then keeps exp2(-inf - max) = 0 and the correction 0 instead of NaN. Once a visible key is
      // seen the max is finite. Without documents key 0 is visible to every row, so the max is finite from step 0.
      const float new_max = fmaxf(row_max[half], step_max);
      float max_used = new_max;
      if constexpr (kDocs) max_used = new_max == -INFINITY ? 0.0f : new_max;
      const float correction = exp2f(row_max[half] - max_used);
      row_max[half] = new_max;
      float step_sum = 0.0f;
#pragma unroll
      for (int nt = 0; nt < kSTiles; ++nt) {
        s[nt][2 * half] = exp2f(s[nt][2 * half] - max_used);
        s[nt][2 * half + 1] = exp2f(s[nt][2 * half + 1] - max_used);
        step_sum += s[nt][2 * half] + s[nt][2 * half + 1];
      }
      row_sum[half] = row_sum[half] * correction + step_sum;  // this thread's share; summed over the quad at the end
#pragma unroll
      for (int nt = 0; nt < kHd / 8; ++nt) o[nt][2 * half] *= correction, o[nt][2 * half + 1] *= correction;
    }

    cp_async_wait<1>();  // V_j has landed (K_{j+1} may be in flight)
    __syncthreads();
    gemm_regs_by_tile<kHd, kSTiles>(o, s, s_v, lane);
    __syncthreads();  // every warp is done with V_j
    if (j + 1 < n_steps) load_tile<kKeys, kHd>(s_v, v_base, kv_stride, key0 + kKeys, p.seq_len);
    cp_async_commit();
  }
  cp_async_wait<0>();

  float inv_sum[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float total = row_sum[half];
    total += __shfl_xor_sync(0xffffffffu, total, 1);
    total += __shfl_xor_sync(0xffffffffu, total, 2);
    inv_sum[half] = 1.0f / total;
    const int row = row_lo + 8 * half;
    if (c == 0 && row < p.seq_len)
      p.lse[(static_cast<int64_t>(b) * p.n_heads + h) * p.seq_len + row] =
          (row_max[half] + log2f(total)) * 0.69314718055994531f;
  }
  store_rows<kHd>(p.out + static_cast<int64_t>(b) * p.seq_len * q_stride + h * kHd, q_stride,
                  q0 + warp * kRowsPerWarp, p.seq_len, o, inv_sum[0], inv_sum[1], lane);
}

// ---------------------------------------------------------------------------------------------------------
// Backward, step 1: delta[b, h, t] = sum_d dout[b, t, h, d] out[b, t, h, d] (fp32). One warp per row.
template <int kHd>
__global__ void __launch_bounds__(kThreads) bwd_delta_kernel(AttentionParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;  // (b, t, h) flattened
  const int lane = threadIdx.x % 32;
  if (row >= static_cast<int64_t>(p.batch) * p.seq_len * p.n_heads) return;
  float sum = 0.0f;
  for (int d = lane * 8; d < kHd; d += 32 * 8) {
    const Bf16x8 x = load8(p.dout + row * kHd + d), y = load8(p.out + row * kHd + d);
#pragma unroll
    for (int j = 0; j < 8; ++j) sum += __bfloat162float(x.v[j]) * __bfloat162float(y.v[j]);
  }
  sum = warp_sum(sum);
  if (lane == 0) {
    const int h = static_cast<int>(row % p.n_heads);
    const int64_t bt = row / p.n_heads;
    const int t = static_cast<int>(bt % p.seq_len), b = static_cast<int>(bt / p.seq_len);
    p.delta[(static_cast<int64_t>(b) * p.n_heads + h) * p.seq_len + t] = sum;
  }
}

// Backward, step 2: dK and dV. Grid (key blocks of 64, n_kv_heads, batch); each warp owns 16 keys and keeps
// their dK, dV accumulators in registers while the block walks every query head of the group and every query
// block at or after its keys (causal). Per step, in the warp's transposed view (keys as rows):
//   S^T = K Q^T;  P^T = exp2(S^T scale_log2 - lse[q] log2 e) masked;  dP^T = V dO^T;  dS^T = P^T (dP^T - delta[q])
//   dV += P^T dO;  dK += dS^T Q   (dK scaled by 1/sqrt(d) at the end)
// Q, dO, lse and delta are double-buffered: step i+1's loads are issued right after the barrier that opens
// step i, so they fly while step i computes. That barrier also proves every warp is done with step i-1's
// buffer, the one being refilled. All four travel by cp.async (lse and delta a word each): a plain load
// would make the warp wait a global round trip before the step's first shared-memory read. A query past the
// sequence reads lse = delta = 0 with Q and dO rows of zeros, so its terms of dV (P^T dO) and dK (dS^T Q,
// dS = P (dO V^T - delta)) are exactly 0.
template <int kHd, int kQueries>
__global__ void __launch_bounds__(kThreads) bwd_dkdv_kernel(AttentionParams p) {
  extern __shared__ __align__(128) unsigned char smem_bytes[];
  __nv_bfloat16* s_k = reinterpret_cast<__nv_bfloat16*>(smem_bytes);
  __nv_bfloat16* s_v = s_k + kBlockRows * kHd;
  __nv_bfloat16* s_q = s_v + kBlockRows * kHd;    // [2][kQueries][kHd]
  __nv_bfloat16* s_do = s_q + 2 * kQueries * kHd;  // [2][kQueries][kHd]
  float* s_lse = reinterpret_cast<float*>(s_do + 2 * kQueries * kHd);  // [2][kQueries], natural log
  float* s_delta = s_lse + 2 * kQueries;                                // [2][kQueries]
  int32_t* s_doc = reinterpret_cast<int32_t*>(s_delta + 2 * kQueries);  // [2][kQueries]: queries' document starts
  constexpr int kQTiles = kQueries / 8;
  constexpr float kLog2e = 1.4426950408889634f;

  const int n_block = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int group = p.n_heads / p.n_kv_heads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, c = lane % 4;
  const int64_t q_stride = static_cast<int64_t>(p.n_heads) * kHd, kv_stride = static_cast<int64_t>(p.n_kv_heads) * kHd;
  const int key0 = n_block * kBlockRows;
  const int key_lo = key0 + warp * kRowsPerWarp + lane / 4;  // this thread's keys: key_lo, key_lo + 8

  load_tile<kBlockRows, kHd>(s_k, p.k + static_cast<int64_t>(b) * p.seq_len * kv_stride + kvh * kHd, kv_stride, key0,
                             p.seq_len);
  load_tile<kBlockRows, kHd>(s_v, p.v + static_cast<int64_t>(b) * p.seq_len * kv_stride + kvh * kHd, kv_stride, key0,
                             p.seq_len);
  cp_async_commit();

  // Steps: (query head of the group, query block at or after key0), query blocks fastest. With documents the
  // queries end where a document that starts after this block's last key begins (binary search: doc_start never
  // decreases): later queries see none of these keys.
  const int32_t* doc = p.doc_start ? p.doc_start + static_cast<int64_t>(b) * p.seq_len : nullptr;
  int q_end = p.seq_len;
  if (doc) {
    const int last_key = min(key0 + kBlockRows, p.seq_len) - 1;
    int lo = last_key + 1, hi = p.seq_len;  // the first t in [lo, hi) with doc[t] > last_key, or hi
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (doc[mid] > last_key) hi = mid;
      else lo = mid + 1;
    }
    q_end = lo;
  }
  const int first_q_block = key0 / kQueries;  // earlier queries see none of these keys
  const int q_blocks = (q_end + kQueries - 1) / kQueries - first_q_block;  // >= 1: key0 < q_end
  const int n_steps = group * q_blocks;
  const auto step_q0 = [&](int step) { return (first_q_block + step % q_blocks) * kQueries; };
  const auto issue = [&](int step, int buf) {
    const int h = kvh * group + step / q_blocks, q0 = step_q0(step);
    const int64_t head = static_cast<int64_t>(b) * p.seq_len * q_stride + h * kHd;
    load_tile<kQueries, kHd>(s_q + buf * kQueries * kHd, p.q + head, q_stride, q0, p.seq_len);
    load_tile<kQueries, kHd>(s_do + buf * kQueries * kHd, p.dout + head, q_stride, q0, p.seq_len);
    const int64_t stat_base = (static_cast<int64_t>(b) * p.n_heads + h) * p.seq_len;
    for (int i = threadIdx.x; i < kQueries; i += kThreads) {
      const bool valid = q0 + i < p.seq_len;
      const int64_t at = stat_base + (valid ? q0 + i : 0);
      cp_async4(smem_address(s_lse + buf * kQueries + i), p.lse + at, valid);
      cp_async4(smem_address(s_delta + buf * kQueries + i), p.delta + at, valid);
      if (doc) cp_async4(smem_address(s_doc + buf * kQueries + i), doc + (valid ? q0 + i : 0), valid);
    }
    cp_async_commit();
  };

  float dk[kHd / 8][4] = {}, dv[kHd / 8][4] = {};
  issue(0, 0);
  for (int step = 0; step < n_steps; ++step) {
    const int buf = step & 1, q0 = step_q0(step);
    cp_async_wait<0>();  // this step's tiles (and K, V on the first step) have landed for this thread
    __syncthreads();     // ... for every thread; and every warp is done with the other buffer
    if (step + 1 < n_steps) issue(step + 1, buf ^ 1);
    const __nv_bfloat16* q_tile = s_q + buf * kQueries * kHd;
    const __nv_bfloat16* do_tile = s_do + buf * kQueries * kHd;
    const float* lse = s_lse + buf * kQueries;
    const float* delta = s_delta + buf * kQueries;
    const int32_t* first_key = s_doc + buf * kQueries;  // read only with documents

    float pt[kQTiles][4] = {};
    gemm_rows_by_rows<kHd, kQTiles>(pt, s_k, warp * kRowsPerWarp, q_tile, 0, lane);
#pragma unroll
    for (int nt = 0; nt < kQTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qi = nt * 8 + 2 * c + (e & 1);
        const int key = key_lo + 8 * (e >> 1);
        const bool masked = key > q0 + qi || (doc != nullptr && key < first_key[qi]);
        pt[nt][e] = masked ? 0.0f : exp2f(pt[nt][e] * p.scale_log2 - lse[qi] * kLog2e);
      }
    float dst[kQTiles][4] = {};
    gemm_rows_by_rows<kHd, kQTiles>(dst, s_v, warp * kRowsPerWarp, do_tile, 0, lane);
#pragma unroll
    for (int nt = 0; nt < kQTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dst[nt][e] = pt[nt][e] * (dst[nt][e] - delta[nt * 8 + 2 * c + (e & 1)]);
    gemm_regs_by_tile<kHd, kQTiles>(dv, pt, do_tile, lane);
    gemm_regs_by_tile<kHd, kQTiles>(dk, dst, q_tile, lane);
  }
  const int row0 = key0 + warp * kRowsPerWarp;
  store_rows<kHd>(p.dk + static_cast<int64_t>(b) * p.seq_len * kv_stride + kvh * kHd, kv_stride, row0, p.seq_len, dk,
                  p.scale, p.scale, lane);
  store_rows<kHd>(p.dv + static_cast<int64_t>(b) * p.seq_len * kv_stride + kvh * kHd, kv_stride, row0, p.seq_len, dv,
                  1.0f, 1.0f, lane);
}

// Backward, step 3: dQ. Grid (query blocks of 64, n_heads, batch); each warp owns 16 queries and walks the key
// blocks up to the diagonal:  S = Q K^T; P = exp2(S scale_log2 - lse2) masked; dP = dO V^T;
// dS = P (dP - delta);  dQ += dS K   (scaled by 1/sqrt(d) at the end). Recomputing S and dP here instead of
// adding dQ atomically from the dK/dV kernel costs two extra products and buys a deterministic dQ.
// K and V are double-buffered like Q and dO above.
template <int kHd, int kKeys>
__global__ void __launch_bounds__(kThreads) bwd_dq_kernel(AttentionParams p) {
  extern __shared__ __align__(128) unsigned char smem_bytes[];
  __nv_bfloat16* s_q = reinterpret_cast<__nv_bfloat16*>(smem_bytes);
  __nv_bfloat16* s_do = s_q + kBlockRows * kHd;
  __nv_bfloat16* s_k = s_do + kBlockRows * kHd;  // [2][kKeys][kHd]
  __nv_bfloat16* s_v = s_k + 2 * kKeys * kHd;    // [2][kKeys][kHd]
  constexpr int kSTiles = kKeys / 8;
  constexpr float kLog2e = 1.4426950408889634f;

  const int m_block = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int kvh = h / (p.n_heads / p.n_kv_heads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int64_t q_stride = static_cast<int64_t>(p.n_heads) * kHd, kv_stride = static_cast<int64_t>(p.n_kv_heads) * kHd;
  const __nv_bfloat16* k_base = p.k + static_cast<int64_t>(b) * p.seq_len * kv_stride + kvh * kHd;
  const __nv_bfloat16* v_base = p.v + static_cast<int64_t>(b) * p.seq_len * kv_stride + kvh * kHd;
  const int q0 = m_block * kBlockRows;
  const int row_lo = q0 + warp * kRowsPerWarp + g;
  const int64_t stat_base = (static_cast<int64_t>(b) * p.n_heads + h) * p.seq_len;
  // Documents, as in the forward: the first key step and this thread's rows' first keys.
  const int32_t* doc = p.doc_start ? p.doc_start + static_cast<int64_t>(b) * p.seq_len : nullptr;
  const int first_step = doc ? doc[q0] / kKeys : 0;
  int row_first_key[2] = {0, 0};
  if (doc) {
    row_first_key[0] = doc[min(row_lo, p.seq_len - 1)];
    row_first_key[1] = doc[min(row_lo + 8, p.seq_len - 1)];
  }

  load_tile<kBlockRows, kHd>(s_q, p.q + static_cast<int64_t>(b) * p.seq_len * q_stride + h * kHd, q_stride, q0,
                             p.seq_len);
  load_tile<kBlockRows, kHd>(s_do, p.dout + static_cast<int64_t>(b) * p.seq_len * q_stride + h * kHd, q_stride, q0,
                             p.seq_len);
  const auto issue = [&](int j, int buf) {
    load_tile<kKeys, kHd>(s_k + buf * kKeys * kHd, k_base, kv_stride, j * kKeys, p.seq_len);
    load_tile<kKeys, kHd>(s_v + buf * kKeys * kHd, v_base, kv_stride, j * kKeys, p.seq_len);
    cp_async_commit();  // the first group also carries Q and dO
  };
  float lse2[2], delta[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row_lo + 8 * half;
    lse2[half] = row < p.seq_len ? p.lse[stat_base + row] * kLog2e : INFINITY;
    delta[half] = row < p.seq_len ? p.delta[stat_base + row] : 0.0f;
  }

  float dq[kHd / 8][4] = {};
  const int n_steps = (min(p.seq_len, q0 + kBlockRows) + kKeys - 1) / kKeys;
  issue(first_step, 0);
  for (int j = first_step; j < n_steps; ++j) {
    const int key0 = j * kKeys, buf = (j - first_step) & 1;
    cp_async_wait<0>();
    __syncthreads();  // tiles of step j visible to all; every warp is done with the other buffer
    if (j + 1 < n_steps) issue(j + 1, buf ^ 1);
    const __nv_bfloat16* k_tile = s_k + buf * kKeys * kHd;
    const __nv_bfloat16* v_tile = s_v + buf * kKeys * kHd;

    float s[kSTiles][4] = {};
    gemm_rows_by_rows<kHd, kSTiles>(s, s_q, warp * kRowsPerWarp, k_tile, 0, lane);
#pragma unroll
    for (int nt = 0; nt < kSTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key0 + nt * 8 + 2 * c + (e & 1);
        const int half = e >> 1;
        const bool masked = key > row_lo + 8 * half || key >= p.seq_len || key < row_first_key[half];
        s[nt][e] = masked ? 0.0f : exp2f(s[nt][e] * p.scale_log2 - lse2[half]);
      }
    float dp[kSTiles][4] = {};
    gemm_rows_by_rows<kHd, kSTiles>(dp, s_do, warp * kRowsPerWarp, v_tile, 0, lane);
#pragma unroll
    for (int nt = 0; nt < kSTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dp[nt][e] = s[nt][e] * (dp[nt][e] - delta[e >> 1]);
    gemm_regs_by_tile<kHd, kSTiles>(dq, dp, k_tile, lane);
  }
  store_rows<kHd>(p.dq + static_cast<int64_t>(b) * p.seq_len * q_stride + h * kHd, q_stride, q0 + warp * kRowsPerWarp,
                  p.seq_len, dq, p.scale, p.scale, lane);
}

// Shared-memory bytes of each kernel.
template <int kHd>
constexpr int fwd_smem_bytes() {  // Q, K, V
  return 3 * kBlockRows * kHd * 2;
}
template <int kHd, int kQueries>
constexpr int dkdv_smem_bytes() {  // K, V; two buffers of Q, dO, lse, delta, document starts
  return 2 * kBlockRows * kHd * 2 + 2 * (2 * kQueries * kHd * 2 + 3 * kQueries * 4);
}
template <int kHd, int kKeys>
constexpr int dq_smem_bytes() {  // Q, dO; two buffers of K, V
  return 2 * kBlockRows * kHd * 2 + 2 * (2 * kKeys * kHd * 2);
}

}  // namespace tuna::cuda::attention
