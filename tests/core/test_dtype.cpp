// Tests for core/dtype.h. Expected values come from bit reasoning written out in each test, and the
// sweeps check the rounding property itself (nearest representable value, ties to even) against
// exact double arithmetic, so neither depends on the code under test.
#include "core/dtype.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace tuna {
namespace {

float from_bits(uint32_t bits) { return std::bit_cast<float>(bits); }

// Exact value of an f16 bit pattern, by the IEEE 754 binary16 definition, in double.
double f16_value(uint16_t h) {
  int sign = (h >> 15) ? -1 : 1;
  int exponent = (h >> 10) & 0x1f;
  int mantissa = h & 0x3ff;
  if (exponent == 31) return mantissa ? std::nan("") : sign * std::numeric_limits<double>::infinity();
  if (exponent == 0) return sign * std::ldexp(mantissa, -24);
  return sign * std::ldexp(1024 + mantissa, exponent - 25);
}

// Exact value of a bf16 bit pattern: sign, 8-bit exponent (bias 127), 7-bit mantissa.
double bf16_value(uint16_t b) {
  int sign = (b >> 15) ? -1 : 1;
  int exponent = (b >> 7) & 0xff;
  int mantissa = b & 0x7f;
  if (exponent == 255) return mantissa ? std::nan("") : sign * std::numeric_limits<double>::infinity();
  if (exponent == 0) return sign * std::ldexp(mantissa, -133);
  return sign * std::ldexp(128 + mantissa, exponent - 134);
}

TEST(DType, SizesAndNames) {
  struct Row {
    DType dtype;
    const char* name;
    size_t size;
  };
  const Row rows[] = {{DType::F64, "F64", 8}, {DType::F32, "F32", 4},   {DType::F16, "F16", 2},
                      {DType::BF16, "BF16", 2}, {DType::I64, "I64", 8}, {DType::I32, "I32", 4},
                      {DType::I16, "I16", 2}, {DType::I8, "I8", 1},     {DType::U8, "U8", 1},
                      {DType::BOOL, "BOOL", 1}};
  for (const Row& row : rows) {
    EXPECT_EQ(dtype_size(row.dtype), row.size) << row.name;
    EXPECT_EQ(dtype_name(row.dtype), row.name);
    ASSERT_TRUE(parse_dtype(row.name).has_value()) << row.name;
    EXPECT_EQ(*parse_dtype(row.name), row.dtype);
  }
  EXPECT_FALSE(parse_dtype("f32").has_value());  // the spec spells them in capitals
  EXPECT_FALSE(parse_dtype("F8_E4M3").has_value());
  EXPECT_FALSE(parse_dtype("").has_value());
  EXPECT_TRUE(is_floating(DType::BF16));
  EXPECT_FALSE(is_floating(DType::I32));
}

TEST(DType, Bf16FromF32EdgeCases) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);  // 1.0f = 0x3f800000: the top half exactly
  EXPECT_EQ(f32_to_bf16(-2.0f), 0xc000);
  EXPECT_EQ(f32_to_bf16(0.0f), 0x0000);
  EXPECT_EQ(f32_to_bf16(-0.0f), 0x8000);
  // Ties: low half exactly 0x8000 rounds to the even upper half.
  EXPECT_EQ(f32_to_bf16(from_bits(0x3f808000)), 0x3f80);  // between 3f80 (even) and 3f81
  EXPECT_EQ(f32_to_bf16(from_bits(0x3f818000)), 0x3f82);  // between 3f81 and 3f82 (even)
  EXPECT_EQ(f32_to_bf16(from_bits(0x3f808001)), 0x3f81);  // just above the tie
  EXPECT_EQ(f32_to_bf16(from_bits(0x3f817fff)), 0x3f81);  // just below the tie
  // Rounding carries into the exponent: 0x3fffffff (just under 2) -> 2.0 = 0x4000.
  EXPECT_EQ(f32_to_bf16(from_bits(0x3fffffff)), 0x4000);
  // Largest finite bf16 is 0x7f7f; a value at the tie above it (odd mantissa) goes to inf,
  // as does FLT_MAX.
  EXPECT_EQ(f32_to_bf16(from_bits(0x7f7f7fff)), 0x7f7f);
  EXPECT_EQ(f32_to_bf16(from_bits(0x7f7f8000)), 0x7f80);
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(f32_to_bf16(-std::numeric_limits<float>::max()), 0xff80);
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(f32_to_bf16(-std::numeric_limits<float>::infinity()), 0xff80);
  // f32 subnormals: same exponent field, so the same rule applies.
  EXPECT_EQ(f32_to_bf16(from_bits(0x00000001)), 0x0000);
  EXPECT_EQ(f32_to_bf16(from_bits(0x00008000)), 0x0000);  // tie to even 0
  EXPECT_EQ(f32_to_bf16(from_bits(0x00018000)), 0x0002);  // tie to even 2
  EXPECT_EQ(f32_to_bf16(from_bits(0x00010000)), 0x0001);
  // NaN stays NaN, including one whose payload lies only in the low bits (plain truncation: inf).
  for (uint32_t nan_bits : {0x7fc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu}) {
    uint16_t b = f32_to_bf16(from_bits(nan_bits));
    EXPECT_EQ(b & 0x7f80, 0x7f80) << std::hex << nan_bits;
    EXPECT_NE(b & 0x007f, 0) << std::hex << nan_bits;
    EXPECT_EQ(b & 0x8000, (nan_bits >> 16) & 0x8000);
  }
}

