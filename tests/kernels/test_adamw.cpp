// kernels/cpu/adamw: the update against numbers from torch.optim.AdamW and against the formula on random
// state; sum_of_squares against a float64 loop and across thread counts.
#include <gtest/gtest.h>

#include <cmath>

#include "kernels/cpu/adamw.h"
#include "tests/kernels/op_test_util.h"

namespace tuna::cpu {
namespace {

using test::TestRng;

TEST(AdamwTest, MatchesTorchAdamW) {
  // torch 2.5 optim.AdamW(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False) in float64,
  // three steps, fed grad * 0.5 (we feed grad and grad_scale 0.5). Inputs are exact in fp32; our state is
  // fp32 between steps, so agreement is to a few fp32 ulps.
  std::vector<float> param = {0.5f, -1.25f, 2.0f, 0.0f, 0.003f};
  const std::vector<std::vector<float>> grads = {
      {0.25f, -1.5f, 3.0f, 0.0f, -0.0625f}, {-0.5f, -1.0f, 2.5f, 0.125f, 0.0f}, {1.0f, 0.75f, -4.0f, 0.0f, 0.5f}};
  const std::vector<std::vector<double>> torch_params = {
      {0.48950000079999995, -1.2387500001333334, 1.9880000000666667, 0.0, 0.012996996800001024},
      {0.49264424012151714, -1.2277604626108658, 1.9760777248476058, -0.0073495983809313868, 0.019770474159952908},
      {0.48802873555861281, -1.2220132796621375, 1.9733286854543066, -0.013096967781922732, 0.014188566656281605}};
  const std::vector<double> torch_m = {0.037624999999999992, -0.068249999999999991, 0.034000000000000023,
                                       0.0056249999999999989, 0.022468749999999996};
  const std::vector<double> torch_v = {0.016173828125000015, 0.044289062500000045, 0.37575000000000036,
                                       0.00018554687500000016, 0.0031690673828125029};
  std::vector<float> m(5, 0.0f), v(5, 0.0f);
  for (int64_t step = 1; step <= 3; ++step) {
    const AdamWStep s{.lr = 0.01, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .step = step,
                      .grad_scale = 0.5};
    adamw_update(param.data(), grads[step - 1].data(), m.data(), v.data(), 5, s);
    for (int i = 0; i < 5; ++i) EXPECT_NEAR(param[i], torch_params[step - 1][i], 1e-6) << "step " << step << ", i " << i;
  }
  EXPECT_LT(test::rel_error_norm(m, torch_m), 1e-6);
  EXPECT_LT(test::rel_error_norm(v, torch_v), 1e-6);
}

TEST(AdamwTest, MatchesFormulaOnRandomState) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const int64_t n = 1037;
  for (int trial = 0; trial < 4; ++trial) {
    const AdamWStep s{.lr = rng.uniform(1e-5, 1e-2), .beta1 = rng.uniform(0.8, 0.95), .beta2 = rng.uniform(0.9, 0.999),
                      .eps = 1e-8, .weight_decay = trial == 0 ? 0.0 : rng.uniform(0.0, 0.2),
                      .step = rng.integer(1, 5000), .grad_scale = rng.uniform(0.01, 2.0)};
    std::vector<float> param = rng.vector<float>(n), grad = rng.vector<float>(n, -3.0, 3.0),
                       m = rng.vector<float>(n, -0.1, 0.1), v = rng.vector<float>(n, 0.0, 0.01);
    std::vector<double> expected_param(n), expected_m(n), expected_v(n);
    for (int64_t i = 0; i < n; ++i) {
      const double g = grad[i] * s.grad_scale;
      expected_m[i] = s.beta1 * m[i] + (1 - s.beta1) * g;
      expected_v[i] = s.beta2 * v[i] + (1 - s.beta2) * g * g;
      const double m_hat = expected_m[i] / (1 - std::pow(s.beta1, s.step));
      const double v_hat = expected_v[i] / (1 - std::pow(s.beta2, s.step));
      // sqrt(v)/sqrt(bc2) + eps = sqrt(v_hat) + eps: torch's denominator, rewritten.
      expected_param[i] = param[i] * (1 - s.lr * s.weight_decay) - s.lr * m_hat / (std::sqrt(v_hat) + s.eps);
    }
    adamw_update(param.data(), grad.data(), m.data(), v.data(), n, s);
    // Double arithmetic, one fp32 rounding per stored value.
    EXPECT_LT(test::rel_error_norm(param, expected_param), 1e-7) << "trial " << trial;
    EXPECT_LT(test::rel_error_norm(m, expected_m), 1e-7) << "trial " << trial;
    EXPECT_LT(test::rel_error_norm(v, expected_v), 1e-7) << "trial " << trial;
  }
}

TEST(SumOfSquaresTest, MatchesFloat64Loop) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  for (int64_t n : {0, 1, 37, 100003}) {
    const std::vector<float> x = rng.vector<float>(n, -2.0, 2.0);
    double expected = 0.0;
    for (float value : x) expected += double(value) * value;
    // Only the summation order differs: relative 1e-15 or so in double.
    EXPECT_NEAR(sum_of_squares(x.data(), n), expected, 1e-12 * expected) << "n " << n;
  }
}

TEST(SumOfSquaresTest, IsBitIdenticalAcrossThreadCounts) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const int64_t n = 100003;  // several chunks plus a partial one
  const std::vector<float> x = rng.vector<float>(n, -2.0, 2.0);
  double reference = 0.0;
  test::with_omp_threads(1, [&] { reference = sum_of_squares(x.data(), n); });
  for (int threads : test::determinism_thread_counts()) {
    double result = 0.0;
    test::with_omp_threads(threads, [&] { result = sum_of_squares(x.data(), n); });
    EXPECT_TRUE(test::bitwise_equal(std::vector<double>{result}, std::vector<double>{reference}))
        << threads << " threads: " << result << " vs " << reference;
  }
}

TEST(AccumulateTest, AddsElementwise) {
  test::TestRng rng;
  SCOPED_TRACE(rng.describe());
  const int64_t n = 1001;
  std::vector<float> dst = rng.vector<float>(n, -2.0, 2.0);
  const std::vector<float> src = rng.vector<float>(n, -2.0, 2.0), before = dst;
  accumulate(dst.data(), src.data(), n);
  for (int64_t i = 0; i < n; i++) EXPECT_EQ(dst[i], before[i] + src[i]) << i;
}

}  // namespace
}  // namespace tuna::cpu
