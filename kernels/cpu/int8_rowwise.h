// int8 with one absmax per row: the frozen-base storage of --base_quant int8, bitsandbytes' LLM.int8() weight
// format (int8_vectorwise_quant: the CB and SCB of an 8-bit Linear). CPU twin of kernels/int8_rowwise.cuh.
//
// A weight [rows, cols]: scale[r] = max |w[r, :]|; q[r, c] = round_half_even(w[r, c] * ((1 / scale[r]) * 127)), in
// [-127, 127] (a row of zeros: scale 0, q 0); back: w = (q * scale[r]) * fp32(1/127). Each product rounded to fp32
// on its own, as torch computes bitsandbytes' expressions (tests/fixtures/base_quant/int8.safetensors holds its output).
// Why this scheme for int8: it is what transformers' load_in_8bit stores for a LoRA base, one scale per output row
// (a GEMM epilogue can apply it), and 1 byte + 4 / cols a parameter. bitsandbytes' 8-bit Linear first casts the
// weight to fp16; tuna quantizes the bf16/fp32 values themselves (fp16 would flush a bf16 weight's small values).
#pragma once
#include <cstdint>

namespace tuna::cpu {

constexpr float kInt8InvScale = 7.874015718698502e-3f;  // 1/127, as bitsandbytes writes it

// Fails (tuna::Error) naming `what` and the element when w holds a NaN or an infinity. OVERWRITES q, scale.
void int8_rowwise_quantize(const float* w, int64_t rows, int64_t cols, int8_t* q, float* scale, const char* what);
// w[r, c] = (q[r, c] * scale[r]) * kInt8InvScale, in fp32 or rounded to bf16 (bits). OVERWRITES out.
void int8_rowwise_dequantize(const int8_t* q, const float* scale, int64_t rows, int64_t cols, float* out);
void int8_rowwise_dequantize(const int8_t* q, const float* scale, int64_t rows, int64_t cols, uint16_t* out_bf16);

}  // namespace tuna::cpu
