// kernels/cpu/swiglu: forward against a float64 loop, backward against finite differences, overwrite
// semantics and saturation at large |gate|.
#include <gtest/gtest.h>

#include <cmath>

#include "kernels/cpu/swiglu.h"
#include "tests/kernels/op_test_util.h"

namespace tuna::cpu {
namespace {

using test::TestRng;

// Float: expf and a few products in fp32.
template <typename T>
void check_forward(TestRng& rng, double tolerance) {
  const int64_t n = 13 * 37;
  const std::vector<T> gate = rng.vector<T>(n, -6.0, 6.0), up = rng.vector<T>(n, -2.0, 2.0);
  std::vector<T> out = test::nan_filled<T>(n);
  swiglu_fwd(out.data(), gate.data(), up.data(), n);
  std::vector<double> expected(n);
  for (int64_t i = 0; i < n; ++i) expected[i] = double(gate[i]) / (1.0 + std::exp(-double(gate[i]))) * up[i];
  EXPECT_LT(test::rel_error_norm(out, expected), tolerance);
}

TEST(SwigluTest, ForwardMatchesFloat64Loop) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  check_forward<float>(rng, 1e-6);
  check_forward<double>(rng, 1e-14);
}

TEST(SwigluTest, BackwardMatchesFiniteDifferences) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const int64_t n = 3 * 37;
  std::vector<double> gate = rng.vector<double>(n, -6.0, 6.0), up = rng.vector<double>(n, -2.0, 2.0);
  const std::vector<double> dout = rng.vector<double>(n);
  std::vector<double> out(n);
  auto objective = [&] {
    swiglu_fwd(out.data(), gate.data(), up.data(), n);
    return test::weighted_sum(out, dout);
  };
  std::vector<double> dgate = test::nan_filled<double>(n), dup = test::nan_filled<double>(n);
  swiglu_bwd(dgate.data(), dup.data(), dout.data(), gate.data(), up.data(), n);
  EXPECT_LT(test::rel_error_norm(dgate, test::numeric_gradient(gate, objective)), test::kFiniteDifferenceTolerance);
  EXPECT_LT(test::rel_error_norm(dup, test::numeric_gradient(up, objective)), test::kFiniteDifferenceTolerance);
}

TEST(SwigluTest, SaturatesWithoutNaNForLargeGates) {
  // silu(x) -> x for x >> 0 and -> 0 for x << 0; exp(-x) overflowing to inf must give 0, not NaN.
  const std::vector<float> gate = {-1000.0f, -100.0f, 100.0f, 1000.0f}, up(4, 2.0f), dout(4, 1.0f);
  std::vector<float> out(4), dgate(4), dup(4);
  swiglu_fwd(out.data(), gate.data(), up.data(), 4);
  swiglu_bwd(dgate.data(), dup.data(), dout.data(), gate.data(), up.data(), 4);
  EXPECT_TRUE(test::all_finite(out) && test::all_finite(dgate) && test::all_finite(dup));
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_EQ(out[3], 2000.0f);
  EXPECT_EQ(dgate[0], 0.0f);
  EXPECT_EQ(dgate[3], 2.0f);
}

}  // namespace
}  // namespace tuna::cpu