TEST(DType, Bf16ToF32IsExactForAllPatterns) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    float f = bf16_to_f32(static_cast<uint16_t>(b));
    double expected = bf16_value(static_cast<uint16_t>(b));
    if (std::isnan(expected)) {
      EXPECT_TRUE(std::isnan(f)) << b;
      EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(f))));
    } else {
      ASSERT_EQ(static_cast<double>(f), expected) << std::hex << b;
      ASSERT_EQ(f32_to_bf16(f), b) << std::hex << b;  // round trip is the identity
    }
  }
}

TEST(DType, F16FromF32EdgeCases) {
  EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16(-2.0f), 0xc000);
  EXPECT_EQ(f32_to_f16(0.0f), 0x0000);
  EXPECT_EQ(f32_to_f16(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_f16(0.5f), 0x3800);
  // Ties in the normal range: 1 + 2^-11 is halfway between 0x3c00 (even) and 0x3c01.
  EXPECT_EQ(f32_to_f16(1.0f + 0x1p-11f), 0x3c00);
  EXPECT_EQ(f32_to_f16(1.0f + 3 * 0x1p-11f), 0x3c02);  // between 3c01 and 3c02 (even)
  EXPECT_EQ(f32_to_f16(std::nextafter(1.0f + 0x1p-11f, 2.0f)), 0x3c01);
  // Max: 65504 = 0x7bff. 65520 is the tie with 65536 and 0x7bff is odd: inf. Just below: 65504.
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(std::nextafter(65520.0f, 0.0f)), 0x7bff);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);
  EXPECT_EQ(f32_to_f16(-65520.0f), 0xfc00);
  EXPECT_EQ(f32_to_f16(1e10f), 0x7c00);
  EXPECT_EQ(f32_to_f16(std::numeric_limits<float>::max()), 0x7c00);
  EXPECT_EQ(f32_to_f16(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(f32_to_f16(-std::numeric_limits<float>::infinity()), 0xfc00);
  // Subnormals: units of 2^-24.
  EXPECT_EQ(f32_to_f16(0x1p-24f), 0x0001);
  EXPECT_EQ(f32_to_f16(-0x1p-24f), 0x8001);
  EXPECT_EQ(f32_to_f16(0x1p-25f), 0x0000);                          // tie between 0 (even) and 1
  EXPECT_EQ(f32_to_f16(std::nextafter(0x1p-25f, 1.0f)), 0x0001);    // just above that tie
  EXPECT_EQ(f32_to_f16(3 * 0x1p-25f), 0x0002);                      // tie between 1 and 2 (even)
  EXPECT_EQ(f32_to_f16(5 * 0x1p-25f), 0x0002);                      // tie between 2 (even) and 3
  EXPECT_EQ(f32_to_f16(1023 * 0x1p-24f), 0x03ff);                   // largest subnormal
  EXPECT_EQ(f32_to_f16(0x1p-14f - 0x1p-25f), 0x0400);               // tie between 3ff and 400 (even)
  EXPECT_EQ(f32_to_f16(0x1p-14f), 0x0400);                          // smallest normal
  EXPECT_EQ(f32_to_f16(0x1p-30f), 0x0000);
  EXPECT_EQ(f32_to_f16(-0x1p-30f), 0x8000);
  EXPECT_EQ(f32_to_f16(from_bits(0x00000001)), 0x0000);  // f32 subnormal
  // NaN stays NaN, with its sign.
  for (uint32_t nan_bits : {0x7fc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu}) {
    uint16_t h = f32_to_f16(from_bits(nan_bits));
    EXPECT_EQ(h & 0x7c00, 0x7c00) << std::hex << nan_bits;
    EXPECT_NE(h & 0x03ff, 0) << std::hex << nan_bits;
    EXPECT_EQ(h & 0x8000, (nan_bits >> 16) & 0x8000);
  }
}

TEST(DType, F16ToF32IsExactForAllPatterns) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    float f = f16_to_f32(static_cast<uint16_t>(h));
    double expected = f16_value(static_cast<uint16_t>(h));
    if (std::isnan(expected)) {
      EXPECT_TRUE(std::isnan(f)) << h;
      EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(f))));
    } else {
      ASSERT_EQ(static_cast<double>(f), expected) << std::hex << h;
      ASSERT_EQ(std::signbit(f), (h & 0x8000) != 0) << std::hex << h;
      ASSERT_EQ(f32_to_f16(f), h) << std::hex << h;
    }
  }
}

