// kernels/adamw.cu against kernels/cpu/adamw.cpp: the fused update over segments with and without weight
// decay, fp32 and bf16 moments, stochastic rounding's bracketing and bias, and the deterministic norm.
#if TUNA_CUDA
#include "kernels/adamw.cuh"
#include "kernels/cpu/adamw.h"
#include "tests/kernels/gpu_test_util.h"

namespace tuna::test {
namespace {

struct Problem {
  int64_t n;
  std::vector<int64_t> starts;
  std::vector<uint8_t> decays;
  std::vector<float> param, grad, m, v;
};

Problem make_problem(TestRng& rng) {
  Problem p;
  // decay, no decay (a norm weight), decay, ...: boundaries on and off the kernel's 4-element groups, and
  // tensors of 1 to 3 elements (several boundaries inside one group), as a tensor-parallel slice may have.
  p.starts = {0, 1000, 1064, 1065, 1067, 1070, 2001, 5000};
  p.decays = {1, 0, 1, 0, 1, 0, 1, 0};
  p.n = 5000 + 4 * rng.integer(1, 300);
  p.param = rng.vector<float>(p.n);
  p.grad = rng.vector<float>(p.n, -3, 3);
  p.m = rng.vector<float>(p.n, -0.1, 0.1);
  p.v = rng.vector<float>(p.n, 0, 0.01);
  return p;
}

// The CPU twin applied segment by segment, exactly as model/optimizer.cpp does.
void cpu_update(Problem& p, const cuda::AdamWArgs& a) {
  for (size_t s = 0; s < p.starts.size(); ++s) {
    const int64_t begin = p.starts[s], end = s + 1 < p.starts.size() ? p.starts[s + 1] : p.n;
    cpu::AdamWStep step{a.lr, a.beta1, a.beta2, a.eps, p.decays[s] ? a.weight_decay : 0.0, a.step, a.grad_scale};
    cpu::adamw_update(p.param.data() + begin, p.grad.data() + begin, p.m.data() + begin, p.v.data() + begin,
                      end - begin, step);
  }
}

cuda::AdamWArgs args(bool stochastic) { return {1e-2, 0.9, 0.95, 1e-8, 0.1, 7, 0.5, stochastic, 1234u}; }

TEST(AdamWGpu, FusedUpdateMatchesCpuTwin) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  Problem p = make_problem(rng);
  DeviceBuffer<float> d_param(p.param), d_grad(p.grad), d_m(p.m), d_v(p.v);
  DeviceBuffer<int64_t> d_starts(p.starts);
  DeviceBuffer<uint8_t> d_decays(p.decays);
  DeviceBf16 d_bf16(p.n);
  d_bf16.poison();
  const cuda::AdamWSegments seg{d_starts.get(), d_decays.get(), static_cast<int>(p.starts.size())};
  const cuda::AdamWArgs nearest = args(/*stochastic=*/false);
  cuda::adamw_update(d_param.get(), d_bf16.bf(), d_grad.get(), d_m.get(), d_v.get(), p.n, seg, nearest, nullptr);
  const std::vector<float> before = p.param;
  cpu_update(p, nearest);
  // Compare the updates (new - old), not the parameters: the parameters barely move, so comparing them
  // would hide a wrong update. fp32 math against double: ~1e-6 relative; the subtraction adds ~6e-8 / 1e-2.
  std::vector<float> got = d_param.download();
  std::vector<double> delta_gpu(p.n), delta_ref(p.n);
  for (int64_t i = 0; i < p.n; ++i) delta_gpu[i] = double(got[i]) - before[i], delta_ref[i] = double(p.param[i]) - before[i];
  const double err = rel_error_norm(delta_gpu, delta_ref);
  std::printf("  adamw update err %.3e\n", err);
  EXPECT_LE(err, 1e-4);
  expect_close_to_naive("adamw m (fp32)", d_m.download(), p.m, to_double(p.m));
  expect_close_to_naive("adamw v (fp32)", d_v.download(), p.v, to_double(p.v));
  std::vector<double> rounded(p.n);
  for (int64_t i = 0; i < p.n; ++i) rounded[i] = round_bf16(got[i]);
  EXPECT_EQ(rel_error_norm(d_bf16.values(), rounded), 0.0) << "bf16 copy is not round-to-nearest of the master";
}

TEST(AdamWGpu, Bf16MomentsAndStochasticRounding) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  Problem p = make_problem(rng);
  for (float& x : p.m) x = round_bf16(x);
  for (float& x : p.v) x = round_bf16(x);
  DeviceBuffer<float> d_param(p.param), d_grad(p.grad);
  DeviceBf16 d_m(p.m), d_v(p.v), d_bf16(p.n);
  DeviceBuffer<int64_t> d_starts(p.starts);
  DeviceBuffer<uint8_t> d_decays(p.decays);
  const cuda::AdamWSegments seg{d_starts.get(), d_decays.get(), static_cast<int>(p.starts.size())};
  const cuda::AdamWArgs stochastic = args(/*stochastic=*/true);
  cuda::adamw_update(d_param.get(), d_bf16.bf(), d_grad.get(), d_m.bf(), d_v.bf(), p.n, seg, stochastic, nullptr);
  cpu_update(p, stochastic);
  // bf16 moments: within 2x of one rounding (stochastic rounding's error is at most one bf16 spacing).
  std::vector<double> naive_m(p.n), naive_v(p.n);
  for (int64_t i = 0; i < p.n; ++i) naive_m[i] = round_bf16(p.m[i]), naive_v[i] = round_bf16(p.v[i]);
  expect_close_to_naive("adamw m (bf16, SR)", d_m.values(), naive_m, to_double(p.m), 2e-3);
  expect_close_to_naive("adamw v (bf16, SR)", d_v.values(), naive_v, to_double(p.v), 2e-3);
  // Stochastic rounding brackets the master value and is unbiased: the mean signed error over many
  // elements, in units of the local bf16 spacing, is near 0 (round-to-nearest would also bracket, but SR
  // is checked to pick both neighbours).
  std::vector<float> master = d_param.download();
  std::vector<double> bf = d_bf16.values();
  double bias = 0;
  int64_t up = 0;
  for (int64_t i = 0; i < p.n; ++i) {
    const uint16_t low = static_cast<uint16_t>(std::bit_cast<uint32_t>(master[i]) >> 16);
    const double below = bf16_to_f32(low), above = bf16_to_f32(static_cast<uint16_t>(low + 1));
    const bool ok = bf[i] == below || bf[i] == above;
    ASSERT_TRUE(ok) << "element " << i << ": " << bf[i] << " does not bracket " << master[i];
    bias += (bf[i] - master[i]) / std::abs(above - below);
    up += bf[i] != below;
  }
  bias /= double(p.n);
  std::printf("  stochastic rounding: mean error %.4f spacings, %.1f%% rounded away from zero\n", bias,
              100.0 * up / p.n);
  EXPECT_LT(std::abs(bias), 0.05);
  EXPECT_GT(up, p.n / 10);
}

