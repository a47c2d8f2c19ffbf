// kernels/rope.cu against kernels/cpu/rope.cpp, with llama3 scaling, in place, forward and backward; and with
// row strides (q and k read out of, and their gradients written into, fused q|k|v rows; odd strides too).
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
    const int64_t batch = 2, seq = 300 + rng.integer(0, 33), width = heads * head_dim;
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
        cuda::rope_bwd(d_x.bf(), d_x.bf(), d_cos.get(), d_sin.get(), batch, seq, heads, head_dim, width, width,
                       /*positions=*/nullptr, nullptr);
      else
        cuda::rope_fwd(d_x.bf(), d_x.bf(), d_cos.get(), d_sin.get(), batch, seq, heads, head_dim, width, width,
                       /*positions=*/nullptr, nullptr);
      std::vector<double> ref(count), xd(x.begin(), x.end()), c(cos_f.begin(), cos_f.end()),
          s(sin_f.begin(), sin_f.end());
      (backward ? cpu::rope_bwd<double> : cpu::rope_fwd<double>)(ref.data(), xd.data(), c.data(), s.data(), batch,
                                                                 seq, heads, head_dim, width, width,
                                                                 /*positions=*/nullptr);
      std::vector<double> naive(count);
      for (int64_t i = 0; i < count; ++i) naive[i] = round_bf16(ref[i]);
      expect_close_to_naive(backward ? "rope bwd" : "rope fwd", d_x.values(), naive, ref);
    }
  }
}

// Positions restarted at each packed document (the model's default): both kernels (the 16-byte path at head_dim
// 64 and 128, the pair kernel at 8) read each row's table row at its position, as the CPU twin does.
TEST(RopeGpu, RestartedPositionsMatchTheCpuTwin) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  for (auto [head_dim, heads] : {std::pair<int64_t, int64_t>{8, 3}, {64, 3}, {128, 8}}) {
    SCOPED_TRACE("head_dim " + std::to_string(head_dim) + ", heads " + std::to_string(heads));
    const int64_t batch = 2, seq = 97, width = heads * head_dim, count = batch * seq * width;
    std::vector<double> inv_freq(head_dim / 2);
    cpu::rope_inv_freq(inv_freq.data(), head_dim, 10000.0, cpu::RopeScaling{});
    std::vector<float> cos_f(seq * head_dim / 2), sin_f(seq * head_dim / 2);
    cpu::rope_table(cos_f.data(), sin_f.data(), inv_freq.data(), seq, head_dim);
    std::vector<int32_t> positions;
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t n : {int64_t{1}, int64_t{40}, int64_t{1}, int64_t{55}})
        for (int64_t i = 0; i < n; ++i) positions.push_back(static_cast<int32_t>(i));
    const std::vector<float> x = random_bf16_values(rng, count, -3, 3);
    DeviceBuffer<float> d_cos(cos_f), d_sin(sin_f);
    DeviceBuffer<int32_t> d_positions(positions);
    for (bool backward : {false, true}) {
      SCOPED_TRACE(backward ? "backward" : "forward");
      DeviceBf16 d_x(x);
      if (backward)
        cuda::rope_bwd(d_x.bf(), d_x.bf(), d_cos.get(), d_sin.get(), batch, seq, heads, head_dim, width, width,
                       d_positions.get(), nullptr);
      else
        cuda::rope_fwd(d_x.bf(), d_x.bf(), d_cos.get(), d_sin.get(), batch, seq, heads, head_dim, width, width,
                       d_positions.get(), nullptr);
      std::vector<double> ref(count), xd(x.begin(), x.end()), c(cos_f.begin(), cos_f.end()),
          s(sin_f.begin(), sin_f.end());
      (backward ? cpu::rope_bwd<double> : cpu::rope_fwd<double>)(ref.data(), xd.data(), c.data(), s.data(), batch,
                                                                 seq, heads, head_dim, width, width, positions.data());
      std::vector<double> naive(count);
      for (int64_t i = 0; i < count; ++i) naive[i] = round_bf16(ref[i]);
      expect_close_to_naive(backward ? "rope bwd, positions" : "rope fwd, positions", d_x.values(), naive, ref);
    }
  }
}

