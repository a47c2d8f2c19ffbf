// kernels/matmul.cu (cuBLASLt) against kernels/cpu/matmul.cpp (double). Shapes are not multiples of any
// tile; the forward's residual epilogue and both write modes of the backward's dinp and of its dweight are
// covered, each overwrite over a NaN-filled destination (beta = 0 must not read it). The FP8 products against the
// CPU twin's simulation (kernels/cpu/fp8.h's fp8_gemm) on the same codes.
#if TUNA_CUDA
#include <functional>
#include <string>

#include "kernels/cpu/fp8.h"
#include "kernels/cpu/matmul.h"
#include "kernels/fp8.cuh"
#include "kernels/matmul.cuh"
#include "tests/kernels/gpu_test_util.h"

namespace tuna::test {
namespace {

// Naive bf16 matmul: fp32 accumulation over bf16 inputs in index order; out[n, oc] = a[n, k] . b[oc, k].
std::vector<double> naive_nt(const std::vector<double>& a, const std::vector<double>& b, int64_t n, int64_t k,
                             int64_t oc) {
  std::vector<double> out(n * oc);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t o = 0; o < oc; ++o) {
      float acc = 0;
      for (int64_t j = 0; j < k; ++j) acc += float(a[i * k + j]) * float(b[o * k + j]);
      out[i * oc + o] = acc;
    }
  return out;
}

std::vector<double> transpose(const std::vector<double>& x, int64_t rows, int64_t cols) {
  std::vector<double> t(x.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = x[r * cols + c];
  return t;
}

TEST(MatmulGpu, ForwardWithResidualAndBackward) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const int64_t n = 77 + rng.integer(0, 40), ic = 8 * rng.integer(10, 40), oc = 8 * rng.integer(10, 40);
  std::vector<float> inp = random_bf16_values(rng, n * ic), w = random_bf16_values(rng, oc * ic),
                     resid = random_bf16_values(rng, n * oc), dout = random_bf16_values(rng, n * oc),
                     dinp0 = random_bf16_values(rng, n * ic);
  std::vector<float> dw0 = rng.vector<float>(oc * ic);
  std::vector<double> x(inp.begin(), inp.end()), wd(w.begin(), w.end()), r(resid.begin(), resid.end()),
      g(dout.begin(), dout.end());
  cuda::MatmulContext ctx;
  DeviceBf16 d_inp(inp), d_w(w), d_resid(resid), d_dout(dout), d_out(n * oc);

  for (bool with_residual : {false, true}) {
    SCOPED_TRACE(with_residual ? "residual epilogue" : "plain");
    d_out.poison();
    if (with_residual)
      cuda::matmul_residual_fwd(ctx, d_out.bf(), d_inp.bf(), d_w.bf(), d_resid.bf(), n, ic, oc, nullptr);
    else
      cuda::matmul_fwd(ctx, d_out.bf(), d_inp.bf(), d_w.bf(), n, ic, oc, nullptr);
    std::vector<double> ref(n * oc);
    cpu::matmul_fwd(ref.data(), x.data(), wd.data(), n, ic, oc);
    std::vector<double> naive = naive_nt(x, wd, n, ic, oc);
    for (int64_t i = 0; i < n * oc; ++i) {
      if (with_residual) ref[i] += r[i], naive[i] = float(naive[i]) + float(r[i]);
      naive[i] = round_bf16(naive[i]);
    }
    expect_close_to_naive(with_residual ? "matmul fwd + residual" : "matmul fwd", d_out.values(), naive, ref);
  }

  // dinp and dweight in the four pairings of their modes (each pairing a distinct cuBLASLt call for dweight's
  // beta, cached by shape and beta).
  for (bool accumulate : {false, true}) {
    for (GradWrite dweight_write : {GradWrite::Overwrite, GradWrite::Accumulate}) {
      SCOPED_TRACE(accumulate ? "accumulate dinp" : "overwrite dinp");
      SCOPED_TRACE(dweight_write == GradWrite::Overwrite ? "overwrite dweight" : "accumulate dweight");
      DeviceBf16 d_dinp(dinp0);
      if (!accumulate) d_dinp.poison();
      DeviceBuffer<float> d_dw(dw0);
      if (dweight_write == GradWrite::Overwrite) d_dw.poison();
      cuda::matmul_bwd(ctx, d_dinp.bf(), d_dw.get(), d_dout.bf(), d_inp.bf(), d_w.bf(), n, ic, oc, accumulate,
                       dweight_write, nullptr);
      std::vector<double> ref_dinp(dinp0.begin(), dinp0.end()), ref_dw(dw0.begin(), dw0.end());
      cpu::matmul_bwd(ref_dinp.data(), ref_dw.data(), g.data(), x.data(), wd.data(), n, ic, oc, accumulate,
                      dweight_write);
      // naive dinp = dout @ w: as naive_nt with b = w^T ([ic, oc])
      std::vector<double> naive_dinp = naive_nt(g, transpose(wd, oc, ic), n, oc, ic);
      for (int64_t i = 0; i < n * ic; ++i)
        naive_dinp[i] = round_bf16(accumulate ? float(naive_dinp[i]) + dinp0[i] : naive_dinp[i]);
      expect_close_to_naive("matmul dinp", d_dinp.values(), naive_dinp, ref_dinp);
      expect_close_to_naive("matmul dweight (fp32)", d_dw.download(), ref_dw, ref_dw);
    }
  }

  // No rows: an overwritten dweight is zeros (a sum over nothing), an accumulated one is left alone.
  DeviceBuffer<float> d_overwritten(dw0), d_accumulated(dw0);
  d_overwritten.poison();
  cuda::matmul_bwd(ctx, nullptr, d_overwritten.get(), d_dout.bf(), d_inp.bf(), d_w.bf(), 0, ic, oc,
                   /*accumulate_dinp=*/false, GradWrite::Overwrite, nullptr);
  cuda::matmul_bwd(ctx, nullptr, d_accumulated.get(), d_dout.bf(), d_inp.bf(), d_w.bf(), 0, ic, oc,
                   /*accumulate_dinp=*/false, GradWrite::Accumulate, nullptr);
  EXPECT_EQ(d_overwritten.download(), std::vector<float>(oc * ic, 0.0f));
  EXPECT_EQ(d_accumulated.download(), dw0);
}

// The strided entry points an adapter uses (its B product added into a column block of the fused q|k|v or gate|up
// output, and that block's gradient read in place), at a LoRA rank's narrow K: the block equals the contiguous
// product (added to what it held, one rounding), every other column of the wide buffer is untouched, and the
// backward equals the CPU twin on the block taken out.
TEST(MatmulGpu, StridedColumnBlockOfAWiderOutput) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const int64_t n = 50 + rng.integer(0, 40), r = 8 * rng.integer(1, 4), oc = 8 * rng.integer(4, 12);
  const int64_t col0 = 8 * rng.integer(0, 6), ld = col0 + oc + 8 * rng.integer(1, 6);
  const std::vector<float> u = random_bf16_values(rng, n * r), b = random_bf16_values(rng, oc * r),
                           wide = random_bf16_values(rng, n * ld), dwide = random_bf16_values(rng, n * ld);
  const std::vector<float> db0 = rng.vector<float>(oc * r);
  cuda::MatmulContext ctx;
  DeviceBf16 d_u(u), d_b(b), d_wide(wide), d_dwide(dwide), d_du(n * r);
  cuda::matmul_add_fwd(ctx, d_wide.bf() + col0, ld, d_u.bf(), d_b.bf(), n, r, oc, nullptr);
  const std::vector<double> got = d_wide.values();
  const std::vector<double> ud(u.begin(), u.end()), bd(b.begin(), b.end());
  const std::vector<double> naive = naive_nt(ud, bd, n, r, oc);
  std::vector<double> block(n * oc), want(n * oc), ref(n * oc);
  cpu::matmul_fwd(ref.data(), ud.data(), bd.data(), n, r, oc);
  int64_t outside_changed = 0;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < ld; ++c) {
      if (c < col0 || c >= col0 + oc) {
        outside_changed += got[i * ld + c] != round_bf16(wide[i * ld + c]);
        continue;
      }
      const int64_t k = i * oc + c - col0;
      block[k] = got[i * ld + c];
      want[k] = round_bf16(float(naive[k]) + wide[i * ld + c]);
      ref[k] += wide[i * ld + c];
    }
  EXPECT_EQ(outside_changed, 0);
  expect_close_to_naive("matmul_add_fwd block", block, want, ref);

  // Backward from the block of dwide: du = dy B (overwritten), dB += dy^T u.
  DeviceBuffer<float> d_db(db0);
  d_du.poison();
  cuda::matmul_bwd_strided(ctx, d_du.bf(), d_db.get(), d_dwide.bf() + col0, ld, d_u.bf(), d_b.bf(), n, r, oc,
                           /*accumulate_dinp=*/false, GradWrite::Accumulate, nullptr);
  std::vector<double> dy(n * oc);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < oc; ++c) dy[i * oc + c] = dwide[i * ld + col0 + c];
  std::vector<double> ref_du(n * r), ref_db(db0.begin(), db0.end());
  cpu::matmul_bwd(ref_du.data(), ref_db.data(), dy.data(), ud.data(), bd.data(), n, r, oc, false, GradWrite::Accumulate);
  std::vector<double> naive_du = naive_nt(dy, transpose(bd, oc, r), n, oc, r);
  for (double& x : naive_du) x = round_bf16(x);
  expect_close_to_naive("matmul_bwd_strided dinp", d_du.values(), naive_du, ref_du);
  expect_close_to_naive("matmul_bwd_strided dweight (fp32)", d_db.download(), ref_db, ref_db);
}

