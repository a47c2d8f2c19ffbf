// kernels/cpu/rope: inverse frequencies (default and llama3 scaling), tables, forward against a float64
// loop, backward against finite differences, in-place calls, bad configuration errors.
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

#include "core/error.h"
#include "kernels/cpu/rope.h"
#include "tests/kernels/op_test_util.h"

namespace tuna::cpu {
namespace {

using test::TestRng;

RopeScaling llama31_scaling() {
  RopeScaling scaling;
  scaling.type = "llama3";
  scaling.factor = 8.0;
  scaling.low_freq_factor = 1.0;
  scaling.high_freq_factor = 4.0;
  scaling.original_max_position_embeddings = 8192;
  return scaling;
}

// The llama3 rule written independently of the kernel: classify by position in the original context
// (original / wavelen = how many periods fit in it) instead of by wavelength thresholds.
double expected_llama3(double inv_freq, const RopeScaling& s) {
  const double periods_in_context =
      static_cast<double>(s.original_max_position_embeddings) * inv_freq / (2.0 * std::numbers::pi);
  if (periods_in_context < s.low_freq_factor) return inv_freq / s.factor;  // long wavelengths: stretched
  if (periods_in_context > s.high_freq_factor) return inv_freq;             // short wavelengths: kept
  const double blend = (periods_in_context - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
  return inv_freq * (blend + (1.0 - blend) / s.factor);
}

TEST(RopeTest, DefaultInvFreqIsThetaPower) {
  for (int64_t head_dim : {38, 64, 128}) {
    const double theta = 10000.0;
    std::vector<double> inv_freq(head_dim / 2, NAN);
    rope_inv_freq(inv_freq.data(), head_dim, theta, RopeScaling{});
    for (int64_t i = 0; i < head_dim / 2; ++i) {
      const double expected = std::exp(-std::log(theta) * 2.0 * i / head_dim);
      EXPECT_NEAR(inv_freq[i], expected, 1e-14 * expected) << "head_dim " << head_dim << ", i " << i;
    }
  }
}

TEST(RopeTest, Llama3InvFreqMatchesIndependentFormula) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  // Llama 3.1's own parameters, then random ones.
  std::vector<std::pair<RopeScaling, double>> cases = {{llama31_scaling(), 500000.0}};
  for (int trial = 0; trial < 20; ++trial) {
    RopeScaling scaling = llama31_scaling();
    scaling.factor = rng.uniform(1.0, 32.0);
    scaling.low_freq_factor = rng.uniform(0.5, 2.0);
    scaling.high_freq_factor = scaling.low_freq_factor + rng.uniform(0.5, 8.0);
    scaling.original_max_position_embeddings = rng.integer(256, 16384);
    cases.push_back({scaling, rng.uniform(1e4, 1e6)});
  }
  const int64_t head_dim = 128;
  for (size_t c = 0; c < cases.size(); ++c) {
    const auto& [scaling, theta] = cases[c];
    std::vector<double> inv_freq(head_dim / 2, NAN);
    rope_inv_freq(inv_freq.data(), head_dim, theta, scaling);
    int stretched = 0, kept = 0, blended = 0;
    for (int64_t i = 0; i < head_dim / 2; ++i) {
      const double unscaled = 1.0 / std::pow(theta, 2.0 * i / head_dim);
      const double expected = expected_llama3(unscaled, scaling);
      EXPECT_NEAR(inv_freq[i], expected, 1e-13 * expected)
          << "i " << i << ", theta " << theta << ", factor " << scaling.factor;
      if (expected == unscaled) ++kept;
      else if (expected == unscaled / scaling.factor) ++stretched;
      else ++blended;
    }
    if (c == 0) {  // Llama 3.1's parameters exercise all three bands
      EXPECT_GT(stretched, 0);
      EXPECT_GT(kept, 0);
      EXPECT_GT(blended, 0);
    }
  }
}

TEST(RopeTest, Llama31InvFreqSpotValues) {
  // From transformers 4.46 _compute_llama3_parameters (rope_theta 500000, head_dim 128, factor 8,
  // low 1, high 4, original 8192). HF computes in float32, hence the 1e-6 relative tolerance.
  const std::vector<std::pair<int, double>> known = {
      {0, 1.0},                       // kept
      {10, 0.12868738174438477},      // kept
      {28, 0.0032114461064338684},    // kept, just below the high-frequency wavelength 2048
      {29, 0.0021665706299245358},    // blended
      {31, 0.00085675145965069532},   // blended
      {34, 0.00017850779113359749},   // blended
      {35, 9.556212171446532e-05},    // stretched, just above the low-frequency wavelength 8192
      {50, 4.4115345190220978e-06},   // stretched
      {63, 3.0689258778693329e-07},   // stretched
  };
  std::vector<double> inv_freq(64, NAN);
  rope_inv_freq(inv_freq.data(), 128, 500000.0, llama31_scaling());
  for (const auto& [i, value] : known) EXPECT_NEAR(inv_freq[i], value, 1e-6 * value) << "i " << i;
}

TEST(RopeTest, BadConfigurationIsAnError) {
  std::vector<double> inv_freq(32);
  RopeScaling longrope;
  longrope.type = "longrope";
  try {
    rope_inv_freq(inv_freq.data(), 64, 10000.0, longrope);
    FAIL() << "expected tuna::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("longrope"), std::string::npos) << e.what();
  }
  RopeScaling shrinking;
  shrinking.type = "linear", shrinking.factor = 0.5;
  EXPECT_THROW(rope_inv_freq(inv_freq.data(), 64, 10000.0, shrinking), Error);
  RopeScaling inverted_band = llama31_scaling();
  inverted_band.high_freq_factor = 0.5;
  EXPECT_THROW(rope_inv_freq(inv_freq.data(), 64, 10000.0, inverted_band), Error);
  EXPECT_THROW(rope_inv_freq(inv_freq.data(), 63, 10000.0, RopeScaling{}), Error);
}

TEST(RopeTest, TablesHoldCosAndSinOfPositionTimesFrequency) {
  const int64_t seq_len = 13, head_dim = 10, half = head_dim / 2;
  std::vector<double> inv_freq(half);
  rope_inv_freq(inv_freq.data(), head_dim, 10000.0, RopeScaling{});
  std::vector<float> cos_table = test::nan_filled<float>(seq_len * half), sin_table = cos_table;
  rope_table(cos_table.data(), sin_table.data(), inv_freq.data(), seq_len, head_dim);
  for (int64_t t = 0; t < seq_len; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      EXPECT_NEAR(cos_table[t * half + i], std::cos(t * inv_freq[i]), 1e-7);
      EXPECT_NEAR(sin_table[t * half + i], std::sin(t * inv_freq[i]), 1e-7);
    }
  }
}

// Shapes shared by the rotation tests; nothing round.
struct RopeProblem {
  int64_t batch = 2, seq_len = 13, n_heads = 3, head_dim = 10;
  int64_t size() const { return batch * seq_len * n_heads * head_dim; }
  int64_t width() const { return n_heads * head_dim; }  // one position's values: the contiguous row stride
  int64_t half() const { return head_dim / 2; }
};

template <typename T>
void make_tables(const RopeProblem& p, std::vector<T>& cos_table, std::vector<T>& sin_table) {
  std::vector<double> inv_freq(p.half());
  rope_inv_freq(inv_freq.data(), p.head_dim, 10000.0, RopeScaling{});
  cos_table.resize(p.seq_len * p.half());
  sin_table.resize(p.seq_len * p.half());
  rope_table(cos_table.data(), sin_table.data(), inv_freq.data(), p.seq_len, p.head_dim);
}

// Float: two products and a sum in fp32 per element.
template <typename T>
void check_forward(TestRng& rng, double tolerance) {
  const RopeProblem p;
  std::vector<T> cos_table, sin_table;
  make_tables(p, cos_table, sin_table);
  const std::vector<T> inp = rng.vector<T>(p.size());
  std::vector<T> out = test::nan_filled<T>(p.size());
  rope_fwd(out.data(), inp.data(), cos_table.data(), sin_table.data(), p.batch, p.seq_len, p.n_heads, p.head_dim,
           p.width(), p.width());

  std::vector<double> expected(p.size());
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t t = 0; t < p.seq_len; ++t)
      for (int64_t h = 0; h < p.n_heads; ++h) {
        const int64_t row = ((b * p.seq_len + t) * p.n_heads + h) * p.head_dim;
        for (int64_t i = 0; i < p.half(); ++i) {
          const double c = cos_table[t * p.half() + i], s = sin_table[t * p.half() + i];
          const double x0 = inp[row + i], x1 = inp[row + i + p.half()];
          expected[row + i] = x0 * c - x1 * s;
          expected[row + i + p.half()] = x1 * c + x0 * s;
        }
      }
  EXPECT_LT(test::rel_error_norm(out, expected), tolerance);
}

