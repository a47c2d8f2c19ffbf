// kernels/cpu/embedding: lookup, scatter-add backward with repeated tokens, accumulate/overwrite semantics,
// bad token errors and thread-count determinism.
#include <gtest/gtest.h>

#include "core/error.h"
#include "kernels/cpu/embedding.h"
#include "tests/kernels/op_test_util.h"

namespace tuna::cpu {
namespace {

using test::TestRng;

// Few distinct tokens for many positions, so most table rows receive several gradients.
std::vector<int32_t> random_tokens(TestRng& rng, int64_t n_tokens, int64_t vocab) {
  std::vector<int32_t> tokens(n_tokens);
  for (int32_t& token : tokens) token = static_cast<int32_t>(rng.integer(0, vocab - 1));
  return tokens;
}

TEST(EmbeddingTest, ForwardCopiesTableRows) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const int64_t n_tokens = 19, vocab = 11, dim = 37;
  const std::vector<int32_t> tokens = random_tokens(rng, n_tokens, vocab);
  const std::vector<float> table = rng.vector<float>(vocab * dim);
  std::vector<float> out = test::nan_filled<float>(n_tokens * dim);
  embedding_fwd(out.data(), tokens.data(), table.data(), n_tokens, vocab, dim);
  for (int64_t i = 0; i < n_tokens; ++i)
    for (int64_t j = 0; j < dim; ++j) ASSERT_EQ(out[i * dim + j], table[tokens[i] * dim + j]) << i << ", " << j;
}

// A vocab slice [begin, begin + count): its rows for its tokens, zeros for the others; the backward adds only its
// tokens' gradients. The slices of a split put together give the whole lookup and the whole gradient.
TEST(EmbeddingTest, VocabSlicesSumToTheWholeLookupAndGradient) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const int64_t n_tokens = 23, vocab = 11, dim = 9;
  const std::vector<int32_t> tokens = random_tokens(rng, n_tokens, vocab);
  const std::vector<float> table = rng.vector<float>(vocab * dim), dout = rng.vector<float>(n_tokens * dim);
  std::vector<float> whole(n_tokens * dim), whole_grad(vocab * dim, 0.0f);
  embedding_fwd(whole.data(), tokens.data(), table.data(), n_tokens, vocab, dim);
  embedding_bwd(whole_grad.data(), dout.data(), tokens.data(), n_tokens, vocab, dim);
  std::vector<float> sum(n_tokens * dim, 0.0f);
  for (const auto& [begin, count] : {std::pair<int64_t, int64_t>{0, 4}, {4, 4}, {8, 3}}) {
    std::vector<float> out = test::nan_filled<float>(n_tokens * dim), grad(count * dim, 0.0f);
    embedding_fwd_slice(out.data(), tokens.data(), table.data() + begin * dim, n_tokens, vocab, begin, count, dim);
    for (size_t i = 0; i < sum.size(); i++) sum[i] += out[i];
    embedding_bwd_slice(grad.data(), dout.data(), tokens.data(), n_tokens, vocab, begin, count, dim);
    for (int64_t i = 0; i < count * dim; i++) EXPECT_EQ(grad[i], whole_grad[begin * dim + i]) << begin << ", " << i;
  }
  EXPECT_EQ(sum, whole);
}

TEST(EmbeddingTest, BackwardAddsEachPositionIntoItsTokensRow) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const int64_t n_tokens = 19, vocab = 11, dim = 37;
  const std::vector<int32_t> tokens = random_tokens(rng, n_tokens, vocab);
  const std::vector<double> dout = rng.vector<double>(n_tokens * dim);
  const std::vector<double> prior = rng.vector<double>(vocab * dim);  // accumulates: must be kept
  std::vector<double> dtable = prior;
  embedding_bwd(dtable.data(), dout.data(), tokens.data(), n_tokens, vocab, dim);

  std::vector<double> expected = prior;
  for (int64_t i = 0; i < n_tokens; ++i)
    for (int64_t j = 0; j < dim; ++j) expected[tokens[i] * dim + j] += dout[i * dim + j];
  // Same additions in the same (token) order: exact.
  EXPECT_TRUE(test::bitwise_equal(dtable, expected));
}

TEST(EmbeddingTest, BadTokenIsAnErrorNamingPositionAndValue) {
  const int64_t vocab = 11, dim = 4;
  std::vector<float> table(vocab * dim, 1.0f), out(3 * dim);
  for (int32_t bad : {11, -1, 1 << 30}) {
    const std::vector<int32_t> tokens = {3, bad, 5};
    for (bool backward : {false, true}) {
      try {
        if (backward) embedding_bwd(table.data(), out.data(), tokens.data(), 3, vocab, dim);
        else embedding_fwd(out.data(), tokens.data(), table.data(), 3, vocab, dim);
        ADD_FAILURE() << "token " << bad << ": expected tuna::Error";
      } catch (const Error& e) {
        const std::string message = e.what();
        EXPECT_NE(message.find("position 1"), std::string::npos) << message;
        EXPECT_NE(message.find(std::to_string(bad)), std::string::npos) << message;
      }
    }
  }
  // Nothing was accumulated by the failed backward calls.
  EXPECT_TRUE(test::bitwise_equal(table, std::vector<float>(vocab * dim, 1.0f)));
}

TEST(EmbeddingTest, BackwardIsBitIdenticalAcrossThreadCounts) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const int64_t n_tokens = 517, vocab = 23, dim = 300;  // several column blocks, heavy token repetition
  const std::vector<int32_t> tokens = random_tokens(rng, n_tokens, vocab);
  const std::vector<float> dout = rng.vector<float>(n_tokens * dim);
  const std::vector<float> prior = rng.vector<float>(vocab * dim);
  auto run = [&](int threads) {
    std::vector<float> dtable = prior;
    test::with_omp_threads(threads, [&] {
      embedding_bwd(dtable.data(), dout.data(), tokens.data(), n_tokens, vocab, dim);
    });
    return dtable;
  };
  const std::vector<float> reference = run(1);
  for (int threads : test::determinism_thread_counts())
    EXPECT_TRUE(test::bitwise_equal(run(threads), reference)) << threads << " threads";
}

}  // namespace
}  // namespace tuna::cpu
