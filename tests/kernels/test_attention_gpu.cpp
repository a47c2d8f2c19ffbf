// kernels/attention*.cu (FlashAttention-2 style) against kernels/cpu/attention.cpp in double: forward out and
// lse, backward dq, dk, dv; head dims 64 and 128, grouped-query heads, sequence lengths that are not multiples
// of the 64-row tiles (and 1), determinism of the backward.
//
// The naive same-precision version (see gpu_test_util.h) computes scores and softmax in fp32 and rounds to
// bf16 where the kernels do: P before P V (forward), P and dS before the dV, dK, dQ products, and each output.
#if TUNA_CUDA
#include <cmath>

#include "kernels/attention.cuh"
#include "kernels/cpu/attention.h"
#include "tests/kernels/gpu_test_util.h"

namespace tuna::test {
namespace {

struct Shape {
  int64_t batch, seq, heads, kv_heads, dim;
  int64_t q_count() const { return batch * seq * heads * dim; }
  int64_t kv_count() const { return batch * seq * kv_heads * dim; }
  int64_t q_row(int64_t b, int64_t t, int64_t h) const { return ((b * seq + t) * heads + h) * dim; }
  int64_t kv_row(int64_t b, int64_t t, int64_t h) const { return ((b * seq + t) * kv_heads + h) * dim; }
  std::string describe() const {
    return "batch " + std::to_string(batch) + " seq " + std::to_string(seq) + " heads " + std::to_string(heads) + "/" +
           std::to_string(kv_heads) + " head_dim " + std::to_string(dim);
  }
};

struct Naive {
  std::vector<double> out, lse, dq, dk, dv;
};

// The naive bf16 attention (forward and backward), using the given out (bf16 values) and lse for the backward.
Naive naive_attention(const Shape& s, const std::vector<double>& q, const std::vector<double>& k,
                      const std::vector<double>& v, const std::vector<double>& dout, const std::vector<double>& out_in,
                      const std::vector<double>& lse_in) {
  Naive r;
  r.out.assign(s.q_count(), 0), r.lse.assign(s.batch * s.heads * s.seq, 0);
  r.dq.assign(s.q_count(), 0), r.dk.assign(s.kv_count(), 0), r.dv.assign(s.kv_count(), 0);
  std::vector<double> dk_acc(s.kv_count(), 0), dv_acc(s.kv_count(), 0);  // fp32 values, summed per kv head
  const float scale = 1.0f / std::sqrt(float(s.dim));
  const int64_t group = s.heads / s.kv_heads;
  std::vector<float> sc(s.seq), p(s.seq), acc(s.dim);
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.heads; ++h) {
      const int64_t kvh = h / group;
      for (int64_t t = 0; t < s.seq; ++t) {
        const double* qt = &q[s.q_row(b, t, h)];
        float mx = -INFINITY;
        for (int64_t j = 0; j <= t; ++j) {
          float dot = 0;
          for (int64_t d = 0; d < s.dim; ++d) dot += float(qt[d]) * float(k[s.kv_row(b, j, kvh) + d]);
          sc[j] = dot * scale;
          mx = std::max(mx, sc[j]);
        }
        float sum = 0;
        for (int64_t j = 0; j <= t; ++j) p[j] = std::exp(sc[j] - mx), sum += p[j];
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t j = 0; j <= t; ++j)
          for (int64_t d = 0; d < s.dim; ++d) acc[d] += round_bf16(p[j]) * float(v[s.kv_row(b, j, kvh) + d]);
        for (int64_t d = 0; d < s.dim; ++d) r.out[s.q_row(b, t, h) + d] = round_bf16(acc[d] / sum);
        r.lse[(b * s.heads + h) * s.seq + t] = mx + std::log(sum);

        // backward of this query row, with the given out and lse
        const float lse_t = float(lse_in[(b * s.heads + h) * s.seq + t]);
        const double* gt = &dout[s.q_row(b, t, h)];
        float delta = 0;
        for (int64_t d = 0; d < s.dim; ++d) delta += float(gt[d]) * float(out_in[s.q_row(b, t, h) + d]);
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t j = 0; j <= t; ++j) {
          const float pj = std::exp(sc[j] - lse_t);
          float dp = 0;
          for (int64_t d = 0; d < s.dim; ++d) dp += float(gt[d]) * float(v[s.kv_row(b, j, kvh) + d]);
          const float ds = round_bf16(pj * (dp - delta)), pb = round_bf16(pj);
          for (int64_t d = 0; d < s.dim; ++d) {
            acc[d] += ds * float(k[s.kv_row(b, j, kvh) + d]);
            dk_acc[s.kv_row(b, j, kvh) + d] = float(dk_acc[s.kv_row(b, j, kvh) + d]) + ds * float(qt[d]);
            dv_acc[s.kv_row(b, j, kvh) + d] = float(dv_acc[s.kv_row(b, j, kvh) + d]) + pb * float(gt[d]);
          }
        }
        for (int64_t d = 0; d < s.dim; ++d) r.dq[s.q_row(b, t, h) + d] = round_bf16(acc[d] * scale);
      }
    }
  for (int64_t i = 0; i < s.kv_count(); ++i) r.dk[i] = round_bf16(dk_acc[i] * scale), r.dv[i] = round_bf16(dv_acc[i]);
  return r;
}

