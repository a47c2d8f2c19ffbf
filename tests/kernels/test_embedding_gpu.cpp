// kernels/embedding.cu against kernels/cpu/embedding.cpp. Forward is a copy (exact); the backward sums bf16
// gradients in fp32 in position order, so it matches the double reference to fp32 rounding (< 1e-5), and is bitwise
// reproducible (determinism checked on a batch full of repeated tokens).
#if TUNA_CUDA
#include "kernels/cpu/embedding.h"
#include "kernels/embedding.cuh"
#include "tests/kernels/gpu_test_util.h"

namespace tuna::test {
namespace {

void check_forward(TestRng& rng, int64_t vocab, int64_t dim, int64_t n) {
  SCOPED_TRACE("dim " + std::to_string(dim));
  std::vector<float> table = random_bf16_values(rng, vocab * dim);
  std::vector<int32_t> tokens(n);
  for (auto& t : tokens) t = static_cast<int32_t>(rng.integer(0, vocab - 1));
  DeviceBf16 d_table(table), d_out(n * dim);
  DeviceBuffer<int32_t> d_tokens(tokens);
  d_out.poison();
  cuda::embedding_fwd(d_out.bf(), d_tokens.get(), d_table.bf(), n, vocab, dim, nullptr);
  std::vector<double> expected(n * dim), table_d(table.begin(), table.end());
  cpu::embedding_fwd(expected.data(), tokens.data(), table_d.data(), n, vocab, dim);
  EXPECT_EQ(rel_error_norm(d_out.values(), expected), 0.0);
}

// Vocab-parallel: each of 3 slices looks up its rows and zeros the rest, exactly as the CPU twin; the backward
// through embedding_groups_slice accumulates each slice's rows as the twin does.
TEST(EmbeddingGpu, VocabSlicesLookUpAndAccumulateTheirRows) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const int64_t vocab = 301, dim = 72, n = 500 + rng.integer(0, 37);
  std::vector<int32_t> tokens(n);
  for (auto& t : tokens) t = static_cast<int32_t>(rng.integer(0, vocab - 1));
  DeviceBuffer<int32_t> d_tokens(tokens);
  const std::vector<float> dout = random_bf16_values(rng, n * dim);
  DeviceBf16 d_dout(dout);
  for (const auto& [begin, count] : {std::pair<int64_t, int64_t>{0, 101}, {101, 101}, {202, 99}}) {
    std::vector<float> table = random_bf16_values(rng, count * dim);
    DeviceBf16 d_table(table), d_out(n * dim);
    d_out.poison();
    cuda::embedding_fwd_slice(d_out.bf(), d_tokens.get(), d_table.bf(), n, vocab, begin, count, dim, nullptr);
    std::vector<double> expected(n * dim), table_d(table.begin(), table.end());
    cpu::embedding_fwd_slice(expected.data(), tokens.data(), table_d.data(), n, vocab, begin, count, dim);
    EXPECT_EQ(rel_error_norm(d_out.values(), expected), 0.0) << "slice at " << begin;

    cuda::EmbeddingGroups groups;
    cuda::embedding_groups_slice(groups, tokens.data(), n, vocab, begin, count);
    DeviceBuffer<int32_t> d_pos(groups.positions), d_unique(groups.unique_tokens), d_offsets(groups.offsets);
    const std::vector<float> initial = rng.vector<float>(count * dim);
    DeviceBuffer<float> d_grad(initial);
    cuda::embedding_bwd(d_grad.get(), d_dout.bf(), d_pos.get(), d_unique.get(), d_offsets.get(),
                        static_cast<int64_t>(groups.unique_tokens.size()), dim, nullptr);
    std::vector<double> grad_expected(initial.begin(), initial.end()), dout_d(dout.begin(), dout.end());
    cpu::embedding_bwd_slice(grad_expected.data(), dout_d.data(), tokens.data(), n, vocab, begin, count, dim);
    EXPECT_LE(rel_error_norm(d_grad.download(), grad_expected), 1e-5) << "slice at " << begin;
  }
}

// Token 5 is a tenth of the batch: a group much longer than the kernel's batches of positions.
void check_backward(TestRng& rng, int64_t vocab, int64_t dim, int64_t n) {
  SCOPED_TRACE("dim " + std::to_string(dim));
  std::vector<float> dout = random_bf16_values(rng, n * dim);
  std::vector<int32_t> tokens(n);
  for (auto& t : tokens) t = static_cast<int32_t>(rng.integer(0, 9) == 0 ? 5 : rng.integer(0, vocab - 1));
  std::vector<float> initial = rng.vector<float>(vocab * dim);
  cuda::EmbeddingGroups groups;
  cuda::embedding_groups(groups, tokens.data(), n, vocab);
  DeviceBf16 d_dout(dout);
  DeviceBuffer<int32_t> d_pos(groups.positions), d_unique(groups.unique_tokens), d_offsets(groups.offsets);
  std::vector<float> first;
  for (int run = 0; run < 2; ++run) {
    DeviceBuffer<float> d_table(initial);
    cuda::embedding_bwd(d_table.get(), d_dout.bf(), d_pos.get(), d_unique.get(), d_offsets.get(),
                        static_cast<int64_t>(groups.unique_tokens.size()), dim, nullptr);
    std::vector<float> got = d_table.download();
    if (run == 0) {
      std::vector<double> expected(initial.begin(), initial.end()), dout_d(dout.begin(), dout.end());
      cpu::embedding_bwd(expected.data(), dout_d.data(), tokens.data(), n, vocab, dim);
      const double err = rel_error_norm(got, expected);
      std::printf("  embedding_bwd fp32 err %.3e\n", err);
      EXPECT_LE(err, 1e-5);  // fp32 sums of up to a few hundred rows (docs/architecture.md: fp32 paths < 1e-5)
      first = got;
    } else {
      EXPECT_TRUE(bitwise_equal(first, got)) << "embedding_bwd is not deterministic";
    }
  }
}

TEST(EmbeddingGpu, ForwardCopiesRowsExactly) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  check_forward(rng, 301, 200, 1000 + rng.integer(0, 37));
  check_forward(rng, 13, 16384, 5 + rng.integer(0, 6));  // LLaMA-3 405B's width, a row of vectors per thread
}

TEST(EmbeddingGpu, BackwardAccumulatesDeterministically) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  check_backward(rng, 97, 136, 2048 + rng.integer(0, 100));
  check_backward(rng, 7, 16384, 41 + rng.integer(0, 6));
}

TEST(EmbeddingGpu, GroupsRejectOutOfRangeTokens) {
  const std::vector<int32_t> tokens = {1, 2, 7};
  cuda::EmbeddingGroups groups;
  EXPECT_THROW(cuda::embedding_groups(groups, tokens.data(), 3, 5), Error);
}

}  // namespace
}  // namespace tuna::test
#endif  // TUNA_CUDA
