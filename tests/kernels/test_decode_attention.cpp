// kernels/cpu/decode_attention: the rows past .. past + n_new - 1 of attention_fwd, read from a KV cache
// larger than the context (prompt-sized and single-token appends, group sizes 1, 2 and 4), in float and
// double; independent of the thread count; a cache too small is refused.
#include <gtest/gtest.h>

#include "core/error.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/decode_attention.h"
#include "tests/kernels/op_test_util.h"

namespace tuna::cpu {
namespace {

using test::TestRng;

struct Problem {
  int64_t batch, seq, heads, kv_heads, dim;
};

// attention_fwd over the whole sequence against decode_attention_fwd over positions past.. of the same
// tensors, with k and v copied into a cache of `capacity` positions (garbage beyond the filled ones).
template <typename T>
double decode_error(TestRng& rng, const Problem& p, int64_t past, int64_t capacity) {
  const int64_t q_row = p.heads * p.dim, kv_row = p.kv_heads * p.dim, n_new = p.seq - past;
  const std::vector<T> q = rng.vector<T>(p.batch * p.seq * q_row), k = rng.vector<T>(p.batch * p.seq * kv_row),
                       v = rng.vector<T>(p.batch * p.seq * kv_row);
  std::vector<T> out(q.size()), lse(p.batch * p.heads * p.seq);
  attention_fwd(out.data(), lse.data(), q.data(), k.data(), v.data(), p.batch, p.seq, p.heads, p.kv_heads, p.dim);

  std::vector<T> k_cache = rng.vector<T>(p.batch * capacity * kv_row, -9, 9), v_cache = k_cache;
  std::vector<T> q_new(p.batch * n_new * q_row), expected(q_new.size());
  for (int64_t b = 0; b < p.batch; ++b) {
    std::copy_n(k.begin() + b * p.seq * kv_row, p.seq * kv_row, k_cache.begin() + b * capacity * kv_row);
    std::copy_n(v.begin() + b * p.seq * kv_row, p.seq * kv_row, v_cache.begin() + b * capacity * kv_row);
    std::copy_n(q.begin() + (b * p.seq + past) * q_row, n_new * q_row, q_new.begin() + b * n_new * q_row);
    std::copy_n(out.begin() + (b * p.seq + past) * q_row, n_new * q_row, expected.begin() + b * n_new * q_row);
  }
  std::vector<T> got = test::nan_filled<T>(q_new.size());
  decode_attention_fwd(got.data(), q_new.data(), k_cache.data(), v_cache.data(), p.batch, n_new, past, capacity,
                       p.heads, p.kv_heads, p.dim);
  return test::rel_error_norm(got, std::vector<double>(expected.begin(), expected.end()));
}

TEST(DecodeAttention, EqualsTheForwardsRowsFromACache) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  for (const Problem& p : {Problem{2, 13, 3, 3, 10}, Problem{2, 13, 6, 3, 10}, Problem{1, 40, 12, 3, 16}}) {
    for (int64_t past : {int64_t(0), int64_t(5), p.seq - 1}) {
      SCOPED_TRACE("heads " + std::to_string(p.heads) + "/" + std::to_string(p.kv_heads) + " seq " +
                   std::to_string(p.seq) + " past " + std::to_string(past));
      // Both compute each row the same way up to summation order: a few roundings in either precision.
      EXPECT_LT(decode_error<float>(rng, p, past, p.seq + 7), 1e-6);
      EXPECT_LT(decode_error<double>(rng, p, past, p.seq + 7), 1e-13);
    }
  }
}

TEST(DecodeAttention, BitIdenticalAcrossThreadCounts) {
  TestRng rng;
  const int64_t batch = 2, n_new = 3, past = 30, capacity = 40, heads = 8, kv_heads = 2, dim = 16;
  const std::vector<float> q = rng.vector<float>(batch * n_new * heads * dim),
                           k = rng.vector<float>(batch * capacity * kv_heads * dim),
                           v = rng.vector<float>(batch * capacity * kv_heads * dim);
  auto run = [&](int threads) {
    std::vector<float> out(q.size());
    test::with_omp_threads(threads, [&] {
      decode_attention_fwd(out.data(), q.data(), k.data(), v.data(), batch, n_new, past, capacity, heads, kv_heads, dim);
    });
    return out;
  };
  const std::vector<float> reference = run(1);
  for (int threads : test::determinism_thread_counts())
    EXPECT_TRUE(test::bitwise_equal(run(threads), reference)) << threads << " threads";
}

TEST(DecodeAttention, RefusesACacheTooSmall) {
  std::vector<float> q(16), out(16), cache(8 * 16);
  EXPECT_THROW(decode_attention_fwd(out.data(), q.data(), cache.data(), cache.data(), 1, 2, 7, 8, 1, 1, 16), Error);
}

}  // namespace
}  // namespace tuna::cpu
