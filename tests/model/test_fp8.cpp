// model/fp8: the option's values, and the CPU twin of an FP8 GEMM group against the operations it is made of (the
// casts and the simulated GEMM of kernels/cpu/fp8.h, bit for bit), against fp32 products (within FP8's error), and
// split over two tensor-parallel ranks (threads) against one rank: the amax reduced over tp gives each rank the
// scale the whole tensor has, so the split products equal the whole one's. Then the CPU model with --fp8 tensorwise:
// near its fp32 self, and split over tp (with and without sp) against one rank.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "comm/comm.h"
#include "core/error.h"  // str
#include "kernels/cpu/classifier.h"  // kIgnoreIndex
#include "kernels/cpu/fp8.h"
#include "kernels/cpu/matmul.h"
#include "model/fp8.h"
#include "model/llama.h"
#include "tests/kernels/op_test_util.h"
#include "tests/test_util.h"

namespace tuna {
namespace {

using cpu::Fp8Format;

TEST(Fp8Mode, ParsesTheRecipesItHas) {
  EXPECT_EQ(parse_fp8_mode("off", "--fp8"), Fp8Mode::Off);
  EXPECT_EQ(parse_fp8_mode("tensorwise", "--fp8"), Fp8Mode::Tensorwise);
  EXPECT_STREQ(fp8_mode_name(Fp8Mode::Tensorwise), "tensorwise");
  std::string e = testing_util::error_of([] { parse_fp8_mode("rowwise", "run.toml: fp8"); });
  EXPECT_NE(e.find("run.toml: fp8: rowwise FP8"), std::string::npos) << e;
  EXPECT_NE(e.find("not implemented"), std::string::npos) << e;
  e = testing_util::error_of([] { parse_fp8_mode("e4m3", "--fp8"); });
  EXPECT_NE(e.find("--fp8: expected off or tensorwise, found 'e4m3'"), std::string::npos) << e;
  EXPECT_FALSE(parse_fp8_forward_codes("both", "--fp8_weight_codes"));
  EXPECT_TRUE(parse_fp8_forward_codes("forward", "--fp8_weight_codes"));
  EXPECT_STREQ(fp8_weight_codes_name(true), "forward");
  e = testing_util::error_of([] { parse_fp8_forward_codes("none", "run.toml: fp8_weight_codes"); });
  EXPECT_NE(e.find("run.toml: fp8_weight_codes: expected both or forward, found 'none'"), std::string::npos) << e;
}

std::vector<float> random_values(test::TestRng& rng, int64_t n, double scale) {
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(scale * rng.uniform(-1, 1));
  return v;
}

// A q|k|v-like group: three parts of a shared input, forward and backward through Fp8GroupCpu.
struct Group {
  int64_t n, in;
  std::vector<int64_t> outs;
  std::vector<float> x;
  std::vector<std::vector<float>> w, dy;
};

Group make_group(test::TestRng& rng) {
  Group g{rng.integer(3, 40), rng.integer(2, 60), {rng.integer(1, 30), rng.integer(1, 20), rng.integer(1, 20)}, {}, {}, {}};
  g.x = random_values(rng, g.n * g.in, 3.0);
  for (int64_t out : g.outs) {
    g.w.push_back(random_values(rng, out * g.in, 0.05));
    g.dy.push_back(random_values(rng, g.n * out, 1e-4));
  }
  g.w[1][3] *= 40;  // one large weight: the block's shared scale saturates nothing, but the other parts lose bits
  return g;
}

TEST(Fp8GroupCpu, IsTheCastsAndTheSimulatedGemm) {
  test::TestRng rng;
  SCOPED_TRACE(rng.describe());
  Group g = make_group(rng);
  std::vector<Fp8GroupCpu::Part> parts;
  std::vector<std::vector<float>> out;
  std::vector<float*> outs;
  for (size_t i = 0; i < g.outs.size(); ++i) {
    parts.push_back({g.w[i].data(), g.outs[i]});
    out.emplace_back(g.n * g.outs[i], NAN);
  }
  for (auto& o : out) outs.push_back(o.data());
  Fp8GroupCpu group;
  group.forward(parts, outs, g.x.data(), g.n, g.in, /*x_split=*/false, nullptr);

  // By hand: the input's codes, the block's codes under one amax, one simulated GEMM per part.
  float amax_x = 0, amax_w = 0, inv_x = 0, inv_w = 0;
  cpu::fp8_amax(&amax_x, g.x.data(), g.n, g.in, g.in);
  for (size_t i = 0; i < g.outs.size(); ++i) cpu::fp8_amax(&amax_w, g.w[i].data(), g.outs[i], g.in, g.in);
  std::vector<uint8_t> xq(g.n * g.in);
  cpu::fp8_cast(xq.data(), &inv_x, g.x.data(), g.n, g.in, g.in, amax_x, Fp8Format::E4M3);
  for (size_t i = 0; i < g.outs.size(); ++i) {
    std::vector<uint8_t> wq(g.outs[i] * g.in);
    cpu::fp8_cast(wq.data(), &inv_w, g.w[i].data(), g.outs[i], g.in, g.in, amax_w, Fp8Format::E4M3);
    std::vector<float> want(g.n * g.outs[i]);
    cpu::fp8_gemm(want.data(), g.outs[i], xq.data(), Fp8Format::E4M3, inv_x, wq.data(), Fp8Format::E4M3, inv_w, g.n,
                  g.outs[i], g.in, false);
    EXPECT_TRUE(test::bitwise_equal(out[i], want)) << "part " << i;
    // And near the fp32 product: e4m3 keeps 3 mantissa bits (a relative step of at most 1/16 an operand).
    std::vector<float> exact(g.n * g.outs[i]);
    cpu::matmul_fwd(exact.data(), g.x.data(), g.w[i].data(), g.n, g.in, g.outs[i]);
    const double err = test::rel_error_norm(out[i], exact);
    EXPECT_LT(err, 0.15) << "part " << i;
  }

  // Backward: dx (accumulated onto a start), dW added to what the gradient holds.
  std::vector<float> dx0 = random_values(rng, g.n * g.in, 1.0), dx = dx0;
  std::vector<std::vector<float>> dw;
  std::vector<float*> dws;
  std::vector<const float*> dys;
  for (size_t i = 0; i < g.outs.size(); ++i) {
    dw.push_back(random_values(rng, g.outs[i] * g.in, 1.0));
    dys.push_back(g.dy[i].data());
  }
  const std::vector<std::vector<float>> dw0 = dw;
  for (auto& d : dw) dws.push_back(d.data());
  dws[2] = nullptr;  // a part without a weight gradient
  group.backward(parts, dys, dws, dx.data(), /*accumulate_dx=*/true, g.x.data(), g.n, g.in, false, false, nullptr);
  float amax_dy = 0, inv_dy = 0;
  for (size_t i = 0; i < g.outs.size(); ++i) cpu::fp8_amax(&amax_dy, g.dy[i].data(), g.n, g.outs[i], g.outs[i]);
  std::vector<uint8_t> xt(g.n * g.in);
  cpu::fp8_cast_transpose(nullptr, xt.data(), &inv_x, g.x.data(), g.n, g.in, g.in, amax_x, Fp8Format::E4M3);
  std::vector<float> want_dx = dx0;
  for (size_t i = 0; i < g.outs.size(); ++i) {
    const int64_t out_i = g.outs[i];
    std::vector<uint8_t> gq(g.n * out_i), gt(g.n * out_i), wt(out_i * g.in);
    cpu::fp8_cast_transpose(gq.data(), gt.data(), &inv_dy, g.dy[i].data(), g.n, out_i, out_i, amax_dy, Fp8Format::E5M2);
    cpu::fp8_cast_transpose(nullptr, wt.data(), &inv_w, g.w[i].data(), out_i, g.in, g.in, amax_w, Fp8Format::E4M3);
    cpu::fp8_gemm(want_dx.data(), g.in, gq.data(), Fp8Format::E5M2, inv_dy, wt.data(), Fp8Format::E4M3, inv_w, g.n,
                  g.in, out_i, true);
    if (i == 2) {
      EXPECT_TRUE(test::bitwise_equal(dw[i], dw0[i])) << "a null weight gradient was written";
      continue;
    }
    std::vector<float> want_dw = dw0[i];
    cpu::fp8_gemm(want_dw.data(), g.in, gt.data(), Fp8Format::E5M2, inv_dy, xt.data(), Fp8Format::E4M3, inv_x, out_i,
                  g.in, g.n, true);
    EXPECT_TRUE(test::bitwise_equal(dw[i], want_dw)) << "part " << i;
  }
  EXPECT_TRUE(test::bitwise_equal(dx, want_dx));
}

// Near the fp32 backward: e5m2 gradients keep 2 mantissa bits (a relative step of at most 1/8 a value).
TEST(Fp8GroupCpu, BackwardIsNearTheFp32Products) {
  test::TestRng rng;
  SCOPED_TRACE(rng.describe());
  const int64_t n = 64, in = 48, out = 40;
  const std::vector<float> x = random_values(rng, n * in, 2.0), w = random_values(rng, out * in, 0.1),
                           dy = random_values(rng, n * out, 1e-3);
  std::vector<float> dx(n * in, NAN), dw(out * in, 0.0f), ref_dx(n * in), ref_dw(out * in, 0.0f);
  Fp8GroupCpu group;
  group.backward({{w.data(), out}}, {dy.data()}, {dw.data()}, dx.data(), false, x.data(), n, in, false, false, nullptr);
  cpu::matmul_bwd(ref_dx.data(), ref_dw.data(), dy.data(), x.data(), w.data(), n, in, out, false, GradWrite::Accumulate);
  EXPECT_LT(test::rel_error_norm(dx, ref_dx), 0.15);
  EXPECT_LT(test::rel_error_norm(dw, ref_dw), 0.15);
  EXPECT_GT(test::rel_error_norm(dx, ref_dx), 1e-4) << "no FP8 rounding at all: not quantized";
}

// A column-parallel group (q|k|v-like: each part's rows split over 2 ranks, x whole) and a row-parallel one
// (o-like: x and W split by columns), on tp = 2 threads against one rank: the same codes everywhere, so each rank's
// part of the output (column-parallel) or partial sum (row-parallel, summed here) is the whole product's.
TEST(Fp8GroupCpu, TensorParallelSplitsCastWithTheWholeTensorsScales) {
  test::TestRng rng;
  SCOPED_TRACE(rng.describe());
  const int64_t n = 24, in = 32, out = 16;  // out and in split in halves
  const std::vector<float> x = random_values(rng, n * in, 2.0), w = random_values(rng, out * in, 0.1),
                           dy = random_values(rng, n * out, 1e-3);
  // One rank, column-parallel view: y = x W^T.
  Fp8GroupCpu whole;
  std::vector<float> y(n * out), dx(n * in), dw(out * in, 0.0f);
  whole.forward({{w.data(), out}}, {y.data()}, x.data(), n, in, false, nullptr);
  whole.backward({{w.data(), out}}, {dy.data()}, {dw.data()}, dx.data(), false, x.data(), n, in, false, false, nullptr);

  auto comms = make_local_comms(2, 60.0);
  std::vector<std::vector<float>> col_y(2), col_dw(2), col_dx(2), row_y(2), row_dw(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      Comm* tp = comms[r].get();
      const int64_t half = out / 2;
      // Column-parallel: rows [r * half, (r + 1) * half) of W; the output gradient's columns likewise (split).
      std::vector<float> w_rows(w.begin() + r * half * in, w.begin() + (r + 1) * half * in), dy_cols(n * half);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t c = 0; c < half; ++c) dy_cols[i * half + c] = dy[i * out + r * half + c];
      Fp8GroupCpu group;
      col_y[r].resize(n * half), col_dw[r].assign(half * in, 0.0f), col_dx[r].resize(n * in);
      group.forward({{w_rows.data(), half}}, {col_y[r].data()}, x.data(), n, in, /*x_split=*/false, tp);
      group.backward({{w_rows.data(), half}}, {dy_cols.data()}, {col_dw[r].data()}, col_dx[r].data(), false, x.data(),
                     n, in, /*x_split=*/false, /*dy_split=*/true, tp);
      // Row-parallel: columns [r * in / 2, ...) of x and W; dy whole.
      const int64_t cols = in / 2;
      std::vector<float> x_cols(n * cols), w_cols(out * cols);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t c = 0; c < cols; ++c) x_cols[i * cols + c] = x[i * in + r * cols + c];
      for (int64_t o = 0; o < out; ++o)
        for (int64_t c = 0; c < cols; ++c) w_cols[o * cols + c] = w[o * in + r * cols + c];
      row_y[r].resize(n * out), row_dw[r].assign(out * cols, 0.0f);
      std::vector<float> row_dx(n * cols);
      group.forward({{w_cols.data(), out}}, {row_y[r].data()}, x_cols.data(), n, cols, /*x_split=*/true, tp);
      group.backward({{w_cols.data(), out}}, {dy.data()}, {row_dw[r].data()}, row_dx.data(), false, x_cols.data(), n,
                     cols, /*x_split=*/true, /*dy_split=*/false, tp);
    });
  for (auto& t : threads) t.join();
  // Column-parallel: each rank's columns of y and rows of dW are the whole product's; dx sums the two partials.
  for (int r = 0; r < 2; ++r)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < out / 2; ++c)
        ASSERT_NEAR(col_y[r][i * (out / 2) + c], y[i * out + r * (out / 2) + c],
                    1e-5 * std::fabs(y[i * out + r * (out / 2) + c]) + 1e-9);
  for (int r = 0; r < 2; ++r)
    for (int64_t k = 0; k < out / 2 * in; ++k)
      ASSERT_NEAR(col_dw[r][k], dw[r * (out / 2) * in + k], 1e-5 * std::fabs(dw[r * (out / 2) * in + k]) + 1e-12);
  for (int64_t k = 0; k < n * in; ++k) ASSERT_NEAR(col_dx[0][k] + col_dx[1][k], dx[k], 1e-5 * std::fabs(dx[k]) + 1e-9);
  // Row-parallel: the partial outputs sum to the whole product; each rank's dW columns are the whole one's.
  for (int64_t k = 0; k < n * out; ++k) ASSERT_NEAR(row_y[0][k] + row_y[1][k], y[k], 1e-5 * std::fabs(y[k]) + 1e-6);
  for (int r = 0; r < 2; ++r)
    for (int64_t o = 0; o < out; ++o)
      for (int64_t c = 0; c < in / 2; ++c)
        ASSERT_NEAR(row_dw[r][o * (in / 2) + c], dw[o * in + r * (in / 2) + c],
                    1e-5 * std::fabs(dw[o * in + r * (in / 2) + c]) + 1e-12);
}