TEST(RopeTest, ForwardMatchesFloat64Loop) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  check_forward<float>(rng, 1e-6);
  check_forward<double>(rng, 1e-14);
}

TEST(RopeTest, BackwardMatchesFiniteDifferences) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const RopeProblem p;
  std::vector<double> cos_table, sin_table;
  make_tables(p, cos_table, sin_table);
  std::vector<double> inp = rng.vector<double>(p.size());
  const std::vector<double> dout = rng.vector<double>(p.size());
  std::vector<double> out(p.size());
  auto objective = [&] {
    rope_fwd(out.data(), inp.data(), cos_table.data(), sin_table.data(), p.batch, p.seq_len, p.n_heads,
             p.head_dim, p.width(), p.width());
    return test::weighted_sum(out, dout);
  };
  std::vector<double> dinp = test::nan_filled<double>(p.size());
  rope_bwd(dinp.data(), dout.data(), cos_table.data(), sin_table.data(), p.batch, p.seq_len, p.n_heads,
           p.head_dim, p.width(), p.width());
  EXPECT_LT(test::rel_error_norm(dinp, test::numeric_gradient(inp, objective)), test::kFiniteDifferenceTolerance);
}

// Positions restarted at each packed document: every document of the row is rotated exactly as if it were a
// sequence of its own (the same table rows, the same arithmetic: bitwise), forward and backward.
TEST(RopeTest, RestartedPositionsRotateEachDocumentAsItsOwnSequence) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const RopeProblem p;
  std::vector<float> cos_table, sin_table;
  make_tables(p, cos_table, sin_table);
  const std::vector<int64_t> lengths{1, p.seq_len - 4, 3};  // per row; sums to seq_len
  std::vector<int32_t> positions;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t n : lengths)
      for (int64_t i = 0; i < n; ++i) positions.push_back(static_cast<int32_t>(i));
  const std::vector<float> x = rng.vector<float>(p.size());
  for (bool backward : {false, true}) {
    SCOPED_TRACE(backward ? "backward" : "forward");
    auto rotate = backward ? rope_bwd<float> : rope_fwd<float>;
    std::vector<float> packed(p.size());
    rotate(packed.data(), x.data(), cos_table.data(), sin_table.data(), p.batch, p.seq_len, p.n_heads, p.head_dim,
           p.width(), p.width(), positions.data());
    int64_t at = 0;  // rows of width() values
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t n : lengths) {
        std::vector<float> alone(n * p.width());
        rotate(alone.data(), x.data() + at * p.width(), cos_table.data(), sin_table.data(), 1, n, p.n_heads,
               p.head_dim, p.width(), p.width(), nullptr);
        EXPECT_TRUE(test::bitwise_equal(alone, std::vector<float>(packed.begin() + at * p.width(),
                                                                  packed.begin() + (at + n) * p.width())));
        at += n;
      }
  }
}

