// GEMM TFLOP/s through kernels/matmul (cuBLASLt, bf16 in, fp32 accumulate) at the linear layers of LLaMA
// 3.2-1B, 3-8B and 2-70B for 8192 tokens as the GPU model runs them: o (C -> C), the fused q|k|v (C -> C + 2
// kv_dim), the fused gate|up (C -> 2F), down (F -> C); forward, input gradient and (fp32-accumulated) weight
// gradient. `of_peak`: fraction of the dense bf16 peak.
// Each shape twice: with the algorithm the trainer uses (the heuristic's first answer, `first`), and with the
// fastest of the heuristic's first 8 timed in place (`best of 8`, MatmulContext::set_timed_candidates): the
// gain a timed choice would bring, measured before building one into the trainer.
#include "bench/gpu_bench_util.h"
#include "kernels/matmul.cuh"

namespace tuna::bench {
namespace {

constexpr int64_t kTokens = 8192;

constexpr int kTimedCandidates = 8;

cuda::MatmulContext& context(bool timed) {
  static cuda::MatmulContext first;
  static cuda::MatmulContext best;
  static const bool best_set = (best.set_timed_candidates(kTimedCandidates), true);
  (void)best_set;
  return timed ? best : first;
}

// pass 0: forward, 1: dinp, 2: dweight; timed 0: the heuristic's first algorithm, 1: the fastest of its first 8
void BM_Gemm(benchmark::State& state) {
  const int64_t ic = state.range(0), oc = state.range(1), pass = state.range(2), n = kTokens;
  cuda::MatmulContext& ctx = context(state.range(3) != 0);
  DeviceMemory inp(n * ic * 2), w(oc * ic * 2), out(n * oc * 2), dinp(n * ic * 2), dw(oc * ic * 4);
  fill_random_bf16(inp.as<__nv_bfloat16>(), n * ic, 1);
  fill_random_bf16(w.as<__nv_bfloat16>(), oc * ic, 2, 0.02f);
  fill_random_bf16(out.as<__nv_bfloat16>(), n * oc, 3);
  TUNA_CUDA_CHECK(cudaMemset(dw.ptr, 0, oc * ic * 4));
  cudaStream_t stream = nullptr;
  run_timed(state, stream, [&] {
    if (pass == 0)
      cuda::matmul_fwd(ctx, out.as<__nv_bfloat16>(), inp.as<__nv_bfloat16>(), w.as<__nv_bfloat16>(), n, ic, oc,
                       stream);
    else if (pass == 1)
      cuda::matmul_bwd(ctx, dinp.as<__nv_bfloat16>(), nullptr, out.as<__nv_bfloat16>(), inp.as<__nv_bfloat16>(),
                       w.as<__nv_bfloat16>(), n, ic, oc, /*accumulate_dinp=*/false, GradWrite::Accumulate, stream);
    else  // accumulating (beta = 1: C read), as every micro-batch of a step after its first
      cuda::matmul_bwd(ctx, nullptr, dw.as<float>(), out.as<__nv_bfloat16>(), inp.as<__nv_bfloat16>(),
                       w.as<__nv_bfloat16>(), n, ic, oc, /*accumulate_dinp=*/false, GradWrite::Accumulate, stream);
  });
  const double flops = 2.0 * n * ic * oc;
  state.counters["TFLOP/s"] = rate(flops / 1e12);
  state.counters["of_peak"] = rate(flops / gpu_peak_bf16_flops());
  static const char* kPass[] = {"fwd", "dinp", "dweight"};
  state.SetLabel(std::string(kPass[pass]) + " " + std::to_string(n) + "x" + std::to_string(ic) + " -> " +
                 std::to_string(oc) + (state.range(3) ? " best of " + std::to_string(kTimedCandidates) : " first"));
}

// {in, out} per model: 1B (C 2048, kv 512, F 8192), 8B (C 4096, kv 1024, F 14336), 70B (C 8192, kv 1024, F 28672);
// outs C (o_proj), C + 2 kv (q|k|v), 2F (gate|up).
BENCHMARK(BM_Gemm)
    ->ArgNames({"ic", "oc", "pass", "timed"})
    ->ArgsProduct({{2048}, {2048, 3072, 16384}, {0, 1, 2}, {0, 1}})
    ->ArgsProduct({{8192}, {2048}, {0, 1, 2}, {0, 1}})
    ->ArgsProduct({{4096}, {4096, 6144, 28672}, {0, 1, 2}, {0, 1}})
    ->ArgsProduct({{14336}, {4096}, {0, 1, 2}, {0, 1}})
    ->ArgsProduct({{8192}, {8192, 10240, 57344}, {0, 1, 2}, {0, 1}})
    ->ArgsProduct({{28672}, {8192}, {0, 1, 2}, {0, 1}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.1);

}  // namespace
}  // namespace tuna::bench

TUNA_GPU_BENCH_MAIN((void)0)
