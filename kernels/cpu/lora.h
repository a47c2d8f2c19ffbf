// The element-wise parts of a LoRA adapter: CPU twin of kernels/lora.cuh (fp32).
#pragma once
#include <cstdint>

namespace tuna {

// The one definition of a LoRA dropout mask (model/lora.h keys the streams; kernels/lora.cu restates it for the
// device, and its tests hold the two equal).
inline uint64_t lora_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
// True when the element survives a dropout of probability p (then it is scaled by 1 / (1 - p)).
inline bool lora_dropout_keeps(uint64_t stream, int64_t index, double p) {
  const uint64_t bits = lora_mix(stream + 0x9E3779B97F4A7C15ull * (static_cast<uint64_t>(index) + 1));
  return static_cast<double>(bits >> 11) * 0x1.0p-53 >= p;
}

}  // namespace tuna

namespace tuna::cpu {

// dst[row, j] (= or +=, by accumulate) keep(row * global_in + col0 + j) ? src[row, j] / (1 - p) : 0 over rows x in
// contiguous elements, keep being lora_dropout_keeps(stream_key, index, p) above. dst may equal src (then
// accumulate is false).
void lora_dropout(float* dst, const float* src, int64_t rows, int64_t in, int64_t global_in, int64_t col0,
                  uint64_t stream_key, double p, bool accumulate);

// x[i] *= s.
void scale(float* x, int64_t count, float s);

}  // namespace tuna::cpu
