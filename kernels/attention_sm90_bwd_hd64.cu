// The sm_90a attention backward for head_dim 64 (see attention_sm90_kernels.cuh).
#include "kernels/attention_sm90_launch.cuh"

namespace tuna::cuda {

void attention_sm90_bwd_hd64(const AttentionParams& p, float* scratch, const float* rope_cos, const float* rope_sin,
                             const int32_t* rope_positions, cudaStream_t stream) {
  attention::launch_sm90_bwd</*head_dim=*/64>(p, scratch, rope_cos, rope_sin, rope_positions, stream);
}

}  // namespace tuna::cuda
