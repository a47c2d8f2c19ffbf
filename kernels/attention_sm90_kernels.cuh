// FlashAttention-3 style kernels for sm_90a (forward; backward below), templates over the head dim; included
// by attention_sm90_launch.cuh (and the host emulator) only. Internal to kernels/.
//
// Structure (FlashAttention-3, Shah et al. 2024; tuna's own code):
//   - warp specialisation: warpgroup 0 is the producer (one elected thread issues every TMA copy; setmaxnreg
//     gives its registers back), warpgroups 1 and 2 the consumers (setmaxnreg takes them), each owning 64 rows;
//   - operands arrive by TMA into 128B-swizzled shared memory and are read by wgmma through matrix
//     descriptors; the tensor cores run asynchronously to the threads that issue them;
//   - mbarrier pipelines: a full/empty pair per stage of K and per stage of V, and one for Q, so the producer
//     runs up to kStages blocks ahead and consumers never wait on a __syncthreads;
//   - the consumers overlap the softmax of block j with the QK^T of block j+1 and the PV of block j (both
//     issued before the softmax starts; wgmma.wait_group 1 retires the first);
//   - a persistent grid (one CTA per SM) takes the (query block, head) tiles longest-first (the causal rows
//     of the last query blocks see the most keys) from an atomic counter, so that a CTA started late (its SM
//     busy with another kernel, e.g. a collective overlapping the layer) takes fewer tiles instead of carrying
//     a fixed share into a tail; only the diagonal block is masked;
//   - documents (p.doc_start, attention_params.cuh): a tile's keys start at the block holding its first row's
//     document start, and the backward's key blocks stop at the first query block whose first row's document
//     starts after them, so blocks wholly outside a block's documents are never loaded; inside, the blocks some
//     row's document starts after are masked per element. Each kernel has an instance with documents and one
//     without (the plain causal code, with no document state).
//
// Shared tiles: a [rows][head_dim] tile is head_dim / 64 "panels" of [rows][64] bf16, each row 128 bytes and
// swizzled as TMA's 128B mode writes it (16-byte chunk c of row r at c ^ (r % 8)). wgmma reads a panel:
//   K-major (Q as A, K as B of S = Q K^T): start + 32 bytes per 16-wide k-step inside the 128-byte row, SBO =
//     1024 (8 rows), the k-steps past 64 in the next panel;
//   MN-major (V as B of O = P V, trans-b): start + 2048 bytes per 16-key k-step (16 rows), LBO = the panel's
//     bytes (the next 64 columns of N), SBO = 1024 (the next 8 keys).
// Fragments (PTX ISA 9.7.15.5.1.1): the m64nN fp32 accumulator puts row 16w + g (+8) and columns 8i + 2t, +1
// of 8-column tile i in registers 4i..4i+3 of lane 4g + t of warp w; two adjacent 8-column tiles are exactly
// the A fragment of a 16-wide k-step, so P feeds P V from registers (as in FlashAttention-2 with mma.sync).
//
// Compiled into the sm_90a image only (TUNA_SM90A_DEVICE): the sm_80 image gets kernels that trap, which the
// launchers never start on a device without sm_90a (attention_sm90_launch.cuh checks). A plain sm_90 build
// (SM=90, no "a") reports binaryVersion 90 like an sm_90a one, so the launchers' check passes it: the trap
// turns what would be a silently empty kernel into a launch error.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/attention_params.cuh"
#include "kernels/common.cuh"
#include "kernels/scratch.h"  // AttentionBwdScratch
// Under TUNA_EMULATOR, <cuda_bf16.h> above is the emulator's (its shim/ comes first on that build's include
// path) and already declares host versions of these helpers, so this header names no file of tests/.
#ifndef TUNA_EMULATOR
#include "kernels/attention_sm90_ptx.cuh"  // mbarrier_*, tma_load_*, wgmma_*, setmaxnreg_*, elect_one, ...
#endif

#if defined(TUNA_EMULATOR) || (defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL))
#define TUNA_SM90A_DEVICE 1
#else
#define TUNA_SM90A_DEVICE 0
#endif

namespace tuna::cuda::attention {

// The Hopper kernels' arguments: the common block and the tensor maps of the TMA copies (made on the host by
// attention_sm90_launch.cuh: Q, K, V, dO as 4-D (head_dim, heads, seq, batch) bf16 tensors, boxes of 64 x 1 x
// rows x 1 with 128B swizzle).
struct Sm90Params {
  AttentionParams p;
  CUtensorMap q_map, k_map, v_map, dout_map;
  float* dq_accum;          // backward: [batch, n_heads, seq_pad, head_dim] fp32, the dQ partial sums
  int* dq_flags;            // backward: [batch, n_heads, m_blocks], the next key block to add into each dQ block
  int* bwd_tickets;         // backward: zeroed before the launch; each CTA takes the next as its work's index
  const float* rope_cos;    // backward: [>= seq_len, head_dim / 2] or null: apply RoPE's backward to dQ, dK
  const float* rope_sin;
  const int32_t* rope_positions;  // backward: [batch, seq_len], each row's RoPE position, or null (its index t)
  int n_tiles;              // forward: query blocks x batch x heads
  int* tile_counter;        // forward: the tiles handed out past the first wave; 0 at launch, left 0 at exit
};

constexpr int kWarpGroupThreads = 128;
constexpr int kSm90Threads = 3 * kWarpGroupThreads;  // producer + two consumer warpgroups
constexpr int kConsumerThreads = 2 * kWarpGroupThreads;
constexpr int kPanelCols = 64;                       // bf16 per 128-byte swizzled row
constexpr int kProducerRegisters = 24, kConsumerRegisters = 240;  // 128 x 24 + 256 x 240 <= 64 K

// Named barriers of the forward: the two consumer warpgroups take turns issuing their GEMMs (kBarTurn + the
// warpgroup whose turn it is), so that one's softmax overlaps the other's GEMMs (FlashAttention-3's ping-pong).
constexpr int kBarTurn = 4;
// Named barriers of the backward (bar 0 is __syncthreads): both consumer warpgroups (their dQ partials written,
// then added), and each warpgroup's own (its dS tile written, before its wgmma reads it).
constexpr int kBarConsumers = 1, kBarDsWritten = 2;  // kBarDsWritten + consumer warpgroup (0, 1)

// A descriptor of a 128B-swizzled operand (PTX ISA 9.7.15.5.1.2.2): start, LBO and SBO in 16-byte units.
__host__ __device__ constexpr uint64_t sw128_descriptor(uint32_t start, uint32_t lbo, uint32_t sbo) {
  return uint64_t{(start >> 4) & 0x3fff} | uint64_t{(lbo >> 4) & 0x3fff} << 16 | uint64_t{(sbo >> 4) & 0x3fff} << 32 |
         uint64_t{1} << 62;
}

// A stage counter of a multi-stage pipeline and the parity of its current use: the n-th use of a stage waits
// for phase n of its full barrier (parity n & 1) and, on the producer side, for phase n - 1 of its empty
// barrier (parity (n & 1) ^ 1, which the first use passes: it asks about the phase before phase 0).
template <int kStages>
struct PipelineState {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) stage = 0, phase ^= 1;
  }
};

