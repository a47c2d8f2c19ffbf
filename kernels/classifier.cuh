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

// *total = sum_{i < n} losses[i] in double, in index order by one block: deterministic. OVERWRITES *total.
void loss_sum(double* total, const float* losses, int64_t n, cudaStream_t stream);

}  // namespace tuna::cuda
