// The sm_90a attention forward for head_dim 64 (see attention_sm90_kernels.cuh).
#include "kernels/attention_sm90_launch.cuh"

namespace tuna::cuda {

bool attention_sm90_image_present() {
  cudaFuncAttributes attributes;
  TUNA_CUDA_CHECK(cudaFuncGetAttributes(&attributes, attention::sm90_fwd_kernel<64, false>));
  return attributes.binaryVersion == 90;
}

void attention_sm90_fwd_hd64(const AttentionParams& p, cudaStream_t stream) {
  attention::launch_sm90_fwd</*head_dim=*/64>(p, stream);
}

}  // namespace tuna::cuda
