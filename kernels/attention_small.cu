// Attention for small head dims (8, 16, 32): a plain fp32 kernel, one thread per query row (forward, dQ) or
// per key row (dK/dV), with the FlashAttention contract (online softmax, lse kept, no seq x seq storage).
// It exists so that tiny models (the transformers fixtures have head_dim 8) run on the GPU backend end to
// end; it makes no attempt at speed. The tensor-core kernels (attention_kernels.cuh) serve 64 and 128.
// The kernels are in attention_small_kernels.cuh, apart from these launches.
#include "core/cuda_check.h"
#include "kernels/attention_params.cuh"
#include "kernels/attention_small_kernels.cuh"
#include "kernels/common.cuh"

namespace tuna::cuda {
namespace {

template <int kHd>
void launch(const AttentionParams& p, bool backward, cudaStream_t stream) {
  using namespace small_attention;  // the kernels and their kThreads
  const int64_t q_rows = static_cast<int64_t>(p.batch) * p.seq_len * p.n_heads;
  const int64_t kv_rows = static_cast<int64_t>(p.batch) * p.seq_len * p.n_kv_heads;
  const unsigned q_grid = static_cast<unsigned>(ceil_div(q_rows, kThreads));
  if (!backward) {
    launch_kernel(small_fwd_kernel<kHd>, q_grid, kThreads, 0, stream, p);
    TUNA_CUDA_CHECK_LAUNCH();
    return;
  }
  launch_kernel(small_dq_kernel<kHd>, q_grid, kThreads, 0, stream, p);  // also writes delta, which dK/dV reads
  TUNA_CUDA_CHECK_LAUNCH();
  launch_kernel(small_dkdv_kernel<kHd>, static_cast<unsigned>(ceil_div(kv_rows, kThreads)), kThreads, 0, stream, p);
  TUNA_CUDA_CHECK_LAUNCH();
}

}  // namespace

void attention_small(const AttentionParams& p, int head_dim, bool backward, cudaStream_t stream) {
  switch (head_dim) {
    case 8: launch<8>(p, backward, stream); break;
    case 16: launch<16>(p, backward, stream); break;
    case 32: launch<32>(p, backward, stream); break;
    default: TUNA_CHECK(false, "attention_small: head_dim ", head_dim);
  }
}

}  // namespace tuna::cuda
