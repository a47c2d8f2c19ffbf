// Attention forward and backward TFLOP/s, causal, head_dim 128 (and 64), seq 2k/4k/8k, LLaMA-3-8B heads
// (32 query, 8 kv), 16k tokens per launch, for both paths of attention.cuh: mma (FlashAttention-2 style) and
// hopper (FlashAttention-3 style, sm_90a; skipped with an error row on other devices). scripts/gpu-check.sh
// prints the two side by side. FLOPs by the FlashAttention convention: forward 4 * b * h * s^2/2 * d (QK^T and
// PV over the causal half), backward 2.5x the forward (5 products), whatever a kernel actually recomputes (the
// mma path recomputes 2 extra products in its dQ pass; the hopper path none). The `of_peak` counter is the
// fraction of the device's dense bf16 peak (gpu_peak_bf16_flops; TUNA_PEAK_TFLOPS overrides).
// The backward also runs with 32 kv heads (G = 1, no grouping) at the same query heads, hence the same FLOPs:
// its rate beside the 8-kv-head one (G = 4) shows what grouped-query attention costs the backward's ordered
// dQ additions (a CTA per kv head walks every query head of its group). Labelled "bwd G=1 ...", apart from the
// rows the peers are matched to (they run G = 4).
//
// BM_AttentionDocuments: packed windows of 4,096 tokens made of documents of 256, 1,024 or 4,096 tokens, hd128,
// both paths (hopper:1 skipped with an error row where it cannot run), with the document mask (masked:1) and
// without it (masked:0, attention across the documents, as before masks). Both report `useful TFLOP/s`: the FLOPs
// of causal attention inside each document (what the masked run must compute) over the time taken. A masked
// kernel that skips the key blocks outside the documents keeps that rate near the plain causal rate at every
// document length (time proportional to the useful FLOPs: masked / unmasked time near doc_tokens / 4096, which
// scripts/gpu-check.sh's table prints beside it); the unmasked one spends 4096 / doc_tokens times the work, and
// its useful rate drops by that factor. The label ends with the path, then the batch.
#include <vector>

#include "bench/gpu_bench_util.h"
#include "core/cuda_check.h"
#include "kernels/attention.cuh"

