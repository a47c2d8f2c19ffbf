// kernels/cpu/attention: causal GQA forward against a float64 loop, backward against finite differences
// for group sizes 1, 2 and 4, seq_len 1, causality, overwrite semantics and thread-count determinism; the same
// with packed documents (doc_start) against a float64 loop over an explicit block-diagonal causal mask.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <numeric>

#include "core/error.h"
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

// Textbook attention: the full score matrix row by row, softmax, weighted sum of values. allowed(b, t, j): whether
// query t of sequence b sees key j (j <= t always; default: every such key).
using KeyMask = std::function<bool(int64_t b, int64_t t, int64_t j)>;
NaiveAttention naive_attention(const AttentionProblem& p, const std::vector<double>& q, const std::vector<double>& k,
                               const std::vector<double>& v, const KeyMask& allowed = nullptr) {
  NaiveAttention result{std::vector<double>(p.q_size()), std::vector<double>(p.lse_size())};
  const int64_t group = p.n_heads / p.n_kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(p.head_dim));
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.n_heads; ++h)
      for (int64_t t = 0; t < p.seq_len; ++t) {
        const double* q_t = &q[((b * p.seq_len + t) * p.n_heads + h) * p.head_dim];
        std::vector<double> scores(t + 1, -INFINITY);
        for (int64_t j = 0; j <= t; ++j) {
          if (allowed && !allowed(b, t, j)) continue;
          const double* k_j = &k[((b * p.seq_len + j) * p.n_kv_heads + h / group) * p.head_dim];
          double dot = 0.0;
          for (int64_t d = 0; d < p.head_dim; ++d) dot += q_t[d] * k_j[d];
          scores[j] = dot * scale;
        }
        double max_score = -INFINITY;
        for (double s : scores) max_score = std::max(max_score, s);
        double sum = 0.0;
        for (double s : scores) sum += std::exp(s - max_score);
        result.lse[(b * p.n_heads + h) * p.seq_len + t] = max_score + std::log(sum);
        double* out_t = &result.out[((b * p.seq_len + t) * p.n_heads + h) * p.head_dim];
        for (int64_t j = 0; j <= t; ++j) {
          if (allowed && !allowed(b, t, j)) continue;
          const double* v_j = &v[((b * p.seq_len + j) * p.n_kv_heads + h / group) * p.head_dim];
          for (int64_t d = 0; d < p.head_dim; ++d) out_t[d] += std::exp(scores[j] - max_score) / sum * v_j[d];
        }
      }
  return result;
}

