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

}  // namespace tuna::cpu
