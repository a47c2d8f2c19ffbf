// kernels/cpu/fp8 against a float64 reference of the formats written from their definitions (OCP 8-bit floating
// point: e4m3 "FN" and e5m2): every code's value; the conversion of every representable value, of every midpoint
// between neighbours (ties to even) and of the fp32 values either side of it, of values past the max (saturation,
// inf), of the subnormal range down to underflow, of NaNs and fp32 subnormals, and of a million random fp32 bit
// patterns, bit for bit; torchao's scale; the amax fold; the casts (plain and transposed); and the scaled GEMM
// against a float64 sum of the same products.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "kernels/cpu/fp8.h"
#include "tests/kernels/op_test_util.h"
#include "tests/test_util.h"

namespace tuna::cpu {
namespace {

// ---- the float64 reference: the format's definition, nothing of the implementation's bit tricks
struct Reference {
  Fp8Format format;
  int exponent_bits, mantissa_bits, bias;
  double max;
  std::vector<int> finite;  // the finite non-negative codes in increasing order of value (0 .. max's code)
  std::vector<double> finite_values;

  explicit Reference(Fp8Format f)
      : format(f),
        exponent_bits(f == Fp8Format::E4M3 ? 4 : 5),
        mantissa_bits(f == Fp8Format::E4M3 ? 3 : 2),
        bias(f == Fp8Format::E4M3 ? 7 : 15),
        max(f == Fp8Format::E4M3 ? 448.0 : 57344.0) {
    for (int c = 0; c < 128; ++c)
      if (!is_nan(c) && !is_inf(c)) finite.push_back(c), finite_values.push_back(value(c));
  }