// Two floats as a bf16 pair, the first in the low half.
__device__ __forceinline__ uint32_t pack_bf16_pair(float lo, float hi) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

// ---------------------------------------------------------------------------------------------------------
// Forward.

template <int kHd>
struct Sm90Fwd {
  static constexpr int kBlockM = 128;  // queries per tile: 64 per consumer warpgroup
  static constexpr int kBlockN = 128;  // keys per step
  static constexpr int kStages = kHd == 64 ? 3 : 2;
  static constexpr int kPanels = kHd / kPanelCols;
  static constexpr uint32_t kPanelBytes = kBlockN * 128;  // [128 rows][64] bf16 (Q's panels have as many rows)
  static constexpr uint32_t kTileBytes = kPanels * kPanelBytes;
  // Shared layout from a 1024-byte aligned base: Q, K stages, V stages, then the barriers.
  static constexpr uint32_t kQ = 0, kK = kTileBytes, kV = kK + kStages * kTileBytes;
  static constexpr uint32_t kBarriers = kV + kStages * kTileBytes;
  static constexpr uint32_t kQFull = kBarriers, kQEmpty = kQFull + 8;
  static constexpr uint32_t kKFull = kQEmpty + 8, kKEmpty = kKFull + 8 * kStages;
  static constexpr uint32_t kVFull = kKEmpty + 8 * kStages, kVEmpty = kVFull + 8 * kStages;
  static constexpr uint32_t kEnd = kVEmpty + 8 * kStages;
  static constexpr int kSmemBytes = kEnd + 1024;  // + slack to align the base
  static constexpr int kSRegs = kBlockN / 2, kORegs = kHd / 2;
};

#if TUNA_SM90A_DEVICE
// Row statistics of the online softmax for the two rows (g and g + 8 of the warp's 16) a thread holds.
struct SoftmaxRows {
  float max[2], sum[2];
};

// How a block of keys is masked in the forward's softmax. kNone: every key visible to every row (a block below
// the diagonal, inside every row's document). kCausal: key > query and keys past the sequence (the diagonal block
// without documents). kDocument: those and keys before the row's document start (every block some row's
// document starts after, and the diagonal, with documents); a row may then see no key of the block.
enum class FwdMask { kNone, kCausal, kDocument };

// Masks the block (kMask), takes each row's max on the raw scores, and exponentiates as exp2(s * scale_log2 -
// max * scale_log2): one FFMA and one MUFU.EX2 per score. The running max stays in raw units. Returns the factor
// each row's earlier output must be scaled by. `row` is the thread's first row, `key0` the block's first key,
// `first_key` its two rows' document starts (read by kDocument only).
template <FwdMask kMask, int kRegs>
__device__ __forceinline__ void online_softmax(float (&s)[kRegs], SoftmaxRows& rows, float (&correction)[2], int row,
                                               int key0, int seq_len, float scale_log2, const int (&first_key)[2]) {
  if constexpr (kMask != FwdMask::kNone) {
    const int t = threadIdx.x % 4;
#pragma unroll
    for (int r = 0; r < kRegs; ++r) {
      const int key = key0 + 8 * (r / 4) + 2 * t + r % 2, half = (r / 2) % 2, q = row + 8 * half;
      bool masked = key > q || key >= seq_len;
      if constexpr (kMask == FwdMask::kDocument) masked = masked || key < first_key[half];
      if (masked) s[r] = -INFINITY;
    }
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float block_max = -INFINITY;
#pragma unroll
    for (int i = 0; i < kRegs / 4; ++i)
      block_max = fmaxf(block_max, fmaxf(s[4 * i + 2 * half], s[4 * i + 2 * half + 1]));
    block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffffu, block_max, 1));
    block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffffu, block_max, 2));
    // Without documents key 0 is in every row's first block, so the running max is finite from the first block
    // on (and the first block's correction, exp2(-inf), is 0). With documents a row may see no key of its
    // first blocks (its document starts later): its max stays -inf, and subtracting 0 instead keeps its terms
    // and correction 0 rather than NaN. Any block not masked by documents shows every row a key, so only the
    // kDocument instance needs the select.
    const float new_max = fmaxf(rows.max[half], block_max);
    float max_used = new_max;
    if constexpr (kMask == FwdMask::kDocument) max_used = new_max == -INFINITY ? 0.0f : new_max;
    correction[half] = ex2_approx_ftz((rows.max[half] - max_used) * scale_log2);
    rows.max[half] = new_max;
    const float max_scaled = max_used * scale_log2;
    float block_sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kRegs / 4; ++i) {
      s[4 * i + 2 * half] = ex2_approx_ftz(fmaf(s[4 * i + 2 * half], scale_log2, -max_scaled));
      s[4 * i + 2 * half + 1] = ex2_approx_ftz(fmaf(s[4 * i + 2 * half + 1], scale_log2, -max_scaled));
      block_sum += s[4 * i + 2 * half] + s[4 * i + 2 * half + 1];
    }
    rows.sum[half] = rows.sum[half] * correction[half] + block_sum;  // this thread's share; the quad sums at the end
  }
}

// P (fp32 accumulator fragments of kBlockN columns) as bf16 A fragments, one per 16-key k-step.
template <int kRegs>
__device__ __forceinline__ void to_a_fragments(uint32_t (&a)[kRegs / 8][4], const float (&s)[kRegs]) {
#pragma unroll
  for (int kk = 0; kk < kRegs / 8; ++kk)
#pragma unroll
    for (int i = 0; i < 4; ++i) a[kk][i] = pack_bf16_pair(s[8 * kk + 2 * i], s[8 * kk + 2 * i + 1]);
}

template <int kRegs>
__device__ __forceinline__ void scale_rows(float (&o)[kRegs], const float (&factor)[2]) {
#pragma unroll
  for (int r = 0; r < kRegs; ++r) o[r] *= factor[(r / 2) % 2];
}
#endif  // TUNA_SM90A_DEVICE

