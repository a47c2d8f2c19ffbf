// kernels/cpu/attention: causal GQA forward against a float64 loop, backward against finite differences
// for group sizes 1, 2 and 4, seq_len 1, causality, overwrite semantics and thread-count determinism.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "kernels/cpu/attention.h"
#include "tests/kernels/op_test_util.h"

namespace tuna::cpu {
namespace {

using test::TestRng;

struct AttentionProblem {
  int64_t batch, seq_len, n_heads, n_kv_heads, head_dim;
  int64_t q_size() const { return batch * seq_len * n_heads * head_dim; }
  int64_t kv_size() const { return batch * seq_len * n_kv_heads * head_dim; }
  int64_t lse_size() const { return batch * n_heads * seq_len; }
};

// Three kv groups, with 1, 2 and 4 query heads per group; seq 13 and head_dim 10 are not round.
std::vector<AttentionProblem> gqa_problems(int64_t seq_len) {
  return {{2, seq_len, 3, 3, 10}, {2, seq_len, 6, 3, 10}, {2, seq_len, 12, 3, 10}};
}

std::string describe(const AttentionProblem& p) {
  return "batch " + std::to_string(p.batch) + ", seq_len " + std::to_string(p.seq_len) + ", n_heads " +
         std::to_string(p.n_heads) + ", n_kv_heads " + std::to_string(p.n_kv_heads) + ", head_dim " +
         std::to_string(p.head_dim);
}

struct NaiveAttention {
  std::vector<double> out, lse;
};

// Textbook attention: the full score matrix row by row, softmax, weighted sum of values.
NaiveAttention naive_attention(const AttentionProblem& p, const std::vector<double>& q, const std::vector<double>& k,
                               const std::vector<double>& v) {
  NaiveAttention result{std::vector<double>(p.q_size()), std::vector<double>(p.lse_size())};
  const int64_t group = p.n_heads / p.n_kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(p.head_dim));
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.n_heads; ++h)
      for (int64_t t = 0; t < p.seq_len; ++t) {
        const double* q_t = &q[((b * p.seq_len + t) * p.n_heads + h) * p.head_dim];
        std::vector<double> scores(t + 1);
        for (int64_t j = 0; j <= t; ++j) {
          const double* k_j = &k[((b * p.seq_len + j) * p.n_kv_heads + h / group) * p.head_dim];
          double dot = 0.0;
          for (int64_t d = 0; d < p.head_dim; ++d) dot += q_t[d] * k_j[d];
          scores[j] = dot * scale;
        }
        double max_score = scores[0];
        for (double s : scores) max_score = std::max(max_score, s);
        double sum = 0.0;
        for (double s : scores) sum += std::exp(s - max_score);
        result.lse[(b * p.n_heads + h) * p.seq_len + t] = max_score + std::log(sum);
        double* out_t = &result.out[((b * p.seq_len + t) * p.n_heads + h) * p.head_dim];
        for (int64_t j = 0; j <= t; ++j) {
          const double* v_j = &v[((b * p.seq_len + j) * p.n_kv_heads + h / group) * p.head_dim];
          for (int64_t d = 0; d < p.head_dim; ++d) out_t[d] += std::exp(scores[j] - max_score) / sum * v_j[d];
        }
      }
  return result;
}

template <typename T>
void forward(const AttentionProblem& p, std::vector<T>& out, std::vector<T>& lse, const std::vector<T>& q,
             const std::vector<T>& k, const std::vector<T>& v) {
  out.resize(p.q_size());
  lse.resize(p.lse_size());
  attention_fwd(out.data(), lse.data(), q.data(), k.data(), v.data(), p.batch, p.seq_len, p.n_heads, p.n_kv_heads,
                p.head_dim);
}

// Float: inputs and outputs are fp32 but all arithmetic is double, so the error is a few fp32 roundings.
template <typename T>
void check_forward(TestRng& rng, const AttentionProblem& p, double input_range, double tolerance) {
  SCOPED_TRACE(describe(p));
  const std::vector<T> q = rng.vector<T>(p.q_size(), -input_range, input_range);
  const std::vector<T> k = rng.vector<T>(p.kv_size(), -input_range, input_range);
  const std::vector<T> v = rng.vector<T>(p.kv_size());
  std::vector<T> out = test::nan_filled<T>(p.q_size()), lse = test::nan_filled<T>(p.lse_size());
  forward(p, out, lse, q, k, v);
  const NaiveAttention expected = naive_attention(p, test::to_double(q), test::to_double(k), test::to_double(v));
  EXPECT_LT(test::rel_error_norm(out, expected.out), tolerance);
  EXPECT_LT(test::rel_error_norm(lse, expected.lse), tolerance);
}

