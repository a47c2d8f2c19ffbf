// GEMM TFLOP/s through kernels/matmul (cuBLASLt, bf16 in, fp32 accumulate) at the linear layers of LLaMA
// 3.2-1B, 3-8B and 2-70B for 8192 tokens as the GPU model runs them: o (C -> C), the fused q|k|v (C -> C + 2
// kv_dim), the fused gate|up (C -> 2F), down (F -> C); forward, input gradient and (fp32-accumulated) weight
// gradient. `of_peak`: fraction of the dense bf16 peak. BM_GemmAdapter: the LoRA adapters' rank-16 products.
// Each shape twice: with the algorithm the trainer uses (the heuristic's first answer, `first`), and with the
// fastest of the heuristic's first 8 timed in place (`best of 8`, MatmulContext::set_timed_candidates): the
// gain a timed choice would bring, measured before building one into the trainer.
// BM_GemmFp8: the same products with FP8 operands (--fp8 tensorwise: e4m3 x e4m3 forward with fast accumulation,
// e5m2 gradients), at the 8B and 70B shapes, against the dense FP8 peak (twice bf16's on Hopper): the planner's FP8
// rates (plan/plan_rates.json, gemm_fp8). BM_Fp8Cast: the casts around them (amax, then the bf16 -> FP8 cast with
// its transpose), GB/s moved against the copy bandwidth.
#include "bench/gpu_bench_util.h"
#include "kernels/fp8.cuh"
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

