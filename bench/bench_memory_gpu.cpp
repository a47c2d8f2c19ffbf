// Memory-bound kernels' achieved GB/s against a device-to-device copy measured first in the same run
// (`of_copy`), at LLaMA-3-8B activation sizes for 16k tokens. Bytes are the fewest each kernel must move (each
// input read once, each output written once); the copy counts bytes read plus bytes written.
#include <string>

#include "bench/gpu_bench_util.h"
#include "kernels/adamw.cuh"
#include "kernels/rmsnorm.cuh"
#include "kernels/rope.cuh"
#include "kernels/swiglu.cuh"

namespace tuna::bench {
namespace {

constexpr int64_t kTokens = 16384, kHidden = 4096, kFfn = 14336, kHeads = 32, kHeadDim = 128;
double g_copy_bytes_per_s = 0;  // set by measure_copy_once, before any benchmark runs

void report(benchmark::State& state, double bytes) {
  state.counters["GB/s"] = rate(bytes / 1e9);
  if (g_copy_bytes_per_s > 0) state.counters["of_copy"] = rate(bytes / g_copy_bytes_per_s);
}

void BM_Copy(benchmark::State& state) {
  const size_t bytes = size_t(2) << 30;
  DeviceMemory a(bytes), b(bytes);
  TUNA_CUDA_CHECK(cudaMemset(a.ptr, 1, bytes));
  run_timed(state, nullptr, [&] { TUNA_CUDA_CHECK(cudaMemcpyAsync(b.ptr, a.ptr, bytes, cudaMemcpyDeviceToDevice)); });
  report(state, 2.0 * double(bytes));
}

// Google Benchmark gives a benchmark no access to its own rate, so the copy is timed once more here, directly.
void measure_copy_once() {
  const size_t bytes = size_t(2) << 30;
  DeviceMemory a(bytes), b(bytes);
  TUNA_CUDA_CHECK(cudaMemset(a.ptr, 1, bytes));
  cudaEvent_t start, stop;
  TUNA_CUDA_CHECK(cudaEventCreate(&start));
  TUNA_CUDA_CHECK(cudaEventCreate(&stop));
  TUNA_CUDA_CHECK(cudaMemcpy(b.ptr, a.ptr, bytes, cudaMemcpyDeviceToDevice));
  float best = 1e30f;
  for (int i = 0; i < 10; ++i) {
    TUNA_CUDA_CHECK(cudaEventRecord(start));
    TUNA_CUDA_CHECK(cudaMemcpyAsync(b.ptr, a.ptr, bytes, cudaMemcpyDeviceToDevice));
    TUNA_CUDA_CHECK(cudaEventRecord(stop));
    TUNA_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    TUNA_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    best = std::min(best, ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  g_copy_bytes_per_s = 2.0 * double(bytes) / (best * 1e-3);
  std::printf("device-to-device copy: %.0f GB/s (read + write, best of 10 x 2 GiB)\n", g_copy_bytes_per_s / 1e9);
}

// RMSNorm at the hidden sizes of LLaMA 1B / 8B / 70B / 405B (state.range(0)), 16k tokens.
void BM_RmsNormFwd(benchmark::State& state) {
  const int64_t n = kTokens, dim = state.range(0);
  DeviceMemory x(n * dim * 2), w(dim * 2), out(n * dim * 2), rstd(n * 4);
  fill_random_bf16(x.as<__nv_bfloat16>(), n * dim, 1);
  fill_random_bf16(w.as<__nv_bfloat16>(), dim, 2);
  run_timed(state, nullptr, [&] {
    cuda::rmsnorm_fwd(out.as<__nv_bfloat16>(), rstd.as<float>(), nullptr, x.as<__nv_bfloat16>(), nullptr,
                      w.as<__nv_bfloat16>(), n, dim, 1e-5, nullptr);
  });
  report(state, 2.0 * n * dim * 2 + n * 4.0);
  state.SetLabel("dim " + std::to_string(dim));  // gpu-check's table names a row by its label
}

void BM_RmsNormBwd(benchmark::State& state) {
  const int64_t n = kTokens, dim = state.range(0);
  DeviceMemory x(n * dim * 2), w(dim * 2), g(n * dim * 2), dx(n * dim * 2), rstd(n * 4), dw(dim * 4),
      scratch(cuda::rmsnorm_bwd_scratch_floats(n, dim) * 4);
  fill_random_bf16(x.as<__nv_bfloat16>(), n * dim, 1);
  fill_random_bf16(g.as<__nv_bfloat16>(), n * dim, 2);
  fill_random_bf16(dx.as<__nv_bfloat16>(), n * dim, 3);
  fill_random_bf16(w.as<__nv_bfloat16>(), dim, 4);
  cuda::fill_constant(rstd.as<float>(), n, 1.0f, nullptr);
  cuda::fill_constant(dw.as<float>(), dim, 0.0f, nullptr);
  run_timed(state, nullptr, [&] {
    cuda::rmsnorm_bwd(dx.as<__nv_bfloat16>(), dw.as<float>(), g.as<__nv_bfloat16>(), x.as<__nv_bfloat16>(),
                      w.as<__nv_bfloat16>(), rstd.as<float>(), scratch.as<float>(), n, dim, nullptr);
  });
  report(state, 4.0 * n * dim * 2);  // read x, dout, dinp; write dinp
  state.SetLabel("dim " + std::to_string(dim));
}

void BM_Rope(benchmark::State& state) {
  const int64_t seq = 4096, batch = kTokens / seq, count = kTokens * kHeads * kHeadDim;
  DeviceMemory x(count * 2), cos_t(seq * kHeadDim / 2 * 4), sin_t(seq * kHeadDim / 2 * 4);
  fill_random_bf16(x.as<__nv_bfloat16>(), count, 1);
  cuda::fill_normal(cos_t.as<float>(), seq * kHeadDim / 2, 2, 0.5f, nullptr);
  cuda::fill_normal(sin_t.as<float>(), seq * kHeadDim / 2, 3, 0.5f, nullptr);
  run_timed(state, nullptr, [&] {
    cuda::rope_fwd(x.as<__nv_bfloat16>(), x.as<__nv_bfloat16>(), cos_t.as<float>(), sin_t.as<float>(), batch, seq,
                   kHeads, kHeadDim, nullptr);
  });
  report(state, 2.0 * count * 2);
}

void BM_SwigluFwd(benchmark::State& state) {
  const int64_t n = kTokens * kFfn;
  DeviceMemory gate(n * 2), up(n * 2), out(n * 2);
  fill_random_bf16(gate.as<__nv_bfloat16>(), n, 1);
  fill_random_bf16(up.as<__nv_bfloat16>(), n, 2);
  run_timed(state, nullptr,
            [&] { cuda::swiglu_fwd(out.as<__nv_bfloat16>(), gate.as<__nv_bfloat16>(), up.as<__nv_bfloat16>(), n, nullptr); });
  report(state, 3.0 * n * 2);
}

void BM_SwigluBwd(benchmark::State& state) {
  const int64_t n = kTokens * kFfn;
  DeviceMemory gate(n * 2), up(n * 2), dout(n * 2), dgate(n * 2), dup(n * 2);
  fill_random_bf16(gate.as<__nv_bfloat16>(), n, 1);
  fill_random_bf16(up.as<__nv_bfloat16>(), n, 2);
  fill_random_bf16(dout.as<__nv_bfloat16>(), n, 3);
  run_timed(state, nullptr, [&] {
    cuda::swiglu_bwd(dgate.as<__nv_bfloat16>(), dup.as<__nv_bfloat16>(), dout.as<__nv_bfloat16>(),
                     gate.as<__nv_bfloat16>(), up.as<__nv_bfloat16>(), n, nullptr);
  });
  report(state, 5.0 * n * 2);
}

// AdamW over 1B parameters in one launch (8 segments alternating decay), fp32 or bf16 moments.
void BM_AdamW(benchmark::State& state) {
  const bool bf16_moments = state.range(0) != 0;
  const int64_t n = int64_t(1) << 30;
  const int64_t moment_bytes = bf16_moments ? 2 : 4;
  DeviceMemory master(n * 4), grad(n * 4), m(n * moment_bytes), v(n * moment_bytes), param(n * 2);
  cuda::fill_normal(master.as<float>(), n, 1, 0.02f, nullptr);
  cuda::fill_normal(grad.as<float>(), n, 2, 1e-3f, nullptr);
  TUNA_CUDA_CHECK(cudaMemset(m.ptr, 0, n * moment_bytes));
  TUNA_CUDA_CHECK(cudaMemset(v.ptr, 0, n * moment_bytes));
  std::vector<int64_t> starts;
  std::vector<uint8_t> decays;
  for (int s = 0; s < 8; ++s) starts.push_back(s * (n / 8)), decays.push_back(s % 2);
  DeviceMemory d_starts(starts.size() * 8), d_decays(decays.size());
  TUNA_CUDA_CHECK(cudaMemcpy(d_starts.ptr, starts.data(), starts.size() * 8, cudaMemcpyHostToDevice));
  TUNA_CUDA_CHECK(cudaMemcpy(d_decays.ptr, decays.data(), decays.size(), cudaMemcpyHostToDevice));
  const cuda::AdamWSegments seg{d_starts.as<int64_t>(), d_decays.as<uint8_t>(), 8};
  int64_t step = 0;
  run_timed(state, nullptr, [&] {
    const cuda::AdamWArgs args{1e-4, 0.9, 0.95, 1e-8, 0.1, ++step, 1.0, bf16_moments, 7u};
    if (bf16_moments)
      cuda::adamw_update(master.as<float>(), param.as<__nv_bfloat16>(), grad.as<float>(), m.as<__nv_bfloat16>(),
                         v.as<__nv_bfloat16>(), n, seg, args, nullptr);
    else
      cuda::adamw_update(master.as<float>(), param.as<__nv_bfloat16>(), grad.as<float>(), m.as<float>(), v.as<float>(),
                         n, seg, args, nullptr);
  });
  // grad read; master, m, v read and written; bf16 params written.
  report(state, double(n) * (4 + 2 * 4 + 4 * moment_bytes + 2));
  state.SetLabel(bf16_moments ? "bf16 moments, stochastic rounding" : "fp32 moments");
}

BENCHMARK(BM_Copy)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.2);
BENCHMARK(BM_RmsNormFwd)->ArgName("dim")->Arg(2048)->Arg(4096)->Arg(8192)->Arg(16384)->UseManualTime()
    ->Unit(benchmark::kMicrosecond)->MinTime(0.2);
BENCHMARK(BM_RmsNormBwd)->ArgName("dim")->Arg(2048)->Arg(4096)->Arg(8192)->Arg(16384)->UseManualTime()
    ->Unit(benchmark::kMicrosecond)->MinTime(0.2);
BENCHMARK(BM_Rope)->UseManualTime()->Unit(benchmark::kMicrosecond)->MinTime(0.2);
BENCHMARK(BM_SwigluFwd)->UseManualTime()->Unit(benchmark::kMicrosecond)->MinTime(0.2);
BENCHMARK(BM_SwigluBwd)->UseManualTime()->Unit(benchmark::kMicrosecond)->MinTime(0.2);
BENCHMARK(BM_AdamW)->Arg(0)->Arg(1)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.3);

}  // namespace
}  // namespace tuna::bench

TUNA_GPU_BENCH_MAIN(tuna::bench::measure_copy_once())
