// Token embedding on the GPU, the twin of kernels/cpu/embedding.cpp.
//
//   forward:  out[i, :] = table[tokens[i], :]                          out: [n, dim] bf16, OVERWRITTEN
//   backward: dtable[t, :] += sum_{i: tokens[i] = t} dout[i, :]         dtable: [vocab, dim] fp32, ACCUMULATED
//   vocab-parallel: a rank's table holds rows [vocab_begin, vocab_begin + vocab_count); other tokens give zero rows
//   (summed over the ranks, every token's row once) and, through embedding_groups_slice, no gradient.
//
// The backward is deterministic without atomics: the host groups positions by token (embedding_groups, a
// stable counting sort), and one block owns each distinct token's row and sums its positions in increasing
// order, so a repeated token is one serial fp32 sum, never a race.
//
// Memory-bound. A thread loads kUnroll 16-byte vectors before storing or adding any (the backward still adds
// them in position order, and reads its dtable row before them), so a frequent token's chain of dependent
// loads (a comma: ~4% of 16k positions) is ~40 memory round trips, not ~650.
#include "kernels/embedding.cuh"

#include <algorithm>
#include <cmath>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common.cuh"

namespace tuna::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kFwdUnroll = 4;   // vectors a forward thread loads before storing any
constexpr int kBwdUnroll = 16;  // positions whose rows a backward thread loads before adding any

// One block per token row; thread t copies the vectors t, t + kThreads, ... of the row, kFwdUnroll at a time. The
// table holds rows [vocab_begin, vocab_begin + vocab_count) (the whole vocabulary without tensor parallelism).
__global__ void __launch_bounds__(kThreads)
    embedding_fwd_kernel(bf16* out, const int32_t* tokens, const bf16* table, int64_t vocab, int64_t vocab_begin,
                         int64_t vocab_count, int64_t dim) {
  const int64_t i = blockIdx.x;
  const int64_t token = tokens[i];
  const int64_t row = token - vocab_begin;
  bf16* row_out = out + i * dim;
  const bool valid = token >= 0 && token < vocab, mine = row >= 0 && row < vocab_count;
  const int64_t n_vec = dim / 8;
  for (int64_t v0 = threadIdx.x; v0 < n_vec; v0 += kThreads * kFwdUnroll) {
    Packed8 x[kFwdUnroll];
#pragma unroll
    for (int k = 0; k < kFwdUnroll; ++k) {
      const int64_t v = v0 + k * kThreads;
      x[k] = valid && mine && v < n_vec ? load_packed(table + row * dim + v * 8) : zeros_packed();  // another slice's: 0
    }
#pragma unroll
    for (int k = 0; k < kFwdUnroll; ++k) {
      const int64_t v = v0 + k * kThreads;
      if (v >= n_vec) break;
      if (valid) {
        store_packed(row_out + v * 8, x[k]);
      } else {
        Bf16x8 poison;
#pragma unroll
        for (int j = 0; j < 8; ++j) poison.v[j] = __float2bfloat16(NAN);
        store8(row_out + v * 8, poison);
      }
    }
  }
}

// blockIdx.x: distinct token u; blockIdx.y: a slice of kThreads * 8 columns.
__global__ void __launch_bounds__(kThreads)
    embedding_bwd_kernel(float* dtable, const bf16* dout, const int32_t* positions, const int32_t* unique_tokens,
                         const int32_t* offsets, int64_t dim) {
  const int u = blockIdx.x;
  const int64_t c = (static_cast<int64_t>(blockIdx.y) * kThreads + threadIdx.x) * 8;
  if (c >= dim) return;
  float4* row4 = reinterpret_cast<float4*>(dtable + static_cast<int64_t>(unique_tokens[u]) * dim + c);
  float4 lo = row4[0], hi = row4[1];
  const int begin = offsets[u], end = offsets[u + 1];
  float acc[8] = {};
  for (int p0 = begin; p0 < end; p0 += kBwdUnroll) {
    Packed8 g[kBwdUnroll];
#pragma unroll
    for (int k = 0; k < kBwdUnroll; ++k)
      g[k] = p0 + k < end ? load_packed(dout + static_cast<int64_t>(positions[p0 + k]) * dim + c) : zeros_packed();
#pragma unroll
    for (int k = 0; k < kBwdUnroll; ++k) {
      if (p0 + k >= end) break;
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] += unpack(g[k], j);  // position order: the contract's sum
    }
  }
  lo.x += acc[0], lo.y += acc[1], lo.z += acc[2], lo.w += acc[3];
  hi.x += acc[4], hi.y += acc[5], hi.z += acc[6], hi.w += acc[7];
  row4[0] = lo;
  row4[1] = hi;
}

}  // namespace

