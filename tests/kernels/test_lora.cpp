// kernels/cpu/lora: the dropout kernel draws exactly lora_dropout_keeps's mask (its integer form of the test included:
// probabilities whose threshold is an exact integer, the smallest and largest ones), scales the survivors by
// 1 / (1 - p), overwrites or accumulates, and works in place; over a tensor-parallel rank's columns too.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "kernels/cpu/lora.h"
#include "tests/kernels/op_test_util.h"

namespace tuna::cpu {
namespace {

using test::TestRng;

TEST(LoraDropoutKernel, DrawsLoraDropoutKeepsMaskExactly) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  struct Case {
    int64_t rows, in, global_in, col0;
    double p;
  };
  // 0.5 and 0.25: p 2^53 an integer (the test's edge, bits >> 11 equal to it, is kept); 2^-53: only a zero draw
  // drops; 1 - 2^-53: only the largest draw survives.
  for (const Case& c : {Case{9, 37, 37, 0, 0.1}, Case{4, 24, 96, 48, 0.5}, Case{3, 70, 70, 0, 0.25},
                        Case{5, 33, 33, 0, 0.0}, Case{2, 50, 50, 0, std::ldexp(1.0, -53)},
                        Case{2, 50, 50, 0, 1 - std::ldexp(1.0, -53)}, Case{6, 1000, 3000, 1000, 0.05}}) {
    SCOPED_TRACE("rows " + std::to_string(c.rows) + ", in " + std::to_string(c.in) + ", p " + std::to_string(c.p));
    const int64_t n = c.rows * c.in;
    const uint64_t stream = lora_mix(static_cast<uint64_t>(rng.vector<double>(1, 0, 1e15)[0]));
    const std::vector<float> src = rng.vector<float>(n), base = rng.vector<float>(n);
    std::vector<float> out = test::nan_filled<float>(n), acc = base, in_place = src;
    lora_dropout(out.data(), src.data(), c.rows, c.in, c.global_in, c.col0, stream, c.p, /*accumulate=*/false);
    lora_dropout(acc.data(), src.data(), c.rows, c.in, c.global_in, c.col0, stream, c.p, /*accumulate=*/true);
    lora_dropout(in_place.data(), in_place.data(), c.rows, c.in, c.global_in, c.col0, stream, c.p, false);
    const float scale = static_cast<float>(1.0 / (1.0 - c.p));
    for (int64_t row = 0; row < c.rows; row++)
      for (int64_t j = 0; j < c.in; j++) {
        const int64_t i = row * c.in + j;
        const bool keep = lora_dropout_keeps(stream, row * c.global_in + c.col0 + j, c.p);
        const float want = keep ? src[i] * scale : 0.0f;
        ASSERT_EQ(out[i], want) << "row " << row << ", column " << j;
        ASSERT_EQ(acc[i], base[i] + want) << "row " << row << ", column " << j;
        ASSERT_EQ(in_place[i], want) << "row " << row << ", column " << j;
      }
  }
}

}  // namespace
}  // namespace tuna::cpu