// Tables for head_dim at seq positions (default scaling), fp32 as the model uploads them.
void rope_tables(int64_t seq, int64_t head_dim, std::vector<float>& cos_f, std::vector<float>& sin_f) {
  std::vector<double> inv_freq(head_dim / 2);
  cpu::rope_inv_freq(inv_freq.data(), head_dim, 10000.0, cpu::RopeScaling{});
  cos_f.resize(seq * head_dim / 2), sin_f.resize(seq * head_dim / 2);
  cpu::rope_table(cos_f.data(), sin_f.data(), inv_freq.data(), seq, head_dim);
}

TEST(RopeGpu, StridedRowsMatchTheCpuTwin) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  struct Case {
    int64_t head_dim, heads, out_stride, inp_stride;
  };
  // The model's: q (32 heads of 64) read from q|k|v rows of 32 + 2 x 8 heads, k's gradient (8 heads of 128)
  // written into them; an odd stride off the 16-byte path; both strides wide; the pair kernel's head_dim 8.
  const Case cases[] = {{64, 32, 32 * 64, 48 * 64},   {128, 8, 48 * 128, 8 * 128}, {64, 3, 3 * 64 + 5, 3 * 64},
                        {128, 3, 4 * 128, 5 * 128 + 8}, {8, 3, 3 * 8 + 3, 5 * 8 + 1}};
  for (const Case& k : cases) {
    SCOPED_TRACE("head_dim " + std::to_string(k.head_dim) + ", heads " + std::to_string(k.heads) + ", strides " +
                 std::to_string(k.out_stride) + " / " + std::to_string(k.inp_stride));
    const int64_t batch = 2, seq = 37 + rng.integer(0, 20), positions = batch * seq, width = k.heads * k.head_dim;
    std::vector<float> cos_f, sin_f;
    rope_tables(seq, k.head_dim, cos_f, sin_f);
    const std::vector<float> x = random_bf16_values(rng, positions * k.inp_stride, -3, 3);
    DeviceBuffer<float> d_cos(cos_f), d_sin(sin_f);
    DeviceBf16 d_x(x);
    std::vector<double> xd(x.begin(), x.end()), c(cos_f.begin(), cos_f.end()), s(sin_f.begin(), sin_f.end());
    for (bool backward : {false, true}) {
      SCOPED_TRACE(backward ? "backward" : "forward");
      DeviceBf16 d_out(positions * k.out_stride);
      d_out.poison();
      (backward ? cuda::rope_bwd : cuda::rope_fwd)(d_out.bf(), d_x.bf(), d_cos.get(), d_sin.get(), batch, seq, k.heads,
                                                   k.head_dim, k.out_stride, k.inp_stride,
                                                   /*positions=*/nullptr, nullptr);
      std::vector<double> ref(positions * k.out_stride);
      (backward ? cpu::rope_bwd<double> : cpu::rope_fwd<double>)(ref.data(), xd.data(), c.data(), s.data(), batch, seq,
                                                                 k.heads, k.head_dim, k.out_stride, k.inp_stride,
                                                                 /*positions=*/nullptr);
      const std::vector<uint16_t> bits = d_out.download();
      std::vector<double> gpu(positions * width), rows(positions * width), naive(positions * width);
      int64_t gap_writes = 0;
      for (int64_t p = 0; p < positions; ++p)
        for (int64_t i = 0; i < k.out_stride; ++i) {
          const int64_t at = p * k.out_stride + i;
          if (i >= width) {
            gap_writes += bits[at] != 0xffff;
            continue;
          }
          gpu[p * width + i] = bf16_to_f32(bits[at]), rows[p * width + i] = ref[at];
          naive[p * width + i] = round_bf16(ref[at]);
        }
      EXPECT_EQ(gap_writes, 0) << "elements between the rows were written";
      expect_close_to_naive(backward ? "strided rope bwd" : "strided rope fwd", gpu, naive, rows);
    }
  }
}

}  // namespace
}  // namespace tuna::test
#endif  // TUNA_CUDA