  bool is_nan(int code) const {
    const int e = (code & 0x7f) >> mantissa_bits, m = code & ((1 << mantissa_bits) - 1);
    if (format == Fp8Format::E4M3) return (code & 0x7f) == 0x7f;  // E4M3FN: S.1111.111 only
    return e == (1 << exponent_bits) - 1 && m != 0;
  }
  bool is_inf(int code) const {
    return format == Fp8Format::E5M2 && ((code & 0x7f) >> mantissa_bits) == 31 && (code & 3) == 0;
  }
  // (-1)^s 2^(e - bias) (1 + m / 2^M), or 2^(1 - bias) (m / 2^M) when e == 0.
  double value(int code) const {
    const int e = (code & 0x7f) >> mantissa_bits, m = code & ((1 << mantissa_bits) - 1);
    const double sign = (code & 0x80) ? -1.0 : 1.0;
    const double frac = static_cast<double>(m) / (1 << mantissa_bits);
    return sign * (e == 0 ? std::ldexp(frac, 1 - bias) : std::ldexp(1.0 + frac, e - bias));
  }
  const std::vector<int>& finite_codes() const { return finite; }
  // cvt.rn.satfinite: nearest finite value (ties: the even code, whose mantissa's last bit is 0), |x| > max to
  // max, NaN to 0x7f, the sign kept (zero included).
  uint8_t convert(float x) const {
    if (std::isnan(x)) return 0x7f;
    const double a = std::fabs(static_cast<double>(x));
    const int sign = std::signbit(x) ? 0x80 : 0;
    if (a > max) return static_cast<uint8_t>(sign | finite.back());
    int best = finite[0];
    double best_distance = INFINITY;
    for (size_t i = 0; i < finite.size(); ++i) {
      const double distance = std::fabs(finite_values[i] - a);
      if (distance < best_distance || (distance == best_distance && finite[i] % 2 == 0))
        best = finite[i], best_distance = distance;
    }
    return static_cast<uint8_t>(sign | best);
  }
};

std::string hex(int code) {
  char text[8];
  std::snprintf(text, sizeof(text), "0x%02x", code);
  return text;
}

class Fp8FormatTest : public ::testing::TestWithParam<Fp8Format> {};

TEST_P(Fp8FormatTest, DecodesEveryCode) {
  const Reference ref(GetParam());
  for (int c = 0; c < 256; ++c) {
    const float got = fp8_to_float(static_cast<uint8_t>(c), GetParam());
    if (ref.is_nan(c)) {
      EXPECT_TRUE(std::isnan(got)) << hex(c);
    } else if (ref.is_inf(c)) {
      EXPECT_EQ(got, (c & 0x80) ? -INFINITY : INFINITY) << hex(c);
    } else {
      EXPECT_EQ(static_cast<double>(got), ref.value(c)) << hex(c);
      EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << hex(c);
    }
  }
  EXPECT_EQ(static_cast<double>(fp8_max(GetParam())), ref.max);
  EXPECT_EQ(ref.value(ref.finite_codes().back()), ref.max);
}

TEST_P(Fp8FormatTest, ConvertsRepresentableValuesAndMidpointsExactly) {
  const Reference ref(GetParam());
  const std::vector<int> codes = ref.finite_codes();
  int64_t checked = 0;
  const auto check = [&](float x) {
    ASSERT_EQ(fp8_from_float(x, GetParam()), ref.convert(x)) << "x = " << x << " (bits " << std::bit_cast<uint32_t>(x)
                                                             << ")";
    ++checked;
  };
  for (int sign : {1, -1})
    for (size_t i = 0; i < codes.size(); ++i) {
      const float v = static_cast<float>(sign * ref.value(codes[i]));
      check(v);
      ASSERT_EQ(fp8_from_float(v, GetParam()), (sign < 0 ? 0x80 : 0) | codes[i]) << "round trip of " << v;
      if (i + 1 == codes.size()) continue;
      // The midpoint to the next value (one bit more than the format has: exact in fp32) and its fp32 neighbours.
      const double mid = (ref.value(codes[i]) + ref.value(codes[i + 1])) / 2;
      const float m = static_cast<float>(sign * mid);
      ASSERT_EQ(static_cast<double>(m), sign * mid);
      check(m);
      check(std::nextafter(m, 0.0f));
      check(std::nextafter(m, sign * INFINITY));
      const uint8_t tie = fp8_from_float(std::fabs(m), GetParam());
      EXPECT_EQ(tie % 2, 0) << "the tie at " << mid << " went to the odd code " << hex(tie);
    }
  EXPECT_GT(checked, 8 * static_cast<int64_t>(codes.size()) - 8);
}

TEST_P(Fp8FormatTest, SaturatesPastTheMax) {
  const Reference ref(GetParam());
  const float max = fp8_max(GetParam());
  const uint8_t max_code = static_cast<uint8_t>(ref.finite_codes().back());
  for (float x : {max, std::nextafter(max, INFINITY), max * 1.0625f, max * 1.125f, max * 1.2f, max * 2.0f, 1e30f,
                  std::numeric_limits<float>::max(), INFINITY}) {
    EXPECT_EQ(fp8_from_float(x, GetParam()), max_code) << x;
    EXPECT_EQ(fp8_from_float(-x, GetParam()), 0x80 | max_code) << -x;
    EXPECT_EQ(fp8_from_float(x, GetParam()), ref.convert(x)) << x;
  }
}

TEST_P(Fp8FormatTest, RoundsIntoAndUnderTheSubnormals) {
  const Reference ref(GetParam());
  const double smallest = ref.value(1);  // the smallest subnormal
  EXPECT_EQ(smallest, std::ldexp(1.0, 1 - ref.bias - ref.mantissa_bits));
  for (double x : {smallest / 2, smallest / 2 * (1 + 1e-6), smallest / 2 * (1 - 1e-6), smallest * 1.5, smallest * 2.5,
                   smallest * 3.5, smallest / 4, smallest / 1e6, ref.value(1 << ref.mantissa_bits) * 0.99}) {
    for (double s : {1.0, -1.0}) {
      const float f = static_cast<float>(s * x);
      EXPECT_EQ(fp8_from_float(f, GetParam()), ref.convert(f)) << f;
    }
  }
  EXPECT_EQ(fp8_from_float(static_cast<float>(smallest / 2), GetParam()), 0x00);  // a tie to the even zero
  EXPECT_EQ(fp8_from_float(static_cast<float>(-smallest / 2), GetParam()), 0x80);
  EXPECT_EQ(fp8_from_float(static_cast<float>(smallest * 1.5), GetParam()), 0x02);
  // fp32 subnormals and zeros: signed zero.
  for (float x : {std::numeric_limits<float>::denorm_min(), 1e-40f, 0.0f}) {
    EXPECT_EQ(fp8_from_float(x, GetParam()), 0x00) << x;
    EXPECT_EQ(fp8_from_float(-x, GetParam()), 0x80) << -x;
  }
}

TEST_P(Fp8FormatTest, NaNsBecomeTheCanonicalNaN) {
  for (uint32_t bits : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu})
    EXPECT_EQ(fp8_from_float(std::bit_cast<float>(bits), GetParam()), kFp8NaN) << bits;
  EXPECT_TRUE(std::isnan(fp8_to_float(kFp8NaN, GetParam())));
}

TEST_P(Fp8FormatTest, ConvertsRandomBitPatternsAsTheReference) {
  test::TestRng rng;
  SCOPED_TRACE(rng.describe());
  const Reference ref(GetParam());
  // 200k with exponents around the format's range (every case: subnormal, normal, saturated) and 50k of anything.
  for (int i = 0; i < 250000; ++i) {
    uint32_t bits = static_cast<uint32_t>(rng.integer(0, 0xffffffffLL));
    if (i < 200000) {
      const uint32_t exponent = static_cast<uint32_t>(rng.integer(127 - ref.bias - 12, 127 + 17));
      bits = (bits & 0x807fffffu) | (exponent << 23);
    }
    const float x = std::bit_cast<float>(bits);
    ASSERT_EQ(fp8_from_float(x, GetParam()), ref.convert(x)) << "bits " << bits;
  }
}

TEST_P(Fp8FormatTest, ScaleIsTorchaos) {
  const Fp8Format f = GetParam();
  const double max = fp8_max(f);
  for (float amax : {1.0f, 3.0f, 0.1f, 1e-3f, 123.456f, 1e5f, 7e-13f}) {
    const double clamped = std::max(static_cast<double>(amax), 1e-12);
    EXPECT_EQ(fp8_scale(amax, f), static_cast<float>(max / clamped)) << amax;
  }
  EXPECT_EQ(fp8_scale(0.0f, f), static_cast<float>(max / 1e-12));  // an all-zero tensor: finite scale, zero codes
  EXPECT_TRUE(std::isnan(fp8_scale(NAN, f)));
  EXPECT_EQ(fp8_scale(INFINITY, f), 0.0f);
}

INSTANTIATE_TEST_SUITE_P(Formats, Fp8FormatTest, ::testing::Values(Fp8Format::E4M3, Fp8Format::E5M2),
                         [](const auto& info) { return std::string(fp8_name(info.param)); });

TEST(Fp8Test, AmaxFoldsAcrossCallsAndKeepsNaN) {
  const std::vector<float> x = {0.5f, -3.0f, 2.0f, 9.0f, /*past cols*/ -100.0f, 0.25f, 1.0f, -4.0f, 0.0f, 50.0f};
  float amax = 0.0f;
  fp8_amax(&amax, x.data(), 2, 4, 5);  // rows of 4 at stride 5: element 4 and 9 lie outside
  EXPECT_EQ(amax, 9.0f);
  const float more[] = {-12.0f};
  fp8_amax(&amax, more, 1, 1, 1);
  EXPECT_EQ(amax, 12.0f);
  const float nan[] = {1.0f, NAN, 2.0f};
  fp8_amax(&amax, nan, 1, 3, 3);
  EXPECT_TRUE(std::isnan(amax));
  fp8_amax(&amax, more, 1, 1, 1);
  EXPECT_TRUE(std::isnan(amax));
}

TEST(Fp8Test, CastsScaleThenConvert) {
  test::TestRng rng;
  SCOPED_TRACE(rng.describe());
  const int64_t rows = rng.integer(1, 40), cols = rng.integer(1, 70), ld = cols + rng.integer(0, 5);
  for (Fp8Format f : {Fp8Format::E4M3, Fp8Format::E5M2}) {
    std::vector<float> x(rows * ld);
    for (float& v : x) v = static_cast<float>(rng.uniform(-1, 1) * std::exp(rng.uniform(-12, 4)));
    float amax = 0.0f;
    fp8_amax(&amax, x.data(), rows, cols, ld);
    std::vector<uint8_t> out(rows * cols), out2(rows * cols), out_t(rows * cols);
    float inv = 0, inv2 = 0;
    fp8_cast(out.data(), &inv, x.data(), rows, cols, ld, amax, f);
    fp8_cast_transpose(out2.data(), out_t.data(), &inv2, x.data(), rows, cols, ld, amax, f);
    const float scale = fp8_scale(amax, f);
    EXPECT_EQ(inv, 1.0f / scale);
    EXPECT_EQ(inv2, inv);
    const Reference ref(f);
    int max_codes = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const uint8_t expected = ref.convert(x[r * ld + c] * scale);
        ASSERT_EQ(out[r * cols + c], expected) << r << ", " << c;
        ASSERT_EQ(out2[r * cols + c], expected);
        ASSERT_EQ(out_t[c * rows + r], expected);
        max_codes += (expected & 0x7f) == ref.finite_codes().back();
      }
    EXPECT_GE(max_codes, 1) << "the amax element maps to (about) the max";
    // Transposed alone: out may be null.
    std::vector<uint8_t> only_t(rows * cols);
    fp8_cast_transpose(nullptr, only_t.data(), &inv2, x.data(), rows, cols, ld, amax, f);
    EXPECT_EQ(only_t, out_t);
  }
}

