// The CPU training step: forward + backward + AdamW for the demo model (demo/config.json) at the demo's
// batch, reported as tokens/s. tools/reference/bench_torch.py times PyTorch eager on the same model and
// batch, so the two compare in one run:
//   build/bench_train_step && python3 tools/reference/bench_torch.py --config demo/config.json --batch 8 --seq 128
#include <benchmark/benchmark.h>

#include <random>

#include "core/threads.h"
#include "model/config.h"
#include "model/llama.h"
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

}  // namespace
}  // namespace tuna

BENCHMARK_MAIN();
