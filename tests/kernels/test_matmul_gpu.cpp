// kernels/matmul.cu (cuBLASLt) against kernels/cpu/matmul.cpp (double). Shapes are not multiples of any
// tile; the forward's residual epilogue and both write modes of the backward's dinp and of its dweight are
// covered, each overwrite over a NaN-filled destination (beta = 0 must not read it).
#if TUNA_CUDA
#include "kernels/cpu/matmul.h"
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

}  // namespace
}  // namespace tuna::test
#endif  // TUNA_CUDA
