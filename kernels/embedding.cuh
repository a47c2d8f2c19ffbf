// Token embedding lookup on the GPU. Contract of kernels/cpu/embedding.h, bf16 table and activations,
// fp32 gradient table.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

namespace tuna::cuda {

// out[i, :] = table[tokens[i], :], i < n_tokens (tokens on the device). Overwrites out. A token outside
// [0, vocab) cannot raise an error on the device: its row is filled with NaN, so the loss turns NaN loudly
// (callers validate tokens on the host first; model/llama_gpu does). dim % 8 == 0.
void embedding_fwd(__nv_bfloat16* out, const int32_t* tokens, const __nv_bfloat16* table, int64_t n_tokens,
                   int64_t vocab, int64_t dim, cudaStream_t stream);

// Vocab-parallel: table holds rows [vocab_begin, vocab_begin + vocab_count) of the vocab-row embedding.
// out[i, :] = table[tokens[i] - vocab_begin, :] for a token in the slice, ZEROS for any other token of [0, vocab)
// (summed over the tensor-parallel ranks, every token's row once), NaN outside [0, vocab). OVERWRITES out.
void embedding_fwd_slice(__nv_bfloat16* out, const int32_t* tokens, const __nv_bfloat16* table, int64_t n_tokens,
                         int64_t vocab, int64_t vocab_begin, int64_t vocab_count, int64_t dim, cudaStream_t stream);

// The token positions grouped by token id, built on the host from the host copy of the tokens: the plan
// that makes the backward deterministic without atomics. positions lists 0..n-1 sorted stably by token;
// unique_tokens[u] is the u-th distinct token; positions[offsets[u] .. offsets[u+1]) are its positions, in
// increasing order. A token outside [0, vocab) is a tuna::Error naming the position and the value.
struct EmbeddingGroups {
  std::vector<int32_t> positions, unique_tokens, offsets;
};
void embedding_groups(EmbeddingGroups& groups, const int32_t* host_tokens, int64_t n_tokens, int64_t vocab);
// The groups of the tokens inside [vocab_begin, vocab_begin + vocab_count) only, their ids relative to
// vocab_begin: embedding_bwd with them accumulates a vocab-parallel rank's slice of the table gradient.
void embedding_groups_slice(EmbeddingGroups& groups, const int32_t* host_tokens, int64_t n_tokens, int64_t vocab,
                            int64_t vocab_begin, int64_t vocab_count);

// dtable[unique_tokens[u], :] += sum over that token's positions p (in increasing order) of dout[p, :].
// ACCUMULATES (fp32). Deterministic: each row is owned by one thread block and summed in position order.
// positions / unique_tokens / offsets are device copies of an EmbeddingGroups. dim % 8 == 0.
void embedding_bwd(float* dtable, const __nv_bfloat16* dout, const int32_t* positions,
                   const int32_t* unique_tokens, const int32_t* offsets, int64_t n_unique, int64_t dim,
                   cudaStream_t stream);

}  // namespace tuna::cuda
