// kernels/swiglu.cu against kernels/cpu/swiglu.cpp on fresh random inputs: contiguous sizes that are not a
// multiple of the 8-wide vectors (tail path), the model's fused gate|up rows (up = gate + cols, stride 2 cols,
// backward in place), strides wider than that, and strides or widths off the 16-byte path (element-wise).
#if TUNA_CUDA
#include "kernels/cpu/fp8.h"
#include "kernels/cpu/swiglu.h"
#include "kernels/swiglu.cuh"
#include "tests/kernels/gpu_test_util.h"

namespace tuna::test {
namespace {

struct SwigluCase {
  int64_t rows, cols, stride;
  bool in_place;  // the backward writes dgate over gate and dup over up
};

// Elements of a [rows, stride] buffer past each row's first `written` columns that differ from before the call.
int64_t gap_changes(const std::vector<uint16_t>& before, const std::vector<uint16_t>& after, int64_t rows,
                    int64_t stride, int64_t written) {
  int64_t changes = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = written; c < stride; ++c) changes += before[r * stride + c] != after[r * stride + c];
  return changes;
}

void check_swiglu(TestRng& rng, const SwigluCase& sc) {
  const auto [rows, cols, stride, in_place] = sc;
  SCOPED_TRACE("rows " + std::to_string(rows) + ", cols " + std::to_string(cols) + ", stride " +
               std::to_string(stride) + (in_place ? ", in place" : ""));
  // gate and up in one strided buffer when a row holds both (the fused layout), else one buffer each; random
  // values in the gaps too, which no call may change.
  const bool fused = stride >= 2 * cols;
  const int64_t n = rows * cols, span = rows * stride;
  std::vector<float> gate_host = random_bf16_values(rng, span, -6, 6), up_host = random_bf16_values(rng, span, -2, 2);
  std::vector<float> dout = random_bf16_values(rng, n);
  if (fused)
    for (int64_t r = 0; r < rows; ++r)
      std::copy(up_host.begin() + r * stride, up_host.begin() + r * stride + cols,
                gate_host.begin() + r * stride + cols);
  DeviceBf16 d_gate(gate_host), d_up_own(up_host), d_dout(dout), d_out(n), d_dgate(span), d_dup(span);
  __nv_bfloat16* gate = d_gate.bf();
  __nv_bfloat16* up = fused ? gate + cols : d_up_own.bf();
  const std::vector<uint16_t> gate_bits = d_gate.download(), up_bits = d_up_own.download();
  d_out.poison(), d_dgate.poison(), d_dup.poison();
  cuda::swiglu_fwd(d_out.bf(), gate, up, rows, cols, stride, nullptr);
  __nv_bfloat16* dgate = in_place ? gate : d_dgate.bf();
  __nv_bfloat16* dup = in_place ? up : d_dup.bf();
  cuda::swiglu_bwd(dgate, dup, d_dout.bf(), gate, up, rows, cols, stride, nullptr);

  // The reference: the CPU twin in double on the contiguous values.
  std::vector<double> g(n), u(n), d(dout.begin(), dout.end());
  const std::vector<float>& up_source = fused ? gate_host : up_host;
  const int64_t up_offset = fused ? cols : 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      g[r * cols + c] = gate_host[r * stride + c], u[r * cols + c] = up_source[r * stride + up_offset + c];
  std::vector<double> out(n), dg(n), du(n);
  cpu::swiglu_fwd(out.data(), g.data(), u.data(), rows, cols, cols);
  cpu::swiglu_bwd(dg.data(), du.data(), d.data(), g.data(), u.data(), rows, cols, cols);
  std::vector<double> n_out(n), n_dg(n), n_du(n);
  for (int64_t i = 0; i < n; ++i)
    n_out[i] = round_bf16(out[i]), n_dg[i] = round_bf16(dg[i]), n_du[i] = round_bf16(du[i]);

  // The GPU's strided results, gathered; every element of a written buffer outside its rows' columns unchanged.
  const std::vector<uint16_t> dgate_bits = in_place ? d_gate.download() : d_dgate.download();
  const std::vector<uint16_t> dup_bits = !in_place ? d_dup.download() : fused ? dgate_bits : d_up_own.download();
  const int64_t dup_offset = in_place && fused ? cols : 0;
  std::vector<uint16_t> gpu_dg(n), gpu_du(n);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      gpu_dg[r * cols + c] = dgate_bits[r * stride + c], gpu_du[r * cols + c] = dup_bits[r * stride + dup_offset + c];
  const std::vector<uint16_t> poisoned(span, 0xffff);
  if (in_place && fused) {
    EXPECT_EQ(gap_changes(gate_bits, dgate_bits, rows, stride, 2 * cols), 0);
  } else {
    EXPECT_EQ(gap_changes(in_place ? gate_bits : poisoned, dgate_bits, rows, stride, cols), 0);
    EXPECT_EQ(gap_changes(in_place ? up_bits : poisoned, dup_bits, rows, stride, cols), 0);
  }
  expect_close_to_naive("swiglu out", d_out.values(), n_out, out);
  expect_close_to_naive("swiglu dgate", bf16_bits_to_double(gpu_dg), n_dg, dg);
  expect_close_to_naive("swiglu dup", bf16_bits_to_double(gpu_du), n_du, du);
}

TEST(SwigluGpu, ForwardAndBackward) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  // Contiguous: one long row, tails of n % 8.
  const int64_t odd = 100003 + rng.integer(0, 6);
  check_swiglu(rng, {1, odd, odd, false});
  check_swiglu(rng, {3, 28672, 28672, false});  // three rows of LLaMA-2/3 70B's ffn width
  check_swiglu(rng, {1, 5, 5, false});
  check_swiglu(rng, {1, 8 * 1000 + 3, 8 * 1000 + 3, false});
  // The model's fused gate|up rows, backward in place (and out of place).
  check_swiglu(rng, {3, 28672, 2 * 28672, true});
  const int64_t width = 8 * (100 + rng.integer(0, 30));
  check_swiglu(rng, {37, width, 2 * width, true});
  check_swiglu(rng, {37, 1024, 2048, false});
  // Wider strides on the 16-byte path, then off it: an odd stride, a width not a multiple of 8.
  check_swiglu(rng, {9, 64, 136, true});
  check_swiglu(rng, {13, 40, 83 + 2 * rng.integer(0, 10), true});
  check_swiglu(rng, {11, 37, 80, false});
  check_swiglu(rng, {7, 40, 41, false});  // gate and up in buffers of their own, stride just over cols
}

