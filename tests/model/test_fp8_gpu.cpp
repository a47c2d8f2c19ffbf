// model/fp8_gpu (a projection group's FP8 GEMMs on the device) against the CPU twin, model/fp8's Fp8GroupCpu, on the
// same bf16 values: a q|k|v-shaped group (one fused weight block on the GPU, three parts on the CPU) and a row-
// parallel-shaped one split at a row (as sequence parallelism runs it), forward with and without a residual, and the
// backward's input and weight gradients. The casts are the same codes on both (kernels/fp8.cu against
// kernels/cpu/fp8.cpp: test_fp8_gpu.cpp), so what differs is the order of fp32 sums and the GPU's bf16 outputs:
// stated tolerances (relative error norms) are 4e-3 for a bf16 output (one rounding, 2^-9 an element) and 1e-5 for
// fp32 weight gradients; the forward allows 2e-2 on a GPU, whose FP8 forward accumulates fast (fewer bits, see
// tests/kernels/test_matmul_gpu.cpp), where the emulator's cuBLASLt double accumulates in full fp32.
#if TUNA_CUDA
#include <cmath>
#include <string>
#include <vector>

#include "kernels/fp8.cuh"
#include "kernels/matmul.cuh"
#include "model/fp8.h"
#include "model/fp8_gpu.h"
#include "tests/kernels/gpu_test_util.h"

