// kernels/rope.cu against kernels/cpu/rope.cpp, with llama3 scaling, in place, forward and backward.
#if TUNA_CUDA
#include "kernels/cpu/rope.h"
#include "kernels/rope.cuh"
#include "tests/kernels/gpu_test_util.h"

namespace tuna::test {
namespace {

TEST(RopeGpu, ForwardAndBackwardInPlaceWithLlama3Scaling) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  // 3 heads: not a multiple of the heads a thread rotates together (4); 8: LLaMA's kv heads.
  for (auto [head_dim, heads] : {std::pair<int64_t, int64_t>{8, 3}, {64, 3}, {128, 3}, {128, 8}}) {
    SCOPED_TRACE("head_dim " + std::to_string(head_dim) + ", heads " + std::to_string(heads));
    const int64_t batch = 2, seq = 300 + rng.integer(0, 33);
    cpu::RopeScaling scaling;
    scaling.type = "llama3", scaling.factor = 32, scaling.low_freq_factor = 1, scaling.high_freq_factor = 4;
    scaling.original_max_position_embeddings = 128;
    std::vector<double> inv_freq(head_dim / 2);
    cpu::rope_inv_freq(inv_freq.data(), head_dim, 500000.0, scaling);
    std::vector<float> cos_f(seq * head_dim / 2), sin_f(seq * head_dim / 2);
    cpu::rope_table(cos_f.data(), sin_f.data(), inv_freq.data(), seq, head_dim);
    const int64_t count = batch * seq * heads * head_dim;
    std::vector<float> x = random_bf16_values(rng, count, -3, 3);
    DeviceBuffer<float> d_cos(cos_f), d_sin(sin_f);
    for (bool backward : {false, true}) {
      SCOPED_TRACE(backward ? "backward" : "forward");
      DeviceBf16 d_x(x);
      if (backward)
        cuda::rope_bwd(d_x.bf(), d_x.bf(), d_cos.get(), d_sin.get(), batch, seq, heads, head_dim, nullptr);
      else
        cuda::rope_fwd(d_x.bf(), d_x.bf(), d_cos.get(), d_sin.get(), batch, seq, heads, head_dim, nullptr);
      std::vector<double> ref(count), xd(x.begin(), x.end()), c(cos_f.begin(), cos_f.end()), s(sin_f.begin(), sin_f.end());
      if (backward) cpu::rope_bwd(ref.data(), xd.data(), c.data(), s.data(), batch, seq, heads, head_dim);
      else cpu::rope_fwd(ref.data(), xd.data(), c.data(), s.data(), batch, seq, heads, head_dim);
      std::vector<double> naive(count);
      for (int64_t i = 0; i < count; ++i) naive[i] = round_bf16(ref[i]);
      expect_close_to_naive(backward ? "rope bwd" : "rope fwd", d_x.values(), naive, ref);
    }
  }
}

}  // namespace
}  // namespace tuna::test
#endif  // TUNA_CUDA
