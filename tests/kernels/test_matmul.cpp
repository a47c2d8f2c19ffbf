// kernels/cpu/matmul: nn.Linear forward against a float64 loop, backward against finite differences,
// overwrite/accumulate semantics of dinp and dweight, a null dinp or dweight, and no rows.
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
  for (const auto& [n, ic, oc] : {std::tuple<int64_t, int64_t, int64_t>{1000, 136, 120}, {77, 520, 300}, {4099, 64, 40}}) {
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

}  // namespace
}  // namespace tuna::cpu