// ---- the CPU model (model/llama.cpp) with FP8 projections

struct Tokens {
  std::vector<int32_t> inputs, targets;
};
Tokens random_tokens(int64_t n, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  Tokens t;
  for (int64_t i = 0; i < n; ++i) {
    t.inputs.push_back(static_cast<int32_t>(rng() % vocab));
    t.targets.push_back(rng() % 7 == 0 ? cpu::kIgnoreIndex : static_cast<int32_t>(rng() % vocab));
  }
  return t;
}

// FP8 moves the loss and the gradients by FP8's rounding, no more: the loss within 2% of fp32's, each gradient tensor
// within a relative error norm of 0.25 (e5m2 output gradients keep 2 mantissa bits), and not equal (it is FP8).
TEST(LlamaFp8, StaysNearTheFp32Model) {
  const LlamaConfig cfg = LlamaConfig::load("tests/fixtures/llama2_tiny/config.json");
  Llama fp32(cfg, 2, 16), fp8(cfg, 2, 16);
  fp32.init_random(5, 0.05);
  fp8.params = fp32.params;
  fp8.set_fp8(Fp8Mode::Tensorwise);
  EXPECT_EQ(fp8.fp8(), Fp8Mode::Tensorwise);
  const Tokens t = random_tokens(32, cfg.vocab_size, 1);
  fp32.zero_grads(), fp8.zero_grads();
  const LossSum a = fp32.forward_backward(t.inputs.data(), t.targets.data(), 2, 16);
  const LossSum b = fp8.forward_backward(t.inputs.data(), t.targets.data(), 2, 16);
  EXPECT_EQ(a.count, b.count);
  EXPECT_NEAR(b.sum, a.sum, 0.02 * a.sum);
  EXPECT_NE(b.sum, a.sum);
  for (const ParamTensor& p : fp32.layout().tensors()) {
    const std::vector<float> ga(fp32.grads.begin() + p.offset, fp32.grads.begin() + p.offset + p.numel),
        gb(fp8.grads.begin() + p.offset, fp8.grads.begin() + p.offset + p.numel);
    EXPECT_LT(test::rel_error_norm(gb, ga), 0.25) << p.name;
  }
}