TEST(RopeTest, InPlaceEqualsOutOfPlace) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const RopeProblem p;
  std::vector<float> cos_table, sin_table;
  make_tables(p, cos_table, sin_table);
  const std::vector<float> x = rng.vector<float>(p.size());

  std::vector<float> out(p.size()), in_place = x;
  rope_fwd(out.data(), x.data(), cos_table.data(), sin_table.data(), p.batch, p.seq_len, p.n_heads, p.head_dim,
           p.width(), p.width());
  rope_fwd(in_place.data(), in_place.data(), cos_table.data(), sin_table.data(), p.batch, p.seq_len, p.n_heads,
           p.head_dim, p.width(), p.width());
  EXPECT_TRUE(test::bitwise_equal(in_place, out));

  std::vector<float> dinp(p.size()), dinp_in_place = x;
  rope_bwd(dinp.data(), x.data(), cos_table.data(), sin_table.data(), p.batch, p.seq_len, p.n_heads, p.head_dim,
           p.width(), p.width());
  rope_bwd(dinp_in_place.data(), dinp_in_place.data(), cos_table.data(), sin_table.data(), p.batch, p.seq_len,
           p.n_heads, p.head_dim, p.width(), p.width());
  EXPECT_TRUE(test::bitwise_equal(dinp_in_place, dinp));
}

