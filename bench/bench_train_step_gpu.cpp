// One full GPU training step (forward, backward, AdamW) of a LLaMA-3.2-1B-shaped model at seq 4096:
// tokens/s and MFU = tokens/s x model FLOPs per token / device bf16 peak. Model FLOPs (LlamaGpu::
// flops_per_token): 6 per matmul weight per token (lm_head included, embedding lookup not) plus causal
// attention's 6 * seq * q_dim per layer. The peak is gpu_peak_bf16_flops() (datasheet dense bf16 scaled by SM
// count; TUNA_PEAK_TFLOPS overrides, e.g. with the GEMM bench's measured best).
#include <chrono>
#include <memory>
#include <vector>

#include "bench/gpu_bench_util.h"
#include "core/error.h"
#include "comm/comm.h"
#include "engine/engine.h"
#include "model/llama_gpu.h"
#include "model/memory_plan.h"

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
// (the forward is a third of the model FLOPs; AdamW is memory-bound: 30 bytes per parameter). hopper 1: the sm_90a
// attention kernels (--attention hopper), else mma. fp8 1: --fp8 tensorwise (the seven projections' GEMMs in FP8,
// model/fp8.h), beside the bf16 step of the same shape; its MFU is still against the bf16 peak (the model FLOPs are
// the same), so it says how much faster the step is, not how close to the FP8 peak.
void BM_TrainStep(benchmark::State& state) {
  const int64_t batch = state.range(0), seq = state.range(1), part = state.range(2);
  const AttentionPath path = state.range(3) != 0 ? AttentionPath::kHopper : AttentionPath::kMma;
  const bool fp8 = state.range(4) != 0;
  const LlamaConfig config = llama32_1b();
  MemoryLayout run;
  run.micro_batch = batch, run.seq_len = seq, run.attention = path;
  run.fp8 = fp8 ? Fp8Mode::Tensorwise : Fp8Mode::Off;
  LlamaGpu model(config, run);
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
                 std::to_string(seq) + ", " + attention_path_option(path) + " attention" +
                 (fp8 ? ", --fp8 tensorwise" : ""));
}

BENCHMARK(BM_TrainStep)
    ->ArgNames({"batch", "seq", "part", "hopper", "fp8"})
    ->Args({2, 4096, 0, 0, 0})
    ->Args({4, 4096, 0, 0, 0})
    ->Args({2, 4096, 0, 0, 1})
    ->Args({4, 4096, 0, 0, 1})
    ->Args({2, 4096, 1, 0, 0})
    ->Args({2, 4096, 2, 0, 0})
    ->Args({4, 4096, 0, 1, 0})
    ->Args({4, 4096, 0, 1, 1})  // FP8 with the hopper attention: the pair most likely to reach 1.3x the bf16 step
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(2.0);

// The trainer's step through the engine (engine/engine.h) on one GPU, by ZeRO stage and recompute mode, on the
// same 1B shape at batch 2 x 4096: the overhead of ZeRO-3's code path at world 1 against ZeRO-0 (its gathers are
// device copies into the rotating buffers, its gradients pass through unit buffers into the shard: aim <= 5%),
// and of recompute against none (full: a second forward of every layer but the top one, aim <= 1.35x), with the
// activation memory each mode plans and the device memory the step used (cudaMemGetInfo after a step, all of
// this process's allocations) against the plan's total. Wall time per step: finish_step synchronizes the device.
// lora > 0: the same step with LoRA adapters of that rank on all seven projections (alpha 2r, no dropout), the base
// frozen in bf16: no weight-gradient GEMMs, no base update; its tokens/s against the full step's (aim >= 1.4x).
void BM_EngineStep(benchmark::State& state) {
  const int zero = static_cast<int>(state.range(0));
  const Recompute recompute = static_cast<Recompute>(state.range(1));
  const int64_t lora_rank = state.range(2);
  const int64_t batch = 2, seq = 4096;
  const LlamaConfig config = llama32_1b();
  std::unique_ptr<Comm> world = make_single_comm();
  Mesh mesh = make_mesh(*world, 1);
  EngineOptions o;
  o.device = Device::Cuda, o.micro_batch = batch, o.seq_len = seq, o.zero = zero, o.recompute = recompute;
  o.bf16_moments = true;
  if (lora_rank > 0) o.lora.rank = lora_rank, o.lora.alpha = 2.0 * lora_rank, o.seed = 1;
  size_t free_before = 0, total = 0;
  TUNA_CUDA_CHECK(cudaMemGetInfo(&free_before, &total));
  // Weights: a counter hash, fast for a billion values (the step's speed does not depend on them).
  const WeightFill weights = [](const ParamLayout&, const Segment& piece, float* out) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < piece.size; i++) {
      uint64_t x = static_cast<uint64_t>(piece.begin + i) * 0x9E3779B97F4A7C15ull;
      x ^= x >> 31, x *= 0xBF58476D1CE4E5B9ull, x ^= x >> 29;
      out[i] = 0.02f * (static_cast<float>(x >> 40) / 8388608.0f - 1.0f);
    }
  };
  std::unique_ptr<Engine> engine = make_engine(config, o, mesh, weights);
  std::vector<int32_t> inputs(batch * seq), targets(batch * seq);
  uint64_t x = 88172645463325252ull;
  for (size_t i = 0; i < inputs.size(); ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    inputs[i] = static_cast<int32_t>(x % config.vocab_size);
    targets[i] = static_cast<int32_t>((x >> 20) % config.vocab_size);
  }
  const auto step = [&] {
    engine->begin_step();
    const LossSum loss = engine->forward_backward(inputs.data(), targets.data(), batch, seq);
    engine->finish_step(loss, 1e-5);
  };
  step();  // warm-up: cuBLASLt heuristics, first touches
  size_t free_after = 0;
  TUNA_CUDA_CHECK(cudaMemGetInfo(&free_after, &total));
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    step();
    state.SetIterationTime(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  const MemoryLayout l = engine_memory_layout(o, mesh);
  const MemoryPlan plan = plan_gpu_memory(config, l);
  const double tokens = static_cast<double>(batch * seq);
  state.counters["tokens/s"] = rate(tokens);
  state.counters["MFU"] = rate(tokens * engine->flops_per_token(seq) / gpu_peak_bf16_flops());
  state.counters["GiB"] = static_cast<double>(free_before - free_after) / double(1 << 30);
  state.counters["plan_GiB"] = static_cast<double>(plan.total()) / double(1 << 30);
  state.counters["activations_GiB"] = static_cast<double>(plan.bytes(MemoryKind::Activations)) / double(1 << 30);
  state.SetLabel(str("engine step, ", lora_rank > 0 ? describe_lora(l.lora) + ", " : std::string(), "ZeRO-", zero,
                     ", recompute ", recompute_name(recompute),
                     ", LLaMA-3.2-1B shape, batch 2 x seq 4096 (device memory used vs plan: GiB / plan_GiB)"));
}

