// Softmax cross-entropy over the vocabulary on the GPU, forward and backward in one pass over the logits,
// in place. Contract of kernels/cpu/classifier.h, bf16 logits, fp32 losses.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace tuna::cuda {

// logits: [n, vocab] bf16, row i scored against targets[i] (device int32; cpu::kIgnoreIndex = -100 skips).
// losses[i] = logsumexp(logits[i]) - logits[i, targets[i]], 0 for ignored rows. OVERWRITTEN (fp32, required).
// When dloss != 0, logits is OVERWRITTEN by its gradient (softmax - onehot) * dloss (zeros for ignored rows);
// when dloss == 0 it is left as it was. A target outside [0, vocab) that is not the ignore index cannot
// raise an error on the device: that row's loss (and gradient) is NaN. Callers validate on the host.
void classifier_fwd_bwd(__nv_bfloat16* logits, float* losses, const int32_t* targets, int64_t n, int64_t vocab,
                        float dloss, cudaStream_t stream);
// A preference objective's backward (kernels/cpu/classifier.h classifier_weighted_bwd): each row's weight (device fp32
// [n]) instead of one dloss. logits OVERWRITTEN by weights[i] (softmax - onehot); zeros for ignored rows and rows of
// weight 0. The per-token log-probs it follows are classifier_fwd_bwd's losses with dloss 0, negated.
void classifier_weighted_bwd(__nv_bfloat16* logits, const int32_t* targets, const float* weights, int64_t n,
                             int64_t vocab, cudaStream_t stream);

// Vocab-parallel (tensor parallelism): each rank holds columns [vocab_begin, vocab_begin + count) of every row of
// logits [n, count] bf16, out of a vocabulary of `vocab`. The contract of kernels/cpu/classifier.h's three steps,
// with fp32 statistics [3, n] (device):
//   classifier_partial_stats: stats = (row max, sum of exp(x - max), target logit if in this slice else 0) of
//     this rank's columns; ignored rows 0. OVERWRITES stats. Then the caller: global_max = max over ranks of
//     stats[0, n).
//   classifier_rescale_sums: stats[n + i] *= exp(stats[i] - global_max[i]). Then the caller: sum stats[n, 3n)
//     over the ranks (into sum_and_target).
//   classifier_parallel_fwd_bwd: losses[i] = global_max + log(sum) - target logit (0 for ignored rows) OVERWRITTEN;
//     with dloss != 0, logits OVERWRITTEN by (softmax - onehot) * dloss over this rank's columns.
void classifier_partial_stats(const __nv_bfloat16* logits, float* stats, const int32_t* targets, int64_t n,
                              int64_t count, int64_t vocab_begin, int64_t vocab, cudaStream_t stream);
void classifier_rescale_sums(float* stats, const float* global_max, int64_t n, cudaStream_t stream);
void classifier_parallel_fwd_bwd(__nv_bfloat16* logits, float* losses, const int32_t* targets,
                                 const float* global_max, const float* sum_and_target, int64_t n, int64_t count,
                                 int64_t vocab_begin, float dloss, cudaStream_t stream);
// The weighted backward's step 3 (kernels/cpu/classifier.h classifier_parallel_weighted_bwd): each row's weight (device
// fp32 [n]) instead of one dloss, no losses. logits OVERWRITTEN by weights[i] (softmax - onehot) over this rank's
// columns; zeros for ignored rows and rows of weight 0.
void classifier_parallel_weighted_bwd(__nv_bfloat16* logits, const int32_t* targets, const float* global_max,
                                      const float* sum_and_target, const float* weights, int64_t n, int64_t count,
                                      int64_t vocab_begin, cudaStream_t stream);
// *total = sum_{i < n} losses[i] in double, in index order by one block: deterministic. OVERWRITES *total.
void loss_sum(double* total, const float* losses, int64_t n, cudaStream_t stream);

}  // namespace tuna::cuda
