// Token embedding, CPU twin of kernels/embedding.cu.
//
//   forward:  out[i, :] = table[tokens[i], :]             out: [n_tokens, dim], OVERWRITTEN
//   backward: dtable[tokens[i], :] += dout[i, :]          dtable: [vocab, dim], ACCUMULATED
//
// The backward is a scatter-add: two positions holding the same token add into the same table row. To stay
// deterministic without atomics, threads split the table's COLUMNS, and each thread walks every token in
// order for its own columns, so every dtable element receives its additions in token order whatever the
// thread count.
#include "kernels/cpu/embedding.h"

#include <algorithm>

#include "core/error.h"
#include "kernels/cpu/parallel.h"

namespace tuna::cpu {
namespace {

// Tokens come from data files, so a bad one is a user-facing error; the first bad position is reported.
void check_tokens(const int32_t* tokens, int64_t n_tokens, int64_t vocab) {
  for (int64_t i = 0; i < n_tokens; ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab)
      fail("embedding: token at position ", i, " is ", tokens[i], ", outside the vocabulary [0, ", vocab,
           ")");
  }
}

// Columns per parallel work item of the backward: wide enough for contiguous, vectorizable row slices.
constexpr int64_t kColumnBlock = 64;

}  // namespace

template <typename T>
void embedding_fwd(T* out, const int32_t* tokens, const T* table, int64_t n_tokens, int64_t vocab,
                   int64_t dim) {
  TUNA_CHECK(n_tokens >= 0 && vocab > 0 && dim > 0, "n_tokens ", n_tokens, ", vocab ", vocab, ", dim ", dim);
  check_tokens(tokens, n_tokens, vocab);
#pragma omp parallel for schedule(static) if (n_tokens * dim >= kMinParallelWork)
  for (int64_t i = 0; i < n_tokens; ++i) {
    const T* row = table + static_cast<int64_t>(tokens[i]) * dim;
    std::copy(row, row + dim, out + i * dim);
  }
}

template <typename T>
void embedding_bwd(T* dtable, const T* dout, const int32_t* tokens, int64_t n_tokens, int64_t vocab,
                   int64_t dim) {
  TUNA_CHECK(n_tokens >= 0 && vocab > 0 && dim > 0, "n_tokens ", n_tokens, ", vocab ", vocab, ", dim ", dim);
  check_tokens(tokens, n_tokens, vocab);
  const int64_t n_blocks = (dim + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for schedule(static)
  for (int64_t block = 0; block < n_blocks; ++block) {
    const int64_t begin = block * kColumnBlock;
    const int64_t end = std::min(dim, begin + kColumnBlock);
    for (int64_t i = 0; i < n_tokens; ++i) {
      T* table_row = dtable + static_cast<int64_t>(tokens[i]) * dim;
      const T* grad_row = dout + i * dim;
      for (int64_t j = begin; j < end; ++j) table_row[j] += grad_row[j];
    }
  }
}

template void embedding_fwd<float>(float*, const int32_t*, const float*, int64_t, int64_t, int64_t);
template void embedding_fwd<double>(double*, const int32_t*, const double*, int64_t, int64_t, int64_t);
template void embedding_bwd<float>(float*, const float*, const int32_t*, int64_t, int64_t, int64_t);
template void embedding_bwd<double>(double*, const double*, const int32_t*, int64_t, int64_t, int64_t);

}  // namespace tuna::cpu
