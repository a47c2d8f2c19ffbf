// core/dtype.h — element types of stored tensors and conversions between them.
//
// DType names the element types a safetensors file may hold that tuna reads or writes. Names are the
// safetensors spellings ("F32", "BF16", ...). bf16 and f16 values are stored as their raw uint16_t bits
// on the host; the GPU side uses __nv_bfloat16 / __half, which have the same bits.
//
// Conversions to the narrower type round to nearest, ties to even (what PyTorch, numpy and the CUDA
// intrinsics do), so a checkpoint converted by tuna matches one converted by transformers bit for bit.
// NaN stays NaN, inf stays inf, finite values past the largest finite value become inf, and f16
// subnormals are produced and read exactly. Widening conversions are exact.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace tuna {

enum class DType : uint8_t { F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL };

// Bytes per element: F64 8, F32 4, F16/BF16 2, I64 8, I32 4, I16 2, I8/U8/BOOL 1.
size_t dtype_size(DType dtype);
// The safetensors name: "F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL".
std::string_view dtype_name(DType dtype);
// Inverse of dtype_name (exact, case-sensitive, as the spec spells them); nullopt for anything else.
std::optional<DType> parse_dtype(std::string_view name);
// F64, F32, F16, BF16: the types convert_to_f32 / convert_from_f32 accept.
bool is_floating(DType dtype);

// ---- scalar conversions (inline: bulk loops and kernels/cpu call them per element) ----

inline float bf16_to_f32(uint16_t bits) { return std::bit_cast<float>(uint32_t{bits} << 16); }

inline uint16_t f32_to_bf16(float value) {
  uint32_t x = std::bit_cast<uint32_t>(value);
  // A NaN whose payload lies only in the low 16 bits would truncate to inf: force the quiet bit.
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x0040u);
  // Round to nearest even: add 0x7fff plus the lowest kept bit; a carry may ripple into the exponent,
  // which is exactly the rounding up to the next binade (or to inf past the largest finite bf16).
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

inline float f16_to_f32(uint16_t bits) {
  uint32_t sign = uint32_t{bits & 0x8000u} << 16;
  uint32_t exponent = (bits >> 10) & 0x1fu;
  uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0x1f)  // inf or NaN; the payload moves to the top of the f32 mantissa
    return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    if (mantissa == 0) return std::bit_cast<float>(sign);
    // Subnormal: mantissa * 2^-24, exact in f32 (any 10-bit integer times a power of two is).
    float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return sign ? -magnitude : magnitude;
  }
  // Normal: rebias the exponent from 15 to 127.
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline uint16_t f32_to_f16(float value) {
  uint32_t x = std::bit_cast<uint32_t>(value);
  uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u)  // NaN: keep the top payload bits, set the quiet bit so it cannot become inf
    return static_cast<uint16_t>(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
  // 65520 (0x477ff000) is halfway between the largest half, 65504, and 65536; 65504 has an odd
  // mantissa, so the tie rounds up, to inf. Everything at or above it is inf.
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (ax >= 0x38800000u) {  // normal half (>= 2^-14): rebias, round off 13 mantissa bits to even
    uint32_t rounded = ax + 0xfffu + ((ax >> 13) & 1u);
    return static_cast<uint16_t>(sign | ((rounded - (112u << 23)) >> 13));
  }
  // 2^-25 is half the smallest subnormal (2^-24); the tie goes to the even neighbour, zero.
  if (ax <= 0x33000000u) return sign;
  // Subnormal half: value = m * 2^(e-150) with the implicit bit in m; in units of 2^-24 that is
  // m >> (126 - e), rounded to nearest even. A result of 0x400 is the smallest normal, correctly.
  uint32_t exponent = ax >> 23;
  uint32_t mantissa = (ax & 0x7fffffu) | 0x800000u;
  uint32_t shift = 126u - exponent;  // 14..24 in this range
  uint32_t quotient = mantissa >> shift;
  uint32_t remainder = mantissa & ((1u << shift) - 1u);
  uint32_t half = 1u << (shift - 1u);
  if (remainder > half || (remainder == half && (quotient & 1u))) ++quotient;
  return static_cast<uint16_t>(sign | quotient);
}

// ---- bulk conversions ----
// src need not be aligned (tensors inside a safetensors file may sit at any byte offset).
// Large arrays are converted by all OpenMP threads.

// dst[i] = float(src[i]) for src_dtype in F64, F32, F16, BF16 (F64 rounds to nearest).
void convert_to_f32(const void* src, DType src_dtype, float* dst, int64_t n);
// dst[i] = src[i] rounded to dst_dtype, for dst_dtype in F64, F32, F16, BF16.
void convert_from_f32(const float* src, DType dst_dtype, void* dst, int64_t n);

// The index of the first element of src (dtype F64, F32, F16 or BF16; any alignment) that is NaN or
// infinite, or -1 when all n are finite. Read by the exponent bits, without converting; all OpenMP threads
// for large arrays. Loaders refuse non-finite weights and moments with it (a NaN in a checkpoint trains on as
// NaN and turns every later loss into NaN).
int64_t first_non_finite(const void* src, DType dtype, int64_t n);
// The element as a double (for the message that names it).
double element_as_double(const void* src, DType dtype, int64_t i);

}  // namespace tuna