// Grid: min(tiles, SMs) persistent CTAs of 384 threads. Tile t is query block m_blocks - 1 - t / (batch x heads)
// of (batch, head) t % (batch x heads). CTA i's first tile is i; each later one is gridDim.x + the value its
// producer draws from args.tile_counter (atomicAdd) while the current tile's K and V stream in, handed to the
// consumers through shared memory with the Q barrier: the producer writes it once the consumers have released
// the previous tile's Q, and its arrival on kQFull publishes it. A tile past the end, with a bare arrival, tells
// the consumers to stop. Every CTA draws until it gets a tile past the end, so the draws are exactly n_tiles,
// valued 0 .. n_tiles - 1: the CTA that draws n_tiles - 1 draws last and puts the counter back to 0 for the
// next launch on the stream. Which CTA computes a tile changes from run to run; what it computes does not.
// kDocs: p.doc_start is set. A tile's keys then start at the block holding its first row's document start (the
// earlier blocks are never loaded: the producer and the consumers both start there), and blocks that some row's
// document starts after are masked per element; without documents the instance is the plain causal one.
template <int kHd, bool kDocs>
__global__ void __launch_bounds__(kSm90Threads, 1) sm90_fwd_kernel(const __grid_constant__ Sm90Params args) {
#if TUNA_SM90A_DEVICE
  using C = Sm90Fwd<kHd>;
  const AttentionParams& p = args.p;
  extern __shared__ __align__(128) unsigned char smem_bytes[];  // aligned to 1024 below
  const uint32_t base = (smem_address(smem_bytes) + 1023) & ~1023u;
  const int bh_count = p.batch * p.n_heads, m_blocks = (p.seq_len + C::kBlockM - 1) / C::kBlockM;
  const int group_size = p.n_heads / p.n_kv_heads;
  __shared__ int scheduled_tile;  // the tile whose Q the current phase of kQFull brings (n_tiles or more: none)

  if (threadIdx.x == 0) {
    mbarrier_init(base + C::kQFull, 1);
    mbarrier_init(base + C::kQEmpty, kConsumerThreads);
    for (int s = 0; s < C::kStages; ++s) {
      mbarrier_init(base + C::kKFull + 8 * s, 1);
      mbarrier_init(base + C::kKEmpty + 8 * s, kConsumerThreads);
      mbarrier_init(base + C::kVFull + 8 * s, 1);
      mbarrier_init(base + C::kVEmpty + 8 * s, kConsumerThreads);
    }
    fence_mbarrier_init();
  }
  __syncthreads();

  const int warpgroup = threadIdx.x / kWarpGroupThreads;
  if (warpgroup == 0) {
    // ---- producer: one thread issues every copy, in the order the consumers use them.
    setmaxnreg_dec<kProducerRegisters>();
    if (threadIdx.x >= 32 || !elect_one()) return;
    tma_prefetch_descriptor(&args.q_map);
    tma_prefetch_descriptor(&args.k_map);
    tma_prefetch_descriptor(&args.v_map);
    PipelineState<C::kStages> kv;
    uint32_t tile_parity = 0;
    for (int tile = blockIdx.x;; tile_parity ^= 1) {
      mbarrier_wait(base + C::kQEmpty, tile_parity ^ 1);  // the consumers have read the previous tile's index
      scheduled_tile = tile;
      if (tile >= args.n_tiles) {
        mbarrier_arrive(base + C::kQFull);
        break;
      }
      const int m_block = m_blocks - 1 - tile / bh_count, bh = tile % bh_count;
      const int b = bh / p.n_heads, h = bh % p.n_heads, kvh = h / group_size;
      mbarrier_arrive_expect_tx(base + C::kQFull, C::kTileBytes);
      for (int panel = 0; panel < C::kPanels; ++panel)
        tma_load_4d(base + C::kQ + panel * C::kPanelBytes, &args.q_map, base + C::kQFull, panel * kPanelCols, h,
                    m_block * C::kBlockM, b);
      const int drawn = atomicAdd(args.tile_counter, 1);  // its latency hidden behind this tile's K/V issue
      if (drawn == args.n_tiles - 1) *args.tile_counter = 0;
      int first_block = 0;
      if constexpr (kDocs)
        first_block = p.doc_start[static_cast<int64_t>(b) * p.seq_len + m_block * C::kBlockM] / C::kBlockN;
      for (int j = first_block; j <= m_block; ++j, kv.advance()) {
        const uint32_t k_stage = base + C::kK + kv.stage * C::kTileBytes;
        const uint32_t v_stage = base + C::kV + kv.stage * C::kTileBytes;
        mbarrier_wait(base + C::kKEmpty + 8 * kv.stage, kv.phase ^ 1);
        mbarrier_arrive_expect_tx(base + C::kKFull + 8 * kv.stage, C::kTileBytes);
        for (int panel = 0; panel < C::kPanels; ++panel)
          tma_load_4d(k_stage + panel * C::kPanelBytes, &args.k_map, base + C::kKFull + 8 * kv.stage,
                      panel * kPanelCols, kvh, j * C::kBlockN, b);
        mbarrier_wait(base + C::kVEmpty + 8 * kv.stage, kv.phase ^ 1);
        mbarrier_arrive_expect_tx(base + C::kVFull + 8 * kv.stage, C::kTileBytes);
        for (int panel = 0; panel < C::kPanels; ++panel)
          tma_load_4d(v_stage + panel * C::kPanelBytes, &args.v_map, base + C::kVFull + 8 * kv.stage,
                      panel * kPanelCols, kvh, j * C::kBlockN, b);
      }
      tile = drawn + static_cast<int>(gridDim.x);
    }
    return;
  }

  // ---- consumers: warpgroup 1 owns rows 0..63 of each tile, warpgroup 2 rows 64..127.
  setmaxnreg_inc<kConsumerRegisters>();
  const int cw = warpgroup - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int64_t q_stride = static_cast<int64_t>(p.n_heads) * kHd;
  PipelineState<C::kStages> kv;
  uint32_t tile_parity = 0;
  // S = Q K^T for the K stage `stage`: kHd / 16 k-steps, 4 per panel. The operand fences keep the compiler
  // from moving accesses of the registers a wgmma uses across its issue (or the wait that retires it).
  const auto issue_s = [&](float (&s)[C::kSRegs], int stage) {
    const uint32_t q_rows = base + C::kQ + cw * 64 * 128, k_tile = base + C::kK + stage * C::kTileBytes;
    fence_operand(s);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kHd / 16; ++kk) {
      const uint32_t offset = (kk / 4) * C::kPanelBytes + (kk % 4) * 32;
      wgmma_ss<C::kBlockN, 0, 0>(s, sw128_descriptor(q_rows + offset, 16, 1024),
                                 sw128_descriptor(k_tile + offset, 16, 1024), kk > 0);
    }
    wgmma_commit();
  };
  // O += P V for the V stage `stage`: 8 k-steps of 16 keys, A from registers, V read MN-major; and once a
  // wait has retired it, the stage released.
  const auto issue_pv = [&](float (&o)[C::kORegs], uint32_t (&pa)[C::kBlockN / 16][4], int stage) {
    const uint32_t v_tile = base + C::kV + stage * C::kTileBytes;
    fence_operand(o);
#pragma unroll
    for (int kk = 0; kk < C::kBlockN / 16; ++kk) fence_operand(pa[kk]);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < C::kBlockN / 16; ++kk)
      wgmma_rs<kHd, 1>(o, pa[kk], sw128_descriptor(v_tile + kk * 2048, C::kPanelBytes, 1024), true);
    wgmma_commit();
  };
  const auto retire_pv = [&](float (&o)[C::kORegs], uint32_t (&pa)[C::kBlockN / 16][4], int stage) {
    fence_operand(o);
#pragma unroll
    for (int kk = 0; kk < C::kBlockN / 16; ++kk) fence_operand(pa[kk]);
    mbarrier_arrive(base + C::kVEmpty + 8 * stage);
  };

  // Turns: warpgroup c waits for its turn (bar.sync kBarTurn + c), issues, and hands the turn over (bar.arrive
  // on the other's). Both take the same number of turns; warpgroup 1 hands the first turn to warpgroup 0, and
  // warpgroup 0 takes one last turn after its last tile, matching warpgroup 1's last hand-over.
  const auto take_turn = [&] { named_barrier_sync(kBarTurn + cw, kConsumerThreads); };
  const auto hand_over = [&] { named_barrier_arrive(kBarTurn + 1 - cw, kConsumerThreads); };
  if (cw == 1) hand_over();

  for (;; tile_parity ^= 1) {
    mbarrier_wait(base + C::kQFull, tile_parity);
    const int tile = scheduled_tile;
    if (tile >= args.n_tiles) break;
    const int m_block = m_blocks - 1 - tile / bh_count, bh = tile % bh_count;
    const int b = bh / p.n_heads, h = bh % p.n_heads;
    const int row = m_block * C::kBlockM + cw * 64 + warp * 16 + lane / 4;  // this thread's rows: row, row + 8
    // Documents: the first key block (the one holding the tile's first row's document start), this thread's
    // rows' document starts, and the first block every row of the warpgroup sees whole: before it, the steps are
    // the instance that masks by document. That choice picks between two instances of the step, each with its
    // own wgmma instructions, so it must be the same for the warpgroup's four warps (wgmma is .aligned: all 128
    // threads execute the same instruction); it is taken from the warpgroup's last row. The first block's
    // softmax, which no wgmma follows inside its branch, is chosen per warp, from the warp's last row. Rows past
    // the sequence take the last row's document: they are never stored.
    int first_block = 0, doc_blocks_end = 0, warp_doc_blocks_end = 0, first_key[2] = {0, 0};
    if constexpr (kDocs) {
      const int32_t* doc = p.doc_start + static_cast<int64_t>(b) * p.seq_len;
      const int warpgroup_row0 = m_block * C::kBlockM + cw * 64;
      first_block = doc[m_block * C::kBlockM] / C::kBlockN;
      first_key[0] = doc[min(row, p.seq_len - 1)];
      first_key[1] = doc[min(row + 8, p.seq_len - 1)];
      doc_blocks_end = (doc[min(warpgroup_row0 + 63, p.seq_len - 1)] + C::kBlockN - 1) / C::kBlockN;
      warp_doc_blocks_end = (doc[min(warpgroup_row0 + warp * 16 + 15, p.seq_len - 1)] + C::kBlockN - 1) / C::kBlockN;
    }
    // Blocks of kBlockN keys from first_block up to the diagonal (kBlockN == kBlockM).
    const int n_blocks = m_block + 1 - first_block;
    constexpr FwdMask kDiagonalMask = kDocs ? FwdMask::kDocument : FwdMask::kCausal;

    float s[C::kSRegs] = {}, o[C::kORegs];
    uint32_t pa[C::kBlockN / 16][4];
    SoftmaxRows rows{{-INFINITY, -INFINITY}, {0.0f, 0.0f}};
    float correction[2];
#pragma unroll
    for (int r = 0; r < C::kORegs; ++r) o[r] = 0.0f;

    mbarrier_wait(base + C::kKFull + 8 * kv.stage, kv.phase);
    take_turn();
    issue_s(s, kv.stage);
    hand_over();
    wgmma_wait<0>();
    fence_operand(s);
    mbarrier_arrive(base + C::kKEmpty + 8 * kv.stage);
    if (n_blocks == 1) mbarrier_arrive(base + C::kQEmpty);  // the tile's last read of Q has retired
    const int key0 = first_block * C::kBlockN;
    bool first_masked = n_blocks == 1;
    if constexpr (kDocs) first_masked = first_masked || first_block < warp_doc_blocks_end;  // kDiagonalMask: kDocument
    if (first_masked) online_softmax<kDiagonalMask>(s, rows, correction, row, key0, p.seq_len, p.scale_log2, first_key);
    else online_softmax<FwdMask::kNone>(s, rows, correction, row, key0, p.seq_len, p.scale_log2, first_key);
    to_a_fragments(pa, s);

    // Block j + 1's S and block j's P V in flight together, block j + 1's softmax between them. Only the last
    // (diagonal) block and, with documents, the blocks before doc_blocks_end are masked: their steps are separate
    // instances, so the others carry no mask code.
    const auto step = [&](int j, auto mask, auto diagonal) {
      constexpr FwdMask kMask = decltype(mask)::value;
      constexpr bool kDiagonal = decltype(diagonal)::value;
      PipelineState<C::kStages> next = kv;
      next.advance();
      mbarrier_wait(base + C::kKFull + 8 * next.stage, next.phase);
      mbarrier_wait(base + C::kVFull + 8 * kv.stage, kv.phase);
      take_turn();
      issue_s(s, next.stage);
      issue_pv(o, pa, kv.stage);
      hand_over();
      wgmma_wait<1>();  // S of block j + 1 is done; P_j V_j may still run
      fence_operand(s);
      mbarrier_arrive(base + C::kKEmpty + 8 * next.stage);
      if constexpr (kDiagonal) mbarrier_arrive(base + C::kQEmpty);  // the tile's last read of Q has retired
      online_softmax<kMask>(s, rows, correction, row, (j + 1) * C::kBlockN, p.seq_len, p.scale_log2, first_key);
      wgmma_wait<0>();
      retire_pv(o, pa, kv.stage);
      scale_rows(o, correction);
      to_a_fragments(pa, s);
      kv = next;
    };
    using NoMask = std::integral_constant<FwdMask, FwdMask::kNone>;
    using DocumentMask = std::integral_constant<FwdMask, FwdMask::kDocument>;
    for (int j = first_block; j + 1 < m_block; ++j) {
      if constexpr (kDocs) {
        if (j + 1 < doc_blocks_end) {
          step(j, DocumentMask{}, std::false_type{});
          continue;
        }
      }
      step(j, NoMask{}, std::false_type{});
    }
    if (n_blocks > 1) step(m_block - 1, std::integral_constant<FwdMask, kDiagonalMask>{}, std::true_type{});
    // The last block's P V.
    mbarrier_wait(base + C::kVFull + 8 * kv.stage, kv.phase);
    take_turn();
    issue_pv(o, pa, kv.stage);
    hand_over();
    wgmma_wait<0>();
    retire_pv(o, pa, kv.stage);
    kv.advance();

    // Epilogue: O / rowsum as bf16, lse = max * scale + log(sum) (from log2 units); rows past the sequence are not
    // stored.
    float inv_sum[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float total = rows.sum[half];
      total += __shfl_xor_sync(0xffffffffu, total, 1);
      total += __shfl_xor_sync(0xffffffffu, total, 2);
      inv_sum[half] = 1.0f / total;
      const int q = row + 8 * half;
      if (lane % 4 == 0 && q < p.seq_len)
        p.lse[(static_cast<int64_t>(b) * p.n_heads + h) * p.seq_len + q] =
            (rows.max[half] * p.scale_log2 + log2f(total)) * 0.69314718055994531f;
    }
    __nv_bfloat16* out = p.out + static_cast<int64_t>(b) * p.seq_len * q_stride + h * kHd;
#pragma unroll
    for (int r = 0; r < C::kORegs; r += 2) {
      const int half = (r / 2) % 2, q = row + 8 * half, col = 8 * (r / 4) + 2 * (lane % 4);
      if (q < p.seq_len)
        *reinterpret_cast<__nv_bfloat162*>(out + q * q_stride + col) =
            __floats2bfloat162_rn(o[r] * inv_sum[half], o[r + 1] * inv_sum[half]);
    }
  }
  if (cw == 0) take_turn();  // warpgroup 1's last hand-over
