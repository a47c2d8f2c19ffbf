// kernels/cpu/rmsnorm: forward against a float64 loop, backward against finite differences, its overwrite and
// accumulate semantics, and thread-count determinism.
#include <gtest/gtest.h>

#include <cmath>

#include "kernels/cpu/rmsnorm.h"
#include "tests/kernels/op_test_util.h"

namespace tuna::cpu {
namespace {

using test::TestRng;

constexpr double kEps = 1e-5;

struct NaiveRmsnorm {
  std::vector<double> out, rstd;
};

NaiveRmsnorm naive_rmsnorm(const std::vector<double>& inp, const std::vector<double>& weight, int64_t n,
                           int64_t dim) {
  NaiveRmsnorm result{std::vector<double>(n * dim), std::vector<double>(n)};
  for (int64_t i = 0; i < n; ++i) {
    double mean_sq = 0.0;
    for (int64_t j = 0; j < dim; ++j) mean_sq += inp[i * dim + j] * inp[i * dim + j];
    mean_sq /= dim;
    result.rstd[i] = 1.0 / std::sqrt(mean_sq + kEps);
    for (int64_t j = 0; j < dim; ++j) result.out[i * dim + j] = inp[i * dim + j] * result.rstd[i] * weight[j];
  }
  return result;
}

// Float results carry one or two fp32 roundings per element (unit roundoff 6e-8); double ones differ from
// the loop only in summation order.
template <typename T>
void check_forward(TestRng& rng, double tolerance) {
  const int64_t n = 13, dim = 37;
  const std::vector<T> inp = rng.vector<T>(n * dim, -2.0, 2.0);
  const std::vector<T> weight = rng.vector<T>(dim, 0.5, 1.5);
  std::vector<T> out = test::nan_filled<T>(n * dim), rstd = test::nan_filled<T>(n);
  rmsnorm_fwd(out.data(), rstd.data(), inp.data(), weight.data(), n, dim, kEps);

  const NaiveRmsnorm expected = naive_rmsnorm(test::to_double(inp), test::to_double(weight), n, dim);
  EXPECT_LT(test::rel_error_norm(out, expected.out), tolerance);
  EXPECT_LT(test::rel_error_norm(rstd, expected.rstd), tolerance);
}

TEST(RmsnormTest, ForwardMatchesFloat64Loop) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  check_forward<float>(rng, 1e-6);
  check_forward<double>(rng, 1e-13);
}

TEST(RmsnormTest, BackwardMatchesFiniteDifferences) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const int64_t n = 5, dim = 37;
  std::vector<double> inp = rng.vector<double>(n * dim, -2.0, 2.0);
  std::vector<double> weight = rng.vector<double>(dim, 0.5, 1.5);
  const std::vector<double> dout = rng.vector<double>(n * dim);  // R of L = sum(out * R)

  std::vector<double> out(n * dim), rstd(n);
  auto objective = [&] {
    rmsnorm_fwd(out.data(), rstd.data(), inp.data(), weight.data(), n, dim, kEps);
    return test::weighted_sum(out, dout);
  };
  objective();
  std::vector<double> dinp(n * dim, 0.0), dweight = test::nan_filled<double>(dim);
  rmsnorm_bwd(dinp.data(), dweight.data(), dout.data(), inp.data(), weight.data(), rstd.data(), n, dim,
              GradWrite::Overwrite);

  EXPECT_LT(test::rel_error_norm(dinp, test::numeric_gradient(inp, objective)), test::kFiniteDifferenceTolerance);
  EXPECT_LT(test::rel_error_norm(dweight, test::numeric_gradient(weight, objective)),
            test::kFiniteDifferenceTolerance);
}

