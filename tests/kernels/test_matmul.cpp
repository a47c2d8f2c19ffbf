// kernels/cpu/matmul: nn.Linear forward against a float64 loop, backward against finite differences,
// overwrite/accumulate semantics of dinp and dweight, a null dinp or dweight, and no rows; the general gemm (both
// transposes, alpha, beta, leading dimensions wider than the rows) against a float64 loop; every product bit for bit
// the same at any thread count, split by rows or by columns; and the GEMM counter.
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "kernels/cpu/matmul.h"
#include "tests/kernels/op_test_util.h"

namespace tuna::cpu {
namespace {

using test::TestRng;

// Not round, and n != ic != oc so any transposed index shows up.
constexpr int64_t kRows = 13, kIn = 37, kOut = 19;

// Float: a 37-term fp32 dot product per output; its error bound is ~ic * 6e-8 but typical error far less.
template <typename T>
void check_forward(TestRng& rng, double tolerance) {
  const std::vector<T> inp = rng.vector<T>(kRows * kIn), weight = rng.vector<T>(kOut * kIn);
  std::vector<T> out = test::nan_filled<T>(kRows * kOut);
  matmul_fwd(out.data(), inp.data(), weight.data(), kRows, kIn, kOut);
  std::vector<double> expected(kRows * kOut, 0.0);
  for (int64_t i = 0; i < kRows; ++i)
    for (int64_t o = 0; o < kOut; ++o)
      for (int64_t c = 0; c < kIn; ++c) expected[i * kOut + o] += double(inp[i * kIn + c]) * weight[o * kIn + c];
  EXPECT_LT(test::rel_error_norm(out, expected), tolerance);
}

TEST(MatmulTest, ForwardMatchesFloat64Loop) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  check_forward<float>(rng, 1e-6);
  check_forward<double>(rng, 1e-14);
}

TEST(MatmulTest, BackwardMatchesFiniteDifferences) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  std::vector<double> inp = rng.vector<double>(kRows * kIn), weight = rng.vector<double>(kOut * kIn);
  const std::vector<double> dout = rng.vector<double>(kRows * kOut);
  std::vector<double> out(kRows * kOut);
  auto objective = [&] {
    matmul_fwd(out.data(), inp.data(), weight.data(), kRows, kIn, kOut);
    return test::weighted_sum(out, dout);
  };
  std::vector<double> dinp = test::nan_filled<double>(kRows * kIn), dweight = test::nan_filled<double>(kOut * kIn);
  matmul_bwd(dinp.data(), dweight.data(), dout.data(), inp.data(), weight.data(), kRows, kIn, kOut,
             /*accumulate_dinp=*/false, GradWrite::Overwrite);
  EXPECT_LT(test::rel_error_norm(dinp, test::numeric_gradient(inp, objective)), test::kFiniteDifferenceTolerance);
  EXPECT_LT(test::rel_error_norm(dweight, test::numeric_gradient(weight, objective)),
            test::kFiniteDifferenceTolerance);
}

