// FP8 casts on the GPU (--fp8 tensorwise): a GEMM operand's amax, and its bf16 values cast to e4m3 or e5m2 with the
// per-tensor scale that amax gives. Contract of kernels/cpu/fp8.h (fp8_amax, fp8_cast, fp8_cast_transpose), with
// bf16 inputs, the amax and the scale's inverse in device memory: nothing waits for the host.
// The producers of most GEMM inputs fold their amax themselves (rmsnorm_*_amax, swiglu_*_amax); fp8_amax serves
// the rest (the attention output, the q|k|v gradient, the weights).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cpu/fp8.h"

namespace tuna::cuda {

using cpu::Fp8Format;

// *amax = max(*amax, max |x[r, c]|) over rows x cols, rows ld apart. ACCUMULATES: the caller zeroes *amax (fp32,
// device) before the first producer.
void fp8_amax(float* amax, const __nv_bfloat16* x, int64_t rows, int64_t cols, int64_t ld, cudaStream_t stream);

// out[r, c] = cvt.rn.satfinite(fp32(x[r, c] * scale)), scale = fp8_scale(*amax) (computed on the device in float64,
// as the twin), out dense [rows, cols]; *inv_scale = fp32(1 / scale), the GEMM's operand scale. OVERWRITES out and
// *inv_scale.
void fp8_cast(uint8_t* out, float* inv_scale, const __nv_bfloat16* x, int64_t rows, int64_t cols, int64_t ld,
              const float* amax, Fp8Format format, cudaStream_t stream);

// The same codes into out_t[c, r] (dense [cols, rows]), and into out[r, c] when out is not null: one read of x
// for both layouts an FP8 GEMM operand is used in. OVERWRITES out_t, out and *inv_scale.
void fp8_cast_transpose(uint8_t* out, uint8_t* out_t, float* inv_scale, const __nv_bfloat16* x, int64_t rows,
                        int64_t cols, int64_t ld, const float* amax, Fp8Format format, cudaStream_t stream);

}  // namespace tuna::cuda