TEST(AttentionTest, ForwardMatchesFloat64Loop) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  for (const AttentionProblem& p : gqa_problems(13)) {
    check_forward<float>(rng, p, 1.0, 1e-6);
    check_forward<double>(rng, p, 1.0, 1e-13);
  }
}

TEST(AttentionTest, ForwardIsStableForLargeScores) {
  // Scores of several hundred: exp would overflow without the max subtraction.
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  for (const AttentionProblem& p : gqa_problems(13)) check_forward<float>(rng, p, 30.0, 1e-6);
}

TEST(AttentionTest, BackwardMatchesFiniteDifferences) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  for (const AttentionProblem& p : gqa_problems(7)) {
    SCOPED_TRACE(describe(p));
    std::vector<double> q = rng.vector<double>(p.q_size()), k = rng.vector<double>(p.kv_size()),
                        v = rng.vector<double>(p.kv_size());
    const std::vector<double> dout = rng.vector<double>(p.q_size());
    std::vector<double> out, lse;
    auto objective = [&] {
      forward(p, out, lse, q, k, v);
      return test::weighted_sum(out, dout);
    };
    objective();
    std::vector<double> dq = test::nan_filled<double>(p.q_size()), dk = test::nan_filled<double>(p.kv_size()),
                        dv = test::nan_filled<double>(p.kv_size());
    attention_bwd(dq.data(), dk.data(), dv.data(), dout.data(), out.data(), lse.data(), q.data(), k.data(),
                  v.data(), p.batch, p.seq_len, p.n_heads, p.n_kv_heads, p.head_dim);
    EXPECT_LT(test::rel_error_norm(dq, test::numeric_gradient(q, objective)), test::kFiniteDifferenceTolerance);
    EXPECT_LT(test::rel_error_norm(dk, test::numeric_gradient(k, objective)), test::kFiniteDifferenceTolerance);
    EXPECT_LT(test::rel_error_norm(dv, test::numeric_gradient(v, objective)), test::kFiniteDifferenceTolerance);
  }
}

// The fp32 backward (the CPU backend's) against the double one on the same inputs: fp32 products summed over
// up to seq_len x group terms, a few fp32 roundings each (~1e-7), while a wrong term is O(1).
TEST(AttentionTest, FloatBackwardFollowsDouble) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  for (const AttentionProblem& p : {AttentionProblem{2, 45, 8, 2, 32}, AttentionProblem{1, 70, 4, 4, 10}}) {
    SCOPED_TRACE(describe(p));
    const std::vector<float> q = rng.vector<float>(p.q_size(), -3, 3), k = rng.vector<float>(p.kv_size(), -3, 3),
                             v = rng.vector<float>(p.kv_size()), dout = rng.vector<float>(p.q_size());
    const std::vector<double> qd = test::to_double(q), kd = test::to_double(k), vd = test::to_double(v),
                              doutd = test::to_double(dout);
    std::vector<float> out, lse;
    std::vector<double> outd, lsed;
    forward(p, out, lse, q, k, v);
    forward(p, outd, lsed, qd, kd, vd);
    std::vector<float> dq(p.q_size()), dk(p.kv_size()), dv(p.kv_size());
    std::vector<double> dqd(p.q_size()), dkd(p.kv_size()), dvd(p.kv_size());
    attention_bwd(dq.data(), dk.data(), dv.data(), dout.data(), out.data(), lse.data(), q.data(), k.data(), v.data(),
                  p.batch, p.seq_len, p.n_heads, p.n_kv_heads, p.head_dim);
    attention_bwd(dqd.data(), dkd.data(), dvd.data(), doutd.data(), outd.data(), lsed.data(), qd.data(), kd.data(),
                  vd.data(), p.batch, p.seq_len, p.n_heads, p.n_kv_heads, p.head_dim);
    EXPECT_LT(test::rel_error_norm(dq, dqd), 1e-5);
    EXPECT_LT(test::rel_error_norm(dk, dkd), 1e-5);
    EXPECT_LT(test::rel_error_norm(dv, dvd), 1e-5);
    std::printf("  %s: dq %.2e dk %.2e dv %.2e\n", describe(p).c_str(), test::rel_error_norm(dq, dqd),
                test::rel_error_norm(dk, dkd), test::rel_error_norm(dv, dvd));
  }
}