TEST(Fp8Test, GemmIsTheScaledSumOfExactProducts) {
  test::TestRng rng;
  SCOPED_TRACE(rng.describe());
  const int64_t m = rng.integer(1, 50), n = rng.integer(1, 60), k = rng.integer(1, 300), ldd = n + rng.integer(0, 3);
  for (auto [fa, fb] : {std::pair{Fp8Format::E4M3, Fp8Format::E4M3}, std::pair{Fp8Format::E5M2, Fp8Format::E4M3},
                        std::pair{Fp8Format::E4M3, Fp8Format::E5M2}}) {
    std::vector<uint8_t> a(m * k), b(n * k);
    const auto random_code = [&](Fp8Format f) {
      uint8_t c;
      do c = static_cast<uint8_t>(rng.integer(0, 255));
      while (!std::isfinite(fp8_to_float(c, f)));
      return c;
    };
    for (uint8_t& c : a) c = random_code(fa);
    for (uint8_t& c : b) c = random_code(fb);
    const float sa = static_cast<float>(rng.uniform(1e-4, 1e-2)), sb = static_cast<float>(rng.uniform(1e-3, 1));
    std::vector<float> d(m * ldd, NAN), c0(m * ldd);
    for (float& v : c0) v = static_cast<float>(rng.uniform(-5, 5));
    std::vector<float> acc_d = c0;
    fp8_gemm(d.data(), ldd, a.data(), fa, sa, b.data(), fb, sb, m, n, k, /*accumulate=*/false);
    fp8_gemm(acc_d.data(), ldd, a.data(), fa, sa, b.data(), fb, sb, m, n, k, /*accumulate=*/true);
    const float alpha = sa * sb;
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double exact = 0, magnitude = 0;
        for (int64_t p = 0; p < k; ++p) {
          const double product = static_cast<double>(fp8_to_float(a[i * k + p], fa)) * fp8_to_float(b[j * k + p], fb);
          exact += product, magnitude += std::fabs(product);
        }
        // fp32 accumulation of k exact products: within k ulps of the magnitude; then alpha's rounding.
        const double bound = (k * 0x1p-23 * magnitude + 0x1p-24 * std::fabs(exact)) * alpha + 1e-30;
        ASSERT_NEAR(d[i * ldd + j], alpha * exact, 2 * bound) << i << ", " << j;
        ASSERT_NEAR(acc_d[i * ldd + j], alpha * exact + c0[i * ldd + j], 2 * bound + 1e-6 * std::fabs(c0[i * ldd + j]));
        // The epilogue's rounding order: acc * (sa * sb), then + C.
        ASSERT_EQ(acc_d[i * ldd + j], d[i * ldd + j] + c0[i * ldd + j]);
      }
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = n; j < ldd; ++j) ASSERT_TRUE(std::isnan(d[i * ldd + j])) << "written past n at " << i << ", " << j;
  }
  std::vector<uint8_t> z(4);
  float out[4];
  const std::string e = testing_util::error_of(
      [&] { fp8_gemm(out, 2, z.data(), Fp8Format::E5M2, 1, z.data(), Fp8Format::E5M2, 1, 2, 2, 1, false); });
  EXPECT_NE(e.find("two e5m2 operands"), std::string::npos) << e;
}

}  // namespace
}  // namespace tuna::cpu
