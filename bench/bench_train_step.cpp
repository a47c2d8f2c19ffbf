// The CPU training step: forward + backward + AdamW for the demo model (demo/config.json) at the demo's
// batch, reported as tokens/s; BM_TrainStepLora the same step with rank-16 adapters on all seven projections (the
// base frozen: AdamW over the adapters alone). tools/reference/bench_torch.py times PyTorch eager (with PEFT for
// --lora_rank) on the same model and batch, so the two compare in one run (tools/reference/compare_cpu_step.sh):
//   build/bench_train_step && python3 tools/reference/bench_torch.py --config demo/config.json --batch 8 --seq 128
#include <benchmark/benchmark.h>

#include <random>

#include "core/threads.h"
#include "model/config.h"
#include "model/llama.h"
#include "model/lora.h"
#include "model/optimizer.h"

namespace tuna {
namespace {

// Args: batch, seq, threads, and for BM_TrainStepLora the rank. The demo model (or `config_path`'s) with random
// weights and one random batch; each iteration is a whole step: zero the gradients, forward + backward, AdamW over
// what trains (the model, or with adapters the adapters alone).
void run_steps(benchmark::State& state, const LoraConfig& lora, const char* config_path = "demo/config.json") {
  const int64_t batch = state.range(0), seq = state.range(1);
  set_cpu_threads(static_cast<int>(state.range(2)));
  LlamaConfig config = LlamaConfig::load(config_path);
  Llama model(config, batch, seq, {}, lora);
  model.init_random(1);
  const ParamLayout& trained = lora.enabled() ? model.lora_layout().params : model.layout();
  if (lora.enabled()) init_lora_weights_piece(trained, 2, Segment{0, trained.total()}, model.lora_params.data());
  std::vector<float>& params = lora.enabled() ? model.lora_params : model.params;
  std::vector<float>& grads = lora.enabled() ? model.lora_grads : model.grads;
  AdamW opt(trained, OptimizerConfig{});
  std::mt19937 rng(3);
  std::vector<int32_t> inputs(batch * seq), targets(batch * seq);
  for (size_t i = 0; i < inputs.size(); i++) inputs[i] = rng() % config.vocab_size, targets[i] = rng() % config.vocab_size;
  for (auto _ : state) {
    model.zero_grads();
    LossSum loss = model.forward_backward(inputs.data(), targets.data(), batch, seq);
    opt.step(params.data(), grads.data(), 1.0 / loss.count, 1e-3);
    benchmark::DoNotOptimize(params.data());
  }
  state.counters["tokens_per_s"] = benchmark::Counter(double(batch * seq), benchmark::Counter::kIsIterationInvariantRate);
  const double flops_per_token =  // model/config.h, model/lora.h
      lora.enabled() ? lora_flops_per_token(config, lora, seq) : model_flops_per_token(config, seq);
  state.counters["GFLOP_per_s"] =
      benchmark::Counter(flops_per_token * double(batch * seq) / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_TrainStep(benchmark::State& state) { run_steps(state, LoraConfig{}); }
BENCHMARK(BM_TrainStep)->Args({8, 128, 1})->Args({8, 128, 2})->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(3.0);

// Rank-r adapters on all seven projections, alpha = rank (build/train's default), no dropout (bench_torch.py's PEFT
// model has the same), A as PEFT draws it and B at zero.
void BM_TrainStepLora(benchmark::State& state) {
  LoraConfig lora;
  lora.rank = state.range(3), lora.alpha = static_cast<double>(lora.rank);
  run_steps(state, lora);
}
BENCHMARK(BM_TrainStepLora)->Args({8, 128, 1, 16})->Args({8, 128, 2, 16})->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(3.0);

// A 100M+ shape (bench/llama_135m.json: hidden 576, 30 layers, GQA 9/3, vocab 49,152, tied; a real 135M
// checkpoint's), 4 x 256 tokens on 2 threads: the full step, LoRA r16 on all seven projections and on q_proj alone.
// By FLOPs (model/lora.h) the adapter steps cost 0.67 of the full one; these rows hold the code to that.
void BM_TrainStep135M(benchmark::State& state) {
  LoraConfig lora;
  if (state.range(3) > 0) {
    lora.rank = state.range(3), lora.alpha = static_cast<double>(lora.rank);
    if (state.range(4) == 1) lora.targets = parse_lora_targets("q_proj");
  }
  run_steps(state, lora, "bench/llama_135m.json");
}
// Args: batch, seq, threads, rank (0: the full step), targets (0: all seven, 1: q_proj).
BENCHMARK(BM_TrainStep135M)->Args({4, 256, 2, 0, 0})->Args({4, 256, 2, 16, 0})->Args({4, 256, 2, 16, 1})
    ->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(3);

}  // namespace
}  // namespace tuna

BENCHMARK_MAIN();