BENCHMARK(BM_EngineStep)
    ->ArgNames({"zero", "recompute", "lora"})
    ->Args({0, static_cast<int>(Recompute::None), 0})
    ->Args({3, static_cast<int>(Recompute::None), 0})
    ->Args({0, static_cast<int>(Recompute::Selective), 0})
    ->Args({0, static_cast<int>(Recompute::Full), 0})
    ->Args({0, static_cast<int>(Recompute::None), 16})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(1.0);

// The adapters' step on the model alone (LlamaGpu: forward_backward and the adapters' AdamW), LoRA r16 on all seven
// projections over a bf16 base (nf4 0) or over an NF4 base dequantized a layer at a time (nf4 1, QLoRA), on the 1B
// shape at batch 2 x 4096: QLoRA's tokens/s against LoRA's (aim >= 0.85x), the same harness for both.
void BM_AdapterStep(benchmark::State& state) {
  const bool nf4 = state.range(0) != 0;
  const int64_t batch = 2, seq = 4096;
  const LlamaConfig config = llama32_1b();
  MemoryLayout run;
  run.micro_batch = batch, run.seq_len = seq, run.bf16_moments = true;
  run.lora.rank = 16, run.lora.alpha = 32;
  run.lora.base_quant = nf4 ? BaseQuant::Nf4 : BaseQuant::None;
  LlamaGpu model(config, run);
  // Weights a unit at a time from a counter hash (quantized on the way in for nf4); adapters likewise.
  const auto fill = [](const Segment& piece, std::vector<float>& out) {
    out.resize(piece.size);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < piece.size; i++) {
      uint64_t x = static_cast<uint64_t>(piece.begin + i) * 0x9E3779B97F4A7C15ull;
      x ^= x >> 31, x *= 0xBF58476D1CE4E5B9ull, x ^= x >> 29;
      out[i] = 0.02f * (static_cast<float>(x >> 40) / 8388608.0f - 1.0f);
    }
  };
  std::vector<float> host;
  for (int u = 0; u < model.layout().num_units(); u++) {
    const Segment piece{model.layout().unit_range(u).first,
                        model.layout().unit_range(u).second - model.layout().unit_range(u).first};
    fill(piece, host);
    model.set_params_piece(piece, host.data());
  }
  fill(Segment{0, model.trained_layout().total()}, host);
  model.set_adapters_piece(Segment{0, model.trained_layout().total()}, host.data());
  std::vector<int32_t> inputs(batch * seq), targets(batch * seq);
  uint64_t x = 88172645463325252ull;
  for (size_t i = 0; i < inputs.size(); ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    inputs[i] = static_cast<int32_t>(x % config.vocab_size);
    targets[i] = static_cast<int32_t>((x >> 20) % config.vocab_size);
  }
  run_timed(state, model.stream(), [&] {
    model.zero_grads();
    const LossSum loss = model.forward_backward(inputs.data(), targets.data(), batch, seq);
    model.adamw_step(1.0 / static_cast<double>(loss.count), 1e-5);
  });
  const double tokens = static_cast<double>(batch * seq);
  state.counters["tokens/s"] = rate(tokens);
  state.counters["MFU"] = rate(tokens * model.flops_per_token(seq) / gpu_peak_bf16_flops());
  state.counters["GiB"] = static_cast<double>(model.device_bytes()) / double(1 << 30);
  state.SetLabel(str("adapter step, ", describe_lora(run.lora), ", LLaMA-3.2-1B shape, batch 2 x seq 4096"));
}

BENCHMARK(BM_AdapterStep)->ArgNames({"nf4"})->Arg(0)->Arg(1)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(1.0);

}  // namespace
}  // namespace tuna::bench

TUNA_GPU_BENCH_MAIN((void)0)