#elif defined(__CUDA_ARCH__)
  __trap();  // an image without sm_90a code (sm_80, or a plain sm_90 build): never a silent empty kernel
#endif  // TUNA_SM90A_DEVICE
}

// ---------------------------------------------------------------------------------------------------------
// Backward. One CTA per (key block of 128, kv head, batch): K and V stay in shared memory, dK and dV in the
// consumers' registers (warpgroup c owns keys 64c..64c+63 of the block), while the CTA walks every query head
// of the group and every query block of 64 at or after its keys, last first. Per step, in the transposed view
// of each warpgroup (keys as rows):
//   S^T = K Q^T;  P^T = exp2(S^T scale_log2 - lse log2 e) (causal mask on the diagonal);  dP^T = V dO^T;
//   dS^T = P^T (dP^T - delta);  dV += P^T dO;  dK += dS^T Q;  dQ_c = dS_c K_c
// P^T feeds dV from registers; dS^T goes through shared memory, the A of dK (K-major) and of dQ (MN-major):
// registers stay for the three accumulators. The two warpgroups' dQ partials meet in shared memory and are
// added, warpgroup 0's then warpgroup 1's, into the fp32 accumulator of the query block.
// Determinism: the additions into a query block are ordered by key block, a flag per (batch, head, query block)
// holding the next key block to add; key block 0 stores instead of adding, so the accumulator needs no
// clearing. With documents the first key block to add into query block m is n0 = doc_start[first row of m] / 128
// (no earlier one sees its rows): the flag counts from there, key block n waits for n - n0 and n0 stores. A CTA
// walks only the query blocks whose first row's document starts at or before its last key, so every key block
// from n0 to n walks m too, and the one waited for is still the key block before.
// A CTA waits only for the CTA of the key block before it in its (kv head, batch). Which (key block,
// kv head, batch) a CTA does is the ticket it takes when it starts (an atomic counter), in grid order, not its
// blockIdx: CUDA does not promise to dispatch blocks in blockIdx order, and a CTA waiting on one not yet
// resident could wait forever. With tickets, the CTA waited for took a lower ticket, so it is already running.
// Walking the query blocks last first (and the heads of the group inside each), a CTA reaches each (query block,
// head) at the same step as the CTA before it, so it trails that one by about one addition, not by a block's
// whole work, whatever the group size. A separate pass finishes dQ (scaled, rounded, RoPE's backward).
template <int kHd>
struct Sm90Bwd {
  static constexpr int kBlockN = 128;  // keys per CTA: 64 per consumer warpgroup
  static constexpr int kBlockM = static_cast<int>(gpu_scratch::AttentionBwdScratch::kHopperBlockM);  // queries a step
  static constexpr int kStages = 2;
  static constexpr int kPanels = kHd / kPanelCols;
  static constexpr uint32_t kKvPanelBytes = kBlockN * 128, kKvTileBytes = kPanels * kKvPanelBytes;
  static constexpr uint32_t kQPanelBytes = kBlockM * 128, kQTileBytes = kPanels * kQPanelBytes;
  static constexpr uint32_t kDsBytes = 64 * 128;  // per warpgroup: [64 keys][64 queries] bf16, 128B-swizzled
  // Each warpgroup's dQ partial, fp32 [64 queries][kHd], rows padded by 8 floats so that the fragments' 8-byte
  // stores fall in distinct banks: a half-warp's 4 rows x 4 column pairs then start 8 words apart (4 would
  // overlap neighbouring rows' pairs: 2-way conflicts).
  static constexpr int kDqStride = kHd + 8;
  static constexpr uint32_t kDqTileBytes = kBlockM * kDqStride * 4;
  // Shared layout from a 1024-byte aligned base.
  static constexpr uint32_t kK = 0, kV = kKvTileBytes, kQ = 2 * kKvTileBytes;
  static constexpr uint32_t kDout = kQ + kStages * kQTileBytes, kDs = kDout + kStages * kQTileBytes;
  static constexpr uint32_t kDqTiles = kDs + 2 * kDsBytes;
  // lse [kStages][64], delta [kStages][64], then the queries' document starts [kStages][64] (int, with documents)
  static constexpr uint32_t kStats = kDqTiles + 2 * kDqTileBytes;
  static constexpr uint32_t kKvFull = kStats + 3 * kStages * kBlockM * 4;
  static constexpr uint32_t kQFull = kKvFull + 8, kQEmpty = kQFull + 8 * kStages;
  static constexpr uint32_t kEnd = kQEmpty + 8 * kStages;
  static constexpr int kSmemBytes = kEnd + 1024;
  static constexpr int kSRegs = kBlockM / 2, kDRegs = kHd / 2;
};

