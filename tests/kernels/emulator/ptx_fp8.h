// tests/kernels/emulator/ptx_fp8.h — host versions of the FP8 PTX helpers of kernels/fp8_ptx.cuh
// (cvt.rn.satfinite.e4m3x2.f32 and .e5m2x2.f32), which kernels/fp8.cu finds in their place under TUNA_EMULATOR
// (through the shim's <cuda_bf16.h> and runtime.h, which include this header).
//
// Written from the PTX ISA (cvt, among the data movement and conversion instructions; the alternate floating-point
// data formats e4m3 and e5m2), not from the kernels or the CPU twin
// (kernels/cpu/fp8.cpp works on fp32's bit fields; this works in float64 arithmetic): each of the two fp32 inputs
// is converted to the destination format, a into the upper 8 bits of d and b into the lower; .rn rounds to the
// nearest representable value, ties to even, subnormal results kept; .satfinite (mandatory for these types) makes a
// NaN input the format's NaN and an input of magnitude above MAX_NORM (infinities included) the sign-preserved
// MAX_NORM. The NaN the hardware writes is 0x7f in both formats (the canonical NaN of CUDA's cuda_fp8.hpp, whose
// host path reproduces the instruction): a NaN's sign and payload are dropped.
// tests/kernels/emulator/test_ptx_fp8.cpp holds both to values worked out by hand from those definitions.
#pragma once

#include <cmath>
#include <cstdint>

namespace tuna::emulator {

// One value: `mantissa_bits` stored fraction bits, exponent bias `bias`, largest finite magnitude `max_norm`.
inline uint8_t cvt_rn_satfinite_fp8(float x, int mantissa_bits, int bias, double max_norm) {
  if (std::isnan(x)) return 0x7f;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  double a = std::fabs(static_cast<double>(x));  // exact
  const int min_exponent = 1 - bias;             // of the normals; the subnormals share its quantum
  if (a > max_norm) {
    a = max_norm;
  } else {
    // The spacing of the format's values at a's magnitude (never finer than the subnormals'), and a rounded to a
    // multiple of it: a / quantum is exact in double, nearbyint rounds it to even under the default rounding mode.
    const int exponent = a == 0.0 ? min_exponent : std::max(std::ilogb(a), min_exponent);
    const double quantum = std::ldexp(1.0, exponent - mantissa_bits);
    a = std::nearbyint(a / quantum) * quantum;  // at most max_norm: max_norm is a multiple of its binade's quantum
  }
  if (a < std::ldexp(1.0, min_exponent))  // zero or subnormal: exponent field 0, the value in the smallest steps
    return sign | static_cast<uint8_t>(a / std::ldexp(1.0, min_exponent - mantissa_bits));
  const int exponent = std::ilogb(a);
  const int fraction = static_cast<int>(a / std::ldexp(1.0, exponent - mantissa_bits)) - (1 << mantissa_bits);
  return sign | static_cast<uint8_t>(((exponent + bias) << mantissa_bits) | fraction);
}

}  // namespace tuna::emulator

namespace tuna::cuda::fp8 {

inline uint16_t cvt_e4m3x2(float hi, float lo) {
  using tuna::emulator::cvt_rn_satfinite_fp8;
  return static_cast<uint16_t>((cvt_rn_satfinite_fp8(hi, 3, 7, 448.0) << 8) | cvt_rn_satfinite_fp8(lo, 3, 7, 448.0));
}
inline uint16_t cvt_e5m2x2(float hi, float lo) {
  using tuna::emulator::cvt_rn_satfinite_fp8;
  return static_cast<uint16_t>((cvt_rn_satfinite_fp8(hi, 2, 15, 57344.0) << 8) |
                               cvt_rn_satfinite_fp8(lo, 2, 15, 57344.0));
}

}  // namespace tuna::cuda::fp8
