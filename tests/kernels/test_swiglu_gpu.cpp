// kernels/swiglu.cu against kernels/cpu/swiglu.cpp; n is not a multiple of the 8-wide vectors (tail path).
#if TUNA_CUDA
#include "kernels/cpu/swiglu.h"
#include "kernels/swiglu.cuh"
#include "tests/kernels/gpu_test_util.h"

namespace tuna::test {
namespace {

void check_swiglu(TestRng& rng, int64_t n) {
  SCOPED_TRACE("n " + std::to_string(n));
  std::vector<float> gate = random_bf16_values(rng, n, -6, 6), up = random_bf16_values(rng, n, -2, 2),
                     dout = random_bf16_values(rng, n);
  DeviceBf16 d_gate(gate), d_up(up), d_dout(dout), d_out(n), d_dgate(n), d_dup(n);
  d_out.poison(), d_dgate.poison(), d_dup.poison();
  cuda::swiglu_fwd(d_out.bf(), d_gate.bf(), d_up.bf(), n, nullptr);
  cuda::swiglu_bwd(d_dgate.bf(), d_dup.bf(), d_dout.bf(), d_gate.bf(), d_up.bf(), n, nullptr);
  std::vector<double> g(gate.begin(), gate.end()), u(up.begin(), up.end()), d(dout.begin(), dout.end());
  std::vector<double> out(n), dg(n), du(n);
  cpu::swiglu_fwd(out.data(), g.data(), u.data(), n);
  cpu::swiglu_bwd(dg.data(), du.data(), d.data(), g.data(), u.data(), n);
  std::vector<double> n_out(n), n_dg(n), n_du(n);
  for (int64_t i = 0; i < n; ++i) n_out[i] = round_bf16(out[i]), n_dg[i] = round_bf16(dg[i]), n_du[i] = round_bf16(du[i]);
  expect_close_to_naive("swiglu out", d_out.values(), n_out, out);
  expect_close_to_naive("swiglu dgate", d_dgate.values(), n_dg, dg);
  expect_close_to_naive("swiglu dup", d_dup.values(), n_du, du);
}

TEST(SwigluGpu, ForwardAndBackward) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  check_swiglu(rng, 100003 + rng.integer(0, 6));
  // Three rows of LLaMA-2/3 70B's ffn width (28672), and sizes below one vector and one block of vectors.
  check_swiglu(rng, 3 * 28672);
  check_swiglu(rng, 5);
  check_swiglu(rng, 8 * 1000 + 3);
}

}  // namespace
}  // namespace tuna::test
#endif  // TUNA_CUDA
