// Helpers for the CPU twins' inner loops: one build that uses the vector units of the machine it runs on,
// and an exp that vectorizes.
//
// TUNA_CPU_CLONES compiles a function three times (AVX-512, AVX2 + FMA, baseline x86-64) and lets the loader
// pick one per process from the CPU's features (GCC's target_clones, an ifunc). The binary still runs on any
// x86-64; a process always runs the same clone, so results stay independent of the thread count. Put it on
// the functions that hold the hot loops, not on functions with an `omp parallel` region inside: GCC outlines
// the region's body into a function of its own, which the cloning does not reach.
//
// exp_lanes(float) is exp written as plain arithmetic (no libm call), so that a loop over it vectorizes:
// 2^n e^r with n = round(x / ln 2) and |r| <= ln 2 / 2, e^r by its Taylor series to degree 7 (the truncation
// error r^8 / 8! < 6e-9 is far below fp32's half ulp, 6e-8), 2^n put into the exponent bits. Error under
// 1 ulp on [-87.3, 88.7] (tests/kernels/test_vector_math.cpp); below it 0 and above it +inf, as exp's
// underflow and overflow give (so 1 / (1 + exp(1000)) is a sigmoid's clean 0). NaN in, NaN out.
// exp_lanes(double) is std::exp: the double instantiations of the ops are the tests' references, not a
// fast path.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__x86_64__) && !defined(__clang__)
#define TUNA_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define TUNA_CPU_CLONES
#endif

namespace tuna::cpu {

inline float exp_lanes(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  // ln 2 split in two: n * kLn2High is exact in fp32 for |n| < 2^10, so r loses nothing to the subtraction.
  constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
  // Adding 1.5 * 2^23 rounds to the nearest integer in the default rounding mode (no libm call to vectorize).
  constexpr float kRoundShift = 12582912.0f;
  constexpr float kLowest = -87.3f, kHighest = 88.7f;  // 2^n stays a normal float in between
  const float in = x;
  x = x < kLowest ? kLowest : x;  // written as selects (not std::min) so that NaN passes through
  x = x > kHighest ? kHighest : x;
  const float shifted = x * kLog2e + kRoundShift;
  const float n = shifted - kRoundShift;
  // The same n as an integer, read from the bits (1.5 * 2^23 + n is 0x4B400000 + n): no float-to-int
  // conversion, which would be undefined for NaN.
  const int32_t exponent = std::bit_cast<int32_t>(shifted) - 0x4B400000;
  const float r = (x - n * kLn2High) - n * kLn2Low;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // 2^n as a float: n + 127 in the exponent field. n is in [-126, 128]; 2^128 does not exist, so the top of
  // the range is taken as 2 * 2^127.
  const int32_t clamped = exponent > 127 ? 127 : exponent;
  const float scale = std::bit_cast<float>((clamped + 127) << 23);
  const float value = p * scale * (exponent > 127 ? 2.0f : 1.0f);
  return in < kLowest ? 0.0f : in > kHighest ? std::numeric_limits<float>::infinity() : value;
}

inline double exp_lanes(double x) { return std::exp(x); }

}  // namespace tuna::cpu