TEST(MatmulTest, BackwardAccumulatesWhereAsked) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const std::vector<double> inp = rng.vector<double>(kRows * kIn), weight = rng.vector<double>(kOut * kIn),
                            dout = rng.vector<double>(kRows * kOut);
  // Fresh gradients: dinp overwritten over NaN, dweight added to zeros, and dweight overwritten over NaN.
  std::vector<double> fresh_dinp = test::nan_filled<double>(kRows * kIn), fresh_dweight(kOut * kIn, 0.0);
  matmul_bwd(fresh_dinp.data(), fresh_dweight.data(), dout.data(), inp.data(), weight.data(), kRows, kIn, kOut,
             /*accumulate_dinp=*/false, GradWrite::Accumulate);
  ASSERT_TRUE(test::all_finite(fresh_dinp));
  std::vector<double> overwritten_dweight = test::nan_filled<double>(kOut * kIn);
  matmul_bwd<double>(nullptr, overwritten_dweight.data(), dout.data(), inp.data(), weight.data(), kRows, kIn, kOut,
                     /*accumulate_dinp=*/false, GradWrite::Overwrite);
  EXPECT_EQ(overwritten_dweight, fresh_dweight);

  const std::vector<double> prior_dinp = rng.vector<double>(kRows * kIn), prior_dweight = rng.vector<double>(kOut * kIn);
  std::vector<double> dinp = prior_dinp, dweight = prior_dweight;
  matmul_bwd(dinp.data(), dweight.data(), dout.data(), inp.data(), weight.data(), kRows, kIn, kOut,
             /*accumulate_dinp=*/true, GradWrite::Accumulate);
  std::vector<double> expected_dinp(kRows * kIn), expected_dweight(kOut * kIn);
  for (size_t i = 0; i < expected_dinp.size(); ++i) expected_dinp[i] = prior_dinp[i] + fresh_dinp[i];
  for (size_t i = 0; i < expected_dweight.size(); ++i) expected_dweight[i] = prior_dweight[i] + fresh_dweight[i];
  EXPECT_LT(test::rel_error_norm(dinp, expected_dinp), 1e-14);
  EXPECT_LT(test::rel_error_norm(dweight, expected_dweight), 1e-14);

  // accumulate_dinp = false overwrites dinp whatever dweight does; and the reverse.
  dinp = prior_dinp;
  dweight = prior_dweight;
  matmul_bwd(dinp.data(), dweight.data(), dout.data(), inp.data(), weight.data(), kRows, kIn, kOut,
             /*accumulate_dinp=*/false, GradWrite::Accumulate);
  EXPECT_LT(test::rel_error_norm(dinp, fresh_dinp), 1e-14);
  EXPECT_LT(test::rel_error_norm(dweight, expected_dweight), 1e-14);
  dinp = prior_dinp;
  dweight = prior_dweight;
  matmul_bwd(dinp.data(), dweight.data(), dout.data(), inp.data(), weight.data(), kRows, kIn, kOut,
             /*accumulate_dinp=*/true, GradWrite::Overwrite);
  EXPECT_LT(test::rel_error_norm(dinp, expected_dinp), 1e-14);
  EXPECT_EQ(dweight, fresh_dweight);

  // A null dinp (a layer whose input needs no gradient) skips it; a null dweight skips that.
  dweight = prior_dweight;
  matmul_bwd<double>(nullptr, dweight.data(), dout.data(), inp.data(), weight.data(), kRows, kIn, kOut,
                     /*accumulate_dinp=*/false, GradWrite::Accumulate);
  EXPECT_LT(test::rel_error_norm(dweight, expected_dweight), 1e-14);
  dinp = test::nan_filled<double>(kRows * kIn);
  matmul_bwd<double>(dinp.data(), nullptr, dout.data(), inp.data(), weight.data(), kRows, kIn, kOut,
                     /*accumulate_dinp=*/false, GradWrite::Overwrite);
  EXPECT_LT(test::rel_error_norm(dinp, fresh_dinp), 1e-14);

  // No rows: an overwritten dweight is zero, an accumulated one unchanged.
  std::vector<double> empty_overwritten = test::nan_filled<double>(kOut * kIn);
  dweight = prior_dweight;
  matmul_bwd<double>(nullptr, empty_overwritten.data(), dout.data(), inp.data(), weight.data(), 0, kIn, kOut,
                     /*accumulate_dinp=*/false, GradWrite::Overwrite);
  matmul_bwd<double>(nullptr, dweight.data(), dout.data(), inp.data(), weight.data(), 0, kIn, kOut,
                     /*accumulate_dinp=*/false, GradWrite::Accumulate);
  EXPECT_EQ(empty_overwritten, std::vector<double>(kOut * kIn, 0.0));
  EXPECT_EQ(dweight, prior_dweight);
}

// The rows of each GEMM are split over the OpenMP threads (kernels/cpu/matmul.cpp): forward, dinp and dweight
// (each overwritten and accumulated) bit for bit the same at any thread count, on shapes large enough to be
// split, with row counts that do not divide into the 16-row blocks.
TEST(MatmulTest, BitIdenticalAcrossThreadCounts) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  // The last two have fewer output features than 2 x 16 per thread: their weight gradient is split by columns.
  for (const auto& [n, ic, oc] : {std::tuple<int64_t, int64_t, int64_t>{1000, 136, 120}, {77, 520, 300}, {4099, 64, 40},
                                  {1000, 600, 16}, {517, 1100, 48}}) {
    SCOPED_TRACE("n " + std::to_string(n) + ", ic " + std::to_string(ic) + ", oc " + std::to_string(oc));
    const std::vector<float> inp = rng.vector<float>(n * ic), weight = rng.vector<float>(oc * ic);
    const std::vector<float> dout = rng.vector<float>(n * oc), prior_dinp = rng.vector<float>(n * ic);
    const std::vector<float> prior_dweight = rng.vector<float>(oc * ic);
    struct Result {
      std::vector<float> out, dinp_overwritten, dinp_accumulated, dweight_overwritten, dweight_accumulated;
    };
    auto run = [&](int threads) {
      Result r{std::vector<float>(n * oc), std::vector<float>(n * ic), prior_dinp, std::vector<float>(oc * ic),
               prior_dweight};
      test::with_omp_threads(threads, [&] {
        matmul_fwd(r.out.data(), inp.data(), weight.data(), n, ic, oc);
        matmul_bwd(r.dinp_overwritten.data(), r.dweight_overwritten.data(), dout.data(), inp.data(), weight.data(), n,
                   ic, oc, false, GradWrite::Overwrite);
        matmul_bwd(r.dinp_accumulated.data(), r.dweight_accumulated.data(), dout.data(), inp.data(), weight.data(), n,
                   ic, oc, true, GradWrite::Accumulate);
      });
      return r;
    };
    const Result reference = run(1);
    for (int threads : test::determinism_thread_counts()) {
      const Result r = run(threads);
      EXPECT_TRUE(test::bitwise_equal(r.out, reference.out)) << threads << " threads";
      EXPECT_TRUE(test::bitwise_equal(r.dinp_overwritten, reference.dinp_overwritten)) << threads << " threads";
      EXPECT_TRUE(test::bitwise_equal(r.dinp_accumulated, reference.dinp_accumulated)) << threads << " threads";
      EXPECT_TRUE(test::bitwise_equal(r.dweight_overwritten, reference.dweight_overwritten)) << threads << " threads";
      EXPECT_TRUE(test::bitwise_equal(r.dweight_accumulated, reference.dweight_accumulated)) << threads << " threads";
    }
  }
}

