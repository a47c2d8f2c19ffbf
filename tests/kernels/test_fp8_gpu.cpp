// kernels/fp8.cu against kernels/cpu/fp8.cpp on fresh random bf16 tensors, bit for bit: the amax (folded over two
// calls, and with a NaN), the cast and the transposing cast in both formats, on the 16-byte paths and off them (odd
// widths, rows apart by more than the width, an operand off alignment, ragged tiles), the scale's inverse, an
// all-zero tensor, and nothing written past each output's end.
#if TUNA_CUDA
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cpu/fp8.h"
#include "kernels/fp8.cuh"
#include "tests/kernels/gpu_test_util.h"

namespace tuna::test {
namespace {

using cpu::Fp8Format;

struct CastShape {
  int64_t rows, cols, ld, at;  // at: element offset of x in its buffer (16-byte alignment or not)
};

std::vector<CastShape> cast_shapes(TestRng& rng) {
  return {{64, 128, 128, 0},
          {rng.integer(65, 150), 16 * rng.integer(5, 12), 0, 0},
          {48, 96, 104, 0},
          {rng.integer(1, 70), rng.integer(1, 90), 0, 0},
          {33, 40, 40, 3},
          {16, 8, 8, 0},
          {1, 1, 1, 0}};
}

// Values of widely spread magnitudes, a few past what the format would reach without the scale.
std::vector<float> random_tensor(TestRng& rng, int64_t n) {
  std::vector<float> v(n);
  for (float& x : v) x = round_bf16(rng.uniform(-1, 1) * std::exp(rng.uniform(-14, 6)));
  return v;
}

TEST(Fp8Gpu, AmaxEqualsCpuTwin) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  for (CastShape s : cast_shapes(rng)) {
    if (s.ld == 0) s.ld = s.cols;
    SCOPED_TRACE(std::to_string(s.rows) + " x " + std::to_string(s.cols) + " ld " + std::to_string(s.ld));
    const std::vector<float> x = random_tensor(rng, s.at + s.rows * s.ld), y = random_tensor(rng, s.rows * s.cols);
    DeviceBf16 dx(x), dy(y);
    DeviceBuffer<float> amax(std::vector<float>{0.0f});
    cuda::fp8_amax(amax.get(), dx.bf() + s.at, s.rows, s.cols, s.ld, nullptr);
    cuda::fp8_amax(amax.get(), dy.bf(), s.rows, s.cols, s.cols, nullptr);  // folds into the first
    float expected = 0.0f;
    cpu::fp8_amax(&expected, x.data() + s.at, s.rows, s.cols, s.ld);
    cpu::fp8_amax(&expected, y.data(), s.rows, s.cols, s.cols);
    EXPECT_EQ(amax.download()[0], expected);
  }
  std::vector<float> x = random_tensor(rng, 1000);
  x[rng.integer(0, 999)] = NAN;
  DeviceBf16 dx(x);
  DeviceBuffer<float> amax(std::vector<float>{0.0f});
  cuda::fp8_amax(amax.get(), dx.bf(), 10, 100, 100, nullptr);
  EXPECT_TRUE(std::isnan(amax.download()[0]));
}

TEST(Fp8Gpu, CastsEqualCpuTwin) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  constexpr int64_t kGuard = 32;
  for (Fp8Format format : {Fp8Format::E4M3, Fp8Format::E5M2})
    for (CastShape s : cast_shapes(rng)) {
      if (s.ld == 0) s.ld = s.cols;
      SCOPED_TRACE(std::string(cpu::fp8_name(format)) + " " + std::to_string(s.rows) + " x " +
                   std::to_string(s.cols) + " ld " + std::to_string(s.ld) + " at " + std::to_string(s.at));
      const int64_t n = s.rows * s.cols;
      const std::vector<float> x = random_tensor(rng, s.at + s.rows * s.ld);
      DeviceBf16 dx(x);
      // The scale from a slightly smaller amax than the tensor's: some elements saturate.
      float amax_value = 0.0f;
      cpu::fp8_amax(&amax_value, x.data() + s.at, s.rows, s.cols, s.ld);
      amax_value = round_bf16(amax_value * 0.75);
      DeviceBuffer<float> amax(std::vector<float>{amax_value}), inv(3);
      DeviceBuffer<uint8_t> out(n + kGuard), out2(n + kGuard), out_t(n + kGuard), only_t(n + kGuard);
      for (auto* b : {&out, &out2, &out_t, &only_t}) b->poison();
      inv.poison();
      const __nv_bfloat16* xs = dx.bf() + s.at;
      cuda::fp8_cast(out.get(), inv.get(), xs, s.rows, s.cols, s.ld, amax.get(), format, nullptr);
      cuda::fp8_cast_transpose(out2.get(), out_t.get(), inv.get() + 1, xs, s.rows, s.cols, s.ld, amax.get(), format,
                               nullptr);
      cuda::fp8_cast_transpose(nullptr, only_t.get(), inv.get() + 2, xs, s.rows, s.cols, s.ld, amax.get(), format,
                               nullptr);
      std::vector<uint8_t> expected(n), expected_t(n);
      float expected_inv = 0;
      cpu::fp8_cast_transpose(expected.data(), expected_t.data(), &expected_inv, x.data() + s.at, s.rows, s.cols,
                              s.ld, amax_value, format);
      const std::vector<float> invs = inv.download();
      for (float v : invs) EXPECT_EQ(v, expected_inv);
      const std::vector<uint8_t> got = out.download(), got2 = out2.download(), got_t = out_t.download(),
                                 got_only_t = only_t.download();
      int64_t mismatches = 0, saturated = 0;
      for (int64_t i = 0; i < n; ++i) {
        mismatches += got[i] != expected[i];
        mismatches += got2[i] != expected[i];
        mismatches += got_t[i] != expected_t[i];
        mismatches += got_only_t[i] != expected_t[i];
        saturated += (expected[i] & 0x7f) == cpu::fp8_from_float(cpu::fp8_max(format), format);
      }
      EXPECT_EQ(mismatches, 0);
      if (n > 100) {
        EXPECT_GT(saturated, 0) << "no element saturated: the test misses the clamp";
      }
      for (int64_t i = n; i < n + kGuard; ++i) {
        EXPECT_EQ(got[i], 0xff) << "written past the end";
        EXPECT_EQ(got2[i], 0xff) << "written past the end";
        EXPECT_EQ(got_t[i], 0xff) << "written past the end";
      }
    }
}

TEST(Fp8Gpu, AllZeroTensorCastsToZeros) {
  TUNA_REQUIRE_GPU();
  const std::vector<float> x(32 * 48, 0.0f);
  DeviceBf16 dx(x);
  DeviceBuffer<float> amax(std::vector<float>{0.0f}), inv(1);
  DeviceBuffer<uint8_t> out(x.size()), out_t(x.size());
  cuda::fp8_amax(amax.get(), dx.bf(), 32, 48, 48, nullptr);
  cuda::fp8_cast_transpose(out.get(), out_t.get(), inv.get(), dx.bf(), 32, 48, 48, amax.get(), Fp8Format::E4M3,
                           nullptr);
  EXPECT_EQ(amax.download()[0], 0.0f);
  EXPECT_EQ(inv.download()[0], 1.0f / cpu::fp8_scale(0.0f, Fp8Format::E4M3));
  for (uint8_t c : out.download()) ASSERT_EQ(c, 0);
  for (uint8_t c : out_t.download()) ASSERT_EQ(c, 0);
}

}  // namespace
}  // namespace tuna::test
#endif  // TUNA_CUDA
