// The attention forward for head_dim 64 (see attention_kernels.cuh).
#include "kernels/attention_launch.cuh"

namespace tuna::cuda {

void attention_fwd_hd64(const AttentionParams& p, cudaStream_t stream) { attention::launch_fwd</*head_dim=*/64>(p, stream); }

}  // namespace tuna::cuda
