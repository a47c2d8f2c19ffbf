// comm/comm_nccl.cpp under mpirun, one GPU per rank: the collectives of test_comm.cpp on device buffers,
// including the padded uneven reduce-scatter and all-gather. Skipped without NCCL in the build or without a
// GPU for every local rank (NCCL refuses two ranks on one device).
#include <gtest/gtest.h>

#if TUNA_NCCL
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
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

// Beyond two ranks NCCL's bf16 reduce-scatter rounds the partial sum at each step of its ring (tp > 2 with sequence
// parallelism reduce-scatters bf16 activations): each element within P - 1 roundings (2^-8 of the partial sums'
// magnitude, bounded by the sum of the inputs' magnitudes, each) of the fp32 sum rounded once. And a communicator made
// as the pipeline's (NcclOptions::max_ctas 2) moves a ring of point-to-point messages, its wait_event bounded.
TEST(NcclComm, Bf16ReduceScatterWithinItsRingRoundingAndAFewCtaComm) {
  Comm& w = test::world();
  const LaunchInfo launch = detect_launch();
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < launch.local_size)
    GTEST_SKIP() << "needs one GPU per local rank (" << launch.local_size << "), found " << devices;
  TUNA_CUDA_CHECK(cudaSetDevice(launch.local_rank));
  cudaStream_t stream;
  TUNA_CUDA_CHECK(cudaStreamCreate(&stream));
  {
    std::unique_ptr<Comm> nccl = make_nccl_comm(w.split(0, w.rank()), stream, /*timeout_s=*/60);
    const int P = nccl->size();
    const int64_t n = 4099;
    const auto x = [](int r, int64_t i) { return static_cast<float>(std::sin(0.37 * i + r) * (1 + r % 3)); };
    std::vector<uint16_t> bits(n);
    for (int64_t i = 0; i < n; i++) bits[i] = f32_to_bf16(x(w.rank(), i));
    const Range mine = shard_range(n, w.rank(), P);
    uint16_t *full = nullptr, *piece = nullptr;
    TUNA_CUDA_CHECK(cudaMalloc(&full, n * sizeof(uint16_t)));
    TUNA_CUDA_CHECK(cudaMalloc(&piece, std::max<int64_t>(mine.size(), 1) * sizeof(uint16_t)));
    TUNA_CUDA_CHECK(cudaMemcpy(full, bits.data(), n * sizeof(uint16_t), cudaMemcpyHostToDevice));
    nccl->reserve_scratch((n + P) * 4 * (P + 1));
    nccl->reduce_scatter(full, piece, n, CommType::BF16, "test bf16 ring");
    nccl->barrier("test");
    std::vector<uint16_t> out(mine.size());
    TUNA_CUDA_CHECK(cudaMemcpy(out.data(), piece, out.size() * sizeof(uint16_t), cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < mine.size(); i++) {
      double sum = 0, magnitude = 0;
      for (int r = 0; r < P; r++) {
        const double v = bf16_to_f32(f32_to_bf16(x(r, mine.begin + i)));
        sum += v, magnitude += std::abs(v);
      }
      const double bound = 0.5 * std::abs(sum) / 128 + (P - 1) * magnitude / 256;
      EXPECT_NEAR(bf16_to_f32(out[i]), sum, bound) << "element " << mine.begin + i << " of " << P << " ranks";
    }
    cudaFree(full);
    cudaFree(piece);
  }
  {
    NcclOptions few;
    few.max_ctas = 2;
    std::unique_ptr<Comm> pp = make_nccl_comm(w.split(0, w.rank()), stream, /*timeout_s=*/60, few);
    const int P = pp->size(), next = (pp->rank() + 1) % P, prev = (pp->rank() + P - 1) % P;
    float *out = nullptr, *in = nullptr;
    TUNA_CUDA_CHECK(cudaMalloc(&out, 1024 * sizeof(float)));
    TUNA_CUDA_CHECK(cudaMalloc(&in, 1024 * sizeof(float)));
    std::vector<float> host(1024, static_cast<float>(pp->rank()));
    TUNA_CUDA_CHECK(cudaMemcpy(out, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
    const CommRequest r = pp->recv_start(in, 1024, CommType::F32, prev, "test ring");
    const CommRequest s = pp->send_start(out, 1024, CommType::F32, next, "test ring");
    pp->wait(s);
    pp->wait(r);
    cudaEvent_t done;
    TUNA_CUDA_CHECK(cudaEventCreate(&done));
    TUNA_CUDA_CHECK(cudaEventRecord(done, stream));
    EXPECT_TRUE(pp->wait_event(done, "test ring"));
    cudaEventDestroy(done);
    TUNA_CUDA_CHECK(cudaMemcpy(host.data(), in, host.size() * sizeof(float), cudaMemcpyDeviceToHost));
    for (float v : host) ASSERT_EQ(v, static_cast<float>(prev));
    cudaFree(out);
    cudaFree(in);
  }
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace tuna

#endif  // TUNA_NCCL
