// comm/comm_nccl.cpp under mpirun, one GPU per rank: the collectives of test_comm.cpp on device buffers,
// including the padded uneven reduce-scatter and all-gather. Skipped without NCCL in the build or without a
// GPU for every local rank (NCCL refuses two ranks on one device).
#include <gtest/gtest.h>

#if TUNA_NCCL
#include <cuda_runtime.h>

#include <vector>

#include "core/cuda_check.h"
#include "core/dtype.h"
#include "tests/mpi/mpi_test_util.h"

namespace tuna {
namespace {

float value(int r, int64_t i) { return static_cast<float>(r * 1000 + i % 997); }

TEST(NcclComm, CollectivesOnDeviceBuffers) {
  Comm& w = test::world();
  const LaunchInfo launch = detect_launch();
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < launch.local_size)
    GTEST_SKIP() << "needs one GPU per local rank (" << launch.local_size << "), found " << devices;
  TUNA_CUDA_CHECK(cudaSetDevice(launch.local_rank));
  cudaStream_t stream;
  TUNA_CUDA_CHECK(cudaStreamCreate(&stream));
  std::unique_ptr<Comm> nccl = make_nccl_comm(w.split(0, w.rank()), stream, /*timeout_s=*/60);
  const int P = nccl->size();
  for (int64_t n : {int64_t(1), int64_t(P + 1), int64_t(1003)}) {
    std::vector<float> host(n);
    for (int64_t i = 0; i < n; i++) host[i] = value(w.rank(), i);
    float *full = nullptr, *piece = nullptr;
    TUNA_CUDA_CHECK(cudaMalloc(&full, n * sizeof(float)));
    TUNA_CUDA_CHECK(cudaMalloc(&piece, n * sizeof(float)));
    // all_reduce
    TUNA_CUDA_CHECK(cudaMemcpy(full, host.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    nccl->all_reduce_sum(full, n, "test");
    std::vector<float> out(n);
    TUNA_CUDA_CHECK(cudaStreamSynchronize(stream));
    TUNA_CUDA_CHECK(cudaMemcpy(out.data(), full, n * sizeof(float), cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < n; i++) {
      double sum = 0;
      for (int r = 0; r < P; r++) sum += value(r, i);
      EXPECT_EQ(out[i], static_cast<float>(sum));
    }
    // reduce_scatter, then all_gather of the pieces back
    TUNA_CUDA_CHECK(cudaMemcpy(full, host.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    const Range mine = shard_range(n, w.rank(), P);
    nccl->reduce_scatter(full, piece, n, "test");
    nccl->all_gather(piece, full, n, "test");
    nccl->barrier("test");
    TUNA_CUDA_CHECK(cudaMemcpy(out.data(), full, n * sizeof(float), cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < n; i++) {
      double sum = 0;
      for (int r = 0; r < P; r++) sum += value(r, i);
      EXPECT_EQ(out[i], static_cast<float>(sum)) << "n " << n << " i " << i << " (piece " << mine.begin << ")";
    }
    // bf16 reduce_scatter (ncclBfloat16), padded when uneven, of small integers: exact in bf16 whatever the order
    // and rounding of NCCL's adds.
    std::vector<uint16_t> bits(n);
    for (int64_t i = 0; i < n; i++) bits[i] = f32_to_bf16(static_cast<float>(w.rank() + i % 7));
    uint16_t *b_full = nullptr, *b_piece = nullptr;
    TUNA_CUDA_CHECK(cudaMalloc(&b_full, n * sizeof(uint16_t)));
    TUNA_CUDA_CHECK(cudaMalloc(&b_piece, (mine.size() + 1) * sizeof(uint16_t)));
    TUNA_CUDA_CHECK(cudaMemcpy(b_full, bits.data(), n * sizeof(uint16_t), cudaMemcpyHostToDevice));
    TUNA_CUDA_CHECK(cudaMemset(b_piece, 0xff, (mine.size() + 1) * sizeof(uint16_t)));
    nccl->reduce_scatter(b_full, b_piece, n, CommType::BF16, "test bf16");
    nccl->barrier("test");
    std::vector<uint16_t> b_out(mine.size() + 1);
    TUNA_CUDA_CHECK(cudaMemcpy(b_out.data(), b_piece, b_out.size() * sizeof(uint16_t), cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < mine.size(); i++)
      EXPECT_EQ(bf16_to_f32(b_out[i]), float(P * (P - 1) / 2 + P * ((mine.begin + i) % 7))) << "n " << n << " i " << i;
    EXPECT_EQ(b_out[mine.size()], 0xffff) << "n " << n << ": wrote past its piece";
    cudaFree(b_full);
    cudaFree(b_piece);
    cudaFree(full);
    cudaFree(piece);
  }
  nccl.reset();
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace tuna

#endif  // TUNA_NCCL
