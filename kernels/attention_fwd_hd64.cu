// The attention forward for head_dim 64 (see attention_kernels.cuh). One file per head dim so that CI's
// two cores compile the instantiations in parallel.
#include "core/cuda_check.h"
#include "kernels/attention_kernels.cuh"

namespace tuna::cuda {

void attention_fwd_hd64(const AttentionParams& p, cudaStream_t stream) {
  using namespace attention;
  constexpr int kSmem = fwd_smem_bytes<64>();
  TUNA_CUDA_CHECK(cudaFuncSetAttribute(fwd_kernel<64>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  const dim3 grid((p.seq_len + kBlockRows - 1) / kBlockRows, p.n_heads, p.batch);
  fwd_kernel<64><<<grid, kThreads, kSmem, stream>>>(p);
  TUNA_CUDA_CHECK_LAUNCH();
}

}  // namespace tuna::cuda
