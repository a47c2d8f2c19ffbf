// The attention forward for head_dim 128 (see attention_kernels.cuh).
#include "kernels/attention_launch.cuh"

namespace tuna::cuda {

void attention_fwd_hd128(const AttentionParams& p, cudaStream_t stream) { attention::launch_fwd</*head_dim=*/128>(p, stream); }

}  // namespace tuna::cuda
