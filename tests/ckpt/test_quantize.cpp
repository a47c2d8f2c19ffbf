// ckpt/quantize.h: q8_0 and q4_0 blocks on hand-computed cases that tell the rounding rules apart (half away
// from zero, trunc + 8.5 with the clip at 15, the first of equal magnitudes), the nibble layout, the error bound
// on random rows, and bytes independent of the thread count. Equality with the gguf package's quantizers, byte
// for byte, is checked on whole exports (tests/tools/test_convert.cpp, tools/reference/check_gguf.py).
#include "ckpt/quantize.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/dtype.h"

namespace tuna {
namespace {

uint16_t scale_bits(const std::vector<std::byte>& block) {
  uint16_t bits;
  std::memcpy(&bits, block.data(), 2);
  return bits;
}

TEST(Quantize, Q8_0RoundsHalfAwayFromZero) {
  // max |x| = 127: d = 1 exactly, so q = round(x) and the ties show which rounding it is (banker's: 2, -2, 0).
  std::vector<float> x(32, 0.0f);
  x[0] = 127.0f, x[1] = 2.5f, x[2] = -2.5f, x[3] = 0.5f, x[4] = -126.4f, x[5] = 3.49f;
  std::vector<std::byte> block(quant_block_bytes(BlockQuant::q8_0));
  ASSERT_EQ(block.size(), 34u);
  quantize_blocks(BlockQuant::q8_0, x.data(), 32, block.data());
  EXPECT_EQ(scale_bits(block), f32_to_f16(1.0f));
  const int8_t want[] = {127, 3, -3, 1, -126, 3, 0};
  for (int j = 0; j < 7; ++j) EXPECT_EQ(static_cast<int8_t>(block[2 + j]), want[j]) << "element " << j;
}

TEST(Quantize, Q4_0TakesTheSignedLargestAndClipsAt15) {
  // The value of largest magnitude is -8: d = -8 / -8 = 1, id = 1, q = min(15, trunc(x + 8.5)).
  std::vector<float> x(32, 0.0f);
  x[0] = -8.0f;   // 0.5 -> 0
  x[1] = 7.5f;    // 16 -> clipped to 15
  x[2] = 0.49f;   // 8.99 -> 8
  x[3] = -0.5f;   // 8.0 -> 8
  x[4] = 3.0f;    // 11.5 -> 11
  x[16] = -3.0f;  // 5.5 -> 5, the high nibble of byte 0
  x[17] = 2.6f;   // 11.1 -> 11, the high nibble of byte 1
  std::vector<std::byte> block(quant_block_bytes(BlockQuant::q4_0));
  ASSERT_EQ(block.size(), 18u);
  quantize_blocks(BlockQuant::q4_0, x.data(), 32, block.data());
  EXPECT_EQ(scale_bits(block), f32_to_f16(1.0f));
  EXPECT_EQ(static_cast<int>(block[2]), 0 | (5 << 4));
  EXPECT_EQ(static_cast<int>(block[3]), 15 | (11 << 4));
  EXPECT_EQ(static_cast<int>(block[4]), 8 | (8 << 4));  // x[2] and x[18] = 0
  EXPECT_EQ(static_cast<int>(block[5]), 8 | (8 << 4));
  EXPECT_EQ(static_cast<int>(block[6]), 11 | (8 << 4));
}

TEST(Quantize, Q4_0ScaleSignFollowsTheFirstOfEqualMagnitudes) {
  std::vector<float> x(32, 1.0f);
  x[3] = 5.0f, x[9] = -5.0f;
  std::vector<std::byte> block(18);
  quantize_blocks(BlockQuant::q4_0, x.data(), 32, block.data());
  EXPECT_EQ(scale_bits(block), f32_to_f16(5.0f / -8.0f));
  x[3] = -5.0f, x[9] = 5.0f;
  quantize_blocks(BlockQuant::q4_0, x.data(), 32, block.data());
  EXPECT_EQ(scale_bits(block), f32_to_f16(-5.0f / -8.0f));
}

TEST(Quantize, ZeroBlocks) {
  std::vector<float> x(32, 0.0f);
  std::vector<std::byte> q8(34), q4(18);
  quantize_blocks(BlockQuant::q8_0, x.data(), 32, q8.data());
  quantize_blocks(BlockQuant::q4_0, x.data(), 32, q4.data());
  for (int j = 0; j < 34; ++j) EXPECT_EQ(static_cast<int>(q8[j]), 0) << j;
  EXPECT_EQ(scale_bits(q4), f32_to_f16(-0.0f));  // 0 / -8 is -0, in numpy and ggml alike
  for (int j = 2; j < 18; ++j) EXPECT_EQ(static_cast<int>(q4[j]), 0x88) << j;  // 0 * 0 + 8.5 -> 8, both nibbles
}

TEST(Quantize, ErrorWithinHalfAStepAndIndependentOfThreads) {
  const int64_t n = int64_t(32) << 14;  // 16384 blocks: past the parallel threshold
  std::vector<float> x(n);
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  for (float& v : x) v = normal(rng);
  for (BlockQuant type : {BlockQuant::q8_0, BlockQuant::q4_0}) {
    const size_t bytes = n / 32 * quant_block_bytes(type);
    std::vector<std::byte> one(bytes), many(bytes);
    const int threads = omp_get_max_threads();
    omp_set_num_threads(1);
    quantize_blocks(type, x.data(), n, one.data());
    omp_set_num_threads(4);
    quantize_blocks(type, x.data(), n, many.data());
    omp_set_num_threads(threads);
    EXPECT_EQ(0, std::memcmp(one.data(), many.data(), bytes)) << quant_name(type);
    std::vector<float> y(n);
    dequantize_blocks(type, one.data(), n, y.data());
    for (int64_t b = 0; b < n / 32; ++b) {
      float amax = 0.0f;
      for (int j = 0; j < 32; ++j) amax = std::fmax(amax, std::fabs(x[b * 32 + j]));
      // Steps of amax/127 (q8_0) or amax/8 (q4_0); half a step of rounding, plus the f16 scale's relative 2^-11
      // over up to 127 (or 8) steps. q4_0's clip at 15 costs a whole step at the positive end (the -8 side is
      // exact): x = -d * 8 ... 7.
      const float step = type == BlockQuant::q8_0 ? amax / 127.0f : amax / 8.0f;
      const float bound = (type == BlockQuant::q8_0 ? 0.5f : 1.0f) * step + amax * 0x1p-10f;
      for (int j = 0; j < 32; ++j)
        ASSERT_LE(std::fabs(y[b * 32 + j] - x[b * 32 + j]), bound) << quant_name(type) << " block " << b << " " << j;
    }
  }
}

}  // namespace
}  // namespace tuna
