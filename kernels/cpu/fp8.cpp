// FP8 numerics on the CPU (contract: kernels/cpu/fp8.h). The conversion works on fp32's bits: the exponent and
// mantissa fields shifted into the target's, the dropped bits rounding to nearest even (a carry out of the mantissa
// moves into the exponent, as in the field layout it must); the subnormal range shifts the significand with its
// implicit bit by the exponent's shortfall. Decoding goes through a table of the 256 codes' values.
#include "kernels/cpu/fp8.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/parallel.h"

namespace tuna::cpu {
namespace {

struct FormatBits {
  int mantissa_bits;
  int bias;
  uint8_t max_code;  // the largest finite magnitude's code
  uint32_t max_f32_bits;
};

constexpr FormatBits kE4M3{3, 7, 0x7e, 0x43e00000u};   // 448 = 1.75 * 2^8
constexpr FormatBits kE5M2{2, 15, 0x7b, 0x47600000u};  // 57344 = 1.75 * 2^15

const FormatBits& bits_of(Fp8Format format) { return format == Fp8Format::E4M3 ? kE4M3 : kE5M2; }

// value >> shift rounded to nearest, ties to even (shift >= 1).
uint32_t shift_round_even(uint32_t value, int shift) {
  const uint32_t kept = value >> shift, dropped = value & ((uint32_t{1} << shift) - 1), half = uint32_t{1} << (shift - 1);
  return kept + ((dropped > half || (dropped == half && (kept & 1u))) ? 1u : 0u);
}

float decode(uint8_t code, Fp8Format format) {
  const FormatBits& f = bits_of(format);
  const int exponent_field = (code & 0x7f) >> f.mantissa_bits, mantissa = code & ((1 << f.mantissa_bits) - 1);
  const int max_exponent_field = (1 << (7 - f.mantissa_bits)) - 1;
  const float sign = (code & 0x80) ? -1.0f : 1.0f;
  if (format == Fp8Format::E4M3 && (code & 0x7f) == 0x7f) return std::numeric_limits<float>::quiet_NaN();
  if (format == Fp8Format::E5M2 && exponent_field == max_exponent_field)
    return mantissa == 0 ? sign * std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
  if (exponent_field == 0) return sign * std::ldexp(static_cast<float>(mantissa), 1 - f.bias - f.mantissa_bits);
  return sign * std::ldexp(static_cast<float>((1 << f.mantissa_bits) + mantissa),
                           exponent_field - f.bias - f.mantissa_bits);
}

using DecodeTable = std::array<float, 256>;
const DecodeTable& table_of(Fp8Format format) {
  static const auto make = [](Fp8Format fmt) {
    DecodeTable table;
    for (int c = 0; c < 256; ++c) table[c] = decode(static_cast<uint8_t>(c), fmt);
    return table;
  };
  static const DecodeTable e4m3 = make(Fp8Format::E4M3), e5m2 = make(Fp8Format::E5M2);
  return format == Fp8Format::E4M3 ? e4m3 : e5m2;
}

void check_shape(const char* op, int64_t rows, int64_t cols, int64_t ld) {
  TUNA_CHECK(rows >= 0 && cols >= 0 && ld >= cols, op, " of ", rows, " x ", cols, " with rows ", ld, " apart");
}

}  // namespace

const char* fp8_name(Fp8Format format) { return format == Fp8Format::E4M3 ? "e4m3" : "e5m2"; }

uint8_t fp8_from_float(float x, Fp8Format format) {
  const FormatBits& f = bits_of(format);
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return kFp8NaN;
  if (magnitude > f.max_f32_bits) return sign | f.max_code;  // .satfinite: inf and every |x| > max
  const int exponent = static_cast<int>(magnitude >> 23) - 127;
  const int shift = 23 - f.mantissa_bits;
  if (exponent >= 1 - f.bias) {
    // Normal in the target: rebias the exponent field and round the mantissa; a carry rounds into the exponent.
    // |x| <= max keeps the result at or below max_code.
    const uint32_t rebiased = (static_cast<uint32_t>(exponent + f.bias) << 23) | (magnitude & 0x7fffffu);
    return sign | static_cast<uint8_t>(shift_round_even(rebiased, shift));
  }
  // Subnormal in the target (fp32 subnormals included: far below half its smallest step): the significand with its
  // implicit bit, in units of the smallest subnormal 2^(1 - bias - mantissa_bits). Rounding up to 1 << mantissa_bits
  // is the smallest normal's code, as it must be.
  const uint32_t significand = magnitude < 0x00800000u ? 0u : (magnitude & 0x7fffffu) | 0x800000u;
  const int subnormal_shift = shift + (1 - f.bias) - exponent;
  if (subnormal_shift >= 25) return sign;  // below a quarter of the smallest subnormal: zero (signed)
  return sign | static_cast<uint8_t>(shift_round_even(significand, subnormal_shift));
}

float fp8_to_float(uint8_t code, Fp8Format format) { return table_of(format)[code]; }

float fp8_scale(float amax, Fp8Format format) {
  double floor_amax = static_cast<double>(amax);
  if (floor_amax < kFp8AmaxFloor) floor_amax = kFp8AmaxFloor;  // torch.clamp(min=EPS): a NaN stays NaN
  return static_cast<float>(static_cast<double>(fp8_max(format)) / floor_amax);
}

void fp8_amax(float* amax, const float* x, int64_t rows, int64_t cols, int64_t ld) {
  check_shape("fp8_amax", rows, cols, ld);
  float m = *amax;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float v = std::fabs(x[r * ld + c]);
      if (v > m || std::isnan(v)) m = std::isnan(m) ? m : v;
    }
  *amax = m;
}