// The adapters' rank-16 products as the GPU model runs them (model/llama_gpu_lora.cpp: each target's own): the
// down-projection A x (in -> r) and the up-projection B u (r -> out), each forward, input gradient and weight
// gradient, at the 8B and 70B layers' inputs and outputs. Skinny GEMMs move more bytes than they compute: the
// planner prices adapters at these measured rates (plan/plan_rates.json, gemm_adapter), not at the layer GEMMs'.
void BM_GemmAdapter(benchmark::State& state) { BM_Gemm(state); }
BENCHMARK(BM_GemmAdapter)
    ->ArgNames({"ic", "oc", "pass", "timed"})
    ->ArgsProduct({{4096, 14336}, {16}, {0, 1, 2}, {0}})
    ->ArgsProduct({{16}, {1024, 4096, 14336}, {0, 1, 2}, {0}})
    ->ArgsProduct({{8192, 28672}, {16}, {0, 1, 2}, {0}})
    ->ArgsProduct({{16}, {8192, 28672}, {0, 1, 2}, {0}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.1);

// pass 0: forward, 1: dinp, 2: dweight, as BM_Gemm, with FP8 codes already cast (the casts: BM_Fp8Cast); the
// heuristic's first algorithm, as the trainer runs it. The scales are those of real casts of random data.
void BM_GemmFp8(benchmark::State& state) {
  const int64_t ic = state.range(0), oc = state.range(1), pass = state.range(2), n = kTokens;
  cuda::MatmulContext& ctx = context(/*timed=*/false);
  DeviceMemory x(n * ic * 2), w(oc * ic * 2), g(n * oc * 2), x_q(n * ic), x_t(n * ic), w_q(oc * ic), w_t(oc * ic),
      g_q(n * oc), g_t(n * oc), out(n * oc * 2), dinp(n * ic * 2), dw(oc * ic * 4), scales(24 * sizeof(float));
  fill_random_bf16(x.as<__nv_bfloat16>(), n * ic, 1);
  fill_random_bf16(w.as<__nv_bfloat16>(), oc * ic, 2, 0.02f);
  fill_random_bf16(g.as<__nv_bfloat16>(), n * oc, 3, 1e-3f);
  TUNA_CUDA_CHECK(cudaMemset(dw.ptr, 0, oc * ic * 4));
  TUNA_CUDA_CHECK(cudaMemset(scales.ptr, 0, 24 * sizeof(float)));
  // The amaxes, then the scales 16 bytes apart (cuBLASLt's FP8 GEMMs read each scale 16-byte aligned).
  float* amax = scales.as<float>();
  float* const inv_x = amax + 4, *const inv_w = amax + 8, *const inv_g = amax + 12;
  cudaStream_t stream = nullptr;
  cuda::fp8_amax(amax, x.as<__nv_bfloat16>(), n, ic, ic, stream);
  cuda::fp8_amax(amax + 1, w.as<__nv_bfloat16>(), oc, ic, ic, stream);
  cuda::fp8_amax(amax + 2, g.as<__nv_bfloat16>(), n, oc, oc, stream);
  cuda::fp8_cast_transpose(x_q.as<uint8_t>(), x_t.as<uint8_t>(), inv_x, x.as<__nv_bfloat16>(), n, ic, ic, amax,
                           cuda::Fp8Format::E4M3, stream);
  cuda::fp8_cast_transpose(w_q.as<uint8_t>(), w_t.as<uint8_t>(), inv_w, w.as<__nv_bfloat16>(), oc, ic, ic, amax + 1,
                           cuda::Fp8Format::E4M3, stream);
  cuda::fp8_cast_transpose(g_q.as<uint8_t>(), g_t.as<uint8_t>(), inv_g, g.as<__nv_bfloat16>(), n, oc, oc, amax + 2,
                           cuda::Fp8Format::E5M2, stream);
  const cuda::Fp8Operand X{x_q.as<uint8_t>(), inv_x}, XT{x_t.as<uint8_t>(), inv_x}, W{w_q.as<uint8_t>(), inv_w},
      WT{w_t.as<uint8_t>(), inv_w}, G{g_q.as<uint8_t>(), inv_g}, GT{g_t.as<uint8_t>(), inv_g};
  run_timed(state, stream, [&] {
    if (pass == 0)
      cuda::matmul_fp8_fwd(ctx, out.as<__nv_bfloat16>(), X, W, n, ic, oc, stream);
    else if (pass == 1)
      cuda::matmul_fp8_bwd(ctx, dinp.as<__nv_bfloat16>(), nullptr, G, GT, XT, WT, n, ic, oc, /*accumulate_dinp=*/false,
                           GradWrite::Accumulate, stream);
    else  // accumulating, as BM_Gemm's
      cuda::matmul_fp8_bwd(ctx, nullptr, dw.as<float>(), G, GT, XT, WT, n, ic, oc, /*accumulate_dinp=*/false,
                           GradWrite::Accumulate, stream);
  });
  const double flops = 2.0 * n * ic * oc;
  state.counters["TFLOP/s"] = rate(flops / 1e12);
  state.counters["of_peak"] = rate(flops / (2 * gpu_peak_bf16_flops()));  // Hopper's dense FP8 peak
  static const char* kPass[] = {"fwd", "dinp", "dweight"};
  state.SetLabel(std::string("fp8 ") + kPass[pass] + " " + std::to_string(n) + "x" + std::to_string(ic) + " -> " +
                 std::to_string(oc));
}

BENCHMARK(BM_GemmFp8)
    ->ArgNames({"ic", "oc", "pass"})
    ->ArgsProduct({{4096}, {4096, 6144, 28672}, {0, 1, 2}})
    ->ArgsProduct({{14336}, {4096}, {0, 1, 2}})
    ->ArgsProduct({{8192}, {8192, 10240, 57344}, {0, 1, 2}})
    ->ArgsProduct({{28672}, {8192}, {0, 1, 2}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.1);

// One GEMM operand's casts, as the trainer runs them: its amax (a pass of its own here; the producers of most
// activations fold it in), then the cast to row-major codes and their transpose. Bytes: 2 read by the amax, 2 read
// and 2 written (the two layouts) by the cast, an element.
void BM_Fp8Cast(benchmark::State& state) {
  const int64_t rows = state.range(0), cols = state.range(1);
  DeviceMemory x(rows * cols * 2), q(rows * cols), t(rows * cols), scales(2 * sizeof(float));
  fill_random_bf16(x.as<__nv_bfloat16>(), rows * cols, 4);
  cudaStream_t stream = nullptr;
  float* amax = scales.as<float>();
  run_timed(state, stream, [&] {
    TUNA_CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float), stream));
    cuda::fp8_amax(amax, x.as<__nv_bfloat16>(), rows, cols, cols, stream);
    cuda::fp8_cast_transpose(q.as<uint8_t>(), t.as<uint8_t>(), amax + 1, x.as<__nv_bfloat16>(), rows, cols, cols, amax,
                             cuda::Fp8Format::E4M3, stream);
  });
  const double bytes = 6.0 * double(rows) * double(cols);
  state.counters["GB/s"] = rate(bytes / 1e9);
  state.SetLabel("fp8 amax + cast_transpose " + std::to_string(rows) + "x" + std::to_string(cols));
}

BENCHMARK(BM_Fp8Cast)
    ->ArgNames({"rows", "cols"})
    ->Args({kTokens, 4096})
    ->Args({kTokens, 8192})
    ->Args({kTokens, 28672})
    ->Args({8192, 28672})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.1);

}  // namespace
}  // namespace tuna::bench

TUNA_GPU_BENCH_MAIN((void)0)
