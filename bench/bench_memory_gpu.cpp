// Memory-bound kernels' achieved GB/s against a device-to-device copy measured first in the same run
// (`of_copy`), at LLaMA-3-8B activation sizes for 16k tokens (RMSNorm at the 1B-405B hidden sizes, the
// classifier over one lm_head chunk of a 128k vocabulary). Bytes are the fewest each kernel must move (each
// input read once, each output written once); the copy counts bytes read plus bytes written. The aim is
// >= 85% of the copy for every row.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "bench/gpu_bench_util.h"
#include "kernels/adamw.cuh"
#include "kernels/classifier.cuh"
#include "kernels/embedding.cuh"
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
    cuda::rmsnorm_fwd(out.as<__nv_bfloat16>(), rstd.as<float>(), x.as<__nv_bfloat16>(), w.as<__nv_bfloat16>(), n, dim,
                      1e-5, nullptr);
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
                      w.as<__nv_bfloat16>(), rstd.as<float>(), scratch.as<float>(), n, dim, GradWrite::Accumulate,
                      nullptr);
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
                   kHeads, kHeadDim, kHeads * kHeadDim, kHeads * kHeadDim, /*positions=*/nullptr, nullptr);
  });
  report(state, 2.0 * count * 2);
}

// SwiGLU as the model runs it: gate and up the two halves of the fused gate|up GEMM output [tokens, 2 ffn].
void BM_SwigluFwd(benchmark::State& state) {
  const int64_t n = kTokens * kFfn;
  DeviceMemory gate_up(2 * n * 2), out(n * 2);
  __nv_bfloat16* gate = gate_up.as<__nv_bfloat16>();
  fill_random_bf16(gate, 2 * n, 1);
  run_timed(state, nullptr,
            [&] { cuda::swiglu_fwd(out.as<__nv_bfloat16>(), gate, gate + kFfn, kTokens, kFfn, 2 * kFfn, nullptr); });
  report(state, 3.0 * n * 2);
}

// In place over gate|up, as the model's backward writes d_gate|d_up.
void BM_SwigluBwd(benchmark::State& state) {
  const int64_t n = kTokens * kFfn;
  DeviceMemory gate_up(2 * n * 2), dout(n * 2);
  __nv_bfloat16* gate = gate_up.as<__nv_bfloat16>();
  fill_random_bf16(gate, 2 * n, 1);
  fill_random_bf16(dout.as<__nv_bfloat16>(), n, 3);
  run_timed(state, nullptr, [&] {
    cuda::swiglu_bwd(gate, gate + kFfn, dout.as<__nv_bfloat16>(), gate, gate + kFfn, kTokens, kFfn, 2 * kFfn, nullptr);
  });
  report(state, 5.0 * n * 2);
}

// Softmax cross-entropy forward + backward in place over one lm_head chunk: 2048 rows of LLaMA-3's 128256
// logits (525 MB), every row scored. The gradient it writes is the next iteration's input (finite, O(1)).
void BM_Classifier(benchmark::State& state) {
  const int64_t n = 2048, vocab = 128256;
  DeviceMemory logits(n * vocab * 2), losses(n * 4), targets(n * 4);
  fill_random_bf16(logits.as<__nv_bfloat16>(), n * vocab, 1, 2.0f);
  std::vector<int32_t> host_targets(n);
  for (int64_t i = 0; i < n; ++i) host_targets[i] = static_cast<int32_t>((i * 7919) % vocab);
  TUNA_CUDA_CHECK(cudaMemcpy(targets.ptr, host_targets.data(), n * 4, cudaMemcpyHostToDevice));
  run_timed(state, nullptr, [&] {
    cuda::classifier_fwd_bwd(logits.as<__nv_bfloat16>(), losses.as<float>(), targets.as<int32_t>(), n, vocab, 1.0f,
                             nullptr);
  });
  report(state, 2.0 * n * vocab * 2);  // each logit read once, its gradient written once
  state.SetLabel("2048 rows x vocab 128256");
}

// Embedding backward of 16k tokens at LLaMA 1B's width into a 128256-row fp32 table. Tokens log-uniform over
// the vocabulary (Zipf's law, as text is: the commonest token ~8% of the batch, the long group that bounds
// the kernel).
void BM_EmbeddingBwd(benchmark::State& state) {
  const int64_t n = kTokens, vocab = 128256, dim = 2048;
  std::vector<int32_t> tokens(n);
  uint64_t x = 88172645463325252ull;  // xorshift64: a fixed batch
  for (auto& t : tokens) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    const double u = static_cast<double>(x >> 11) / static_cast<double>(uint64_t(1) << 53);
    t = static_cast<int32_t>(std::min<double>(vocab - 1, std::exp(u * std::log(double(vocab))) - 1));
  }
  cuda::EmbeddingGroups groups;
  cuda::embedding_groups(groups, tokens.data(), n, vocab);
  const int64_t n_unique = static_cast<int64_t>(groups.unique_tokens.size());
  DeviceMemory dout(n * dim * 2), dtable(vocab * dim * 4), positions(n * 4), unique(n_unique * 4),
      offsets((n_unique + 1) * 4);
  fill_random_bf16(dout.as<__nv_bfloat16>(), n * dim, 1);
  cuda::fill_constant(dtable.as<float>(), vocab * dim, 0.0f, nullptr);
  TUNA_CUDA_CHECK(cudaMemcpy(positions.ptr, groups.positions.data(), n * 4, cudaMemcpyHostToDevice));
  TUNA_CUDA_CHECK(cudaMemcpy(unique.ptr, groups.unique_tokens.data(), n_unique * 4, cudaMemcpyHostToDevice));
  TUNA_CUDA_CHECK(cudaMemcpy(offsets.ptr, groups.offsets.data(), (n_unique + 1) * 4, cudaMemcpyHostToDevice));
  run_timed(state, nullptr, [&] {
    cuda::embedding_bwd(dtable.as<float>(), dout.as<__nv_bfloat16>(), positions.as<int32_t>(), unique.as<int32_t>(),
                        offsets.as<int32_t>(), n_unique, dim, nullptr);
  });
  report(state, double(n) * dim * 2 + double(n_unique) * dim * 4 * 2);  // dout read; touched rows read + written
  state.SetLabel("16k tokens (" + std::to_string(n_unique) + " distinct), dim 2048");
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
BENCHMARK(BM_Classifier)->UseManualTime()->Unit(benchmark::kMicrosecond)->MinTime(0.2);
BENCHMARK(BM_EmbeddingBwd)->UseManualTime()->Unit(benchmark::kMicrosecond)->MinTime(0.2);
BENCHMARK(BM_AdamW)->Arg(0)->Arg(1)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.3);

}  // namespace
}  // namespace tuna::bench

TUNA_GPU_BENCH_MAIN(tuna::bench::measure_copy_once())