// tp 2 (and tp 2 with sp) with FP8 against one rank with FP8: the amax reductions give each rank the whole tensors'
// scales, so only the order of fp32 sums differs, and with it, now and then, an element a hair from a rounding
// boundary of the cast: the loss within 1e-3, the gradients within a relative error norm of 1e-2.
TEST(LlamaFp8, TensorParallelFollowsOneRank) {
  const LlamaConfig cfg = LlamaConfig::load("tests/fixtures/llama32_tiny/config.json");
  const int64_t batch = 2, seq = 9;
  const Tokens t = random_tokens(batch * seq, cfg.vocab_size, 2);
  Llama one(cfg, batch, seq);
  one.init_random(7, 0.05);
  one.set_fp8(Fp8Mode::Tensorwise);
  one.zero_grads();
  const LossSum whole = one.forward_backward(t.inputs.data(), t.targets.data(), batch, seq);
  for (bool sequence : {false, true}) {
    SCOPED_TRACE(sequence ? "tp 2 with sp" : "tp 2");
    auto comms = make_local_comms(2, 60.0);
    std::vector<std::string> failures(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r)
      threads.emplace_back([&, r] {
        try {
          LlamaParallel parallel{comms[r].get()};
          parallel.sequence = sequence;
          Llama rank(cfg, batch, seq, parallel);
          rank.init_random(7, 0.05);  // the same global tensors, this rank's blocks
          rank.set_fp8(Fp8Mode::Tensorwise);
          rank.zero_grads();
          const LossSum loss = rank.forward_backward(t.inputs.data(), t.targets.data(), batch, seq);
          if (loss.count != whole.count || std::abs(loss.sum - whole.sum) > 1e-3 * whole.sum)
            failures[r] += str("loss ", loss.sum, " over ", loss.count, ", one rank ", whole.sum, " over ", whole.count, "\n");
          // Each of this rank's gradient blocks against the same block of one rank's gradient.
          for (const ParamTensor& p : rank.layout().tensors()) {
            const ParamTensor& w = one.layout().tensors()[&p - rank.layout().tensors().data()];
            const int64_t cols = p.shape.size() == 2 ? p.shape[1] : p.numel;
            const int64_t global_cols = p.global_shape.size() == 2 ? p.global_shape[1] : p.numel;
            std::vector<float> mine(rank.grads.begin() + p.offset, rank.grads.begin() + p.offset + p.numel), ref;
            for (int64_t i = 0; i < p.numel; ++i) {  // element i of this rank's block, in the whole tensor
              const int64_t row = i / cols, col = i % cols;
              const int64_t g = p.split_dim == 0   ? (p.split_begin + row) * global_cols + col
                                : p.split_dim == 1 ? row * global_cols + p.split_begin + col
                                                   : i;
              ref.push_back(one.grads[w.offset + g]);
            }
            const double e = test::rel_error_norm(mine, ref);
            if (!(e < 1e-2)) failures[r] += str(p.name, ": gradient ", e, " from one rank's\n");
          }
        } catch (const std::exception& e) {
          failures[r] = e.what();
        }
      });
    for (auto& th : threads) th.join();
    for (int r = 0; r < 2; ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
  }
}

}  // namespace
}  // namespace tuna
