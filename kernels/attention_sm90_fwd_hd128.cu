// The sm_90a attention forward for head_dim 128 (see attention_sm90_kernels.cuh).
#include "kernels/attention_sm90_launch.cuh"

namespace tuna::cuda {

void attention_sm90_fwd_hd128(const AttentionParams& p, cudaStream_t stream) {
  attention::launch_sm90_fwd</*head_dim=*/128>(p, stream);
}

}  // namespace tuna::cuda
