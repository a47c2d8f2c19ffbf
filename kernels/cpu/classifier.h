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

// The backward of per-row weighted log-likelihoods, sum_i -weights[i] * log softmax(logits[i])[targets[i]] (a
// preference objective's per-token weights, model/objective.h): logits[i, j] = weights[i] * (softmax(logits[i])_j -
// [j == targets[i]]), OVERWRITTEN; all zeros for ignored rows and rows of weight 0. The weights are known only after
// a forward pass has given the log-probs (losses of classifier_fwd_bwd with dloss 0), so this is a second pass over
// logits computed again, where SFT's single fused pass knows its weight (dloss) up front.
template <typename T>
void classifier_weighted_bwd(T* logits, const int32_t* targets, const std::type_identity_t<T>* weights, int64_t n,
                             int64_t vocab);

// Multiple-choice scoring's head (engine/mc_eval.h): logps[i] = log softmax(logits[i])[targets[i]] (= -the loss of
// classifier_fwd_bwd) and greedy[i] = 1 when targets[i] is the first index of row i's maximum (the argmax of numpy and
// torch, which lm-eval's greedy test compares); 0 and 0 for ignored rows. logits is left as it was.
void classifier_target_logps(const float* logits, const int32_t* targets, int64_t n, int64_t vocab, float* logps,
                             uint8_t* greedy);

// Vocab-parallel cross-entropy (tensor parallelism): each rank holds columns [vocab_begin, vocab_begin + count)
// of every row's logits ([n, count]), out of a vocabulary of `vocab`. Three steps around two reductions over the
// ranks give every rank the loss of classifier_fwd_bwd over the whole row and the gradient of its own columns:
//   1. classifier_partial_stats: stats [3, n]: stats[i] = max_j logits[i, j]; stats[n + i] = sum_j
//      exp(logits[i, j] - stats[i]); stats[2n + i] = the target's logit when the target is in this slice, else 0.
//      Ignored rows: 0, 0, 0. OVERWRITES stats. A target outside [0, vocab) (not ignored) is an error.
//      The caller then takes global_max[i] = the maximum of stats[i] over the ranks,
//   2. classifier_rescale_sums: stats[n + i] *= exp(stats[i] - global_max[i]) (each rank's sum, relative to the
//      global max); the caller then sums stats[n .. 3n) over the ranks: the row's sum of exponentials and its
//      target logit (one rank holds it),
//   3. classifier_parallel_fwd_bwd: with lse = global_max + log(sum): losses[i] = lse - target logit (0 for
//      ignored rows; losses may be null); when dloss != 0, logits[i, j] = (exp(logits[i, j] - lse) - [j is the
//      target]) * dloss, OVERWRITTEN (zeros for ignored rows). Returns the sum of the losses, as classifier_fwd_bwd.
template <typename T>
void classifier_partial_stats(const T* logits, std::type_identity_t<T>* stats, const int32_t* targets, int64_t n,
                              int64_t count, int64_t vocab_begin, int64_t vocab);
template <typename T>
void classifier_rescale_sums(T* stats, const std::type_identity_t<T>* global_max, int64_t n);
template <typename T>
double classifier_parallel_fwd_bwd(T* logits, std::type_identity_t<T>* losses, const int32_t* targets,
                                   const std::type_identity_t<T>* global_max,
                                   const std::type_identity_t<T>* sum_and_target, int64_t n, int64_t count,
                                   int64_t vocab_begin, double dloss);
// The weighted backward's vocab-parallel step 3 (classifier_weighted_bwd over this rank's columns, after steps 1 and
// 2): logits[i, j] = weights[i] (exp(logits[i, j] - lse) - [j is the target]), OVERWRITTEN; all zeros for ignored rows
// and rows of weight 0. Concatenated over the ranks, the gradient of classifier_weighted_bwd on the whole rows.
template <typename T>
void classifier_parallel_weighted_bwd(T* logits, const int32_t* targets, const std::type_identity_t<T>* global_max,
                                      const std::type_identity_t<T>* sum_and_target,
                                      const std::type_identity_t<T>* weights, int64_t n, int64_t count,
                                      int64_t vocab_begin);

}  // namespace tuna::cpu