// For x in the finite range, the result r must satisfy: |x - r| is no more than the distance to either
// neighbour of r, and on an exact tie r is the one with an even mantissa. Checked in exact double
// arithmetic (every f32, f16 and bf16 value and their differences here are exact in double).
// x must lie below the overflow tie; r's neighbours are r - 1 and r + 1 (same sign, magnitude +-1).
template <typename Value>
void check_nearest_even(float x, uint16_t r, Value value, uint16_t max_finite) {
  uint16_t magnitude = r & 0x7fff;
  double dx = x;
  double dr = value(r);
  ASSERT_FALSE(std::isnan(dr)) << x;
  ASSERT_FALSE(std::isinf(dr)) << x;  // callers handle the overflow range themselves
  ASSERT_EQ(std::signbit(dx), std::signbit(dr)) << x;
  double err = std::fabs(dx - dr);
  if (magnitude < max_finite) {
    double up = std::fabs(value(static_cast<uint16_t>(r + 1)) - dx);
    ASSERT_LE(err, up) << x;
    if (err == up) {
      ASSERT_EQ(r & 1, 0) << "tie not to even at " << x;
    }
  }
  if (magnitude > 0) {
    double down = std::fabs(value(static_cast<uint16_t>(r - 1)) - dx);
    ASSERT_LE(err, down) << x;
    if (err == down) {
      ASSERT_EQ(r & 1, 0) << "tie not to even at " << x;
    }
  }
}

