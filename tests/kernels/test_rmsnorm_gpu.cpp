// kernels/rmsnorm.cu against kernels/cpu/rmsnorm.cpp (double), with the tolerance rule of gpu_test_util.h.
#if TUNA_CUDA
#include "kernels/cpu/fp8.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/rmsnorm.cuh"
#include "tests/kernels/gpu_test_util.h"

namespace tuna::test {
namespace {

// Forward against the twin on fresh inputs.
void check_forward(TestRng& rng, int64_t n, int64_t dim) {
  SCOPED_TRACE("n " + std::to_string(n) + ", dim " + std::to_string(dim));
  const double eps = 1e-5;
  std::vector<float> inp = random_bf16_values(rng, n * dim, -2, 2);
  std::vector<float> weight = random_bf16_values(rng, dim, 0.5, 1.5);
  DeviceBf16 d_inp(inp), d_w(weight), d_out(n * dim);
  DeviceBuffer<float> d_rstd(n);
  d_out.poison(), d_rstd.poison();
  cuda::rmsnorm_fwd(d_out.bf(), d_rstd.get(), d_inp.bf(), d_w.bf(), n, dim, eps, nullptr);
  std::vector<double> x(inp.begin(), inp.end());
  std::vector<double> ref(n * dim), rstd(n), w(weight.begin(), weight.end());
  cpu::rmsnorm_fwd(ref.data(), rstd.data(), x.data(), w.data(), n, dim, eps);
  std::vector<double> naive(n * dim);
  for (int64_t i = 0; i < n; ++i) {
    float ss = 0;
    for (int64_t j = 0; j < dim; ++j) ss += float(x[i * dim + j]) * float(x[i * dim + j]);
    const float r = 1.0f / std::sqrt(ss / dim + float(eps));
    for (int64_t j = 0; j < dim; ++j) naive[i * dim + j] = round_bf16(w[j] * (float(x[i * dim + j]) * r));
  }
  expect_close_to_naive("rmsnorm out", d_out.values(), naive, ref);
  expect_close_to_naive("rstd (fp32)", d_rstd.download(), rstd, rstd);
}

// Backward against the twin, dinp accumulating onto random values and dweight written both ways (accumulated onto
// random values, or overwritten over NaN, which must never be read), and bit for bit the same when run again.
void check_backward(TestRng& rng, int64_t n, int64_t dim) {
  SCOPED_TRACE("n " + std::to_string(n) + ", dim " + std::to_string(dim));
  std::vector<float> inp = random_bf16_values(rng, n * dim, -2, 2), dout = random_bf16_values(rng, n * dim);
  std::vector<float> weight = random_bf16_values(rng, dim, 0.5, 1.5), dinp0 = random_bf16_values(rng, n * dim);
  std::vector<float> dweight0 = rng.vector<float>(dim);
  std::vector<float> rstd(n);
  for (int64_t i = 0; i < n; ++i) {
    double ss = 0;
    for (int64_t j = 0; j < dim; ++j) ss += double(inp[i * dim + j]) * inp[i * dim + j];
    rstd[i] = static_cast<float>(1.0 / std::sqrt(ss / dim + 1e-5));
  }
  DeviceBf16 d_inp(inp), d_dout(dout), d_w(weight);
  DeviceBuffer<float> d_rstd(rstd), d_scratch(cuda::rmsnorm_bwd_scratch_floats(n, dim));
  for (GradWrite dweight_write : {GradWrite::Accumulate, GradWrite::Overwrite}) {
    const bool overwrite = dweight_write == GradWrite::Overwrite;
    SCOPED_TRACE(overwrite ? "dweight overwritten" : "dweight accumulated");
    std::vector<uint16_t> first_dinp;
    std::vector<float> first_dw;
    for (int run = 0; run < 2; ++run) {
      DeviceBf16 d_dinp(dinp0);
      DeviceBuffer<float> d_dw(dweight0);
      if (overwrite) d_dw.poison();
      cuda::rmsnorm_bwd(d_dinp.bf(), d_dw.get(), d_dout.bf(), d_inp.bf(), d_w.bf(), d_rstd.get(), d_scratch.get(), n,
                        dim, dweight_write, nullptr);
      if (run == 1) {
        EXPECT_TRUE(bitwise_equal(first_dinp, d_dinp.download()));
        EXPECT_TRUE(bitwise_equal(first_dw, d_dw.download()));
        break;
      }
      first_dinp = d_dinp.download();
      first_dw = d_dw.download();
      std::vector<double> ref_dinp(dinp0.begin(), dinp0.end()), ref_dw(dim, std::nan(""));
      if (!overwrite) ref_dw.assign(dweight0.begin(), dweight0.end());
      std::vector<double> x(inp.begin(), inp.end()), g(dout.begin(), dout.end()), w(weight.begin(), weight.end()),
          r(rstd.begin(), rstd.end());
      cpu::rmsnorm_bwd(ref_dinp.data(), ref_dw.data(), g.data(), x.data(), w.data(), r.data(), n, dim, dweight_write);
      // Naive bf16: fp32 math, the accumulated dinp rounded to bf16 once.
      std::vector<double> naive_dinp(n * dim);
      for (int64_t i = 0; i < n; ++i) {
        float dot = 0;
        for (int64_t j = 0; j < dim; ++j) dot += w[j] * float(g[i * dim + j]) * float(x[i * dim + j]);
        const float corr = rstd[i] * rstd[i] * dot / dim;
        for (int64_t j = 0; j < dim; ++j)
          naive_dinp[i * dim + j] = round_bf16(
              dinp0[i * dim + j] + rstd[i] * (float(w[j]) * float(g[i * dim + j]) - float(x[i * dim + j]) * corr));
      }
      expect_close_to_naive("rmsnorm dinp", bf16_bits_to_double(first_dinp), naive_dinp, ref_dinp);
      expect_close_to_naive("rmsnorm dweight (fp32)", first_dw, ref_dw, ref_dw);
    }
  }
}

TEST(RmsNormGpu, ForwardWithAndWithoutResidualAdd) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  check_forward(rng, 300 + rng.integer(0, 50), 8 * rng.integer(20, 300));  // dim not a multiple of 256
}

TEST(RmsNormGpu, BackwardOverwritesOrAccumulatesAndIsDeterministic) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  check_backward(rng, 200 + rng.integer(0, 100), 8 * rng.integer(20, 500));
}

