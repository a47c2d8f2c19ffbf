// The engines' shared helpers (engine/engine.h): state exchange, the run's memory layout, host staging, weight
// fills. Plain C++: the backends (engine_cpu.cpp, engine_gpu.cpp) and the factory (device.cpp) build on it.
#include "engine/engine.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "ckpt/checkpoint.h"  // WeightReader
#include "core/error.h"
#include "core/memory.h"  // host_available_bytes, require_host_memory
#include "model/preference_step.h"  // PairBatch

namespace tuna {

void declare_layout_options(Options& o, LayoutOptions& l) {
  // Upper bounds are far beyond any real run; they exist so that a typo (or 2^31) fails here, with the option's name,
  // instead of as an allocation of petabytes or an overflow later.
  constexpr double kMaxTokens = 1 << 22, kMaxRanks = 1 << 16;
  o.add("seq_len", &l.seq_len, "tokens per sequence", Bounds::closed(1, kMaxTokens));
  o.add("micro_batch", &l.micro_batch, "sequences per forward/backward (on each GPU or CPU rank)",
        Bounds::closed(1, kMaxTokens));
  o.add("grad_accum", &l.grad_accum, "micro-batches per optimizer step (with --pp: those that flow through the pipe)",
        Bounds::closed(1, kMaxTokens));
  o.add("tp", &l.tp, "tensor-parallel ranks (inside a node); the world is dp x pp x tp", Bounds::closed(1, kMaxRanks));
  o.add("pp", &l.pp, "pipeline stages (consecutive layers per stage split by cost, the embedding on the first and the "
        "head on the last; 1F1B over the grad_accum micro-batches; stages span nodes, tp stays inside one; cuda: ZeRO 0 "
        "and 1); the world is dp x pp x tp", Bounds::closed(1, kMaxRanks));
  o.add("sp", &l.sp, "sequence parallelism with --tp > 1 (Megatron's): norms and residuals hold seq / tp of the tokens, "
        "all-gathered before the tp GEMMs and reduce-scattered after them (cuda: seq_len a multiple of tp); off by "
        "default");
  o.add("zero", &l.zero, "ZeRO stage over dp: 0 replicate, 1 shard optimizer state, 2 and gradients, 3 and parameters",
        Bounds::closed(0, 3));
  o.add("recompute", &l.recompute, "cuda: activations the backward recomputes: none, selective (norms, SwiGLU) or full "
        "(each layer from its input)", {"none", "selective", "full"});
  o.add("bf16_moments", &l.bf16_moments, "cuda: AdamW moments in bf16 (half the optimizer memory)");
  o.add("fp8", &l.fp8, "tensorwise: the seven projections' GEMMs (forward and backward) with FP8 operands, e4m3 "
        "weights and activations, e5m2 output gradients, one dynamic scale per tensor from its amax (torchao's "
        "recipe); the lm_head, attention, norms and optimizer as they are. off: fp32 (cpu), bf16 (cuda)");
  o.add("fp8_weight_codes", &l.fp8_weight_codes, "cuda, with --fp8: which FP8 codes of the weights stay between uses. "
        "both: every layer's in the two layouts the GEMMs read, cast once per update (2 bytes a projection weight); "
        "forward: the forward's layout only (1 byte), the transposed codes cast again before each backward (a cast of "
        "the weights a micro-batch, for half the codes' memory). The same numbers either way", {"both", "forward"});
  o.add("rope_scaling", &l.rope_scaling, "TYPE:FACTOR, TYPE linear, dynamic or yarn (transformers' rope_scaling): "
        "train a context FACTOR times the model's own (--seq_len up to it); written into every checkpoint's and "
        "export's config.json. Empty: the model's config.json decides");
}

void Engine::export_shard(std::vector<float>& params, std::vector<float>& m, std::vector<float>& v) const {
  std::vector<int64_t> at;
  int64_t total = 0;
  for (const Segment& s : segments()) at.push_back(total), total += s.size;
  params.resize(total), m.resize(total), v.resize(total);
  export_state([&](size_t i, const float* p, const float* mi, const float* vi) {
    const int64_t n = segments()[i].size;
    std::copy_n(p, n, params.data() + at[i]), std::copy_n(mi, n, m.data() + at[i]), std::copy_n(vi, n, v.data() + at[i]);
  });
}

void Engine::import_shard(const std::vector<float>& params, const std::vector<float>& m, const std::vector<float>& v) {
  std::vector<int64_t> at;
  int64_t total = 0;
  for (const Segment& s : segments()) at.push_back(total), total += s.size;
  for (const std::vector<float>* x : {&params, &m, &v})
    TUNA_CHECK(static_cast<int64_t>(x->size()) == total, "shard of ", x->size(), " elements, expected ", total);
  import_state([&](size_t i, float* p, float* mi, float* vi) {
    const int64_t n = segments()[i].size;
    std::copy_n(params.data() + at[i], n, p), std::copy_n(m.data() + at[i], n, mi), std::copy_n(v.data() + at[i], n, vi);
  });
}

PreferenceSums Engine::forward_pairs(const PairBatch&, const ObjectiveConfig& objective, const PreferenceStep&, bool) {
  fail("the ", describe(), " engine does not implement the preference objectives yet (--objective ",
       objective_name(objective.objective), "): use --device cpu");
}

Engine::PairStepSums Engine::forward_pairs_step(const std::vector<PairBatch>& micro_batches,
                                               const ObjectiveConfig& objective, const PreferenceStep& step) {
  PairStepSums out;
  for (const PairBatch& b : micro_batches) out.sums.add(forward_pairs(b, objective, step, /*want_grad=*/true));
  out.counted = LossSum{out.sums.loss, out.sums.pairs};
  return out;
}

void Engine::pair_logps(const PairBatch&, double*, double*) {
  fail("the ", describe(), " engine does not implement the preference objectives yet: use --device cpu");
}

void Engine::target_logps(const int32_t*, const int32_t*, int64_t, int64_t, const int32_t*, float*, uint8_t*) {
  fail("--eval_tasks: the ", describe(), " engine does not score multiple-choice tasks during training yet: use --device "
       "cpu, or build/eval --tasks on a checkpoint");
}

void ForwardModel::forward_shared_logps(const int32_t*, int64_t, const int32_t*, const int32_t*, int64_t, int64_t, float*,
                                       uint8_t*) {
  fail("the ", describe(), " forward model scores no shared context (one request per row only)");
}

LossSum Engine::forward_backward_step(const std::vector<MicroBatch>& micro_batches) {
  LossSum loss;
  for (const MicroBatch& b : micro_batches) {
    const LossSum l = forward_backward(b.inputs, b.targets, b.batch, b.seq, b.positions);
    loss.sum += l.sum, loss.count += l.count;
  }
  return loss;
}

MemoryLayout engine_memory_layout(const EngineOptions& o, const Mesh& mesh) {
  MemoryLayout l;
  l.dp = mesh.dp_size, l.dp_rank = mesh.dp_rank, l.tp = mesh.tp_size, l.tp_rank = mesh.tp_rank;
  l.pp = mesh.pp_size, l.pp_rank = mesh.pp_rank, l.sp = o.sp;
  l.zero = o.zero, l.zero_prefetch = o.zero_prefetch, l.recompute = o.recompute;
  l.bf16_moments = o.bf16_moments, l.attention = o.attention, l.fp8 = o.fp8, l.fp8_forward_codes = o.fp8_forward_codes;
  l.micro_batch = o.micro_batch, l.seq_len = o.seq_len;
  static_cast<LoraConfig&>(l.lora) = o.lora;
  l.lora.base_quant = o.base_quant;
  return l;
}

MemoryLayout engine_memory_layout(const LlamaConfig& config, const EngineOptions& options, const Mesh& mesh) {
  return place_layout(config, engine_memory_layout(options, mesh));
}

GpuFit plan_gpu_fit(const LlamaConfig& config, const EngineOptions& options, const Mesh& mesh, int64_t capacity_bytes) {
  const MemoryLayout run = engine_memory_layout(config, options, mesh);
  GpuFit fit = check_gpu_fit(config, run, capacity_bytes);
  fit.report += format_host_staging(plan_gpu_host_staging(config, run));
  return fit;
}

HostStaging plan_gpu_host_staging(const LlamaConfig& config, const MemoryLayout& run) {
  const int dp_rank = static_cast<int>(run.dp_rank), dp_size = static_cast<int>(run.dp);
  // With pipeline stages, the stage's layout: its units are what the rank fills and saves.
  const int tp_rank = static_cast<int>(run.tp_rank), tp = static_cast<int>(run.tp);
  const MemoryLayout placed = place_layout(config, run);
  const ParamLayout layout = run.pp > 1 ? ParamLayout(config, tp_rank, tp, placed.stage()) : ParamLayout(config, tp_rank, tp);
  int64_t largest_piece = 0, largest_unit = 0;
  for (const Segment& s : dp_unit_pieces(layout, dp_rank, dp_size)) largest_piece = std::max(largest_piece, s.size);
  for (int u = 0; u < layout.num_units(); u++)
    largest_unit = std::max(largest_unit, layout.unit_range(u).second - layout.unit_range(u).first);
  HostStaging h;
  if (run.lora.enabled()) {
    // Adapters: the frozen base is filled a unit at a time (at ZeRO-3 this rank's piece of each), then the adapters a
    // unit at a time (at ZeRO 1-3 this rank's piece of each): at most a whole unit; a checkpoint moves the adapters'
    // pieces only.
    const ParamLayout adapters =
        lora_layout(config, run.lora, static_cast<int>(run.tp_rank), static_cast<int>(run.tp)).params;
    int64_t adapter_piece = 0, adapter_unit = 0;
    for (const Segment& s : dp_unit_pieces(adapters, dp_rank, dp_size)) adapter_piece = std::max(adapter_piece, s.size);
    for (int u = 0; u < adapters.num_units(); u++)
      adapter_unit = std::max(adapter_unit, adapters.unit_range(u).second - adapters.unit_range(u).first);
    h.init_bytes = std::max(largest_unit, adapter_unit) * int64_t(sizeof(float));
    h.checkpoint_bytes = adapter_piece * int64_t(3 * sizeof(float) + sizeof(uint16_t));
    return h;
  }
  h.init_bytes = (run.zero >= 1 ? largest_piece : largest_unit) * int64_t(sizeof(float));
  h.checkpoint_bytes = largest_piece * int64_t(3 * sizeof(float) + sizeof(uint16_t));
  return h;
}

std::string format_host_staging(const HostStaging& h) {
  return str("host memory per rank beyond the process's own: start-up ", format_bytes(h.init_bytes),
             " (one piece of the starting weights), checkpoint save or resume ", format_bytes(h.checkpoint_bytes),
             " (one piece of the weights and both moments); weight and checkpoint files are mapped and read a piece "
             "at a time\n");
}

WeightFill weights_from_directory(const std::filesystem::path& dir) {
  auto reader = std::make_shared<std::unique_ptr<WeightReader>>();
  return [dir, reader](const ParamLayout& layout, const Segment& piece, float* out) {
    if (!*reader) *reader = std::make_unique<WeightReader>(dir, layout);
    (*reader)->read(piece, out);
  };
}

WeightFill random_weights(uint64_t seed, double std) {
  return [seed, std](const ParamLayout& layout, const Segment& piece, float* out) {
    init_random_weights_piece(layout, seed, std, piece, out);
  };
}

WeightFill initial_adapters(uint64_t seed) {
  return [seed](const ParamLayout& layout, const Segment& piece, float* out) {
    init_lora_weights_piece(layout, seed, piece, out);
  };
}

void fill_whole(const WeightFill& fill, const ParamLayout& layout, float* out) {
  for (int u = 0; u < layout.num_units(); u++) {
    const auto [begin, end] = layout.unit_range(u);
    fill(layout, Segment{begin, end - begin}, out + begin);
  }
}

AttentionPath choose_attention(const std::string& option, const nlohmann::json& checkpoint_state, std::string* note) {
  if (const char* env = std::getenv("TUNA_ATTENTION"); env != nullptr && *env != '\0')
    fail("environment variable TUNA_ATTENTION=", env, " is not read: choose the attention kernels with --attention "
         "mma|hopper (an option, saved with the run so that a resume runs the same kernels)");
  const AttentionPath asked = parse_attention_path(option, "option 'attention'");
  std::string used;  // what the checkpoint's run resolved its choice to
  if (checkpoint_state.is_object() && checkpoint_state.contains("kernels") && checkpoint_state["kernels"].is_object() &&
      checkpoint_state["kernels"].contains("attention") && checkpoint_state["kernels"]["attention"].is_string())
    used = checkpoint_state["kernels"]["attention"].get<std::string>();
  if (used.empty()) return asked;
  const AttentionPath recorded = parse_attention_path(used, "state.json kernels.attention");
  if (asked == AttentionPath::kDefault) {
    if (note) *note = str("attention kernels: ", used, ", as the checkpoint's run (--attention auto)");
    return recorded;
  }
  if (asked != recorded && note)
    *note = str("the checkpoint's run used the ", used, " attention kernels; this run uses ", option,
                " (--attention): the same function, so the loss continues, but not bit for bit");
  return asked;
}

nlohmann::json check_memory_plan(const LlamaConfig& config, const EngineOptions& options, const Mesh& mesh,
                                 double resident_mb_at_start, int ranks_on_node) {
  const MemoryLayout run = engine_memory_layout(config, options, mesh);
  if (options.device == Device::Cuda) {
    nlohmann::json record = memory_plan_json(plan_gpu_memory(config, run));
    record["device"] = "cuda";
    return record;
  }
  const MemoryPlan plan = plan_cpu_memory(config, run);
  char start[32];
  std::snprintf(start, sizeof start, "%.0f", resident_mb_at_start);
  std::printf("%s", format_memory_table(plan, host_available_bytes(),
                                        str("memory plan per rank (host, above the ", start,
                                            " MB resident at start; capacity: this node's available memory)")).c_str());
  std::fflush(stdout);
  nlohmann::json record = memory_plan_json(plan);
  record["device"] = "cpu";
  require_host_memory(plan.peak(), ranks_on_node, "the memory plan's peak per rank");
  return record;
}

}  // namespace tuna