// Grid (key blocks, kv heads, batch) of 384 threads. kDocs: p.doc_start is set (see the documents note above).
template <int kHd, bool kDocs>
__global__ void __launch_bounds__(kSm90Threads, 1) sm90_bwd_kernel(const __grid_constant__ Sm90Params args) {
#if TUNA_SM90A_DEVICE
  using C = Sm90Bwd<kHd>;
  constexpr float kLog2e = 1.4426950408889634f;
  const AttentionParams& p = args.p;
  extern __shared__ __align__(128) unsigned char smem_bytes[];  // aligned to 1024 below
  const uint32_t base = (smem_address(smem_bytes) + 1023) & ~1023u;
  unsigned char* const smem = smem_bytes + (base - smem_address(smem_bytes));  // the same bytes, generic
  float* const lse_stage = reinterpret_cast<float*>(smem + C::kStats);
  float* const delta_stage = lse_stage + C::kStages * C::kBlockM;
  int* const doc_stage = reinterpret_cast<int*>(delta_stage + C::kStages * C::kBlockM);
  const int m_blocks = (p.seq_len + C::kBlockM - 1) / C::kBlockM;
  __shared__ int ticket;  // this CTA's work, in grid order: key block fastest, then kv head, then batch
  __shared__ int m_end;   // with documents: the query blocks from m_end on see none of this CTA's keys
  if (threadIdx.x == 0) {
    const int drawn = atomicAdd(args.bwd_tickets, 1);
    ticket = drawn;
    if constexpr (kDocs) {
      // Query block m sees these keys iff its first row's document starts at or before the last of them (doc_start
      // never decreases, so later rows' documents start no earlier): the first block that does not, by binary
      // search; the block holding key0 always does.
      const int blocks_n = static_cast<int>(gridDim.x), block = drawn % blocks_n;
      const int batch_index = drawn / (blocks_n * static_cast<int>(gridDim.y));
      const int32_t* doc = p.doc_start + static_cast<int64_t>(batch_index) * p.seq_len;
      const int last_key = min((block + 1) * C::kBlockN, p.seq_len) - 1;
      int lo = block * C::kBlockN / C::kBlockM + 1, hi = m_blocks;
      while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (doc[mid * C::kBlockM] > last_key) hi = mid;
        else lo = mid + 1;
      }
      m_end = lo;
    }
  }
  __syncthreads();
  const int n_block = ticket % gridDim.x, kvh = ticket / gridDim.x % gridDim.y, b = ticket / (gridDim.x * gridDim.y);
  const int group_size = p.n_heads / p.n_kv_heads;
  const int key0 = n_block * C::kBlockN;
  const int first_m = key0 / C::kBlockM;  // earlier query blocks see none of these keys
  int last_m = m_blocks;                  // one past the last query block that sees some of them
  if constexpr (kDocs) last_m = m_end;
  // Step i: query block last_m - 1 - i / group_size, query head i % group_size of the group. Query blocks
  // outer, heads inner: the step of (query block, head) is then the same in every CTA that reaches it, so a CTA
  // and the one it waits for (the key block before, which has more steps only at its end) stay in step.
  const auto step_head = [&](int step) { return kvh * group_size + step % group_size; };
  const auto step_m = [&](int step) { return last_m - 1 - step / group_size; };
  const int n_steps = group_size * (last_m - first_m);

  if (threadIdx.x == 0) {
    mbarrier_init(base + C::kKvFull, 1);
    for (int s = 0; s < C::kStages; ++s) {
      // The TMA thread's arrive.expect_tx + warp 1's 32 lanes (+ warp 2's with documents).
      mbarrier_init(base + C::kQFull + 8 * s, kDocs ? 1 + 64 : 1 + 32);
      mbarrier_init(base + C::kQEmpty + 8 * s, kConsumerThreads);
    }
    fence_mbarrier_init();
  }
  __syncthreads();

  const int warpgroup = threadIdx.x / kWarpGroupThreads, lane = threadIdx.x % 32;
  if (warpgroup == 0) {
    setmaxnreg_dec<kProducerRegisters>();
    const int warp = threadIdx.x / 32;
    if (warp == 0) {
      // ---- TMA: K and V once, then Q and dO per step.
      if (!elect_one()) return;
      tma_prefetch_descriptor(&args.q_map);
      tma_prefetch_descriptor(&args.dout_map);
      mbarrier_arrive_expect_tx(base + C::kKvFull, 2 * C::kKvTileBytes);
      for (int panel = 0; panel < C::kPanels; ++panel) {
        tma_load_4d(base + C::kK + panel * C::kKvPanelBytes, &args.k_map, base + C::kKvFull, panel * kPanelCols, kvh,
                    key0, b);
        tma_load_4d(base + C::kV + panel * C::kKvPanelBytes, &args.v_map, base + C::kKvFull, panel * kPanelCols, kvh,
                    key0, b);
      }
      PipelineState<C::kStages> q;
      for (int step = 0; step < n_steps; ++step, q.advance()) {
        const int h = step_head(step), q0 = step_m(step) * C::kBlockM;
        mbarrier_wait(base + C::kQEmpty + 8 * q.stage, q.phase ^ 1);
        mbarrier_arrive_expect_tx(base + C::kQFull + 8 * q.stage, 2 * C::kQTileBytes);
        for (int panel = 0; panel < C::kPanels; ++panel) {
          const uint32_t offset = q.stage * C::kQTileBytes + panel * C::kQPanelBytes;
          tma_load_4d(base + C::kQ + offset, &args.q_map, base + C::kQFull + 8 * q.stage, panel * kPanelCols, h, q0, b);
          tma_load_4d(base + C::kDout + offset, &args.dout_map, base + C::kQFull + 8 * q.stage, panel * kPanelCols, h,
                      q0, b);
        }
      }
    } else if (warp == 1) {
      // ---- lse and delta of each step's 64 queries: rows of 256 bytes at any offset, which TMA's 16-byte
      // granularity does not fit; plain loads, published by the arrivals' release.
      PipelineState<C::kStages> q;
      for (int step = 0; step < n_steps; ++step, q.advance()) {
        const int h = step_head(step), q0 = step_m(step) * C::kBlockM;
        const int64_t stats = (static_cast<int64_t>(b) * p.n_heads + h) * p.seq_len;
        mbarrier_wait(base + C::kQEmpty + 8 * q.stage, q.phase ^ 1);
        for (int i = lane; i < C::kBlockM; i += 32) {
          const bool valid = q0 + i < p.seq_len;  // a query past the sequence: lse = delta = 0 (its Q, dO are 0)
          lse_stage[q.stage * C::kBlockM + i] = valid ? p.lse[stats + q0 + i] * kLog2e : 0.0f;
          delta_stage[q.stage * C::kBlockM + i] = valid ? p.delta[stats + q0 + i] : 0.0f;
        }
        mbarrier_arrive(base + C::kQFull + 8 * q.stage);
      }
    } else if (kDocs && warp == 2) {
      // ---- with documents, the document starts of each step's 64 queries, likewise; a warp of its own, as warp
      // 1's loop has no room for them in the producers' 24 registers. Past the sequence, the last row's document
      // (those queries' terms are 0 whatever their mask).
      const int32_t* const doc = p.doc_start + static_cast<int64_t>(b) * p.seq_len;
      PipelineState<C::kStages> q;
      for (int step = 0; step < n_steps; ++step, q.advance()) {
        const int q0 = step_m(step) * C::kBlockM;
        mbarrier_wait(base + C::kQEmpty + 8 * q.stage, q.phase ^ 1);
        for (int i = lane; i < C::kBlockM; i += 32)
          doc_stage[q.stage * C::kBlockM + i] = doc[min(q0 + i, p.seq_len - 1)];
        mbarrier_arrive(base + C::kQFull + 8 * q.stage);
      }
    }
    return;
  }

  // ---- consumers. Registers: while the dV, dK and dQ products run, a thread holds their accumulators (3 x
  // kHd / 2 floats) and P^T's A fragments (16), 208 of its 240 at hd128; with the addresses and indices that
  // leaves almost nothing: at hd128 any more state live across the step (a second dQ buffer, operands kept in
  // registers) spills, which the build's -warn-spills (-Werror) turns into a compile error. hd64's accumulators
  // take 96 fewer.
  setmaxnreg_inc<kConsumerRegisters>();
  const int cw = warpgroup - 1, tid = threadIdx.x % kWarpGroupThreads, warp = tid / 32, g = lane / 4, t = lane % 4;
  const int key_lo = key0 + cw * 64 + warp * 16 + g;  // this thread's keys: key_lo, key_lo + 8
  const uint32_t k_rows = base + C::kK + cw * 64 * 128, v_rows = base + C::kV + cw * 64 * 128;
  const uint32_t ds_tile = base + C::kDs + cw * C::kDsBytes;
  const int seq_pad = m_blocks * C::kBlockM;

  float dk[C::kDRegs], dv[C::kDRegs];
