// kernels/cpu/vector_math.h: exp_lanes within 1 ulp of exp on its range (against double exp, in a loop the
// compiler vectorizes for this CPU), exact at 0, 0 and inf beyond its range, NaN through.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/vector_math.h"

namespace tuna::cpu {
namespace {

// The gap between x's magnitude and the next float up: one ulp.
double ulp_of(double x) {
  const float f = static_cast<float>(std::fabs(x));
  return std::nextafter(f, std::numeric_limits<float>::infinity()) - f;
}

TUNA_CPU_CLONES void exp_loop(float* out, const float* in, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = exp_lanes(in[i]);
}

TEST(VectorMath, ExpIsWithinOneUlpOnItsRange) {
  const int64_t n = 400001;
  std::vector<float> x(n), y(n);
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(-87.3 + (88.7 + 87.3) * double(i) / double(n - 1));
  exp_loop(y.data(), x.data(), n);
  double worst = 0;
  float worst_at = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double exact = std::exp(static_cast<double>(x[i]));
    const double ulps = std::fabs(y[i] - exact) / ulp_of(exact);
    if (ulps > worst) worst = ulps, worst_at = x[i];
  }
  EXPECT_LE(worst, 1.0) << "at x = " << worst_at;
}

TEST(VectorMath, ExpAtZeroClampsAndNan) {
  EXPECT_EQ(exp_lanes(0.0f), 1.0f);
  EXPECT_EQ(exp_lanes(-1000.0f), 0.0f);  // underflow, as exp
  EXPECT_EQ(exp_lanes(1000.0f), std::numeric_limits<float>::infinity());  // overflow, as exp
  EXPECT_EQ(1.0f / (1.0f + exp_lanes(1000.0f)), 0.0f);  // a sigmoid's far end: a clean 0, not NaN
  EXPECT_GT(exp_lanes(-87.0f), 0.0f);
  EXPECT_TRUE(std::isfinite(exp_lanes(88.5f)));
  EXPECT_TRUE(std::isnan(exp_lanes(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_EQ(exp_lanes(1.0), std::exp(1.0));  // the double overload is std::exp
}

}  // namespace
}  // namespace tuna::cpu
