// kernels/attention*.cu (FlashAttention-2 style) against kernels/cpu/attention.cpp in double: forward out and
// lse, backward dq, dk, dv; head dims 64 and 128, grouped-query heads, sequence lengths that are not multiples
// of the 64-row tiles (and 1), determinism of the backward.
//
// The naive same-precision version is attention_reference.h's (see gpu_test_util.h for the rule).
#if TUNA_CUDA
#include <cmath>

#include "kernels/attention.cuh"
#include "kernels/cpu/attention.h"
#include "tests/kernels/attention_reference.h"
#include "tests/kernels/gpu_test_util.h"

namespace tuna::test {
namespace {

void check(const AttentionShape& s, TestRng& rng) {
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
  const NaiveAttention naive = naive_attention(s, qd, kd, vd, gd, out_d, lse_d);

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
