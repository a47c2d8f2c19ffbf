// FP8 training numerics (--fp8 tensorwise): the OCP formats, PTX's conversion into them, torchao's per-tensor
// dynamic scale, and cuBLASLt's scaled FP8 GEMM, simulated exactly on the CPU. CPU twin of kernels/fp8.cuh and of
// the FP8 products of kernels/matmul.cuh.
//
//   e4m3 (OCP E4M3FN): 1 sign, 4 exponent (bias 7), 3 mantissa bits; max 448, subnormals down to 2^-9, no inf,
//                      NaN = S.1111.111. The forward's operands (activations and weights).
//   e5m2:              1 sign, 5 exponent (bias 15), 2 mantissa bits; max 57344, subnormals down to 2^-16, inf,
//                      NaN. The gradients (wider range, less precision).
// Conversion: cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32 per value: round to nearest even (subnormals included, no
// flush), |x| > max (inf included) to the sign-preserving max, NaN to the canonical NaN 0x7f.
// Scale (torchao's tensorwise recipe, float8_utils.amax_to_scale): scale = fp32(max / max(amax, 1e-12)) computed in
// float64; code = cvt(fp32(x * scale)); the GEMM takes 1 / scale (fp32) as its operand scale (torch._scaled_mm's
// scale_a/scale_b, cuBLASLt's A/B_SCALE_POINTER).
#pragma once
#include <cstdint>

namespace tuna::cpu {

enum class Fp8Format : uint8_t { E4M3, E5M2 };

constexpr float kE4M3Max = 448.0f;
constexpr float kE5M2Max = 57344.0f;
constexpr uint8_t kFp8NaN = 0x7f;  // what cvt writes for a NaN in either format
constexpr double kFp8AmaxFloor = 1e-12;  // torchao's EPS: an all-zero tensor gets scale max / 1e-12

inline float fp8_max(Fp8Format format) { return format == Fp8Format::E4M3 ? kE4M3Max : kE5M2Max; }
const char* fp8_name(Fp8Format format);

// cvt.rn.satfinite of one fp32 value into the format's code.
uint8_t fp8_from_float(float x, Fp8Format format);
// A code's value, exactly (e5m2's inf as inf; every NaN code as a quiet NaN).
float fp8_to_float(uint8_t code, Fp8Format format);

// torchao's amax_to_scale: fp32(max / max(double(amax), 1e-12)); a NaN amax gives a NaN scale.
float fp8_scale(float amax, Fp8Format format);

// amax = max(amax, max |x[r, c]|) over rows x cols with rows ld apart: ACCUMULATES (the caller starts it at 0), so
// that several producers of one GEMM operand (or several ranks' shards) fold into one. A NaN anywhere makes it NaN.
void fp8_amax(float* amax, const float* x, int64_t rows, int64_t cols, int64_t ld);

// out[r, c] = cvt(fp32(x[r, c] * scale)) with scale = fp8_scale(amax); *inv_scale = fp32(1 / scale). x's rows are
// ld apart, out is [rows, cols] dense. OVERWRITES out and *inv_scale.
void fp8_cast(uint8_t* out, float* inv_scale, const float* x, int64_t rows, int64_t cols, int64_t ld, float amax,
              Fp8Format format);
// The same codes, transposed: out_t[c, r] (dense [cols, rows]); and out[r, c] too when out is not null. The FP8
// GEMM takes both operands K-major, so the backward's products read transposes of the forward's operands.
// OVERWRITES out_t, out and *inv_scale.
void fp8_cast_transpose(uint8_t* out, uint8_t* out_t, float* inv_scale, const float* x, int64_t rows, int64_t cols,
                        int64_t ld, float amax, Fp8Format format);

// The scaled FP8 GEMM as cuBLASLt computes it, with both operands K-major ("TN"): for m x n outputs,
//   D[i, j] (= or +=, by accumulate) (inv_scale_a * inv_scale_b) * sum_k A[i, k] B[j, k]
// with A [m, k] and B [n, k] codes (dense), D's rows ldd apart, fp32 throughout. The products of two FP8 values are
// exact in fp32, so the sum is an fp32 accumulation of exact products, as the tensor cores' (non-fast) mode
// accumulates; its order is BLAS's (cuBLASLt's differs, which moves the last bits). cuBLASLt documents
// D = alpha * scale_A * scale_B * acc + beta * C without the order of those multiplications: the twin forms
// scale_A * scale_B first (one fp32 rounding), then multiplies the accumulator by it, then adds C (beta = 1).
// Overwrite never reads D.
void fp8_gemm(float* d, int64_t ldd, const uint8_t* a, Fp8Format a_format, float inv_scale_a, const uint8_t* b,
              Fp8Format b_format, float inv_scale_b, int64_t m, int64_t n, int64_t k, bool accumulate);

}  // namespace tuna::cpu