// The _amax variants (FP8 training): the same bits as the plain kernels, and the amax of what they stored (the
// twin: cpu::fp8_amax over the downloaded values; the backward's over dgate and dup together), folded onto a running
// value, on the vector path with its tail, on the fused gate|up rows and element-wise.
TEST(SwigluGpu, AmaxVariantsStoreTheSameBitsAndFoldTheirOutputsAmax) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  for (const SwigluCase& sc : {SwigluCase{1, 8 * 500 + 5, 8 * 500 + 5, false}, SwigluCase{19, 96, 192, false},
                               SwigluCase{11, 37, 80, false}}) {
    const auto [rows, cols, stride, in_place] = sc;
    SCOPED_TRACE("rows " + std::to_string(rows) + ", cols " + std::to_string(cols) + ", stride " + std::to_string(stride));
    const int64_t span = rows * stride, n = rows * cols;
    const std::vector<float> gate = random_bf16_values(rng, span, -6, 6), up = random_bf16_values(rng, span, -3, 3);
    const std::vector<float> dout = random_bf16_values(rng, n, -2, 2);
    DeviceBf16 d_gate(gate), d_up(up), d_dout(dout), out(n), out_amax(n), dg(span), du(span), dg_amax(span),
        du_amax(span);
    for (DeviceBf16* b : {&dg, &du, &dg_amax, &du_amax}) b->poison();
    DeviceBuffer<float> fwd_amax(std::vector<float>{0.25f}), bwd_amax(std::vector<float>{0.0f});
    cuda::swiglu_fwd(out.bf(), d_gate.bf(), d_up.bf(), rows, cols, stride, nullptr);
    cuda::swiglu_fwd_amax(out_amax.bf(), d_gate.bf(), d_up.bf(), rows, cols, stride, fwd_amax.get(), nullptr);
    cuda::swiglu_bwd(dg.bf(), du.bf(), d_dout.bf(), d_gate.bf(), d_up.bf(), rows, cols, stride, nullptr);
    cuda::swiglu_bwd_amax(dg_amax.bf(), du_amax.bf(), d_dout.bf(), d_gate.bf(), d_up.bf(), rows, cols, stride,
                          bwd_amax.get(), nullptr);
    EXPECT_TRUE(bitwise_equal(out.download(), out_amax.download()));
    EXPECT_TRUE(bitwise_equal(dg.download(), dg_amax.download()));
    EXPECT_TRUE(bitwise_equal(du.download(), du_amax.download()));
    const auto as_float = [](const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); };
    float expected = 0.25f;
    cpu::fp8_amax(&expected, as_float(out.values()).data(), rows, cols, cols);
    EXPECT_EQ(fwd_amax.download()[0], expected);
    expected = 0.0f;
    cpu::fp8_amax(&expected, as_float(dg.values()).data(), rows, cols, stride);
    cpu::fp8_amax(&expected, as_float(du.values()).data(), rows, cols, stride);
    EXPECT_EQ(bwd_amax.download()[0], expected);
  }
}

}  // namespace
}  // namespace tuna::test
#endif  // TUNA_CUDA