namespace tuna::test {
namespace {

#ifdef TUNA_EMULATOR
constexpr double kForwardBound = 4e-3;  // the double accumulates in fp32: one bf16 rounding
#else
constexpr double kForwardBound = 2e-2;  // cuBLASLt's fast accumulation
#endif

struct GroupCase {
  int64_t n, in;
  std::vector<int64_t> parts;  // the block's row counts (q, k, v or one)
  int64_t split_row;           // the forward run in two GEMMs at this row (0: one)
};

void check_group(TestRng& rng, const GroupCase& k, bool with_residual) {
  SCOPED_TRACE("n " + std::to_string(k.n) + ", in " + std::to_string(k.in) + ", split at " + std::to_string(k.split_row) +
               (with_residual ? ", residual" : ""));
  int64_t rows = 0;
  for (int64_t r : k.parts) rows += r;
  const std::vector<float> x = random_bf16_values(rng, k.n * k.in, -3, 3), w = random_bf16_values(rng, rows * k.in, -0.05, 0.05),
                           dy = random_bf16_values(rng, k.n * rows, -1e-3, 1e-3), resid = random_bf16_values(rng, k.n * rows),
                           dx0 = random_bf16_values(rng, k.n * k.in);
  DeviceBf16 d_x(x), d_w(w), d_dy(dy), d_resid(resid), d_out(k.n * rows), d_dx(dx0);
  DeviceBuffer<uint8_t> codes(rows * k.in), codes_t(rows * k.in), sx(k.n * k.in), sdy(k.n * rows), sdy_t(k.n * rows);
  // The scalars 16 bytes apart, as cuBLASLt reads scales: the weight's amax and scale, the scratch's two scales,
  // x's and dy's amax.
  DeviceBuffer<float> scalars(std::vector<float>(6 * kFp8ScaleStride, 0.0f)), d_dw(rows * k.in);
  float* s = scalars.get();
  const int64_t f = kFp8ScaleStride;
  Fp8GpuWeight weight{codes.get(), codes_t.get(), s, s + f, rows, k.in};
  Fp8GpuScratch scratch{sx.get(), sdy.get(), sdy_t.get(), s + 2 * f};
  cuda::MatmulContext ctx;
  fp8_cast_weight(weight, d_w.bf(), nullptr, nullptr);
  // x's and dy's amax as their producers would fold them.
  cuda::fp8_amax(s + 4 * f, d_x.bf(), k.n, k.in, k.in, nullptr);
  cuda::fp8_amax(s + 5 * f, d_dy.bf(), k.n, rows, rows, nullptr);
  fp8_cast_input(scratch, d_x.bf(), k.n, k.in, s + 4 * f, nullptr);
  d_out.poison();
  const __nv_bfloat16* residual = with_residual ? d_resid.bf() : nullptr;
  const int64_t split = k.split_row;
  if (split > 0)
    fp8_linear_fwd(ctx, d_out.bf(), residual, weight, scratch, 0, split, nullptr);
  fp8_linear_fwd(ctx, d_out.bf() + split * rows, residual ? residual + split * rows : nullptr, weight, scratch, split,
                 k.n - split, nullptr);
  fp8_linear_bwd(ctx, d_dx.bf(), d_dw.get(), d_dy.bf(), s + 5 * f, d_x.bf(), s + 4 * f, weight, k.n, /*accumulate_dx=*/true,
                 GradWrite::Overwrite, scratch, nullptr);

  // The CPU twin: parts of the block, fp32.
  std::vector<Fp8GroupCpu::Part> parts;
  std::vector<std::vector<float>> outs, dys, dws;
  int64_t r0 = 0;
  for (int64_t r : k.parts) {
    parts.push_back({w.data() + r0 * k.in, r});
    outs.emplace_back(k.n * r);
    std::vector<float> part_dy(k.n * r);
    for (int64_t i = 0; i < k.n; ++i)
      for (int64_t c = 0; c < r; ++c) part_dy[i * r + c] = dy[i * rows + r0 + c];
    dys.push_back(part_dy);
    dws.emplace_back(r * k.in, 0.0f);
    r0 += r;
  }
  std::vector<float*> out_ptrs, dw_ptrs;
  std::vector<const float*> dy_ptrs;
  for (size_t i = 0; i < parts.size(); ++i)
    out_ptrs.push_back(outs[i].data()), dw_ptrs.push_back(dws[i].data()), dy_ptrs.push_back(dys[i].data());
  Fp8GroupCpu cpu_group;
  cpu_group.forward(parts, out_ptrs, x.data(), k.n, k.in, false, nullptr);
  std::vector<float> cpu_dx(dx0);
  cpu_group.backward(parts, dy_ptrs, dw_ptrs, cpu_dx.data(), /*accumulate_dx=*/true, x.data(), k.n, k.in, false, false,
                     nullptr);
  std::vector<double> want_out(k.n * rows), want_dw(rows * k.in);
  r0 = 0;
  for (size_t p = 0; p < parts.size(); ++p) {
    const int64_t r = k.parts[p];
    for (int64_t i = 0; i < k.n; ++i)
      for (int64_t c = 0; c < r; ++c)
        want_out[i * rows + r0 + c] = outs[p][i * r + c] + (with_residual ? resid[i * rows + r0 + c] : 0.0f);
    for (int64_t j = 0; j < r * k.in; ++j) want_dw[r0 * k.in + j] = dws[p][j];
    r0 += r;
  }
  const double e_out = rel_error_norm(d_out.values(), want_out), e_dx = rel_error_norm(d_dx.values(), cpu_dx),
               e_dw = rel_error_norm(d_dw.download(), want_dw);
  std::printf("  fp8 group: out err %.2e (bound %.0e), dx err %.2e (4e-3), dW err %.2e (bound %.1e)\n", e_out,
              kForwardBound, e_dx, e_dw, kFp8Fp32OutputBound);
  EXPECT_LE(e_out, kForwardBound);
  EXPECT_LE(e_dx, 4e-3);
  EXPECT_LE(e_dw, kFp8Fp32OutputBound);
}

TEST(Fp8GpuGroup, FollowsTheCpuTwin) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  check_group(rng, {32, 64, {64, 16, 16}, 0}, false);             // q|k|v: a fused block, grouped-query widths
  check_group(rng, {48, 96, {64}, 16}, true);                     // o_proj under sp: split rows, the residual added
  check_group(rng, {16 * rng.integer(2, 5), 16 * rng.integer(2, 6), {16 * rng.integer(1, 4), 16 * rng.integer(1, 4)}, 0},
              false);                                              // gate|up
}

}  // namespace
}  // namespace tuna::test
#endif  // TUNA_CUDA
