// The host side of the tensor-core attention kernels (attention_kernels.cuh): the launch sequences, with
// the dynamic shared memory each kernel needs. Included only by attention_{fwd,bwd}_hdNN.cu. Internal to
// kernels/.
//
// The host emulator (tests/kernels/emulator) compiles these launchers too, with g++ against its CUDA runtime:
// launch_kernel and cudaFuncSetAttribute run there on the host.
#pragma once

#include "core/cuda_check.h"
#include "kernels/attention_kernels.cuh"

namespace tuna::cuda::attention {

// The launch sequences, instantiated once per head dim in attention_{fwd,bwd}_hdNN.cu (one file each, so
// CI's two cores compile them in parallel).
// The forward's instance with documents when p.doc_start is set, the plain causal one otherwise.
template <int kHd, bool kDocs>
void launch_fwd_instance(const AttentionParams& p, cudaStream_t stream) {
  constexpr int kSmem = fwd_smem_bytes<kHd>();
  TUNA_CUDA_CHECK(cudaFuncSetAttribute(fwd_kernel<kHd, kDocs>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  const dim3 grid((p.seq_len + kBlockRows - 1) / kBlockRows, p.n_heads, p.batch);
  launch_kernel(fwd_kernel<kHd, kDocs>, grid, kThreads, kSmem, stream, p);
  TUNA_CUDA_CHECK_LAUNCH();
}
template <int kHd>
void launch_fwd(const AttentionParams& p, cudaStream_t stream) {
  if (p.doc_start != nullptr) launch_fwd_instance<kHd, /*documents=*/true>(p, stream);
  else launch_fwd_instance<kHd, false>(p, stream);
}

// delta, then dK/dV with kQueries-query steps, then dQ with kKeys-key steps.
template <int kHd, int kQueries, int kKeys>
void launch_bwd(const AttentionParams& p, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(p.batch) * p.seq_len * p.n_heads;
  launch_kernel(bwd_delta_kernel<kHd>, static_cast<unsigned>((rows + kWarps - 1) / kWarps), kThreads, 0, stream, p);
  TUNA_CUDA_CHECK_LAUNCH();
  constexpr int kDkdvSmem = dkdv_smem_bytes<kHd, kQueries>();
  TUNA_CUDA_CHECK(cudaFuncSetAttribute(bwd_dkdv_kernel<kHd, kQueries>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       kDkdvSmem));
  const dim3 kv_grid((p.seq_len + kBlockRows - 1) / kBlockRows, p.n_kv_heads, p.batch);
  launch_kernel(bwd_dkdv_kernel<kHd, kQueries>, kv_grid, kThreads, kDkdvSmem, stream, p);
  TUNA_CUDA_CHECK_LAUNCH();
  constexpr int kDqSmem = dq_smem_bytes<kHd, kKeys>();
  TUNA_CUDA_CHECK(
      cudaFuncSetAttribute(bwd_dq_kernel<kHd, kKeys>, cudaFuncAttributeMaxDynamicSharedMemorySize, kDqSmem));
  const dim3 q_grid((p.seq_len + kBlockRows - 1) / kBlockRows, p.n_heads, p.batch);
  launch_kernel(bwd_dq_kernel<kHd, kKeys>, q_grid, kThreads, kDqSmem, stream, p);
  TUNA_CUDA_CHECK_LAUNCH();
}

}  // namespace tuna::cuda::attention
