// kernels/lora.cu against kernels/cpu/lora.cpp: the dropout mask on the device is the CPU's bit for bit (the
// same counter-based stream, model/lora.h), over a tensor-parallel rank's columns too, written and accumulated;
// and the scale.
#if TUNA_CUDA
#include "kernels/cpu/lora.h"
#include "kernels/lora.cuh"
#include "model/lora.h"
#include "tests/kernels/gpu_test_util.h"

namespace tuna::test {
namespace {

struct DropoutCase {
  int64_t rows, in, global_in, col0;
  double p;
};

TEST(LoraGpu, DropoutMaskIsTheCpuTwinsBitForBit) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  for (const DropoutCase& c : {DropoutCase{7, 40, 40, 0, 0.1}, DropoutCase{5, 24, 96, 48, 0.5},
                               DropoutCase{3, 16, 16, 0, 0.9}}) {
    SCOPED_TRACE("rows " + std::to_string(c.rows) + ", in " + std::to_string(c.in) + ", p " + std::to_string(c.p));
    const int64_t n = c.rows * c.in;
    const uint64_t key = lora_dropout_stream(lora_dropout_key(5, 3, 1, 0), 2, LoraTarget::V);
    const std::vector<float> src = random_bf16_values(rng, n, -2, 2), base = random_bf16_values(rng, n, -1, 1);
    DeviceBf16 d_src(src), d_out(n), d_acc(base);
    d_out.poison();
    cuda::lora_dropout(d_out.bf(), d_src.bf(), c.rows, c.in, c.global_in, c.col0, key, c.p, false, nullptr);
    cuda::lora_dropout(d_acc.bf(), d_src.bf(), c.rows, c.in, c.global_in, c.col0, key, c.p, true, nullptr);
    std::vector<float> want(n), want_acc(base);
    cpu::lora_dropout(want.data(), src.data(), c.rows, c.in, c.global_in, c.col0, key, c.p, false);
    cpu::lora_dropout(want_acc.data(), src.data(), c.rows, c.in, c.global_in, c.col0, key, c.p, true);
    const std::vector<double> got = d_out.values(), got_acc = d_acc.values();
    int64_t dropped = 0;
    for (int64_t i = 0; i < n; i++) {
      // The same elements dropped (zeros on both), the survivors scaled and rounded once.
      dropped += want[i] == 0.0f && src[i] != 0.0f;
      EXPECT_EQ(got[i], round_bf16(want[i])) << "element " << i;
      // Accumulated: the rounded survivor added to dst in fp32 and rounded once more (the twin adds in fp32).
      EXPECT_EQ(got_acc[i], round_bf16(base[i] + round_bf16(want[i]))) << "element " << i;
      EXPECT_NEAR(got_acc[i], want_acc[i], 1e-2 * (std::abs(base[i]) + std::abs(want[i]))) << "element " << i;
    }
    // The fraction dropped is p's, within a few standard deviations.
    const double sd = std::sqrt(c.p * (1 - c.p) / n);
    EXPECT_NEAR(double(dropped) / n, c.p, 5 * sd + 1.0 / n);
  }
}

TEST(LoraGpu, ScaleIsTheCpuTwins) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const std::vector<float> x = random_bf16_values(rng, 333, -3, 3);
  DeviceBf16 d(x);
  cuda::scale_bf16(d.bf(), 333, 0.375f, nullptr);
  std::vector<float> want(x);
  cpu::scale(want.data(), 333, 0.375f);
  const std::vector<double> got = d.values();
  for (int i = 0; i < 333; i++) EXPECT_EQ(got[i], round_bf16(want[i])) << i;
}

}  // namespace
}  // namespace tuna::test
#endif  // TUNA_CUDA