// Sharded gradient accumulation: one fp32 add per element, so the GPU equals the CPU twin bit for bit.
TEST(AdamWGpu, AccumulateMatchesCpuTwinExactly) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const int64_t n = 100000 + rng.integer(0, 1000);
  std::vector<float> dst = rng.vector<float>(n, -2, 2), src = rng.vector<float>(n, -2, 2);
  DeviceBuffer<float> d_dst(dst), d_src(src);
  cuda::accumulate(d_dst.get(), d_src.get(), n, nullptr);
  cpu::accumulate(dst.data(), src.data(), n);
  EXPECT_EQ(d_dst.download(), dst);
}

TEST(AdamWGpu, SumOfSquaresIsDeterministicAndExact) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const int64_t n = 3000000 + rng.integer(0, 1000);
  std::vector<float> x = rng.vector<float>(n, -2, 2);
  DeviceBuffer<float> d_x(x);
  DeviceBuffer<double> d_total(1), d_scratch(cuda::sum_of_squares_scratch_doubles());
  cuda::sum_of_squares(d_total.get(), d_x.get(), n, d_scratch.get(), nullptr);
  const double first = d_total.download()[0];
  cuda::sum_of_squares(d_total.get(), d_x.get(), n, d_scratch.get(), nullptr);
  EXPECT_EQ(first, d_total.download()[0]);
  const double ref = cpu::sum_of_squares(x.data(), n);
  EXPECT_NEAR(first, ref, 1e-12 * ref);
}

}  // namespace
}  // namespace tuna::test
#endif  // TUNA_CUDA