#pragma unroll
  for (int r = 0; r < C::kDRegs; ++r) dk[r] = 0.0f, dv[r] = 0.0f;
  mbarrier_wait(base + C::kKvFull, 0);

  PipelineState<C::kStages> q;
  for (int step = 0; step < n_steps; ++step, q.advance()) {
    const int h = step_head(step), m_block = step_m(step), q0 = m_block * C::kBlockM;
    const uint32_t q_tile = base + C::kQ + q.stage * C::kQTileBytes;
    const uint32_t do_tile = base + C::kDout + q.stage * C::kQTileBytes;
    mbarrier_wait(base + C::kQFull + 8 * q.stage, q.phase);

    float st[C::kSRegs], dpt[C::kSRegs];
    fence_operand(dv);
    fence_operand(dk);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kHd / 16; ++kk) {
      const uint32_t kv_offset = (kk / 4) * C::kKvPanelBytes + (kk % 4) * 32;
      const uint32_t q_offset = (kk / 4) * C::kQPanelBytes + (kk % 4) * 32;
      wgmma_ss<C::kBlockM, 0, 0>(st, sw128_descriptor(k_rows + kv_offset, 16, 1024),
                                 sw128_descriptor(q_tile + q_offset, 16, 1024), kk > 0);
    }
#pragma unroll
    for (int kk = 0; kk < kHd / 16; ++kk) {
      const uint32_t kv_offset = (kk / 4) * C::kKvPanelBytes + (kk % 4) * 32;
      const uint32_t q_offset = (kk / 4) * C::kQPanelBytes + (kk % 4) * 32;
      wgmma_ss<C::kBlockM, 0, 0>(dpt, sw128_descriptor(v_rows + kv_offset, 16, 1024),
                                 sw128_descriptor(do_tile + q_offset, 16, 1024), kk > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_operand(st);
    fence_operand(dpt);

    // P^T and dS^T. Only a block reaching past the diagonal (some key after some query) is masked, and with
    // documents one whose first key is before the last query's document start.
    const float* lse2 = lse_stage + q.stage * C::kBlockM;
    const float* delta = delta_stage + q.stage * C::kBlockM;
    const int* first_key = doc_stage + q.stage * C::kBlockM;  // read only with documents
    // The key blocks added into this query block's dQ before this one: with documents they start at the block
    // holding its first row's document start (read before the stage is released below).
    int dq_turn = n_block;
    if constexpr (kDocs) dq_turn = n_block - first_key[0] / C::kBlockN;
    // One FFMA and one MUFU.EX2 a score; the mask's compares only in the instances for such blocks (0: none,
    // 1: causal, 2: causal and documents).
    const auto probabilities = [&](auto mask) {
      constexpr int kMask = decltype(mask)::value;
#pragma unroll
      for (int r = 0; r < C::kSRegs; ++r) {
        const int qi = 8 * (r / 4) + 2 * t + r % 2, key = key_lo + 8 * ((r / 2) % 2);
        float pr = ex2_approx_ftz(fmaf(st[r], p.scale_log2, -lse2[qi]));
        if constexpr (kMask == 1) {
          if (key > q0 + qi) pr = 0.0f;
        } else if constexpr (kMask == 2) {
          if (key > q0 + qi || key < first_key[qi]) pr = 0.0f;
        }
        st[r] = pr;
        dpt[r] = pr * (dpt[r] - delta[qi]);
      }
    };
    const bool causal = key0 + cw * 64 + 63 > q0;
    if constexpr (kDocs) {
      if (key0 + cw * 64 < first_key[C::kBlockM - 1]) probabilities(std::integral_constant<int, 2>{});
      else if (causal) probabilities(std::integral_constant<int, 1>{});
      else probabilities(std::integral_constant<int, 0>{});
    } else {
      if (causal) probabilities(std::integral_constant<int, 1>{});
      else probabilities(std::integral_constant<int, 0>{});
    }
    uint32_t pt_a[C::kBlockM / 16][4];
    to_a_fragments(pt_a, st);
    // dS^T into this warpgroup's [64 keys][64 queries] tile, swizzled as the 128B mode reads it: the A of dK
    // (K-major) and of dQ (MN-major, transposed), from shared memory to keep registers for the accumulators.
#pragma unroll
    for (int r = 0; r < C::kSRegs; r += 2) {
      const uint32_t offset = (warp * 16 + g + 8 * ((r / 2) % 2)) * 128 + (8 * (r / 4) + 2 * t) * 2;
      const uint32_t swizzled = offset ^ (((offset >> 7) & 7) << 4);
      *reinterpret_cast<uint32_t*>(smem + C::kDs + cw * C::kDsBytes + swizzled) = pack_bf16_pair(dpt[r], dpt[r + 1]);
    }
    fence_proxy_async_shared();  // the generic stores before the tensor cores' reads
    named_barrier_sync(kBarDsWritten + cw, kWarpGroupThreads);

    float dq[C::kDRegs];
    fence_operand(dv);
    fence_operand(dk);
#pragma unroll
    for (int kk = 0; kk < C::kBlockM / 16; ++kk) fence_operand(pt_a[kk]);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < C::kBlockM / 16; ++kk)
      wgmma_rs<kHd, 1>(dv, pt_a[kk], sw128_descriptor(do_tile + kk * 2048, C::kQPanelBytes, 1024), true);
#pragma unroll
    for (int kk = 0; kk < C::kBlockM / 16; ++kk)
      wgmma_ss<kHd, 0, 1>(dk, sw128_descriptor(ds_tile + kk * 32, 16, 1024),
                          sw128_descriptor(q_tile + kk * 2048, C::kQPanelBytes, 1024), true);
#pragma unroll
    for (int kk = 0; kk < 64 / 16; ++kk)
      wgmma_ss<kHd, 1, 1>(dq, sw128_descriptor(ds_tile + kk * 2048, C::kDsBytes, 1024),
                          sw128_descriptor(k_rows + kk * 2048, C::kKvPanelBytes, 1024), kk > 0);
    wgmma_commit();
    wgmma_wait<0>();
    fence_operand(dv);
    fence_operand(dk);
    fence_operand(dq);
#pragma unroll
    for (int kk = 0; kk < C::kBlockM / 16; ++kk) fence_operand(pt_a[kk]);
    mbarrier_arrive(base + C::kQEmpty + 8 * q.stage);

    // dQ: both warpgroups' partials into shared tiles, then, once the flag says it is this key block's turn,
    // all 256 consumers add (warpgroup 0's + warpgroup 1's, in that order) into the query block's accumulator
    // in coalesced 16-byte pieces: a fixed order of additions for every element.
    float* const dq_tile = reinterpret_cast<float*>(smem + C::kDqTiles + cw * C::kDqTileBytes);
#pragma unroll
    for (int r = 0; r < C::kDRegs; r += 2) {
      const int row = warp * 16 + g + 8 * ((r / 2) % 2), col = 8 * (r / 4) + 2 * t;
      *reinterpret_cast<float2*>(dq_tile + row * C::kDqStride + col) = make_float2(dq[r], dq[r + 1]);
    }
    int* const flag = args.dq_flags + (static_cast<int64_t>(b) * p.n_heads + h) * m_blocks + m_block;
    if (threadIdx.x == kWarpGroupThreads) flag_wait(flag, dq_turn);
    named_barrier_sync(kBarConsumers, kConsumerThreads);
    const float* const tile0 = reinterpret_cast<const float*>(smem + C::kDqTiles);
    const float* const tile1 = reinterpret_cast<const float*>(smem + C::kDqTiles + C::kDqTileBytes);
    float4* const accum =
        reinterpret_cast<float4*>(args.dq_accum + ((static_cast<int64_t>(b) * p.n_heads + h) * seq_pad + q0) * kHd);
    // Every old value loaded before any store: the stores could alias the loads as far as the compiler knows, so
    // a load-add-store loop would wait one L2 round trip per piece.
    constexpr int kPieces = C::kBlockM * kHd / 4 / kConsumerThreads;
    const int first = threadIdx.x - kWarpGroupThreads;
    float4 old[kPieces];
#pragma unroll
    for (int k = 0; k < kPieces; ++k)
      old[k] = dq_turn != 0 ? accum[first + k * kConsumerThreads] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int k = 0; k < kPieces; ++k) {
      const int i = first + k * kConsumerThreads, row = i / (kHd / 4), col = (i % (kHd / 4)) * 4;
      const float4 a = *reinterpret_cast<const float4*>(tile0 + row * C::kDqStride + col);
      const float4 c = *reinterpret_cast<const float4*>(tile1 + row * C::kDqStride + col);
      float4 sum = make_float4(a.x + c.x, a.y + c.y, a.z + c.z, a.w + c.w);
      if (dq_turn != 0) sum = make_float4(old[k].x + sum.x, old[k].y + sum.y, old[k].z + sum.z, old[k].w + sum.w);
      accum[i] = sum;
    }
    // All added (and the tiles free again); then one thread's release store publishes every consumer's additions
    // (the barrier orders them before it; the release is the one gpu-scope fence of the step).
    named_barrier_sync(kBarConsumers, kConsumerThreads);
    if (threadIdx.x == kWarpGroupThreads) flag_release(flag, dq_turn + 1);
  }

  // dK (times 1 / sqrt(d), then RoPE's backward if asked) and dV of this warpgroup's keys. Columns c and
  // c + kHd / 2, the pairs RoPE rotates, sit in registers r and r + kHd / 4 of the same thread.