TEST(RopeTest, BackwardUndoesForward) {
  // A rotation's transpose is its inverse: rope_bwd(rope_fwd(x)) = x up to rounding.
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const RopeProblem p;
  std::vector<double> cos_table, sin_table;
  make_tables(p, cos_table, sin_table);
  const std::vector<double> x = rng.vector<double>(p.size());
  std::vector<double> y = x;
  rope_fwd(y.data(), y.data(), cos_table.data(), sin_table.data(), p.batch, p.seq_len, p.n_heads, p.head_dim,
           p.width(), p.width());
  rope_bwd(y.data(), y.data(), cos_table.data(), sin_table.data(), p.batch, p.seq_len, p.n_heads, p.head_dim,
           p.width(), p.width());
  EXPECT_LT(test::rel_error_norm(y, x), 1e-14);
}

// Rows of p.width() values placed `stride` apart from `offset` in a buffer of NaN (what a strided call must
// neither read nor write), and back.
std::vector<float> spread_rows(const std::vector<float>& x, const RopeProblem& p, int64_t stride, int64_t offset) {
  const int64_t positions = p.batch * p.seq_len;
  std::vector<float> wide = test::nan_filled<float>(positions * stride + offset);
  for (int64_t r = 0; r < positions; ++r)
    std::copy(x.begin() + r * p.width(), x.begin() + (r + 1) * p.width(), wide.begin() + offset + r * stride);
  return wide;
}
std::vector<float> gather_rows(const std::vector<float>& wide, const RopeProblem& p, int64_t stride, int64_t offset) {
  std::vector<float> x(p.size());
  for (int64_t r = 0; r < p.batch * p.seq_len; ++r)
    std::copy(wide.begin() + offset + r * stride, wide.begin() + offset + r * stride + p.width(),
              x.begin() + r * p.width());
  return x;
}

TEST(RopeTest, StridedRowsEqualContiguousRows) {
  // The model reads q and k out of a fused q|k|v row and writes their gradients back into one: the same bits
  // as the contiguous rotation, whatever the strides (odd ones included), and nothing between the rows touched.
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const RopeProblem p;
  std::vector<float> cos_table, sin_table;
  make_tables(p, cos_table, sin_table);
  const std::vector<float> x = rng.vector<float>(p.size());
  for (bool backward : {false, true}) {
    SCOPED_TRACE(backward ? "backward" : "forward");
    const auto rotate = [&](float* out, const float* inp, int64_t out_stride, int64_t inp_stride) {
      (backward ? rope_bwd<float> : rope_fwd<float>)(out, inp, cos_table.data(), sin_table.data(), p.batch,
                                                     p.seq_len, p.n_heads, p.head_dim, out_stride, inp_stride,
                                                     /*positions=*/nullptr);
    };
    std::vector<float> contiguous(p.size());
    rotate(contiguous.data(), x.data(), p.width(), p.width());
    const int64_t in_stride = p.width() + 7, out_stride = 3 * p.width() + 1, offset = 5;
    // Strided in, contiguous out (the forward's read of q from q|k|v).
    const std::vector<float> wide_in = spread_rows(x, p, in_stride, offset);
    std::vector<float> out(p.size());
    rotate(out.data(), wide_in.data() + offset, p.width(), in_stride);
    EXPECT_TRUE(test::bitwise_equal(out, contiguous));
    // Contiguous in, strided out (the backward's write into d_qkv); the gaps stay NaN.
    std::vector<float> wide_out = test::nan_filled<float>(p.batch * p.seq_len * out_stride + offset);
    rotate(wide_out.data() + offset, x.data(), out_stride, p.width());
    EXPECT_TRUE(test::bitwise_equal(gather_rows(wide_out, p, out_stride, offset), contiguous));
    const std::vector<float> untouched = spread_rows(contiguous, p, out_stride, offset);
    EXPECT_TRUE(test::bitwise_equal(wide_out, untouched));  // NaN == NaN bitwise: the gaps were not written
    // In place with equal strides.
    std::vector<float> in_place = wide_in;
    rotate(in_place.data() + offset, in_place.data() + offset, in_stride, in_stride);
    EXPECT_TRUE(test::bitwise_equal(gather_rows(in_place, p, in_stride, offset), contiguous));
  }
}

}  // namespace
}  // namespace tuna::cpu