template <typename T>
void forward(const AttentionProblem& p, std::vector<T>& out, std::vector<T>& lse, const std::vector<T>& q,
             const std::vector<T>& k, const std::vector<T>& v, const int32_t* doc_start = nullptr) {
  out.resize(p.q_size());
  lse.resize(p.lse_size());
  attention_fwd(out.data(), lse.data(), q.data(), k.data(), v.data(), p.batch, p.seq_len, p.n_heads, p.n_kv_heads,
                p.head_dim, doc_start);
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

// ---------------------------------------------------------------------------------------------------------
// Packed documents. A window is described by its documents' lengths (the first may continue one that began in an
// earlier window: to the kernel it is simply the window's first document). The reference builds the mask from
// document ids, independently of doc_start, which the test derives with its own loop.
struct PackedWindows {
  std::vector<std::vector<int64_t>> lengths;  // per sequence: document lengths, summing to seq_len
  std::vector<int32_t> doc_start;             // [batch, seq_len]
  std::vector<int64_t> doc_id;                // [batch, seq_len]
};

PackedWindows pack(const std::vector<std::vector<int64_t>>& lengths) {
  PackedWindows w{lengths, {}, {}};
  for (const std::vector<int64_t>& row : lengths) {
    int64_t id = 0, at = 0;
    for (int64_t n : row) {
      for (int64_t i = 0; i < n; ++i) w.doc_start.push_back(static_cast<int32_t>(at)), w.doc_id.push_back(id);
      at += n, ++id;
    }
  }
  return w;
}

KeyMask block_diagonal(const PackedWindows& w, int64_t seq_len) {
  return [&w, seq_len](int64_t b, int64_t t, int64_t j) { return w.doc_id[b * seq_len + j] == w.doc_id[b * seq_len + t]; };
}

// Layouts that cover the cases: odd lengths, one-token documents, one document filling the window, boundaries
// inside a 32-query block and inside a 16-column strip, and a boundary exactly on a block edge. seq_len 77.
std::vector<std::vector<int64_t>> document_layouts() {
  return {{1, 5, 33, 1, 37}, std::vector<int64_t>(77, 1), {77}, {20, 17, 3, 37}, {32, 45}, {64, 1, 12}};
}

TEST(AttentionDocumentsTest, ForwardMatchesFloat64BlockDiagonalMask) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const std::vector<std::vector<int64_t>> layouts = document_layouts();
  for (size_t i = 0; i + 1 < layouts.size(); ++i) {
    const PackedWindows w = pack({layouts[i], layouts[i + 1]});  // two sequences with different layouts
    for (AttentionProblem p : gqa_problems(77)) {
      SCOPED_TRACE(describe(p) + ", layouts " + std::to_string(i) + " and " + std::to_string(i + 1));
      const std::vector<double> q = rng.vector<double>(p.q_size(), -2, 2), k = rng.vector<double>(p.kv_size(), -2, 2),
                                v = rng.vector<double>(p.kv_size());
      const NaiveAttention expected = naive_attention(p, q, k, v, block_diagonal(w, p.seq_len));
      std::vector<double> out = test::nan_filled<double>(p.q_size()), lse = test::nan_filled<double>(p.lse_size());
      forward(p, out, lse, q, k, v, w.doc_start.data());
      EXPECT_LT(test::rel_error_norm(out, expected.out), 1e-13);
      EXPECT_LT(test::rel_error_norm(lse, expected.lse), 1e-13);
      const std::vector<float> qf(q.begin(), q.end()), kf(k.begin(), k.end()), vf(v.begin(), v.end());
      std::vector<float> outf, lsef;
      forward(p, outf, lsef, qf, kf, vf, w.doc_start.data());
      EXPECT_LT(test::rel_error_norm(outf, expected.out), 1e-6);
      EXPECT_LT(test::rel_error_norm(lsef, expected.lse), 1e-6);
    }
  }
}

TEST(AttentionDocumentsTest, OneDocumentPerRowEqualsNoDocuments) {
  // doc_start all zero is the plain causal contract, bit for bit (the same sums in the same order).
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const AttentionProblem p{2, 77, 6, 3, 10};
  const PackedWindows w = pack({{77}, {77}});
  const std::vector<float> q = rng.vector<float>(p.q_size()), k = rng.vector<float>(p.kv_size()),
                           v = rng.vector<float>(p.kv_size()), dout = rng.vector<float>(p.q_size());
  std::vector<float> out, lse, out_doc, lse_doc;
  forward(p, out, lse, q, k, v);
  forward(p, out_doc, lse_doc, q, k, v, w.doc_start.data());
  EXPECT_TRUE(test::bitwise_equal(out, out_doc));
  EXPECT_TRUE(test::bitwise_equal(lse, lse_doc));
  std::vector<float> dq(p.q_size()), dk(p.kv_size()), dv(p.kv_size()), dq2(p.q_size()), dk2(p.kv_size()),
      dv2(p.kv_size());
  attention_bwd(dq.data(), dk.data(), dv.data(), dout.data(), out.data(), lse.data(), q.data(), k.data(), v.data(),
                p.batch, p.seq_len, p.n_heads, p.n_kv_heads, p.head_dim);
  attention_bwd(dq2.data(), dk2.data(), dv2.data(), dout.data(), out.data(), lse.data(), q.data(), k.data(), v.data(),
                p.batch, p.seq_len, p.n_heads, p.n_kv_heads, p.head_dim, w.doc_start.data());
  EXPECT_TRUE(test::bitwise_equal(dq, dq2));
  EXPECT_TRUE(test::bitwise_equal(dk, dk2));
  EXPECT_TRUE(test::bitwise_equal(dv, dv2));
}