TEST(AttentionTest, SingleTokenAttendsOnlyToItself) {
  // With one position the softmax is a single 1: out = v of the head's group, lse = the lone score,
  // dq = dk = 0 and dv sums dout over the group's query heads.
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  for (const AttentionProblem& p : gqa_problems(1)) {
    SCOPED_TRACE(describe(p));
    const int64_t group = p.n_heads / p.n_kv_heads;
    const std::vector<double> q = rng.vector<double>(p.q_size()), k = rng.vector<double>(p.kv_size()),
                              v = rng.vector<double>(p.kv_size()), dout = rng.vector<double>(p.q_size());
    std::vector<double> out = test::nan_filled<double>(p.q_size()), lse = test::nan_filled<double>(p.lse_size());
    forward(p, out, lse, q, k, v);
    std::vector<double> dq = test::nan_filled<double>(p.q_size()), dk = test::nan_filled<double>(p.kv_size()),
                        dv = test::nan_filled<double>(p.kv_size());
    attention_bwd(dq.data(), dk.data(), dv.data(), dout.data(), out.data(), lse.data(), q.data(), k.data(),
                  v.data(), p.batch, p.seq_len, p.n_heads, p.n_kv_heads, p.head_dim);

    std::vector<double> expected_dv(p.kv_size(), 0.0);
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t h = 0; h < p.n_heads; ++h) {
        const int64_t q_row = (b * p.n_heads + h) * p.head_dim, kv_row = (b * p.n_kv_heads + h / group) * p.head_dim;
        double score = 0.0;
        for (int64_t d = 0; d < p.head_dim; ++d) {
          EXPECT_DOUBLE_EQ(out[q_row + d], v[kv_row + d]);
          score += q[q_row + d] * k[kv_row + d];
          expected_dv[kv_row + d] += dout[q_row + d];
        }
        EXPECT_NEAR(lse[b * p.n_heads + h], score / std::sqrt(double(p.head_dim)), 1e-15);
      }
    EXPECT_LT(test::rel_error_norm(dq, std::vector<double>(p.q_size(), 0.0)), 1e-15);
    EXPECT_LT(test::rel_error_norm(dk, std::vector<double>(p.kv_size(), 0.0)), 1e-15);
    EXPECT_LT(test::rel_error_norm(dv, expected_dv), 1e-15);
  }
}

TEST(AttentionTest, FutureKeysAndValuesDoNotChangeEarlierOutputs) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const AttentionProblem p = gqa_problems(13)[1];
  const std::vector<float> q = rng.vector<float>(p.q_size());
  std::vector<float> k = rng.vector<float>(p.kv_size()), v = rng.vector<float>(p.kv_size());
  std::vector<float> out, lse;
  forward(p, out, lse, q, k, v);
  // Rewrite keys and values from position `cut` on; outputs before it must not move by a single bit.
  const int64_t cut = 6, kv_row_len = p.n_kv_heads * p.head_dim, q_row_len = p.n_heads * p.head_dim;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t i = (b * p.seq_len + cut) * kv_row_len; i < (b + 1) * p.seq_len * kv_row_len; ++i) {
      k[i] = static_cast<float>(rng.uniform(-5, 5));
      v[i] = static_cast<float>(rng.uniform(-5, 5));
    }
  std::vector<float> out_after, lse_after;
  forward(p, out_after, lse_after, q, k, v);
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t i = b * p.seq_len * q_row_len; i < (b * p.seq_len + cut) * q_row_len; ++i)
      ASSERT_EQ(out_after[i], out[i]) << "element " << i;
}

TEST(AttentionTest, BackwardIsBitIdenticalAcrossThreadCounts) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const AttentionProblem p{3, 29, 8, 2, 16};
  const std::vector<float> q = rng.vector<float>(p.q_size()), k = rng.vector<float>(p.kv_size()),
                           v = rng.vector<float>(p.kv_size()), dout = rng.vector<float>(p.q_size());
  std::vector<float> out, lse;
  forward(p, out, lse, q, k, v);
  struct Grads {
    std::vector<float> dq, dk, dv;
  };
  auto run = [&](int threads) {
    Grads g{std::vector<float>(p.q_size()), std::vector<float>(p.kv_size()), std::vector<float>(p.kv_size())};
    test::with_omp_threads(threads, [&] {
      attention_bwd(g.dq.data(), g.dk.data(), g.dv.data(), dout.data(), out.data(), lse.data(), q.data(),
                    k.data(), v.data(), p.batch, p.seq_len, p.n_heads, p.n_kv_heads, p.head_dim);
    });
    return g;
  };
  const Grads reference = run(1);
  for (int threads : test::determinism_thread_counts()) {
    const Grads g = run(threads);
    EXPECT_TRUE(test::bitwise_equal(g.dq, reference.dq)) << threads << " threads";
    EXPECT_TRUE(test::bitwise_equal(g.dk, reference.dk)) << threads << " threads";
    EXPECT_TRUE(test::bitwise_equal(g.dv, reference.dv)) << threads << " threads";
  }
}

}  // namespace
}  // namespace tuna::cpu