// c[m, n] = alpha op(a) op(b) + beta c over column blocks of wider matrices: each operand's rows `pad` wider than
// its width, against a float64 loop; beta = 0 does not read c (NaN there stays out of the result), and the padding
// columns of c are left as they were.
TEST(MatmulTest, GemmMatchesFloat64LoopWithTransposesScalesAndStrides) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  constexpr int64_t m = 45, n = 23, k = 70, pad = 5;
  for (bool trans_a : {false, true})
    for (bool trans_b : {false, true})
      for (double beta : {0.0, 1.0, -0.5}) {
        SCOPED_TRACE(std::string("trans_a ") + (trans_a ? "1" : "0") + ", trans_b " + (trans_b ? "1" : "0") +
                     ", beta " + std::to_string(beta));
        const int64_t lda = (trans_a ? m : k) + pad, ldb = (trans_b ? k : n) + pad, ldc = n + pad;
        const std::vector<double> a = rng.vector<double>((trans_a ? k : m) * lda);
        const std::vector<double> b = rng.vector<double>((trans_b ? n : k) * ldb);
        std::vector<double> c = beta == 0 ? test::nan_filled<double>(m * ldc) : rng.vector<double>(m * ldc);
        for (int64_t i = 0; i < m; i++)  // the padding: a value the product must not touch
          for (int64_t j = n; j < ldc; j++) c[i * ldc + j] = 7.0;
        std::vector<double> expected = c;
        const double alpha = 0.75;
        for (int64_t i = 0; i < m; i++)
          for (int64_t j = 0; j < n; j++) {
            double sum = 0;
            for (int64_t p = 0; p < k; p++)
              sum += (trans_a ? a[p * lda + i] : a[i * lda + p]) * (trans_b ? b[j * ldb + p] : b[p * ldb + j]);
            expected[i * ldc + j] = alpha * sum + (beta == 0 ? 0.0 : beta * c[i * ldc + j]);
          }
        gemm<double>(trans_a, trans_b, m, n, k, alpha, a.data(), lda, b.data(), ldb, beta, c.data(), ldc);
        EXPECT_LT(test::rel_error_norm(c, expected), 1e-14);
        for (int64_t i = 0; i < m; i++)
          for (int64_t j = n; j < ldc; j++) ASSERT_EQ(c[i * ldc + j], 7.0);
      }
}

// gemm's products split by rows (many rows) and by columns (an adapter's r x in gradient: few rows, many columns), at
// column offsets of wider matrices: bit for bit the same at any thread count.
TEST(MatmulTest, GemmBitIdenticalAcrossThreadCounts) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  for (const auto& [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{1000, 48, 600}, {16, 1100, 1000}, {48, 600, 517}}) {
    SCOPED_TRACE("m " + std::to_string(m) + ", n " + std::to_string(n) + ", k " + std::to_string(k));
    const int64_t ld = n + 16;
    const std::vector<float> a = rng.vector<float>(k * m), b = rng.vector<float>(k * ld), prior = rng.vector<float>(m * ld);
    auto run = [&](int threads) {
      std::vector<float> c = prior;
      test::with_omp_threads(threads, [&] {
        gemm<float>(/*trans_a=*/true, /*trans_b=*/false, m, n, k, 0.5f, a.data(), m, b.data() + 8, ld, 1.0f,
                    c.data() + 8, ld);
      });
      return c;
    };
    const std::vector<float> reference = run(1);
    for (int threads : test::determinism_thread_counts())
      EXPECT_TRUE(test::bitwise_equal(run(threads), reference)) << threads << " threads";
  }
}

// One call and m n k multiply-adds per product; an empty one is not counted.
TEST(MatmulTest, GemmCountCountsProductsAndMultiplyAdds) {
  std::vector<float> a(6 * 5, 1.0f), b(5 * 4, 1.0f), c(6 * 4);
  const GemmCount before = gemm_count();
  matmul_fwd(c.data(), a.data(), b.data(), 6, 5, 4);  // [6, 5] x [4, 5]^T
  gemm<float>(false, false, 6, 4, 5, 1.0f, a.data(), 5, b.data(), 4, 0.0f, c.data(), 4);
  gemm<float>(false, false, 0, 4, 5, 1.0f, a.data(), 5, b.data(), 4, 0.0f, c.data(), 4);
  const GemmCount after = gemm_count();
  EXPECT_EQ(after.calls - before.calls, 2);
  EXPECT_EQ(after.multiply_adds - before.multiply_adds, 2 * 6 * 4 * 5);
}

}  // namespace
}  // namespace tuna::cpu