// No rows: an overwritten dweight is zeros (a sum over nothing), an accumulated one is left alone.
TEST(RmsNormGpu, BackwardOverNoRowsZeroesAnOverwrittenDweight) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const int64_t dim = 8 * rng.integer(1, 100);
  const std::vector<float> dweight0 = rng.vector<float>(dim);
  DeviceBuffer<float> overwritten(dweight0), accumulated(dweight0), scratch(1);
  overwritten.poison();
  cuda::rmsnorm_bwd(nullptr, overwritten.get(), nullptr, nullptr, nullptr, nullptr, scratch.get(), 0, dim,
                    GradWrite::Overwrite, nullptr);
  cuda::rmsnorm_bwd(nullptr, accumulated.get(), nullptr, nullptr, nullptr, nullptr, scratch.get(), 0, dim,
                    GradWrite::Accumulate, nullptr);
  EXPECT_EQ(overwritten.download(), std::vector<float>(dim, 0.0f));
  EXPECT_EQ(accumulated.download(), dweight0);
}

// The model dims (LLaMA 1B/8B/70B hidden 2048/4096/8192, 405B's 16384) and one just off a block shape, on few
// rows: odd counts that end inside a forward block, a backward batch of two rows and a dweight slab.
TEST(RmsNormGpu, ModelDimsUpTo16384WithOddRowCounts) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  for (int64_t dim : {int64_t(2048), int64_t(4096 + 8), int64_t(8192), int64_t(16384)}) {
    const int64_t n = 2 * rng.integer(0, 8) + 33;  // odd, past one 32-row slab
    check_forward(rng, n, dim);
    check_backward(rng, n, dim);
  }
  check_backward(rng, 1, 16384);
  const int64_t n = 2 * rng.integer(0, 8) + 33;  // past 8192 and not a power of 2, over two dweight slabs
  check_forward(rng, n, 12296);
  check_backward(rng, n, 12296);
}

