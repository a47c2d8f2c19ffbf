// Softmax cross-entropy over the vocabulary, forward and backward in one pass, in place.
// CPU twin of kernels/classifier.cuh.
#pragma once
#include <cstdint>
#include <type_traits>

namespace tuna::cpu {

// Rows whose target is this are not trained on (prompt tokens of SFT data, padding). Same value as
// PyTorch's CrossEntropyLoss default, so HF label tensors carry over unchanged.
constexpr int32_t kIgnoreIndex = -100;

// logits: [n, vocab], row i scored against targets[i].
// losses[i] = logsumexp(logits[i]) - logits[i, targets[i]] (0 for ignored rows); losses may be null.
// When dloss != 0, logits is overwritten by its gradient: (softmax(logits[i]) - onehot(targets[i])) * dloss,
// and all zeros for ignored rows; when dloss == 0 logits is left as it was.
// Returns the sum of losses over rows that are not ignored (accumulated in double).
// A target outside [0, vocab) that is not kIgnoreIndex is a tuna::Error naming the row and the value.
template <typename T>
double classifier_fwd_bwd(T* logits, std::type_identity_t<T>* losses, const int32_t* targets, int64_t n, int64_t vocab,
                          double dloss);

}  // namespace tuna::cpu