namespace tuna::bench {
namespace {

constexpr int64_t kTokens = 16384, kHeads = 32;

void BM_Attention(benchmark::State& state) {
  const int64_t seq = state.range(0), head_dim = state.range(1);
  const bool backward = state.range(2) != 0;
  const AttentionPath path = state.range(3) != 0 ? AttentionPath::kHopper : AttentionPath::kMma;
  const int64_t kv_heads = state.range(4);
  if (path == AttentionPath::kHopper && !cuda::attention_hopper_available()) {
    state.SkipWithError("the hopper path needs an sm_90 device and sm_90a code");
    return;
  }
  const int64_t batch = std::max<int64_t>(1, kTokens / seq);
  const int64_t q_count = batch * seq * kHeads * head_dim, kv_count = batch * seq * kv_heads * head_dim;
  DeviceMemory q(q_count * 2), k(kv_count * 2), v(kv_count * 2), out(q_count * 2), dout(q_count * 2),
      dq(q_count * 2), dk(kv_count * 2), dv(kv_count * 2), lse(batch * kHeads * seq * 4),
      scratch(cuda::attention_bwd_scratch_floats(batch, seq, kHeads, head_dim, path) * 4);
  fill_random_bf16(q.as<__nv_bfloat16>(), q_count, 1);
  fill_random_bf16(k.as<__nv_bfloat16>(), kv_count, 2);
  fill_random_bf16(v.as<__nv_bfloat16>(), kv_count, 3);
  fill_random_bf16(dout.as<__nv_bfloat16>(), q_count, 4);
  cudaStream_t stream = nullptr;
  cuda::attention_fwd(out.as<__nv_bfloat16>(), lse.as<float>(), q.as<__nv_bfloat16>(), k.as<__nv_bfloat16>(),
                      v.as<__nv_bfloat16>(), batch, seq, kHeads, kv_heads, head_dim, /*doc_start=*/nullptr, stream,
                      path);
  run_timed(state, stream, [&] {
    if (!backward)
      cuda::attention_fwd(out.as<__nv_bfloat16>(), lse.as<float>(), q.as<__nv_bfloat16>(), k.as<__nv_bfloat16>(),
                          v.as<__nv_bfloat16>(), batch, seq, kHeads, kv_heads, head_dim, /*doc_start=*/nullptr, stream, path);
    else
      cuda::attention_bwd(dq.as<__nv_bfloat16>(), dk.as<__nv_bfloat16>(), dv.as<__nv_bfloat16>(),
                          dout.as<__nv_bfloat16>(), out.as<__nv_bfloat16>(), lse.as<float>(), q.as<__nv_bfloat16>(),
                          k.as<__nv_bfloat16>(), v.as<__nv_bfloat16>(), scratch.as<float>(), batch, seq, kHeads,
                          kv_heads, head_dim, /*doc_start=*/nullptr, stream, path);
  });
  const double fwd_flops = 4.0 * batch * kHeads * double(seq) * double(seq) / 2.0 * head_dim;
  const double flops = backward ? 2.5 * fwd_flops : fwd_flops;
  state.counters["TFLOP/s"] = rate(flops / 1e12);
  state.counters["of_peak"] = rate(flops / gpu_peak_bf16_flops());
  state.SetLabel(std::string(backward ? "bwd" : "fwd") + (kv_heads == kHeads ? " G=1" : "") + " causal hd" +
                 std::to_string(head_dim) + " seq " + std::to_string(seq) + " batch " + std::to_string(batch) + " " +
                 cuda::attention_path_name(path));
}

BENCHMARK(BM_Attention)
    ->ArgNames({"seq", "hd", "bwd", "hopper", "kv"})
    ->ArgsProduct({{2048, 4096, 8192}, {128}, {0, 1}, {0, 1}, {8}})
    ->ArgsProduct({{4096}, {64}, {0, 1}, {0, 1}, {8}})
    ->ArgsProduct({{4096, 8192}, {128}, {1}, {0, 1}, {32}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.3);

void BM_AttentionDocuments(benchmark::State& state) {
  constexpr int64_t kSeq = 4096, kHeadDim = 128, kKvHeads = 8;  // G = 4, as the peers' rows
  const int64_t doc_tokens = state.range(0);
  const bool masked = state.range(1) != 0, backward = state.range(2) != 0;
  const AttentionPath path = state.range(3) != 0 ? AttentionPath::kHopper : AttentionPath::kMma;
  if (path == AttentionPath::kHopper && !cuda::attention_hopper_available()) {
    state.SkipWithError("the hopper path needs an sm_90 device and sm_90a code");
    return;
  }
  const int64_t batch = kTokens / kSeq;
  const int64_t q_count = batch * kSeq * kHeads * kHeadDim, kv_count = batch * kSeq * kKvHeads * kHeadDim;
  DeviceMemory q(q_count * 2), k(kv_count * 2), v(kv_count * 2), out(q_count * 2), dout(q_count * 2),
      dq(q_count * 2), dk(kv_count * 2), dv(kv_count * 2), lse(batch * kHeads * kSeq * 4),
      scratch(cuda::attention_bwd_scratch_floats(batch, kSeq, kHeads, kHeadDim, path) * 4),
      docs(batch * kSeq * 4);
  fill_random_bf16(q.as<__nv_bfloat16>(), q_count, 1);
  fill_random_bf16(k.as<__nv_bfloat16>(), kv_count, 2);
  fill_random_bf16(v.as<__nv_bfloat16>(), kv_count, 3);
  fill_random_bf16(dout.as<__nv_bfloat16>(), q_count, 4);
  std::vector<int32_t> doc_start(batch * kSeq);
  for (int64_t i = 0; i < batch * kSeq; ++i) doc_start[i] = static_cast<int32_t>(i % kSeq / doc_tokens * doc_tokens);
  TUNA_CUDA_CHECK(cudaMemcpy(docs.as<int32_t>(), doc_start.data(), doc_start.size() * 4, cudaMemcpyHostToDevice));
  const int32_t* doc = masked ? docs.as<int32_t>() : nullptr;
  cudaStream_t stream = nullptr;
  cuda::attention_fwd(out.as<__nv_bfloat16>(), lse.as<float>(), q.as<__nv_bfloat16>(), k.as<__nv_bfloat16>(),
                      v.as<__nv_bfloat16>(), batch, kSeq, kHeads, kKvHeads, kHeadDim, doc, stream, path);
  run_timed(state, stream, [&] {
    if (!backward)
      cuda::attention_fwd(out.as<__nv_bfloat16>(), lse.as<float>(), q.as<__nv_bfloat16>(), k.as<__nv_bfloat16>(),
                          v.as<__nv_bfloat16>(), batch, kSeq, kHeads, kKvHeads, kHeadDim, doc, stream, path);
    else
      cuda::attention_bwd(dq.as<__nv_bfloat16>(), dk.as<__nv_bfloat16>(), dv.as<__nv_bfloat16>(),
                          dout.as<__nv_bfloat16>(), out.as<__nv_bfloat16>(), lse.as<float>(), q.as<__nv_bfloat16>(),
                          k.as<__nv_bfloat16>(), v.as<__nv_bfloat16>(), scratch.as<float>(), batch, kSeq, kHeads,
                          kKvHeads, kHeadDim, doc, stream, path);
  });
  // Causal attention inside each document: kSeq / doc_tokens documents of doc_tokens^2 / 2 scores each.
  const double useful_fwd = 4.0 * batch * kHeads * double(kSeq / doc_tokens) * double(doc_tokens) *
                            double(doc_tokens) / 2.0 * kHeadDim;
  const double useful = backward ? 2.5 * useful_fwd : useful_fwd;
  state.counters["useful TFLOP/s"] = rate(useful / 1e12);
  state.counters["of_peak"] = rate(useful / gpu_peak_bf16_flops());
  state.SetLabel(std::string(backward ? "bwd" : "fwd") + " hd128 seq 4096 documents of " + std::to_string(doc_tokens) +
                 (masked ? " masked " : " unmasked ") + cuda::attention_path_name(path) + " batch " +
                 std::to_string(batch));
}

BENCHMARK(BM_AttentionDocuments)
    ->ArgNames({"doc", "masked", "bwd", "hopper"})
    ->ArgsProduct({{256, 1024, 4096}, {1, 0}, {0, 1}, {0, 1}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.2);

}  // namespace
}  // namespace tuna::bench

TUNA_GPU_BENCH_MAIN((void)0)
