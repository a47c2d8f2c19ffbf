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

void BM_TrainStep(benchmark::State& state) {
  const int64_t batch = state.range(0), seq = state.range(1);
  const int threads = static_cast<int>(state.range(2));
  set_cpu_threads(threads);
  LlamaConfig config = LlamaConfig::load("demo/config.json");
  Llama model(config, batch, seq);
  model.init_random(1);
  AdamW opt(model.layout(), OptimizerConfig{});
  std::mt19937 rng(3);
  std::vector<int32_t> inputs(batch * seq), targets(batch * seq);
  for (size_t i = 0; i < inputs.size(); i++) inputs[i] = rng() % config.vocab_size, targets[i] = rng() % config.vocab_size;
  for (auto _ : state) {
    model.zero_grads();
    LossSum loss = model.forward_backward(inputs.data(), targets.data(), batch, seq);
    opt.step(model.params.data(), model.grads.data(), 1.0 / loss.count, 1e-3);
    benchmark::DoNotOptimize(model.params.data());
  }
  state.counters["tokens_per_s"] = benchmark::Counter(double(batch * seq), benchmark::Counter::kIsIterationInvariantRate);
  const double flops_per_token = model_flops_per_token(config, seq);  // model/config.h
  state.counters["GFLOP_per_s"] =
      benchmark::Counter(flops_per_token * double(batch * seq) / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_TrainStep)->Args({8, 128, 1})->Args({8, 128, 2})->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(3.0);

// Args: batch, seq, threads, rank. alpha = rank (build/train's default), no dropout (bench_torch.py's PEFT model
// has the same), A as PEFT draws it and B at zero.
void BM_TrainStepLora(benchmark::State& state) {
  const int64_t batch = state.range(0), seq = state.range(1);
  set_cpu_threads(static_cast<int>(state.range(2)));
  LlamaConfig config = LlamaConfig::load("demo/config.json");
  LoraConfig lora;
  lora.rank = state.range(3), lora.alpha = static_cast<double>(lora.rank);
  Llama model(config, batch, seq, {}, lora);
  model.init_random(1);
  const ParamLayout& adapters = model.lora_layout().params;
  init_lora_weights_piece(adapters, 2, Segment{0, adapters.total()}, model.lora_params.data());
  AdamW opt(adapters, OptimizerConfig{});
  std::mt19937 rng(3);
  std::vector<int32_t> inputs(batch * seq), targets(batch * seq);
  for (size_t i = 0; i < inputs.size(); i++) inputs[i] = rng() % config.vocab_size, targets[i] = rng() % config.vocab_size;
  for (auto _ : state) {
    model.zero_grads();
    LossSum loss = model.forward_backward(inputs.data(), targets.data(), batch, seq);
    opt.step(model.lora_params.data(), model.lora_grads.data(), 1.0 / loss.count, 1e-3);
    benchmark::DoNotOptimize(model.lora_params.data());
  }
  state.counters["tokens_per_s"] = benchmark::Counter(double(batch * seq), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GFLOP_per_s"] = benchmark::Counter(lora_flops_per_token(config, lora, seq) * double(batch * seq) / 1e9,
                                                     benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_TrainStepLora)->Args({8, 128, 1, 16})->Args({8, 128, 2, 16})->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(3.0);

}  // namespace
}  // namespace tuna

BENCHMARK_MAIN();