void check(const Shape& s, TestRng& rng) {
  SCOPED_TRACE(s.describe());
  std::printf(" %s\n", s.describe().c_str());
  std::vector<float> q = random_bf16_values(rng, s.q_count(), -2, 2), k = random_bf16_values(rng, s.kv_count(), -2, 2),
                     v = random_bf16_values(rng, s.kv_count()), dout = random_bf16_values(rng, s.q_count());
  const std::vector<double> qd(q.begin(), q.end()), kd(k.begin(), k.end()), vd(v.begin(), v.end()),
      gd(dout.begin(), dout.end());
  // Reference forward in double.
  std::vector<double> ref_out(s.q_count()), ref_lse(s.batch * s.heads * s.seq);
  cpu::attention_fwd(ref_out.data(), ref_lse.data(), qd.data(), kd.data(), vd.data(), s.batch, s.seq, s.heads,
                     s.kv_heads, s.dim);
  // The backward's inputs out (bf16) and lse (fp32), shared by every version so that the backward is checked
  // on its own.
  std::vector<float> out_bf(s.q_count()), lse_f(ref_lse.size());
  for (size_t i = 0; i < out_bf.size(); ++i) out_bf[i] = round_bf16(ref_out[i]);
  for (size_t i = 0; i < lse_f.size(); ++i) lse_f[i] = static_cast<float>(ref_lse[i]);
  const std::vector<double> out_d(out_bf.begin(), out_bf.end()), lse_d(lse_f.begin(), lse_f.end());
  std::vector<double> ref_dq(s.q_count()), ref_dk(s.kv_count()), ref_dv(s.kv_count());
  cpu::attention_bwd(ref_dq.data(), ref_dk.data(), ref_dv.data(), gd.data(), out_d.data(), lse_d.data(), qd.data(),
                     kd.data(), vd.data(), s.batch, s.seq, s.heads, s.kv_heads, s.dim);
  const Naive naive = naive_attention(s, qd, kd, vd, gd, out_d, lse_d);

  DeviceBf16 d_q(q), d_k(k), d_v(v), d_dout(dout), d_out(s.q_count()), d_out_in(out_bf);
  DeviceBuffer<float> d_lse(ref_lse.size()), d_lse_in(lse_f),
      d_scratch(cuda::attention_bwd_scratch_floats(s.batch, s.seq, s.heads));
  d_out.poison(), d_lse.poison();
  cuda::attention_fwd(d_out.bf(), d_lse.get(), d_q.bf(), d_k.bf(), d_v.bf(), s.batch, s.seq, s.heads, s.kv_heads,
                      s.dim, nullptr);
  expect_close_to_naive("attention out", d_out.values(), naive.out, ref_out);
  expect_close_to_naive("attention lse (fp32)", d_lse.download(), naive.lse, ref_lse);

  std::vector<uint16_t> first[3];
  for (int run = 0; run < 2; ++run) {
    DeviceBf16 d_dq(s.q_count()), d_dk(s.kv_count()), d_dv(s.kv_count());
    d_dq.poison(), d_dk.poison(), d_dv.poison();
    cuda::attention_bwd(d_dq.bf(), d_dk.bf(), d_dv.bf(), d_dout.bf(), d_out_in.bf(), d_lse_in.get(), d_q.bf(), d_k.bf(),
                        d_v.bf(), d_scratch.get(), s.batch, s.seq, s.heads, s.kv_heads, s.dim, nullptr);
    if (run == 0) {
      first[0] = d_dq.download(), first[1] = d_dk.download(), first[2] = d_dv.download();
      expect_close_to_naive("attention dq", bf16_bits_to_double(first[0]), naive.dq, ref_dq);
      expect_close_to_naive("attention dk", bf16_bits_to_double(first[1]), naive.dk, ref_dk);
      expect_close_to_naive("attention dv", bf16_bits_to_double(first[2]), naive.dv, ref_dv);
    } else {
      EXPECT_TRUE(bitwise_equal(first[0], d_dq.download()) && bitwise_equal(first[1], d_dk.download()) &&
                  bitwise_equal(first[2], d_dv.download()))
          << "attention backward is not deterministic";
    }
  }
}

TEST(AttentionGpu, HeadDim64GroupedQuery) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  check({2, 100 + rng.integer(0, 27), 4, 2, 64}, rng);
  check({1, 1, 2, 1, 64}, rng);
  check({1, 64, 3, 3, 64}, rng);
}

TEST(AttentionGpu, HeadDim128GroupedQuery) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  check({2, 150 + rng.integer(0, 27), 4, 1, 128}, rng);
  check({1, 33, 2, 2, 128}, rng);
  check({1, 257, 8, 2, 128}, rng);
}

TEST(AttentionGpu, SmallHeadDimsOfTinyModels) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  check({2, 37, 4, 2, 8}, rng);
  check({1, 20, 2, 1, 16}, rng);
  check({1, 45, 3, 1, 32}, rng);
}

}  // namespace
}  // namespace tuna::test
#endif  // TUNA_CUDA
