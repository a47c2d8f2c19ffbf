// The attention backward for head_dim 128 (see attention_kernels.cuh): delta, then dK/dV with 32-query steps (fewer live registers: dK and dV already hold 128 floats per thread),
// then dQ with 64-key steps.
#include "core/cuda_check.h"
#include "kernels/attention_kernels.cuh"

namespace tuna::cuda {
namespace {
constexpr int kHd = 128, kQueries = 32, kKeys = 64;
}  // namespace

void attention_bwd_hd128(const AttentionParams& p, cudaStream_t stream) {
  using namespace attention;
  const int64_t rows = static_cast<int64_t>(p.batch) * p.seq_len * p.n_heads;
  bwd_delta_kernel<kHd><<<static_cast<unsigned>((rows + kWarps - 1) / kWarps), kThreads, 0, stream>>>(p);
  TUNA_CUDA_CHECK_LAUNCH();
  constexpr int kDkdvSmem = dkdv_smem_bytes<kHd, kQueries>();
  TUNA_CUDA_CHECK(cudaFuncSetAttribute(bwd_dkdv_kernel<kHd, kQueries>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       kDkdvSmem));
  const dim3 kv_grid((p.seq_len + kBlockRows - 1) / kBlockRows, p.n_kv_heads, p.batch);
  bwd_dkdv_kernel<kHd, kQueries><<<kv_grid, kThreads, kDkdvSmem, stream>>>(p);
  TUNA_CUDA_CHECK_LAUNCH();
  constexpr int kDqSmem = dq_smem_bytes<kHd, kKeys>();
  TUNA_CUDA_CHECK(
      cudaFuncSetAttribute(bwd_dq_kernel<kHd, kKeys>, cudaFuncAttributeMaxDynamicSharedMemorySize, kDqSmem));
  const dim3 q_grid((p.seq_len + kBlockRows - 1) / kBlockRows, p.n_heads, p.batch);
  bwd_dq_kernel<kHd, kKeys><<<q_grid, kThreads, kDqSmem, stream>>>(p);
  TUNA_CUDA_CHECK_LAUNCH();
}

}  // namespace tuna::cuda
