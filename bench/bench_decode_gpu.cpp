// Generation on the GPU (build/sample's loop): tokens/s of one sequence decoded with the KV cache
// (model/decode_gpu.h, one position's forward per token) against rerunning the whole context per token
// (LlamaGpu::forward_logits, what build/sample did before the cache), for the demo model (demo/config.json)
// with random weights. An iteration: clear the cache, a prompt of 16 tokens, then 112 tokens one at a time
// (greedy), so the context ends at 128; tokens/s counts the 112 generated after the prompt.
#include <algorithm>

#include "bench/gpu_bench_util.h"
#include "model/decode_gpu.h"
#include "model/llama.h"  // init_random_weights
#include "model/llama_gpu.h"  // LlamaGpu

namespace tuna::bench {
namespace {

constexpr int64_t kPrompt = 16, kContext = 128;

void BM_Generate(benchmark::State& state) {
  const bool cached = state.range(0) != 0;
  const LlamaConfig config = LlamaConfig::load("demo/config.json");
  LlamaGpu model(config, single_rank_layout(1, kContext, /*training=*/false));  // bf16 weights only
  std::vector<float> weights(model.layout().total());
  init_random_weights(model.layout(), 1, 0.3, weights.data());
  model.set_params(weights.data());
  DecodeGpu decoder(GpuWeights{&model.config(), &model.layout(), model.params(), 0}, 1, kContext);
  const int64_t V = config.vocab_size;
  std::vector<float> logits(kContext * V);
  std::vector<int32_t> tokens;
  auto generate = [&] {
    tokens.assign(kPrompt, 0);
    for (int64_t i = 0; i < kPrompt; ++i) tokens[i] = static_cast<int32_t>((i * 37 + 1) % V);
    decoder.clear();
    while (static_cast<int64_t>(tokens.size()) < kContext) {
      const int64_t n = static_cast<int64_t>(tokens.size());
      const float* last = logits.data();
      if (!cached) {
        model.forward_logits(tokens.data(), 1, n, logits.data());
        last = logits.data() + (n - 1) * V;
      } else {
        decoder.append(n == kPrompt ? tokens.data() : &tokens.back(), n == kPrompt ? n : 1, logits.data());
      }
      tokens.push_back(static_cast<int32_t>(std::max_element(last, last + V) - last));
    }
  };
  // Both paths synchronize on every token (the logits come to the host), so the stream's events time them.
  run_timed(state, model.stream(), generate);
  state.counters["tokens/s"] = rate(static_cast<double>(kContext - kPrompt));
  state.SetLabel(std::string(cached ? "KV cache" : "whole context per token") + ", demo model, " +
                 std::to_string(kContext - kPrompt) + " tokens after a prompt of " + std::to_string(kPrompt));
}

BENCHMARK(BM_Generate)->ArgNames({"cached"})->Arg(1)->Arg(0)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(1.0);

}  // namespace
}  // namespace tuna::bench

TUNA_GPU_BENCH_MAIN((void)0)
