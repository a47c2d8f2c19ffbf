// The attention backward for head_dim 64 (see attention_kernels.cuh).
#include "kernels/attention_launch.cuh"

namespace tuna::cuda {

void attention_bwd_hd64(const AttentionParams& p, cudaStream_t stream) {
  attention::launch_bwd</*head_dim=*/64, /*queries per step=*/64, /*keys per step=*/64>(p, stream);
}

}  // namespace tuna::cuda