TEST(AttentionDocumentsTest, BackwardMatchesFiniteDifferences) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  // seq 21: odd documents, one-token ones, and a boundary inside the first 16-column strip.
  for (const std::vector<std::vector<int64_t>>& lengths :
       {std::vector<std::vector<int64_t>>{{1, 6, 1, 13}, {21}}, {{3, 3, 3, 3, 3, 3, 3}, std::vector<int64_t>(21, 1)}}) {
    const PackedWindows w = pack(lengths);
    for (const AttentionProblem& p : {gqa_problems(21)[0], gqa_problems(21)[2]}) {
      SCOPED_TRACE(describe(p));
      std::vector<double> q = rng.vector<double>(p.q_size()), k = rng.vector<double>(p.kv_size()),
                          v = rng.vector<double>(p.kv_size());
      const std::vector<double> dout = rng.vector<double>(p.q_size());
      std::vector<double> out, lse;
      auto objective = [&] {
        forward(p, out, lse, q, k, v, w.doc_start.data());
        return test::weighted_sum(out, dout);
      };
      objective();
      std::vector<double> dq = test::nan_filled<double>(p.q_size()), dk = test::nan_filled<double>(p.kv_size()),
                          dv = test::nan_filled<double>(p.kv_size());
      attention_bwd(dq.data(), dk.data(), dv.data(), dout.data(), out.data(), lse.data(), q.data(), k.data(),
                    v.data(), p.batch, p.seq_len, p.n_heads, p.n_kv_heads, p.head_dim, w.doc_start.data());
      EXPECT_LT(test::rel_error_norm(dq, test::numeric_gradient(q, objective)), test::kFiniteDifferenceTolerance);
      EXPECT_LT(test::rel_error_norm(dk, test::numeric_gradient(k, objective)), test::kFiniteDifferenceTolerance);
      EXPECT_LT(test::rel_error_norm(dv, test::numeric_gradient(v, objective)), test::kFiniteDifferenceTolerance);
    }
  }
}

// Packed == each document alone: the forward and backward of a window equal those of its documents run as
// separate sequences, which is what the mask is for. fp32 against fp32 (different column offsets, so a few
// roundings apart, not bitwise).
TEST(AttentionDocumentsTest, PackedWindowEqualsDocumentsAlone) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const std::vector<int64_t> lengths{20, 1, 40, 7, 1, 31};  // 100 positions: boundaries in and on block edges
  const AttentionProblem packed{1, 100, 8, 2, 16};
  const PackedWindows w = pack({lengths});
  const std::vector<float> q = rng.vector<float>(packed.q_size(), -2, 2), k = rng.vector<float>(packed.kv_size(), -2, 2),
                           v = rng.vector<float>(packed.kv_size()), dout = rng.vector<float>(packed.q_size());
  std::vector<float> out, lse;
  forward(packed, out, lse, q, k, v, w.doc_start.data());
  std::vector<float> dq(packed.q_size()), dk(packed.kv_size()), dv(packed.kv_size());
  attention_bwd(dq.data(), dk.data(), dv.data(), dout.data(), out.data(), lse.data(), q.data(), k.data(), v.data(),
                packed.batch, packed.seq_len, packed.n_heads, packed.n_kv_heads, packed.head_dim, w.doc_start.data());
  const int64_t q_row = packed.n_heads * packed.head_dim, kv_row = packed.n_kv_heads * packed.head_dim;
  int64_t at = 0;
  for (int64_t n : lengths) {
    SCOPED_TRACE("document at " + std::to_string(at) + ", " + std::to_string(n) + " tokens");
    const AttentionProblem alone{1, n, packed.n_heads, packed.n_kv_heads, packed.head_dim};
    auto slice = [](const std::vector<float>& x, int64_t row, int64_t from, int64_t count) {
      return std::vector<float>(x.begin() + from * row, x.begin() + (from + count) * row);
    };
    const std::vector<float> qa = slice(q, q_row, at, n), ka = slice(k, kv_row, at, n), va = slice(v, kv_row, at, n),
                             ga = slice(dout, q_row, at, n);
    std::vector<float> oa, la;
    forward(alone, oa, la, qa, ka, va);
    std::vector<float> dqa(alone.q_size()), dka(alone.kv_size()), dva(alone.kv_size());
    attention_bwd(dqa.data(), dka.data(), dva.data(), ga.data(), oa.data(), la.data(), qa.data(), ka.data(), va.data(),
                  1, n, alone.n_heads, alone.n_kv_heads, alone.head_dim);
    EXPECT_LT(test::rel_error_norm(slice(out, q_row, at, n), oa), 1e-6);
    std::vector<float> lse_packed;
    for (int64_t h = 0; h < packed.n_heads; ++h)
      for (int64_t t = 0; t < n; ++t) lse_packed.push_back(lse[h * packed.seq_len + at + t]);
    EXPECT_LT(test::rel_error_norm(lse_packed, la), 1e-6);
    EXPECT_LT(test::rel_error_norm(slice(dq, q_row, at, n), dqa), 1e-5);
    EXPECT_LT(test::rel_error_norm(slice(dk, kv_row, at, n), dka), 1e-5);
    EXPECT_LT(test::rel_error_norm(slice(dv, kv_row, at, n), dva), 1e-5);
    at += n;
  }
}

