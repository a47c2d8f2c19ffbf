// Token embedding lookup. CPU twin of kernels/embedding.cuh (same contract).
#pragma once
#include <cstdint>

namespace tuna::cpu {

// out[i, :] = table[tokens[i], :] for i < n_tokens. Overwrites out.
// A token outside [0, vocab) is a tuna::Error naming the position and the value.
template <typename T>
void embedding_fwd(T* out, const int32_t* tokens, const T* table, int64_t n_tokens, int64_t vocab,
                   int64_t dim);

// dtable[tokens[i], :] += dout[i, :]. Accumulates. Deterministic: each table row sums its tokens'
// gradients in token order, whatever the thread count.
template <typename T>
void embedding_bwd(T* dtable, const T* dout, const int32_t* tokens, int64_t n_tokens, int64_t vocab,
                   int64_t dim);

// Vocab-parallel (tensor-parallel ranks each hold rows [vocab_begin, vocab_begin + vocab_count) of the table):
// out[i, :] = table[tokens[i] - vocab_begin, :] for a token in the slice, zeros for any other token of [0, vocab),
// so that a sum over the ranks gives every token's row. Overwrites out. A token outside [0, vocab) is an error.
template <typename T>
void embedding_fwd_slice(T* out, const int32_t* tokens, const T* table, int64_t n_tokens, int64_t vocab,
                         int64_t vocab_begin, int64_t vocab_count, int64_t dim);
// dtable[tokens[i] - vocab_begin, :] += dout[i, :] for the tokens in the slice (the others belong to other
// ranks). Accumulates, in token order.
template <typename T>
void embedding_bwd_slice(T* dtable, const T* dout, const int32_t* tokens, int64_t n_tokens, int64_t vocab,
                         int64_t vocab_begin, int64_t vocab_count, int64_t dim);

}  // namespace tuna::cpu