#pragma unroll
  for (int r = 0; r < C::kDRegs; ++r) dk[r] *= p.scale;
  if (args.rope_cos != nullptr) {
    // The rotation's position of this thread's two keys (past the sequence: the last key's; never stored).
    int position[2] = {min(key_lo, p.seq_len - 1), min(key_lo + 8, p.seq_len - 1)};
    if (args.rope_positions != nullptr)
      for (int& x : position) x = args.rope_positions[static_cast<int64_t>(b) * p.seq_len + x];
#pragma unroll
    for (int r = 0; r < C::kDRegs / 2; ++r) {
      const int key = position[(r / 2) % 2], col = 8 * (r / 4) + 2 * t + r % 2;
      const float c = args.rope_cos[static_cast<int64_t>(key) * (kHd / 2) + col];
      const float sn = args.rope_sin[static_cast<int64_t>(key) * (kHd / 2) + col];
      const float first = dk[r], second = dk[r + C::kDRegs / 2];
      dk[r] = first * c + second * sn;
      dk[r + C::kDRegs / 2] = second * c - first * sn;
    }
  }
  const int64_t kv_stride = static_cast<int64_t>(p.n_kv_heads) * kHd;
  const int64_t kv_base = static_cast<int64_t>(b) * p.seq_len * kv_stride + kvh * kHd;