TEST(DType, F16RoundingIsNearestEvenOnRandomFloats) {
  std::mt19937 rng(1234);
  // Exponents from deep subnormal to past the overflow point, random mantissas, plus exact ties.
  std::uniform_int_distribution<uint32_t> exponent(127 - 30, 127 + 17), mantissa(0, 0x7fffff);
  for (int i = 0; i < 200000; ++i) {
    uint32_t m = mantissa(rng);
    if (i % 4 == 0) m = (m & ~0x1fffu) | 0x1000u;  // an exact tie for normal halves
    float x = from_bits((i % 2 ? 0x80000000u : 0u) | (exponent(rng) << 23) | m);
    uint16_t r = f32_to_f16(x);
    if (std::fabs(x) >= 65520.0f) {
      ASSERT_EQ(r & 0x7fff, 0x7c00) << x;
      continue;
    }
    check_nearest_even(x, r, f16_value, 0x7bff);
  }
}

TEST(DType, Bf16RoundingIsNearestEvenOnRandomFloats) {
  std::mt19937 rng(4321);
  std::uniform_int_distribution<uint32_t> bits(0, 0xffffffffu);
  for (int i = 0; i < 200000; ++i) {
    uint32_t b = bits(rng);
    if (i % 4 == 0) b = (b & 0xffff0000u) | 0x8000u;  // an exact tie
    float x = from_bits(b);
    if (!std::isfinite(x)) continue;
    uint16_t r = f32_to_bf16(x);
    // Past the tie above the largest finite bf16 (0x7f7f8000 in f32 bits) the result is inf.
    if ((b & 0x7fffffffu) >= 0x7f7f8000u) {
      ASSERT_EQ(r & 0x7fff, 0x7f80) << x;
      continue;
    }
    check_nearest_even(x, r, bf16_value, 0x7f7f);
  }
}

TEST(DType, BulkConversionsMatchScalar) {
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 100.0f);
  const int64_t n = 100003;  // above the parallel threshold, and odd
  std::vector<float> src(n);
  for (float& v : src) v = dist(rng);
  src[0] = std::numeric_limits<float>::infinity();
  src[1] = 1e-7f;

  std::vector<uint16_t> half(n), brain(n);
  std::vector<double> wide(n);
  std::vector<float> plain(n);
  convert_from_f32(src.data(), DType::F16, half.data(), n);
  convert_from_f32(src.data(), DType::BF16, brain.data(), n);
  convert_from_f32(src.data(), DType::F64, wide.data(), n);
  convert_from_f32(src.data(), DType::F32, plain.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(half[i], f32_to_f16(src[i]));
    ASSERT_EQ(brain[i], f32_to_bf16(src[i]));
    ASSERT_EQ(wide[i], static_cast<double>(src[i]));
    ASSERT_EQ(std::bit_cast<uint32_t>(plain[i]), std::bit_cast<uint32_t>(src[i]));
  }

  std::vector<float> back(n);
  convert_to_f32(half.data(), DType::F16, back.data(), n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(back[i], f16_to_f32(half[i]));
  convert_to_f32(brain.data(), DType::BF16, back.data(), n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(back[i], bf16_to_f32(brain[i]));
  convert_to_f32(wide.data(), DType::F64, back.data(), n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(back[i], src[i]);
  convert_to_f32(plain.data(), DType::F32, back.data(), n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(back[i], src[i]);

  // F64 -> f32 rounds to nearest: 1 + 2^-30 is closer to 1 than to the next float.
  double d = 1.0 + std::ldexp(1.0, -30);
  float f;
  convert_to_f32(&d, DType::F64, &f, 1);
  EXPECT_EQ(f, 1.0f);
}

TEST(DType, BulkConversionReadsUnalignedSources) {
  // A bf16 tensor may start at an odd byte offset inside a safetensors file.
  alignas(8) unsigned char bytes[1 + 3 * 2] = {0xee};
  const uint16_t values[3] = {0x3f80, 0xc000, 0x4040};  // 1, -2, 3
  std::memcpy(bytes + 1, values, sizeof(values));
  float out[3];
  convert_to_f32(bytes + 1, DType::BF16, out, 3);
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], -2.0f);
  EXPECT_EQ(out[2], 3.0f);
}

}  // namespace
}  // namespace tuna