void fp8_cast(uint8_t* out, float* inv_scale, const float* x, int64_t rows, int64_t cols, int64_t ld, float amax,
              Fp8Format format) {
  check_shape("fp8_cast", rows, cols, ld);
  const float scale = fp8_scale(amax, format);
  *inv_scale = 1.0f / scale;
#pragma omp parallel for if (rows * cols >= kMinParallelWork)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = fp8_from_float(x[r * ld + c] * scale, format);
}

void fp8_cast_transpose(uint8_t* out, uint8_t* out_t, float* inv_scale, const float* x, int64_t rows, int64_t cols,
                        int64_t ld, float amax, Fp8Format format) {
  check_shape("fp8_cast_transpose", rows, cols, ld);
  const float scale = fp8_scale(amax, format);
  *inv_scale = 1.0f / scale;
#pragma omp parallel for if (rows * cols >= kMinParallelWork)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const uint8_t code = fp8_from_float(x[r * ld + c] * scale, format);
      out_t[c * rows + r] = code;
      if (out != nullptr) out[r * cols + c] = code;
    }
}

void fp8_gemm(float* d, int64_t ldd, const uint8_t* a, Fp8Format a_format, float inv_scale_a, const uint8_t* b,
              Fp8Format b_format, float inv_scale_b, int64_t m, int64_t n, int64_t k, bool accumulate) {
  TUNA_CHECK(m >= 0 && n >= 0 && k >= 0 && ldd >= n, "fp8_gemm of m ", m, " n ", n, " k ", k, " ldd ", ldd);
  TUNA_CHECK(!(a_format == Fp8Format::E5M2 && b_format == Fp8Format::E5M2),
             "fp8_gemm of two e5m2 operands (cuBLASLt has no e5m2 x e5m2 product)");
  if (m == 0 || n == 0) return;
  const float alpha = inv_scale_a * inv_scale_b;
  // Scratch of the largest call so far, per thread: the CPU model calls this a few times a layer, and fresh vectors
  // of these sizes each time cost page faults (system time) on the order of the products themselves.
  thread_local std::vector<float> a_values, b_values, acc;
  const bool direct = !accumulate && ldd == n;  // the accumulator is d itself
  if (!direct && acc.size() < static_cast<size_t>(m * n)) acc.resize(static_cast<size_t>(m * n));
  float* sum = direct ? d : acc.data();
  if (k == 0) {
    std::fill(sum, sum + m * n, 0.0f);
  } else {
    // The codes' values, unscaled: each product of two is exact in fp32, so BLAS's fp32 sum of them is the
    // tensor cores' accumulation up to order.
    if (a_values.size() < static_cast<size_t>(m * k)) a_values.resize(static_cast<size_t>(m * k));
    if (b_values.size() < static_cast<size_t>(n * k)) b_values.resize(static_cast<size_t>(n * k));
    const DecodeTable &ta = table_of(a_format), &tb = table_of(b_format);
    for (int64_t i = 0; i < m * k; ++i) a_values[i] = ta[a[i]];
    for (int64_t i = 0; i < n * k; ++i) b_values[i] = tb[b[i]];
    matmul_fwd(sum, a_values.data(), b_values.data(), m, k, n);
  }
#pragma omp parallel for if (m * n >= kMinParallelWork)
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      const float product = alpha * sum[i * n + j];
      d[i * ldd + j] = accumulate ? product + d[i * ldd + j] : product;
    }
}

}  // namespace tuna::cpu
