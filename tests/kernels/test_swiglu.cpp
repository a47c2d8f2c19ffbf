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
  swiglu_fwd(out.data(), gate.data(), up.data(), 1, n, n);
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
    swiglu_fwd(out.data(), gate.data(), up.data(), 3, 37, 37);
    return test::weighted_sum(out, dout);
  };
  std::vector<double> dgate = test::nan_filled<double>(n), dup = test::nan_filled<double>(n);
  swiglu_bwd(dgate.data(), dup.data(), dout.data(), gate.data(), up.data(), 3, 37, 37);
  EXPECT_LT(test::rel_error_norm(dgate, test::numeric_gradient(gate, objective)), test::kFiniteDifferenceTolerance);
  EXPECT_LT(test::rel_error_norm(dup, test::numeric_gradient(up, objective)), test::kFiniteDifferenceTolerance);
}

TEST(SwigluTest, SaturatesWithoutNaNForLargeGates) {
  // silu(x) -> x for x >> 0 and -> 0 for x << 0; exp(-x) overflowing to inf must give 0, not NaN.
  const std::vector<float> gate = {-1000.0f, -100.0f, 100.0f, 1000.0f}, up(4, 2.0f), dout(4, 1.0f);
  std::vector<float> out(4), dgate(4), dup(4);
  swiglu_fwd(out.data(), gate.data(), up.data(), 1, 4, 4);
  swiglu_bwd(dgate.data(), dup.data(), dout.data(), gate.data(), up.data(), 2, 2, 2);
  EXPECT_TRUE(test::all_finite(out) && test::all_finite(dgate) && test::all_finite(dup));
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_EQ(out[3], 2000.0f);
  EXPECT_EQ(dgate[0], 0.0f);
  EXPECT_EQ(dgate[3], 2.0f);
}

TEST(SwigluTest, StridedRowsEqualContiguousRows) {
  // The model's gate and up are the two halves of one fused [rows, 2 cols] GEMM output, and its backward writes
  // d_gate, d_up in place over them: the same bits as separate contiguous arrays, for the fused layout, an odd
  // stride, and blocks that split a row (cols > the 4096-element work item); nothing between the rows written.
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{7, 37}, {3, 4096 + 100}}) {
    SCOPED_TRACE("rows " + std::to_string(rows) + ", cols " + std::to_string(cols));
    const int64_t n = rows * cols;
    const std::vector<float> gate = rng.vector<float>(n, -6.0, 6.0), up = rng.vector<float>(n, -2.0, 2.0),
                             dout = rng.vector<float>(n);
    std::vector<float> out(n), dgate(n), dup(n);
    swiglu_fwd(out.data(), gate.data(), up.data(), rows, cols, cols);
    swiglu_bwd(dgate.data(), dup.data(), dout.data(), gate.data(), up.data(), rows, cols, cols);
    for (int64_t stride : {2 * cols, 2 * cols + 3}) {
      SCOPED_TRACE("stride " + std::to_string(stride));
      // gate in columns [0, cols) of each row, up in [cols, 2 cols), NaN in the rest of the stride.
      std::vector<float> gate_up = test::nan_filled<float>(rows * stride);
      for (int64_t r = 0; r < rows; ++r) {
        std::copy(gate.begin() + r * cols, gate.begin() + (r + 1) * cols, gate_up.begin() + r * stride);
        std::copy(up.begin() + r * cols, up.begin() + (r + 1) * cols, gate_up.begin() + r * stride + cols);
      }
      std::vector<float> fused_out = test::nan_filled<float>(n);
      swiglu_fwd(fused_out.data(), gate_up.data(), gate_up.data() + cols, rows, cols, stride);
      EXPECT_TRUE(test::bitwise_equal(fused_out, out));
      std::vector<float> d_gate_up = gate_up;  // in place: d_gate over gate, d_up over up
      swiglu_bwd(d_gate_up.data(), d_gate_up.data() + cols, dout.data(), d_gate_up.data(), d_gate_up.data() + cols,
                 rows, cols, stride);
      std::vector<float> expected = test::nan_filled<float>(rows * stride);
      for (int64_t r = 0; r < rows; ++r) {
        std::copy(dgate.begin() + r * cols, dgate.begin() + (r + 1) * cols, expected.begin() + r * stride);
        std::copy(dup.begin() + r * cols, dup.begin() + (r + 1) * cols, expected.begin() + r * stride + cols);
      }
      EXPECT_TRUE(test::bitwise_equal(d_gate_up, expected));
    }
  }
}

}  // namespace
}  // namespace tuna::cpu