void embedding_fwd_slice(bf16* out, const int32_t* tokens, const bf16* table, int64_t n_tokens, int64_t vocab,
                         int64_t vocab_begin, int64_t vocab_count, int64_t dim, cudaStream_t stream) {
  TUNA_CHECK(n_tokens >= 0 && vocab > 0 && dim > 0 && dim % 8 == 0, "n_tokens ", n_tokens, ", vocab ", vocab,
             ", dim ", dim, " (dim must be a multiple of 8)");
  TUNA_CHECK(vocab_begin >= 0 && vocab_count > 0 && vocab_begin + vocab_count <= vocab, "slice [", vocab_begin, ", +",
             vocab_count, ") of a vocabulary of ", vocab);
  if (n_tokens == 0) return;
  TUNA_CHECK(n_tokens < (int64_t(1) << 31), "n_tokens ", n_tokens);
  launch_kernel(embedding_fwd_kernel, static_cast<unsigned>(n_tokens), kThreads, 0, stream, out, tokens, table, vocab,
                vocab_begin, vocab_count, dim);
  TUNA_CUDA_CHECK_LAUNCH();
}

void embedding_fwd(bf16* out, const int32_t* tokens, const bf16* table, int64_t n_tokens, int64_t vocab,
                   int64_t dim, cudaStream_t stream) {
  embedding_fwd_slice(out, tokens, table, n_tokens, vocab, 0, vocab, dim, stream);
}

void embedding_groups_slice(EmbeddingGroups& groups, const int32_t* host_tokens, int64_t n_tokens, int64_t vocab,
                            int64_t vocab_begin, int64_t vocab_count) {
  embedding_groups(groups, host_tokens, n_tokens, vocab);
  // The groups are sorted by token: keep the run of tokens inside the slice, renumbered from its first row.
  EmbeddingGroups slice;
  for (size_t u = 0; u < groups.unique_tokens.size(); ++u) {
    const int64_t row = groups.unique_tokens[u] - vocab_begin;
    if (row < 0 || row >= vocab_count) continue;
    slice.unique_tokens.push_back(static_cast<int32_t>(row));
    slice.offsets.push_back(static_cast<int32_t>(slice.positions.size()));
    for (int32_t p = groups.offsets[u]; p < groups.offsets[u + 1]; ++p) slice.positions.push_back(groups.positions[p]);
  }
  slice.offsets.push_back(static_cast<int32_t>(slice.positions.size()));
  groups = std::move(slice);
}

void embedding_groups(EmbeddingGroups& groups, const int32_t* host_tokens, int64_t n_tokens, int64_t vocab) {
  TUNA_CHECK(n_tokens >= 0 && n_tokens < (int64_t(1) << 31), "n_tokens ", n_tokens);
  for (int64_t i = 0; i < n_tokens; ++i)
    if (host_tokens[i] < 0 || host_tokens[i] >= vocab)
      fail("embedding: token at position ", i, " is ", host_tokens[i], ", outside the vocabulary [0, ", vocab, ")");
  // Stable sort of positions by token: equal tokens keep increasing positions, which fixes the sum order.
  groups.positions.resize(n_tokens);
  for (int64_t i = 0; i < n_tokens; ++i) groups.positions[i] = static_cast<int32_t>(i);
  std::stable_sort(groups.positions.begin(), groups.positions.end(),
                   [&](int32_t a, int32_t b) { return host_tokens[a] < host_tokens[b]; });
  groups.unique_tokens.clear();
  groups.offsets.clear();
  for (int64_t i = 0; i < n_tokens; ++i) {
    const int32_t token = host_tokens[groups.positions[i]];
    if (groups.unique_tokens.empty() || groups.unique_tokens.back() != token) {
      groups.unique_tokens.push_back(token);
      groups.offsets.push_back(static_cast<int32_t>(i));
    }
  }
  groups.offsets.push_back(static_cast<int32_t>(n_tokens));
}

void embedding_bwd(float* dtable, const bf16* dout, const int32_t* positions, const int32_t* unique_tokens,
                   const int32_t* offsets, int64_t n_unique, int64_t dim, cudaStream_t stream) {
  TUNA_CHECK(n_unique >= 0 && dim > 0 && dim % 8 == 0, "n_unique ", n_unique, ", dim ", dim,
             " (dim must be a multiple of 8)");
  if (n_unique == 0) return;
  const dim3 grid(static_cast<unsigned>(n_unique), static_cast<unsigned>(ceil_div(dim, kThreads * 8)));
  launch_kernel(embedding_bwd_kernel, grid, kThreads, 0, stream, dtable, dout, positions, unique_tokens, offsets, dim);
  TUNA_CUDA_CHECK_LAUNCH();
}

}  // namespace tuna::cuda
