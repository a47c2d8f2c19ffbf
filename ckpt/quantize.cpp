#include "ckpt/quantize.h"

#include <cmath>
#include <cstring>

#include "core/dtype.h"
#include "core/error.h"

namespace tuna {

namespace {

void store_f16(std::byte* at, float value) {
  const uint16_t bits = f32_to_f16(value);  // round to nearest even, as numpy's astype(float16) and ggml's
  std::memcpy(at, &bits, 2);                // the file is little-endian, as is every machine tuna runs on
}

float load_f16(const std::byte* at) {
  uint16_t bits;
  std::memcpy(&bits, at, 2);
  return f16_to_f32(bits);
}

void quantize_q8_0(const float* x, std::byte* out) {
  float amax = 0.0f;
  for (int j = 0; j < kQuantBlock; ++j) amax = std::fmax(amax, std::fabs(x[j]));
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  store_f16(out, d);
  for (int j = 0; j < kQuantBlock; ++j) {
    // roundf: half away from zero, as ggml's and numpy's np_roundf. The product is exactly the fp32 one they
    // round (no fused multiply-add across the call).
    const float v = x[j] * id;
    out[2 + j] = static_cast<std::byte>(static_cast<int8_t>(std::roundf(v)));
  }
}

void quantize_q4_0(const float* x, std::byte* out) {
  float amax = 0.0f, max = 0.0f;
  for (int j = 0; j < kQuantBlock; ++j) {
    const float v = x[j];
    if (amax < std::fabs(v)) amax = std::fabs(v), max = v;  // the first of equal magnitudes, as argmax
  }
  const float d = max / -8.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  store_f16(out, d);
  constexpr int kHalf = kQuantBlock / 2;
  for (int j = 0; j < kHalf; ++j) {
    const float v0 = x[j] * id + 8.5f, v1 = x[kHalf + j] * id + 8.5f;
    // trunc then clip to 15: x / d lies in [-8, 8], so v in [0.5, 16.5]; 16 (x == -max) becomes 15.
    const int q0 = std::min(15, static_cast<int>(v0)), q1 = std::min(15, static_cast<int>(v1));
    out[2 + j] = static_cast<std::byte>(q0 | (q1 << 4));
  }
}

}  // namespace

size_t quant_block_bytes(BlockQuant type) { return type == BlockQuant::q8_0 ? 2 + 32 : 2 + 16; }

const char* quant_name(BlockQuant type) { return type == BlockQuant::q8_0 ? "q8_0" : "q4_0"; }

void quantize_blocks(BlockQuant type, const float* x, int64_t n, std::byte* out) {
  TUNA_CHECK(n % kQuantBlock == 0, "quantize_blocks: ", n, " values are not whole blocks of ", kQuantBlock);
  const int64_t blocks = n / kQuantBlock;
  const size_t bytes = quant_block_bytes(type);
  // A block is ~100 operations: parallel past a few thousand blocks, where the fork pays for itself.
#pragma omp parallel for schedule(static) if (blocks >= 4096)
  for (int64_t b = 0; b < blocks; ++b) {
    if (type == BlockQuant::q8_0)
      quantize_q8_0(x + b * kQuantBlock, out + b * bytes);
    else
      quantize_q4_0(x + b * kQuantBlock, out + b * bytes);
  }
}

void dequantize_blocks(BlockQuant type, const std::byte* blocks, int64_t n, float* y) {
  TUNA_CHECK(n % kQuantBlock == 0, "dequantize_blocks: ", n, " values are not whole blocks of ", kQuantBlock);
  const size_t bytes = quant_block_bytes(type);
  for (int64_t b = 0; b < n / kQuantBlock; ++b) {
    const std::byte* in = blocks + b * bytes;
    const float d = load_f16(in);
    float* v = y + b * kQuantBlock;
    for (int j = 0; j < kQuantBlock; ++j) {
      if (type == BlockQuant::q8_0) {
        v[j] = d * static_cast<float>(static_cast<int8_t>(in[2 + j]));
      } else {
        const int q = (static_cast<int>(in[2 + j % 16]) >> (j < 16 ? 0 : 4)) & 0xf;
        v[j] = d * static_cast<float>(q - 8);
      }
    }
  }
}

}  // namespace tuna
