// One full GPU training step (forward, backward, AdamW) of a LLaMA-3.2-1B-shaped model at seq 4096:
// tokens/s and MFU = tokens/s x model FLOPs per token / device bf16 peak. Model FLOPs (LlamaGpu::
// flops_per_token): 6 per matmul weight per token (lm_head included, embedding lookup not) plus causal
// attention's 6 * seq * q_dim per layer. The peak is gpu_peak_bf16_flops() (datasheet dense bf16 scaled by SM
// count; TUNA_PEAK_TFLOPS overrides, e.g. with the GEMM bench's measured best).
#include "bench/gpu_bench_util.h"
#include "model/llama_gpu.h"

namespace tuna::bench {
namespace {

LlamaConfig llama32_1b() {
  LlamaConfig c;
  c.hidden_size = 2048;
  c.intermediate_size = 8192;
  c.num_hidden_layers = 16;
  c.num_attention_heads = 32;
  c.num_key_value_heads = 8;
  c.head_dim = 64;
  c.vocab_size = 128256;
  c.max_position_embeddings = 131072;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 500000.0;
  c.rope_scaling.type = "llama3";
  c.rope_scaling.factor = 32.0;
  c.rope_scaling.low_freq_factor = 1.0;
  c.rope_scaling.high_freq_factor = 4.0;
  c.rope_scaling.original_max_position_embeddings = 8192;
  c.tie_word_embeddings = true;
  return c;
}

// part 0: the whole step; 1: forward and loss only; 2: AdamW only. The parts show where a step's time goes
// (the forward is a third of the model FLOPs; AdamW is memory-bound: 30 bytes per parameter).
void BM_TrainStep(benchmark::State& state) {
  const int64_t batch = state.range(0), seq = state.range(1), part = state.range(2);
  const LlamaConfig config = llama32_1b();
  LlamaGpu model(config, batch, seq);
  model.init_random(1);
  std::vector<int32_t> inputs(batch * seq), targets(batch * seq);
  uint64_t x = 88172645463325252ull;  // xorshift: random tokens, not zeros
  for (size_t i = 0; i < inputs.size(); ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    inputs[i] = static_cast<int32_t>(x % config.vocab_size);
    targets[i] = static_cast<int32_t>((x >> 20) % config.vocab_size);
  }
  run_timed(state, model.stream(), [&] {
    if (part == 1) {
      model.forward_loss(inputs.data(), targets.data(), batch, seq);
    } else if (part == 2) {
      model.adamw_step(1.0 / static_cast<double>(batch * seq), 1e-5);
    } else {
      model.zero_grads();
      const LossSum loss = model.forward_backward(inputs.data(), targets.data(), batch, seq);
      model.adamw_step(1.0 / static_cast<double>(loss.count), 1e-5);
    }
  });
  const double tokens = static_cast<double>(batch * seq);
  static const char* kPart[] = {"step", "forward+loss", "adamw"};
  if (part == 0) {
    state.counters["tokens/s"] = rate(tokens);
    state.counters["MFU"] = rate(tokens * model.flops_per_token(seq) / gpu_peak_bf16_flops());
  }
  state.counters["GiB"] = static_cast<double>(model.device_bytes()) / double(1 << 30);
  state.SetLabel(std::string(kPart[part]) + ", LLaMA-3.2-1B shape, batch " + std::to_string(batch) + " x seq " +
                 std::to_string(seq));
}

BENCHMARK(BM_TrainStep)
    ->ArgNames({"batch", "seq", "part"})
    ->Args({2, 4096, 0})
    ->Args({4, 4096, 0})
    ->Args({2, 4096, 1})
    ->Args({2, 4096, 2})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(2.0);

}  // namespace
}  // namespace tuna::bench

TUNA_GPU_BENCH_MAIN((void)0)
