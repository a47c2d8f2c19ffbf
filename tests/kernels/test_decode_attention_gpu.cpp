// kernels/decode_attention.cu against kernels/cpu/decode_attention.cpp (in double on the same bf16 values), by
// the rule of gpu_test_util.h: head dims 8 to 128, group sizes 1 to 4, a prompt-sized append (past 0), single
// tokens after a past longer than one chunk of keys, and a cache larger than what is filled.
#if TUNA_CUDA
#include <cmath>

#include "kernels/cpu/decode_attention.h"
#include "kernels/decode_attention.cuh"
#include "tests/kernels/gpu_test_util.h"

namespace tuna::test {
namespace {

struct DecodeCase {
  int64_t batch, n_new, past, capacity, heads, kv_heads, dim;
  std::string describe() const {
    return "batch " + std::to_string(batch) + " n_new " + std::to_string(n_new) + " past " + std::to_string(past) +
           " capacity " + std::to_string(capacity) + " heads " + std::to_string(heads) + "/" +
           std::to_string(kv_heads) + " head_dim " + std::to_string(dim);
  }
};

// fp32 scores, softmax and sums over the bf16 inputs; the output rounded to bf16, as the kernel stores it.
std::vector<double> naive_decode(const DecodeCase& c, const std::vector<double>& q, const std::vector<double>& k,
                                 const std::vector<double>& v) {
  std::vector<double> out(q.size());
  const int64_t group = c.heads / c.kv_heads;
  const float scale = 1.0f / std::sqrt(float(c.dim));
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t i = 0; i < c.n_new; ++i)
      for (int64_t h = 0; h < c.heads; ++h) {
        const int64_t row = ((b * c.n_new + i) * c.heads + h) * c.dim, last = c.past + i;
        auto kv = [&](int64_t j) { return ((b * c.capacity + j) * c.kv_heads + h / group) * c.dim; };
        std::vector<float> s(last + 1);
        float mx = -INFINITY;
        for (int64_t j = 0; j <= last; ++j) {
          float dot = 0;
          for (int64_t d = 0; d < c.dim; ++d) dot += float(q[row + d]) * float(k[kv(j) + d]);
          s[j] = dot * scale;
          mx = std::max(mx, s[j]);
        }
        float sum = 0;
        for (int64_t j = 0; j <= last; ++j) s[j] = std::exp(s[j] - mx), sum += s[j];
        for (int64_t d = 0; d < c.dim; ++d) {
          float acc = 0;
          for (int64_t j = 0; j <= last; ++j) acc += s[j] * float(v[kv(j) + d]);
          out[row + d] = round_bf16(acc / sum);
        }
      }
  return out;
}

TEST(DecodeAttentionGpu, MatchesTheCpuTwin) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const DecodeCase cases[] = {
      {2, 9, 0, 16, 4, 4, 8},        // a prompt: causal among the new positions
      {1, 1, 300, 320, 8, 2, 64},    // one token after more than two chunks of keys
      {2, 3, 130, 140, 8, 4, 128},   // a few tokens, the largest head_dim
      {1, 2, 40, 64, 4, 1, 16},      // one kv head for four query heads
      {1, 1, 127, 128, 2, 2, 32},    // the new key is the first of the second chunk
  };
  for (const DecodeCase& c : cases) {
    SCOPED_TRACE(c.describe());
    const int64_t q_count = c.batch * c.n_new * c.heads * c.dim, cache_count = c.batch * c.capacity * c.kv_heads * c.dim;
    // Scores of a few units, as trained models have: softmax neither flat nor one-hot.
    const std::vector<float> q = random_bf16_values(rng, q_count, -2, 2), k = random_bf16_values(rng, cache_count, -2, 2),
                             v = random_bf16_values(rng, cache_count);
    DeviceBf16 d_q(q), d_k(k), d_v(v), d_out(q_count);
    d_out.poison();
    cuda::decode_attention_fwd(d_out.bf(), d_q.bf(), d_k.bf(), d_v.bf(), c.batch, c.n_new, c.past, c.capacity, c.heads,
                               c.kv_heads, c.dim, nullptr);
    const std::vector<double> qd = to_double(q), kd = to_double(k), vd = to_double(v);
    std::vector<double> ref(q_count);
    cpu::decode_attention_fwd(ref.data(), qd.data(), kd.data(), vd.data(), c.batch, c.n_new, c.past, c.capacity,
                              c.heads, c.kv_heads, c.dim);
    expect_close_to_naive("decode attention out", d_out.values(), naive_decode(c, qd, kd, vd), ref);
  }
}

TEST(DecodeAttentionGpu, RefusesUnsupportedHeadDims) {
  TUNA_REQUIRE_GPU();
  DeviceBf16 buf(4 * 256);
  EXPECT_THROW(cuda::decode_attention_fwd(buf.bf(), buf.bf(), buf.bf(), buf.bf(), 1, 1, 0, 2, 1, 1, 256, nullptr), Error);
  EXPECT_THROW(cuda::decode_attention_fwd(buf.bf(), buf.bf(), buf.bf(), buf.bf(), 1, 1, 0, 2, 1, 1, 12, nullptr), Error);
}

}  // namespace
}  // namespace tuna::test
#endif  // TUNA_CUDA