// --fp8 tensorwise's three products (e4m3 forward, e5m2 gradients; each operand cast on the GPU, which equals the
// twin's cast bit for bit: test_fp8_gpu.cpp) against cpu::fp8_gemm on the same codes and scales. Tolerances: the
// backward accumulates in fp32 like the twin (only the order differs): fp32 dweight within 1e-5, bf16 dinp within
// the rule of gpu_test_util.h. The forward uses cuBLASLt's fast accumulation, whose accumulator keeps fewer bits
// (DeepSeek-V3's report measured about 14 on H800, up to 2% relative error at K = 4096 in its worst case): within
// a relative error norm of 2e-2 of the twin, printed so gpu-check's log keeps the figure.
TEST(MatmulGpu, Fp8ProductsFollowTheTwin) {
  TUNA_REQUIRE_GPU();
  int major = 0, minor = 0;
  TUNA_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  TUNA_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0));
  if (major * 10 + minor < 89) GTEST_SKIP() << "FP8 GEMMs need sm_89 or later";
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  using cpu::Fp8Format;
  const int64_t n = 16 * rng.integer(4, 12), ic = 16 * rng.integer(8, 40), oc = 16 * rng.integer(8, 40);
  const std::vector<float> x = random_bf16_values(rng, n * ic, -4, 4), w = random_bf16_values(rng, oc * ic, -0.1, 0.1),
                           dout = random_bf16_values(rng, n * oc, -1e-3, 1e-3), resid = random_bf16_values(rng, n * oc),
                           dinp0 = random_bf16_values(rng, n * ic);
  const std::vector<float> dw0 = rng.vector<float>(oc * ic);
  DeviceBf16 d_x(x), d_w(w), d_dout(dout), d_resid(resid), d_out(n * oc);
  // Codes on the GPU: x, w (and their transposes), dout (and its transpose).
  DeviceBuffer<uint8_t> x_q(n * ic), x_t(n * ic), w_q(oc * ic), w_t(oc * ic), g_q(n * oc), g_t(n * oc);
  // The scales 16 bytes apart: cuBLASLt's FP8 GEMMs read them so (a scale at +4 bytes is refused, below).
  DeviceBuffer<float> amax(std::vector<float>(3, 0.0f)), inv(12);
  cuda::fp8_amax(amax.get(), d_x.bf(), n, ic, ic, nullptr);
  cuda::fp8_amax(amax.get() + 1, d_w.bf(), oc, ic, ic, nullptr);
  cuda::fp8_amax(amax.get() + 2, d_dout.bf(), n, oc, oc, nullptr);
  cuda::fp8_cast_transpose(x_q.get(), x_t.get(), inv.get(), d_x.bf(), n, ic, ic, amax.get(), Fp8Format::E4M3, nullptr);
  cuda::fp8_cast_transpose(w_q.get(), w_t.get(), inv.get() + 4, d_w.bf(), oc, ic, ic, amax.get() + 1,
                           Fp8Format::E4M3, nullptr);
  cuda::fp8_cast_transpose(g_q.get(), g_t.get(), inv.get() + 8, d_dout.bf(), n, oc, oc, amax.get() + 2,
                           Fp8Format::E5M2, nullptr);
  const cuda::Fp8Operand X{x_q.get(), inv.get()}, XT{x_t.get(), inv.get()}, W{w_q.get(), inv.get() + 4},
      WT{w_t.get(), inv.get() + 4}, G{g_q.get(), inv.get() + 8}, GT{g_t.get(), inv.get() + 8};
  const std::vector<uint8_t> hx = x_q.download(), hxt = x_t.download(), hw = w_q.download(), hwt = w_t.download(),
                             hg = g_q.download(), hgt = g_t.download();
  const std::vector<float> s = inv.download();
  cuda::MatmulContext ctx;
  for (bool with_residual : {false, true}) {
    d_out.poison();
    if (with_residual) cuda::matmul_fp8_residual_fwd(ctx, d_out.bf(), X, W, d_resid.bf(), n, ic, oc, nullptr);
    else cuda::matmul_fp8_fwd(ctx, d_out.bf(), X, W, n, ic, oc, nullptr);
    std::vector<float> twin(resid);
    cpu::fp8_gemm(twin.data(), oc, hx.data(), Fp8Format::E4M3, s[0], hw.data(), Fp8Format::E4M3, s[4], n, oc, ic,
                  /*accumulate=*/with_residual);
    const std::vector<double> got = d_out.values(), ref(twin.begin(), twin.end());
    const double err = rel_error_norm(got, ref);
    std::printf("  fp8 fwd%-14s fast-accum err vs twin %.3e (bound 2e-2)\n", with_residual ? " + residual" : "", err);
    EXPECT_LE(err, 2e-2);
  }
  for (bool accumulate : {false, true})
    for (GradWrite dweight_write : {GradWrite::Overwrite, GradWrite::Accumulate}) {
      SCOPED_TRACE(std::string(accumulate ? "accumulate dinp, " : "overwrite dinp, ") +
                   (dweight_write == GradWrite::Overwrite ? "overwrite dweight" : "accumulate dweight"));
      DeviceBf16 d_dinp(dinp0);
      if (!accumulate) d_dinp.poison();
      DeviceBuffer<float> d_dw(dw0);
      if (dweight_write == GradWrite::Overwrite) d_dw.poison();
      cuda::matmul_fp8_bwd(ctx, d_dinp.bf(), d_dw.get(), G, GT, XT, WT, n, ic, oc, accumulate, dweight_write, nullptr);
      std::vector<float> twin_dinp(dinp0), twin_dw(dw0);
      cpu::fp8_gemm(twin_dinp.data(), ic, hg.data(), Fp8Format::E5M2, s[8], hwt.data(), Fp8Format::E4M3, s[4], n, ic, oc,
                    accumulate);
      cpu::fp8_gemm(twin_dw.data(), ic, hgt.data(), Fp8Format::E5M2, s[8], hxt.data(), Fp8Format::E4M3, s[0], oc, ic,
                    n, dweight_write == GradWrite::Accumulate);
      const std::vector<double> ref_dinp(twin_dinp.begin(), twin_dinp.end()), ref_dw(twin_dw.begin(), twin_dw.end());
      std::vector<double> naive_dinp(ref_dinp);
      for (double& v : naive_dinp) v = round_bf16(v);
      expect_close_to_naive("fp8 dinp", d_dinp.values(), naive_dinp, ref_dinp);
      expect_close_to_naive("fp8 dweight (fp32)", d_dw.download(), ref_dw, ref_dw, kFp8Fp32OutputBound);
    }
  // cuBLASLt's FP8 layout rules, refused before any device work.
  EXPECT_THROW(cuda::matmul_fp8_fwd(ctx, d_out.bf(), X, W, n + 8, ic, oc, nullptr), Error);
  EXPECT_THROW(cuda::matmul_fp8_fwd(ctx, d_out.bf(), cuda::Fp8Operand{x_q.get() + 1, inv.get()}, W, n, ic, oc, nullptr),
               Error);
  // A scale 4 bytes past a 16-byte boundary: cuBLASLt 13.1 offers algorithms for it, then cublasLtMatmul answers
  // NOT_SUPPORTED; the launchers name the operand instead, in every pass.
  const cuda::Fp8Operand misaligned{w_q.get(), inv.get() + 1};
  const auto expect_scale_refused = [](const std::function<void()>& call, const char* what) {
    try {
      call();
      ADD_FAILURE() << what << " accepted a scale 4 bytes past a 16-byte boundary";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("scale"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("16-byte aligned"), std::string::npos) << e.what();
    }
  };
  expect_scale_refused([&] { cuda::matmul_fp8_fwd(ctx, d_out.bf(), X, misaligned, n, ic, oc, nullptr); }, "fwd");
  expect_scale_refused([&] { cuda::matmul_fp8_residual_fwd(ctx, d_out.bf(), X, misaligned, d_resid.bf(), n, ic, oc,
                                                           nullptr); }, "residual fwd");
  DeviceBf16 d_dinp(dinp0);
  DeviceBuffer<float> d_dw(dw0);
  expect_scale_refused([&] { cuda::matmul_fp8_bwd(ctx, d_dinp.bf(), nullptr, G, GT, XT, misaligned, n, ic, oc, false,
                                                  GradWrite::Overwrite, nullptr); }, "dinp");
  expect_scale_refused([&] { cuda::matmul_fp8_bwd(ctx, nullptr, d_dw.get(), G, GT, misaligned, WT, n, ic, oc, false,
                                                  GradWrite::Overwrite, nullptr); }, "dweight");
}

}  // namespace
}  // namespace tuna::test
#endif  // TUNA_CUDA