// The _amax variants (FP8 training): the same bits as the plain kernels, and the amax of what they stored (the
// twin: cpu::fp8_amax over the downloaded bf16 values), folded onto a running value, at each block shape.
TEST(RmsNormGpu, AmaxVariantsStoreTheSameBitsAndFoldTheirOutputsAmax) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  for (int64_t dim : {int64_t(8 * rng.integer(1, 32)), int64_t(8 * rng.integer(33, 64)), int64_t(8 * rng.integer(65, 256)),
                      int64_t(8 * rng.integer(257, 1024)), int64_t(12296)}) {
    const int64_t n = rng.integer(1, 70);
    SCOPED_TRACE("n " + std::to_string(n) + ", dim " + std::to_string(dim));
    const std::vector<float> inp = random_bf16_values(rng, n * dim, -3, 3), weight = random_bf16_values(rng, dim, 0.5, 1.5);
    const std::vector<float> dout = random_bf16_values(rng, n * dim), dinp0 = random_bf16_values(rng, n * dim);
    DeviceBf16 d_inp(inp), d_w(weight), out(n * dim), out_amax(n * dim), d_dout(dout);
    DeviceBuffer<float> rstd(n), rstd_amax(n), amax(std::vector<float>{0.5f}), scratch(cuda::rmsnorm_bwd_scratch_floats(n, dim));
    cuda::rmsnorm_fwd(out.bf(), rstd.get(), d_inp.bf(), d_w.bf(), n, dim, 1e-5, nullptr);
    cuda::rmsnorm_fwd_amax(out_amax.bf(), rstd_amax.get(), d_inp.bf(), d_w.bf(), n, dim, 1e-5, amax.get(), nullptr);
    EXPECT_TRUE(bitwise_equal(out.download(), out_amax.download()));
    EXPECT_TRUE(bitwise_equal(rstd.download(), rstd_amax.download()));
    float expected = 0.5f;
    const std::vector<double> stored = out.values();
    const std::vector<float> stored_f(stored.begin(), stored.end());
    cpu::fp8_amax(&expected, stored_f.data(), n, dim, dim);
    EXPECT_EQ(amax.download()[0], expected);

    DeviceBf16 dinp(dinp0), dinp_amax(dinp0);
    DeviceBuffer<float> dw(dim), dw_amax(dim), bwd_amax(std::vector<float>{0.0f});
    cuda::rmsnorm_bwd(dinp.bf(), dw.get(), d_dout.bf(), d_inp.bf(), d_w.bf(), rstd.get(), scratch.get(), n, dim,
                      GradWrite::Overwrite, nullptr);
    cuda::rmsnorm_bwd_amax(dinp_amax.bf(), dw_amax.get(), d_dout.bf(), d_inp.bf(), d_w.bf(), rstd.get(), scratch.get(),
                           n, dim, GradWrite::Overwrite, bwd_amax.get(), nullptr);
    EXPECT_TRUE(bitwise_equal(dinp.download(), dinp_amax.download()));
    EXPECT_TRUE(bitwise_equal(dw.download(), dw_amax.download()));
    expected = 0.0f;
    const std::vector<double> grads = dinp.values();
    const std::vector<float> grads_f(grads.begin(), grads.end());
    cpu::fp8_amax(&expected, grads_f.data(), n, dim, dim);
    EXPECT_EQ(bwd_amax.download()[0], expected);
  }
}

TEST(RmsNormGpu, RefusesDimsBeyondTheSupported) {
  // Refused by the launchers before any device work, so this runs without a GPU too.
  EXPECT_THROW(cuda::rmsnorm_fwd(nullptr, nullptr, nullptr, nullptr, 4, 16384 + 8, 1e-5, nullptr), Error);
  EXPECT_THROW(cuda::rmsnorm_bwd(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 4, 16384 + 8,
                                 GradWrite::Accumulate, nullptr),
               Error);
}

}  // namespace
}  // namespace tuna::test
#endif  // TUNA_CUDA
