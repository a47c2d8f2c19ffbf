// The attention backward for head_dim 128 (see attention_kernels.cuh), in 32-query steps: fewer live registers,
// as dK and dV already hold 128 floats per thread.
#include "kernels/attention_launch.cuh"

namespace tuna::cuda {

void attention_bwd_hd128(const AttentionParams& p, cudaStream_t stream) {
  attention::launch_bwd</*head_dim=*/128, /*queries per step=*/32, /*keys per step=*/64>(p, stream);
}

}  // namespace tuna::cuda