// Key blocks wholly before a query block's documents are not read at all: NaN there cannot reach the results
// of the later document (a kernel that multiplied them by a zero weight would make NaN).
TEST(AttentionDocumentsTest, KeyBlocksOutsideTheDocumentAreSkipped) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const AttentionProblem p{1, 128, 4, 2, 16};
  const PackedWindows w = pack({{64, 64}});
  const std::vector<float> q = rng.vector<float>(p.q_size()), dout = rng.vector<float>(p.q_size());
  std::vector<float> k = rng.vector<float>(p.kv_size()), v = rng.vector<float>(p.kv_size());
  const int64_t kv_row = p.n_kv_heads * p.head_dim, q_row = p.n_heads * p.head_dim;
  std::fill(k.begin(), k.begin() + 64 * kv_row, NAN);
  std::fill(v.begin(), v.begin() + 64 * kv_row, NAN);
  std::vector<float> out, lse;
  forward(p, out, lse, q, k, v, w.doc_start.data());
  std::vector<float> dq(p.q_size()), dk(p.kv_size()), dv(p.kv_size());
  attention_bwd(dq.data(), dk.data(), dv.data(), dout.data(), out.data(), lse.data(), q.data(), k.data(), v.data(),
                p.batch, p.seq_len, p.n_heads, p.n_kv_heads, p.head_dim, w.doc_start.data());
  EXPECT_TRUE(test::all_finite(std::vector<float>(out.begin() + 64 * q_row, out.end())));
  EXPECT_TRUE(test::all_finite(std::vector<float>(dq.begin() + 64 * q_row, dq.end())));
  EXPECT_TRUE(test::all_finite(std::vector<float>(dk.begin() + 64 * kv_row, dk.end())));
  EXPECT_TRUE(test::all_finite(std::vector<float>(dv.begin() + 64 * kv_row, dv.end())));
}

TEST(AttentionDocumentsTest, BackwardIsBitIdenticalAcrossThreadCounts) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const AttentionProblem p{3, 77, 8, 2, 16};
  const std::vector<std::vector<int64_t>> layouts = document_layouts();
  const PackedWindows w = pack({layouts[0], layouts[1], layouts[3]});
  const std::vector<float> q = rng.vector<float>(p.q_size()), k = rng.vector<float>(p.kv_size()),
                           v = rng.vector<float>(p.kv_size()), dout = rng.vector<float>(p.q_size());
  std::vector<float> out, lse;
  forward(p, out, lse, q, k, v, w.doc_start.data());
  auto run = [&](int threads) {
    std::vector<float> g(p.q_size() + 2 * p.kv_size());
    test::with_omp_threads(threads, [&] {
      attention_bwd(g.data(), g.data() + p.q_size(), g.data() + p.q_size() + p.kv_size(), dout.data(), out.data(),
                    lse.data(), q.data(), k.data(), v.data(), p.batch, p.seq_len, p.n_heads, p.n_kv_heads, p.head_dim,
                    w.doc_start.data());
    });
    return g;
  };
  const std::vector<float> reference = run(1);
  for (int threads : test::determinism_thread_counts())
    EXPECT_TRUE(test::bitwise_equal(run(threads), reference)) << threads << " threads";
}

TEST(AttentionDocumentsTest, InvalidDocumentStartsAreRefused) {
  std::vector<int32_t> starts{0, 0, 2, 2, 3};  // position 4 starts at 3: neither its neighbour's start nor 4
  EXPECT_THROW(check_doc_starts(starts.data(), 1, 5), Error);
  starts = {1, 1, 2, 2, 2};  // the first token must start a document
  EXPECT_THROW(check_doc_starts(starts.data(), 1, 5), Error);
  starts = {0, 0, 2, 2, 4};
  EXPECT_NO_THROW(check_doc_starts(starts.data(), 1, 5));
  // The loader's positions: a document that began in an earlier window (positions 5, 6), then a new one.
  const std::vector<int32_t> positions{5, 6, 0, 1, 2, 0};
  std::vector<int32_t> from(6);
  doc_starts_from_positions(from.data(), positions.data(), 1, 6);
  EXPECT_EQ(from, (std::vector<int32_t>{0, 0, 2, 2, 2, 5}));
}

}  // namespace
}  // namespace tuna::cpu
