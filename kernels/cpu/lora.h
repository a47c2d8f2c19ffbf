// The element-wise parts of a LoRA adapter: CPU twin of kernels/lora.cuh (fp32).
#pragma once
#include <cstdint>

namespace tuna::cpu {

// dst[row, j] (= or +=, by accumulate) keep(row * global_in + col0 + j) ? src[row, j] / (1 - p) : 0 over rows x in
// contiguous elements, keep being model/lora.h's lora_dropout_keeps(stream_key, index, p). dst may equal src (then
// accumulate is false).
void lora_dropout(float* dst, const float* src, int64_t rows, int64_t in, int64_t global_in, int64_t col0,
                  uint64_t stream_key, double p, bool accumulate);

// x[i] *= s.
void scale(float* x, int64_t count, float s);

}  // namespace tuna::cpu
