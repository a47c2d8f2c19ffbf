// The FP8 conversions of the host emulator (ptx_fp8.h: cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32) against values worked
// out by hand from the PTX ISA's definition of cvt and of the two formats, so that a cast kernel passing on the
// emulator passes because it follows the ISA: the operand order (a to the upper byte), exact values, ties to even
// among normals and subnormals, the smallest subnormal and underflow, the top of the range, .satfinite on values
// past MAX_NORM and on infinities, NaNs, signed zeros. Then the instruction inside a launched kernel, and agreement
// with the CPU twin's independent implementation (kernels/cpu/fp8.cpp) over random fp32 bit patterns.
//
// Built only into build/emulated_gpu_tests.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/cuda_check.h"
#include "kernels/common.cuh"
#include "kernels/cpu/fp8.h"
#include "tests/kernels/emulator/runtime.h"
#include "tests/kernels/op_test_util.h"

namespace tuna::emulator {
namespace {

using cuda::fp8::cvt_e4m3x2;
using cuda::fp8::cvt_e5m2x2;

uint8_t e4m3(float x) { return static_cast<uint8_t>(cvt_e4m3x2(0.0f, x) & 0xff); }
uint8_t e5m2(float x) { return static_cast<uint8_t>(cvt_e5m2x2(0.0f, x) & 0xff); }

struct Case {
  float x;
  uint8_t code;
};

// e4m3: S.EEEE.MMM, bias 7; 448 = 1.75 * 2^8 is 0.1111.110 (0.1111.111 is the NaN).
TEST(EmulatorFp8, E4m3FollowsTheIsa) {
  const Case cases[] = {
      {1.0f, 0x38},                   // 0.0111.000
      {-2.0f, 0xc0},                  // 1.1000.000
      {0.5f, 0x30},                   // 0.0110.000
      {240.0f, 0x77},                 // 1.875 * 2^7: 0.1110.111
      {448.0f, 0x7e},                 // MAX_NORM
      {464.0f, 0x7e},                 // halfway to 480, which has no finite code: .satfinite
      {1e6f, 0x7e},                   // far past MAX_NORM
      {-1e6f, 0xfe},                  // sign kept
      {INFINITY, 0x7e},               // .satfinite: an infinity too
      {-INFINITY, 0xfe},
      {0x1p-9f, 0x01},                // the smallest subnormal, 2^(1 - 7) * 1/8
      {0x1p-10f, 0x00},               // half of it: a tie, to the even zero
      {0x1.8p-9f, 0x02},              // 1.5 steps: a tie between 1 and 2, to 2
      {0x1.cp-7f, 0x07},              // 7 steps, the largest subnormal 0.0000.111
      {0x1.ep-7f, 0x08},              // 7.5 steps: a tie between 0.0000.111 and 0.0001.000, to the even code
      {0x1p-6f, 0x08},                // the smallest normal 0.0001.000
      {1.0625f, 0x38},                // halfway 1.0 .. 1.125: to 1.0 (mantissa 000)
      {1.1875f, 0x3a},                // halfway 1.125 .. 1.25: to 1.25 (mantissa 010)
      {std::nextafter(1.0625f, 2.0f), 0x39},  // just past halfway: up
      {0.0f, 0x00},
      {-0.0f, 0x80},
      {-1e-30f, 0x80},                // underflow keeps the sign
  };
  for (const Case& c : cases) EXPECT_EQ(e4m3(c.x), c.code) << c.x;
  EXPECT_EQ(e4m3(NAN), 0x7f);
  EXPECT_EQ(e4m3(-NAN), 0x7f);
  EXPECT_EQ(e4m3(std::bit_cast<float>(0x7f800001u)), 0x7f);  // a signalling NaN
}

// e5m2: S.EEEEE.MM, bias 15, with infinities (0.11111.00) and NaNs; 57344 = 1.75 * 2^15 is 0.11110.11.
TEST(EmulatorFp8, E5m2FollowsTheIsa) {
  const Case cases[] = {
      {1.0f, 0x3c},         // 0.01111.00
      {-2.0f, 0xc0},        // 1.10000.00
      {0.75f, 0x3a},        // 1.5 * 2^-1: 0.01110.10
      {57344.0f, 0x7b},     // MAX_NORM
      {61440.0f, 0x7b},     // halfway to 65536 (the infinity's place): .satfinite keeps MAX_NORM
      {INFINITY, 0x7b},     // .satfinite: no infinity comes out
      {-INFINITY, 0xfb},
      {0x1p-16f, 0x01},     // the smallest subnormal, 2^(1 - 15) * 1/4
      {0x1p-17f, 0x00},     // half of it: to the even zero
      {0x1.8p-16f, 0x02},   // 1.5 steps: to 2
      {0x1p-14f, 0x04},     // the smallest normal 0.00001.00
      {1.125f, 0x3c},       // halfway 1.0 .. 1.25: to 1.0
      {1.375f, 0x3e},       // halfway 1.25 .. 1.5: to 1.5
      {-0.0f, 0x80},
  };
  for (const Case& c : cases) EXPECT_EQ(e5m2(c.x), c.code) << c.x;
  EXPECT_EQ(e5m2(NAN), 0x7f);
}

// The ISA: "the value converted from input a is stored in the upper 8 bits of d and the value converted from input
// b is stored in the lower 8 bits".
TEST(EmulatorFp8, FirstOperandGoesToTheUpperByte) {
  EXPECT_EQ(cvt_e4m3x2(1.0f, -2.0f), 0x38c0);
  EXPECT_EQ(cvt_e5m2x2(-2.0f, 1.0f), 0xc03c);
}

void cvt_kernel(const float* x, uint16_t* out, int n) {
  const int i = static_cast<int>(threadIdx.x);
  if (i < n) out[i] = cvt_e4m3x2(x[i], -x[i]);
}

TEST(EmulatorFp8, ConvertsInsideAKernel) {
  const std::vector<float> x = {1.0f, 448.0f, 0x1p-9f, 1.1875f};
  float* dx = nullptr;
  uint16_t* dout = nullptr;
  TUNA_CUDA_CHECK(cudaMalloc(&dx, x.size() * sizeof(float)));
  TUNA_CUDA_CHECK(cudaMalloc(&dout, 32 * sizeof(uint16_t)));
  TUNA_CUDA_CHECK(cudaMemcpy(dx, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice));
  cuda::launch_kernel(cvt_kernel, dim3(1), dim3(32), 0, nullptr, dx, dout, static_cast<int>(x.size()));
  TUNA_CUDA_CHECK(cudaGetLastError());
  std::vector<uint16_t> out(x.size());
  TUNA_CUDA_CHECK(cudaMemcpy(out.data(), dout, out.size() * sizeof(uint16_t), cudaMemcpyDeviceToHost));
  EXPECT_EQ(out, (std::vector<uint16_t>{0x38b8, 0x7efe, 0x0181, 0x3aba}));
  TUNA_CUDA_CHECK(cudaFree(dx));
  TUNA_CUDA_CHECK(cudaFree(dout));
}

// Two implementations written apart (this one in float64 arithmetic, the twin on fp32's bit fields) agree.
TEST(EmulatorFp8, AgreesWithTheCpuTwin) {
  test::TestRng rng;
  SCOPED_TRACE(rng.describe());
  for (int i = 0; i < 200000; ++i) {
    uint32_t bits = static_cast<uint32_t>(rng.integer(0, 0xffffffffLL));
    // Three in four with exponents from 2^-27 to 2^22: both formats' ranges, underflow and saturation.
    if (i % 4 != 0) bits = (bits & 0x807fffffu) | (static_cast<uint32_t>(rng.integer(100, 149)) << 23);
    const float x = std::bit_cast<float>(bits);
    ASSERT_EQ(e4m3(x), cpu::fp8_from_float(x, cpu::Fp8Format::E4M3)) << "bits " << bits;
    ASSERT_EQ(e5m2(x), cpu::fp8_from_float(x, cpu::Fp8Format::E5M2)) << "bits " << bits;
  }
}

}  // namespace
}  // namespace tuna::emulator