// dinp always accumulates; dweight accumulates or is overwritten (over NaN: never read) by its GradWrite.
TEST(RmsnormTest, BackwardAccumulatesDinpAndOverwritesOrAccumulatesDweight) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const int64_t n = 13, dim = 37;
  const std::vector<float> inp = rng.vector<float>(n * dim, -2.0, 2.0);
  const std::vector<float> weight = rng.vector<float>(dim, 0.5, 1.5);
  const std::vector<float> dout = rng.vector<float>(n * dim);
  std::vector<float> out(n * dim), rstd(n);
  rmsnorm_fwd(out.data(), rstd.data(), inp.data(), weight.data(), n, dim, kEps);

  std::vector<float> fresh_dinp(n * dim, 0.0f), fresh_dweight(dim, 0.0f);
  rmsnorm_bwd(fresh_dinp.data(), fresh_dweight.data(), dout.data(), inp.data(), weight.data(), rstd.data(), n,
              dim, GradWrite::Accumulate);
  const std::vector<float> prior_dinp = rng.vector<float>(n * dim), prior_dweight = rng.vector<float>(dim);
  std::vector<float> dinp = prior_dinp, dweight = prior_dweight;
  rmsnorm_bwd(dinp.data(), dweight.data(), dout.data(), inp.data(), weight.data(), rstd.data(), n, dim,
              GradWrite::Accumulate);

  std::vector<double> expected_dinp(n * dim), expected_dweight(dim);
  for (int64_t i = 0; i < n * dim; ++i) expected_dinp[i] = double(prior_dinp[i]) + fresh_dinp[i];
  for (int64_t j = 0; j < dim; ++j) expected_dweight[j] = double(prior_dweight[j]) + fresh_dweight[j];
  // One extra fp32 rounding of the sum, plus the fresh gradient's own rounding: a few ulps.
  EXPECT_LT(test::rel_error_norm(dinp, expected_dinp), 1e-6);
  EXPECT_LT(test::rel_error_norm(dweight, expected_dweight), 1e-6);

  // Overwrite: the same sums as accumulating onto zeros, whatever dweight held.
  dinp = prior_dinp;
  std::vector<float> overwritten = test::nan_filled<float>(dim);
  rmsnorm_bwd(dinp.data(), overwritten.data(), dout.data(), inp.data(), weight.data(), rstd.data(), n, dim,
              GradWrite::Overwrite);
  EXPECT_EQ(overwritten, fresh_dweight);
  EXPECT_LT(test::rel_error_norm(dinp, expected_dinp), 1e-6);

  // No rows: an overwritten dweight is zero, an accumulated one unchanged.
  overwritten = test::nan_filled<float>(dim);
  dweight = prior_dweight;
  rmsnorm_bwd(dinp.data(), overwritten.data(), dout.data(), inp.data(), weight.data(), rstd.data(), 0, dim,
              GradWrite::Overwrite);
  rmsnorm_bwd(dinp.data(), dweight.data(), dout.data(), inp.data(), weight.data(), rstd.data(), 0, dim,
              GradWrite::Accumulate);
  EXPECT_EQ(overwritten, std::vector<float>(dim, 0.0f));
  EXPECT_EQ(dweight, prior_dweight);

  // A null dweight (a frozen weight): the same input gradient, no weight gradient.
  std::vector<float> frozen_dinp = prior_dinp;
  rmsnorm_bwd(frozen_dinp.data(), static_cast<float*>(nullptr), dout.data(), inp.data(), weight.data(), rstd.data(), n,
              dim, GradWrite::Accumulate);
  dinp = prior_dinp;
  rmsnorm_bwd(dinp.data(), dweight.data(), dout.data(), inp.data(), weight.data(), rstd.data(), n, dim,
              GradWrite::Accumulate);
  EXPECT_EQ(frozen_dinp, dinp);
}

TEST(RmsnormTest, BackwardIsBitIdenticalAcrossThreadCounts) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const int64_t n = 67, dim = 300;  // several column blocks and uneven row splits
  const std::vector<float> inp = rng.vector<float>(n * dim, -2.0, 2.0);
  const std::vector<float> weight = rng.vector<float>(dim, 0.5, 1.5);
  const std::vector<float> dout = rng.vector<float>(n * dim);
  const std::vector<float> prior_dinp = rng.vector<float>(n * dim), prior_dweight = rng.vector<float>(dim);
  std::vector<float> out(n * dim), rstd(n);
  rmsnorm_fwd(out.data(), rstd.data(), inp.data(), weight.data(), n, dim, kEps);

  auto run = [&](int threads, std::vector<float>& dinp, std::vector<float>& dweight) {
    dinp = prior_dinp;
    dweight = prior_dweight;
    test::with_omp_threads(threads, [&] {
      rmsnorm_bwd(dinp.data(), dweight.data(), dout.data(), inp.data(), weight.data(), rstd.data(), n, dim,
                  GradWrite::Accumulate);
    });
  };
  std::vector<float> reference_dinp, reference_dweight;
  run(1, reference_dinp, reference_dweight);
  for (int threads : test::determinism_thread_counts()) {
    std::vector<float> dinp, dweight;
    run(threads, dinp, dweight);
    EXPECT_TRUE(test::bitwise_equal(dinp, reference_dinp)) << threads << " threads";
    EXPECT_TRUE(test::bitwise_equal(dweight, reference_dweight)) << threads << " threads";
  }
}

}  // namespace
}  // namespace tuna::cpu