#pragma unroll
  for (int r = 0; r < C::kDRegs; r += 2) {
    const int key = key_lo + 8 * ((r / 2) % 2), col = 8 * (r / 4) + 2 * t;
    if (key >= p.seq_len) continue;
    const int64_t at = kv_base + key * kv_stride + col;
    *reinterpret_cast<__nv_bfloat162*>(p.dk + at) = __floats2bfloat162_rn(dk[r], dk[r + 1]);
    *reinterpret_cast<__nv_bfloat162*>(p.dv + at) = __floats2bfloat162_rn(dv[r], dv[r + 1]);
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // as the forward's
#endif  // TUNA_SM90A_DEVICE
}

// Eight floats from a 16-byte aligned address, as two 16-byte loads.
__device__ __forceinline__ void load_floats8(float (&out)[8], const float* src) {
  const float4 lo = reinterpret_cast<const float4*>(src)[0], hi = reinterpret_cast<const float4*>(src)[1];
  out[0] = lo.x, out[1] = lo.y, out[2] = lo.z, out[3] = lo.w;
  out[4] = hi.x, out[5] = hi.y, out[6] = hi.z, out[7] = hi.w;
}

// dQ = (the fp32 accumulator) / sqrt(d), then RoPE's backward if asked, as bf16: [batch, n_heads, seq_pad,
// kHd] -> [batch, seq, n_heads, kHd]. One thread per 8 columns of the first half and the 8 they pair with.
template <int kHd>
__global__ void __launch_bounds__(256) sm90_dq_finish_kernel(const __grid_constant__ Sm90Params args) {
  constexpr int kHalf = kHd / 2;
  const AttentionParams& p = args.p;
  const int64_t chunks = static_cast<int64_t>(p.batch) * p.seq_len * p.n_heads * (kHalf / 8);
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= chunks) return;
  const int d = static_cast<int>(i % (kHalf / 8)) * 8;
  const int64_t row = i / (kHalf / 8);  // (b, t, h)
  const int h = static_cast<int>(row % p.n_heads), t = static_cast<int>((row / p.n_heads) % p.seq_len);
  const int b = static_cast<int>(row / (static_cast<int64_t>(p.n_heads) * p.seq_len));
  constexpr int kBlockM = Sm90Bwd<kHd>::kBlockM;
  const int64_t seq_pad = (p.seq_len + kBlockM - 1) / kBlockM * kBlockM;
  // 16-byte loads: the accumulator is 16-byte aligned (the backward's float4 stores rely on it too), and so are
  // the RoPE tables (attention_bwd checks).
  const float* src = args.dq_accum + ((static_cast<int64_t>(b) * p.n_heads + h) * seq_pad + t) * kHd + d;
  float x[8], y[8];
  load_floats8(x, src);
  load_floats8(y, src + kHalf);
#pragma unroll
  for (int j = 0; j < 8; ++j) x[j] *= p.scale, y[j] *= p.scale;
  if (args.rope_cos != nullptr) {
    const int64_t position =
        args.rope_positions != nullptr ? args.rope_positions[static_cast<int64_t>(b) * p.seq_len + t] : t;
    float c[8], sn[8];
    load_floats8(c, args.rope_cos + position * kHalf + d);
    load_floats8(sn, args.rope_sin + position * kHalf + d);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float rx = x[j] * c[j] + y[j] * sn[j], ry = y[j] * c[j] - x[j] * sn[j];
      x[j] = rx, y[j] = ry;
    }
  }
  Bf16x8 first, second;
#pragma unroll
  for (int j = 0; j < 8; ++j) first.v[j] = __float2bfloat16_rn(x[j]), second.v[j] = __float2bfloat16_rn(y[j]);
  store8(p.dq + row * kHd + d, first);
  store8(p.dq + row * kHd + kHalf + d, second);
}

}  // namespace tuna::cuda::attention
