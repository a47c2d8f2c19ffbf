// The planner's step-time model (plan/planner.h): each layout's memory (the engine's plan or the design), its
// step's compute and communication from measured rates, the job's time and cost, and the layout search.
#include "plan/planner.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <ctime>
#include <cstdio>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>

#include "core/error.h"
#include "core/progress.h"
#include "comm/comm.h"  // shard_range
#include "model/optimizer.h"  // dp_unit_pieces
#include "model/layout.h"
#include "model/lora_shape.h"
#include "model/support.h"  // support, require_valid
#include "plan/text.h"

namespace tuna {

namespace fs = std::filesystem;
using nlohmann::json;
using namespace plan_text;

// ---- memory ----

namespace {

// The dimensions of tp rank 0 as a model of their own: a tp-local model is what one tp rank holds (hidden and
// the norms whole; heads, ffn and vocabulary split).
LlamaConfig tp_local_model(const LlamaConfig& c, int64_t tp) {
  const ParamLayout split(c, 0, static_cast<int>(tp));  // refuses a tp that splits kv groups, naming it
  LlamaConfig local = c;
  local.num_attention_heads = split.tp().heads;
  local.num_key_value_heads = split.tp().kv_heads;
  local.intermediate_size = split.tp().ffn;
  local.vocab_size = split.tp().vocab;
  return local;
}

}  // namespace

MemoryPlan design_gpu_memory(const LlamaConfig& config, const MemoryLayout& layout) {
  // The engine's own plan of one tp rank's dimensions as a model of their own, at the same dp, ZeRO stage,
  // recompute and batch: what a GPU holds under Megatron splits (heads, ffn and vocabulary split; hidden, the
  // norms and the [tokens, hidden] activations whole: no sequence parallelism).
  MemoryLayout near = layout;
  near.tp = 1, near.tp_rank = 0;
  near.stages.clear();  // the local model's own split
  return plan_gpu_memory(tp_local_model(config, layout.tp), near);
}

// ---- the step ----

namespace {

// The memory of one layout: the engine's own plan, or, for a layout it refuses, the design.
struct GpuMemory {
  MemoryPlan plan;
  bool engines = true;
  std::string refusal;
};

// --fp8 tensorwise's buffers, as designed (model/fp8.h), for a layout the CUDA engine does not run (model/support.cpp:
// shapes its FP8 GEMMs do not take, or a layout it refuses in bf16 too): the codes of the stage's projection weights as
// model/memory_plan_gpu.cpp keeps them (both layouts or the forward's, every layer's or one: fp8_cast_layers), and one
// projection group's input and output-gradient codes in both layouts. Where the engine runs FP8 its own plan is the
// memory.
void add_fp8_buffers(const LlamaConfig& c, const MemoryLayout& l, MemoryPlan& plan) {
  const ParamLayout layout = ParamLayout(c, 0, static_cast<int>(l.tp));
  const TpDims& d = layout.tp();
  int64_t projections = 0;
  for (const ParamTensor& t : layout.tensors())
    if (t.layer == 0 && t.shape.size() == 2) projections += t.numel;  // a decoder layer's seven projections
  const int64_t n = l.micro_batch * l.seq_len, C = c.hidden_size;
  const int64_t in = std::max({C, d.q_dim, d.ffn}), rows = std::max({d.q_dim + 2 * d.kv_dim, C, 2 * d.ffn});
  const int64_t cast = fp8_cast_layers(l);
  plan.items.push_back({str("FP8 weight codes (e4m3, ", l.fp8_forward_codes ? "forward layout" : "both layouts", ", ",
                            cast, cast == 1 ? " layer)" : " layers)"),
                        MemoryKind::Weights, device_arena_bytes((l.fp8_forward_codes ? 1 : 2) * projections * cast)});
  if (l.fp8_forward_codes)  // one group's transposed codes, cast at each backward: the widest group (gate|up)
    plan.items.push_back({"FP8 transposed codes of one group's weight (e4m3, cast at each backward)",
                          MemoryKind::Workspace, device_arena_bytes(std::max(int64_t{2} * d.ffn, d.q_dim + 2 * d.kv_dim) * C)});
  plan.items.push_back({"FP8 codes of one projection group's input and output gradient (both layouts)",
                        MemoryKind::Workspace, device_arena_bytes(2 * n * in + 2 * n * rows)});
}

GpuMemory gpu_memory_plan(const LlamaConfig& c, const MemoryLayout& asked) {
  GpuMemory m;
  // FP8 on a layout the engine runs with it: its plan, FP8 buffers included.
  if (asked.fp8 != Fp8Mode::Off && support(c, asked, Device::Cuda).runs()) {
    try {
      m.plan = plan_gpu_memory(c, asked);
      return m;
    } catch (const Error&) {
      // planned as designed below, with the reason
    }
  }
  // Elsewhere: the engine's plan of the same layout in bf16, and the FP8 buffers of the design beside it.
  MemoryLayout l = asked;
  l.fp8 = Fp8Mode::Off;
  try {
    m.plan = plan_gpu_memory(c, l);
  } catch (const Error& e) {
    m.engines = false, m.refusal = e.what();
    m.plan = design_gpu_memory(c, l);
  }
  // What the CUDA engine does not run yet (model/support.h: pipeline stages at ZeRO-2 and 3, a quantized base that is
  // int8, at tp > 1 or sharded at ZeRO-3) is planned as designed. Sequence parallelism is priced as the engine runs it
  // (a bf16 all-gather before the column-parallel GEMMs, a bf16 reduce-scatter after the row-parallel ones).
  if (m.engines)
    if (const Support s = support(c, l, Device::Cuda); !s.runs()) m.engines = false, m.refusal = s.reason;
  if (asked.fp8 != Fp8Mode::Off) {
    add_fp8_buffers(c, place_layout(c, asked), m.plan);
    if (const Support s = support(c, asked, Device::Cuda); m.engines && !s.runs()) m.engines = false, m.refusal = s.reason;
  }
  return m;
}

// A plan's peak, memoized: a search and its suggestions ask for the same plans many times (an 80-layer plan has a
// thousand items; a pipeline layout has a plan per stage). The plan itself is made again for the one printed.
struct GpuPeak {
  int64_t peak = 0;
  bool engines = true;
  std::string refusal;
};

const GpuPeak& gpu_peak(const LlamaConfig& c, const MemoryLayout& l) {
  static std::map<std::string, GpuPeak> cache;
  static std::mutex mutex;
  const std::string key = str(c.hidden_size, ",", c.intermediate_size, ",", c.num_hidden_layers, ",",
                              c.num_attention_heads, ",", c.num_key_value_heads, ",", c.head_dim, ",", c.vocab_size, ",",
                              c.tie_word_embeddings, "|", l.dp, ",", l.tp, ",", l.dp_rank, ",", l.tp_rank, ",", l.zero,
                              ",", l.zero_prefetch, ",", recompute_name(l.recompute), ",", l.bf16_moments, ",",
                              l.master_weights, ",", l.training, ",", l.micro_batch, ",", l.seq_len, ",", l.lora.rank,
                              ",", l.lora.targets, ",", l.lora.dropout, ",", base_quant_name(l.lora.base_quant), ",",
                              l.pp, ",", l.pp_rank, ",", l.sp, ",", static_cast<int>(l.attention), ",",
                              fp8_mode_name(l.fp8), ",", l.fp8_forward_codes);
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  const GpuMemory m = gpu_memory_plan(c, l);
  std::lock_guard<std::mutex> lock(mutex);
  return cache.emplace(key, GpuPeak{m.plan.peak(), m.engines, m.refusal}).first->second;
}

// Tensor-parallel rank 0's layout, kept for the next prediction of the same model and tp (a search makes thousands).
const ParamLayout& tp_rank0_layout(const LlamaConfig& c, int64_t tp) {
  thread_local std::map<std::string, std::unique_ptr<const ParamLayout>> cache;
  const std::string key = c.to_json().dump() + str("|", tp);
  auto it = cache.find(key);
  if (it != cache.end()) return *it->second;
  if (cache.size() >= 64) cache.clear();
  return *cache.emplace(key, std::make_unique<const ParamLayout>(c, 0, static_cast<int>(tp))).first->second;
}

// Rates measured on one card, applied to another: compute-bound rates by the ratio of bf16 peaks, memory-bound
// ones by the ratio of HBM bandwidths.
struct Scaling {
  double compute = 1, memory = 1;
  std::string note;
};

Scaling scaling_for(const Rates& r, const GpuKind& gpu) {
  Scaling s;
  if (gpu.name == r.device) return s;
  const GpuKind& measured = find_gpu(r.device);
  s.compute = gpu.peak_bf16_flops / measured.peak_bf16_flops;
  s.memory = gpu.hbm_bytes_per_s / measured.hbm_bytes_per_s;
  s.note = str("rates measured on ", r.device, ", scaled to ", gpu.name, " (compute x", format_number(s.compute, 2),
               " by bf16 peak, memory-bound x", format_number(s.memory, 2), " by HBM bandwidth): unmeasured on ", gpu.name);
  return s;
}

double ring_factor_all_reduce(int64_t n) { return n > 1 ? 2.0 * double(n - 1) / double(n) : 0.0; }
double ring_factor_gather(int64_t n) { return n > 1 ? double(n - 1) / double(n) : 0.0; }

}  // namespace

namespace {

// ---- one layout's prediction, step by step (predict_layout at the end lists the steps) ----

// The job's own checks: the layout on this cluster, the batch, and what the adapters ask of the model.
void check_job(const JobSpec& job) {
  const LlamaConfig& c = job.model;
  const MemoryLayout& l = job.layout;
  const Cluster& k = job.cluster;
  // The layout itself (model/support.h); one the CUDA engine does not run yet is priced as designed.
  require_valid(c, l, Device::Cuda);
  if (l.dp * l.pp * l.tp != k.gpus())
    fail("layout dp ", l.dp, l.pp > 1 ? str(" x pp ", l.pp) : std::string(), " x tp ", l.tp, " is ", l.dp * l.pp * l.tp,
         " ranks, but the cluster has ", k.gpus(), " GPUs (", k.nodes, " nodes x ", k.gpus_per_node, ")");
  if (l.tp > k.gpus_per_node || k.gpus_per_node % l.tp != 0)
    fail("--tp ", l.tp, ": tensor-parallel ranks must sit inside a node and divide its ", k.gpus_per_node, " GPUs");
  if (l.seq_len > c.max_context())
    fail("--seq_len ", l.seq_len, " exceeds the model's context ", c.max_context(),
         " (max_position_embeddings, times a dynamic or yarn rope's factor); --rope_scaling TYPE:FACTOR extends it");
  if (job.grad_accum < 1) fail("--grad_accum: expected >= 1, found ", job.grad_accum);
  // Fewer micro-batches than stages run (the trainer takes them): the pipe never fills, and m + pp - 1 periods still
  // price the step; the memory plan holds the stages' slots whatever m is, as the engine's does.
  check_lora_plan(c, l.lora, "build/plan --lora_rank, --lora_targets, --lora_dropout, --base_quant");
}

// Memory per stage: every stage's plan; the fullest is the one shown, and the layout fits when it does.
void plan_stage_memory(const JobSpec& job, bool keep_plan, Prediction& p) {
  const MemoryLayout& l = job.layout;
  const Cluster& k = job.cluster;
  p.gpu_bytes = -1;
  for (int64_t s = 0; s < l.pp; s++) {
    MemoryLayout stage = l;
    stage.pp_rank = s;
    const GpuPeak& memory = gpu_peak(job.model, stage);
    const double bytes = double(memory.peak) + k.reserve_bytes;
    p.stage_gpu_bytes.push_back(bytes);
    if (bytes > p.gpu_bytes) {
      p.gpu_bytes = bytes, p.fullest_stage = s;
      p.memory_is_engines = memory.engines, p.not_implemented = memory.refusal;
    }
  }
  p.fits = p.gpu_bytes <= k.gpu.hbm_bytes;
  if (keep_plan) {
    MemoryLayout stage = l;
    stage.pp_rank = p.fullest_stage;
    p.memory = gpu_memory_plan(job.model, stage).plan;
  }
}

// Adapters of one layer that read one input: q|k|v share the attention's, gate|up the MLP's; o and down their own.
struct AdapterGroup {
  int64_t in = 0, width = 0;  // input features; summed rank of its targets (the tp all-reduce's width)
  bool column = true;
};

// The step's figures for one micro-batch on one GPU of tp rank 0 (the compute items): each layer's kernels and the
// head's, from the measured rates scaled to the card; and the tensor-parallel collectives inside a stage.
struct StepModel {
  StepModel(const JobSpec& job, const Rates& rates);

  const JobSpec& job;
  const Rates& rates;
  const LlamaConfig& c;
  const MemoryLayout& l;
  const Cluster& k;
  const Scaling scale;
  const ParamLayout& layout;  // tp rank 0's
  const int64_t n, C, qd, kvd, F, V;
  const LoraPlan& lora;
  const bool adapters;
  const bool fp8;
  const double copy_rate, A;

  // The layer GEMMs' time: at the bf16 rates, or with --fp8 at the FP8 ones (Rates::gemm_fp8).
  double gemm_time(int64_t in, int64_t out, int pass) const {
    const double rate = fp8 ? rates.gemm_fp8(n, in, out, pass) : rates.gemm(n, in, out, pass);
    return 2.0 * double(n) * double(in) * double(out) / (rate * scale.compute);
  }
  double mem_time(double bytes, const char* kernel) const { return bytes / (rates.memory_rate(kernel) * scale.memory); }

  // One micro-batch, one layer.
  double layer_fwd_gemm = 0, layer_bwd_gemm = 0;
  double lora_fwd = 0, lora_bwd = 0, lora_fwd_bytes = 0, lora_bwd_bytes = 0;
  int64_t lora_layer = 0;
  std::vector<AdapterGroup> groups;
  double dequant = 0;
  int64_t layer_quantized_bytes = 0, layer_quantized_elements = 0;
  double doc_tokens = 0;
  int64_t span = 0;
  double att_fwd = 0, att_bwd = 0;
  double norm_fwd = 0, norm_bwd = 0, layer_mem_fwd = 0, layer_mem_bwd = 0;
  double recompute = 0, head = 0, layer_kernels = 0;
  // Preference objectives: the log-probs pass runs the head's logits once more (the weighted backward recomputes
  // them); DPO with adapters adds the reference, the base's forward with the adapters off, per micro-batch; DPO of a
  // full fine-tune precomputes the reference once before training.
  bool preference = false, reference_forward = false, precompute = false;
  double head_fwd = 0, logps_head = 0, layer_fwd = 0, reference_layer = 0, reference_head = 0;
  double fp8_cast = 0, fp8_cast_bytes = 0, fp8_weight_bytes = 0;  // --fp8: one layer's casts per micro-batch
  double fp8_weight_casts = 0;  // --fp8: a layer's weight casts per micro-batch
  double fp8_transposed_bytes = 0;  // --fp8_weight_codes forward: a layer's transposed cast per micro-batch
  // Tensor parallel.
  double tp_bytes = 0, tp_one = 0, regather = 0, regather_exposed = 0, adapter_tp_layer = 0;
  double fp8_tp_maxima = 0, fp8_tp_layer = 0;  // --fp8 under tp: a layer's amax maxima per micro-batch, their time
  bool sp = false;

  // One micro-batch through one stage: its layers, and the head on the last stage (the embedding lookup costs
  // nothing here). Under 1F1B every stage runs at the pace of the slowest one.
  double micro_kernels(const PipelineStage& s) const {
    return double(s.layers()) * (layer_kernels + reference_layer) + (s.head ? head + logps_head + reference_head : 0.0);
  }
  // Tensor parallel, on the critical path inside a node: per layer two collectives of a bf16 [tokens, hidden] in the
  // forward and two in the backward (two more in a full recompute's forward), one for the vocab-parallel embedding and
  // one for the head. Without sp each is an all-reduce; with sp an all-gather before a column-parallel GEMM and a
  // reduce-scatter after a row-parallel one, the all-reduce's bytes in two collectives (two latencies).
  double tp_count(const PipelineStage& s) const {
    const bool full = l.recompute == Recompute::Full;
    return l.tp > 1 ? double(4 * s.layers() + s.embedding + s.head + (full ? 2 * s.layers() : 0)) : 0.0;
  }
  // A stage's micro-batch period: its kernels with their launch gaps and its exposed tp collectives.
  double period(const PipelineStage& s) const {
    return micro_kernels(s) * (1 + rates.overhead) + tp_count(s) * tp_one +
           double(s.layers()) * (adapter_tp_layer + fp8_tp_layer + regather_exposed);
  }
  // Where the ranks sit: rank = (dp_rank x pp + stage) x tp + tp_rank (comm/comm.h Mesh), gpus_per_node to a node.
  int64_t node_of(int64_t dp_rank, int64_t stage) const { return (dp_rank * l.pp + stage) * l.tp / k.gpus_per_node; }

 private:
  void time_adapters();
  void time_layer();
  void time_tensor_parallel();
};

StepModel::StepModel(const JobSpec& job, const Rates& rates)
    : job(job), rates(rates), c(job.model), l(job.layout), k(job.cluster), scale(scaling_for(rates, job.cluster.gpu)),
      layout(tp_rank0_layout(job.model, job.layout.tp)), n(l.micro_batch * l.seq_len), C(c.hidden_size),
      qd(layout.tp().q_dim), kvd(layout.tp().kv_dim), F(layout.tp().ffn), V(layout.tp().vocab), lora(l.lora),
      adapters(lora.enabled()), fp8(l.fp8 != Fp8Mode::Off), copy_rate(rates.copy_bytes_per_s * scale.memory), A(double(job.grad_accum)) {
  if (fp8 && rates.fp8_ratio <= 0)
    fail("option 'fp8': the rates table has no gemm_fp8 section (the FP8 GEMM rates); plan/plan_rates.json has one");
  time_layer();
  time_tensor_parallel();
}

// Adapters: 6 FLOPs per adapter weight and token, in GEMMs r wide. Those move more bytes than they compute: each
// reads or accumulates into a [tokens, in] or [tokens, out] activation. A GEMM group reads its input once (q|k|v's A
// share x, as do gate|up's) unless dropout draws a mask per target. Forward: read x, write A x, read it and accumulate
// B A x into the base's output (read and write); backward: read dy twice (dB and B^T dy), read x for dA, accumulate
// A's share into dx. With the skinny GEMMs measured (gpu-check's BM_GemmAdapter: Rates::adapter_shapes) each target's
// six products are priced at the nearest measured shape, as the GPU model runs them (one target at a time), and its
// dropout at the copy bandwidth; until then at the larger of the FLOPs at the layer GEMM rates and the bytes at the
// copy bandwidth (the roofline), which a plan marks as not measured.
void StepModel::time_adapters() {
  const std::vector<LoraTargetShape> shapes = lora_layer_shapes(c, lora, l.tp);
  lora_layer = lora_layer_params(c, lora, l.tp);
  const double tokens = double(n), r = double(lora.rank);
  const auto group_of = [](const std::string& m) {
    return m == "o_proj" ? 1 : m == "gate_proj" || m == "up_proj" ? 2 : m == "down_proj" ? 3 : 0;
  };
  int last_group = -1;
  for (const LoraTargetShape& t : shapes) {
    const bool shares_input = lora.dropout == 0 && group_of(t.module) == last_group;
    last_group = group_of(t.module);
    if (!shares_input) groups.push_back({t.in, 0, t.column_parallel});
    groups.back().width += lora.rank;
    lora_fwd_bytes += tokens * (4 * r + 4 * double(t.out));
    lora_bwd_bytes += tokens * (4 * r + 4 * double(t.out));
    if (lora.dropout > 0)  // dropout(x) written in the forward and again for dA, from the kept bit mask
      lora_fwd_bytes += tokens * double(t.in) * 4.125, lora_bwd_bytes += tokens * double(t.in) * 4.125;
  }
  for (const AdapterGroup& g : groups) lora_fwd_bytes += tokens * 2 * double(g.in), lora_bwd_bytes += tokens * 6 * double(g.in);
  const double flops = 2.0 * tokens * double(lora_layer);
  if (rates.adapter_shapes.empty()) {
    lora_fwd = std::max(flops / (rates.gemm_fwd * scale.compute), lora_fwd_bytes / copy_rate);
    lora_bwd = std::max(2 * flops / (rates.gemm_bwd * scale.compute), lora_bwd_bytes / copy_rate);
    return;
  }
  lora_fwd = lora_bwd = 0;
  const auto product = [&](int64_t in, int64_t out, int pass) {
    return 2.0 * tokens * double(in) * double(out) / (rates.gemm_adapter(n, in, out, pass) * scale.compute);
  };
  for (const LoraTargetShape& t : shapes) {
    lora_fwd += product(t.in, lora.rank, 0) + product(lora.rank, t.out, 0);       // A x, then B u into y
    lora_bwd += product(lora.rank, t.out, 2) + product(lora.rank, t.out, 1) +     // dB, B^T dy
                product(t.in, lora.rank, 2) + product(t.in, lora.rank, 1);        // dA, A^T du into dx
    if (lora.dropout > 0) lora_fwd += tokens * double(t.in) * 4.125 / copy_rate, lora_bwd += tokens * double(t.in) * 4.125 / copy_rate;
  }
}

void StepModel::time_layer() {
  // The GPU model's GEMMs: q|k|v and gate|up fused (one GEMM over each adjacent weight block), o_proj, down_proj.
  // A frozen weight (adapters) has no weight-gradient GEMM: 4 FLOPs per weight and token instead of 6.
  const std::vector<std::pair<int64_t, int64_t>> gemms = {{C, qd + 2 * kvd}, {qd, C}, {C, 2 * F}, {F, C}};
  for (const auto& [in, out] : gemms) {
    layer_fwd_gemm += gemm_time(in, out, 0);
    layer_bwd_gemm += gemm_time(in, out, 1) + (adapters ? 0.0 : gemm_time(in, out, 2));
  }
  if (adapters) time_adapters();
  // --fp8 tensorwise: the casts, memory-bound at their measured (or assumed) share of the copy bandwidth. Per
  // micro-batch: each group's output gradient read in bf16 and written in e5m2 in both layouts (4 bytes an element),
  // the attention output likewise in e4m3, and the codes the norms and SwiGLU write beside their bf16 outputs, the
  // amax and cast fused in (both layouts: 2). The weights' amax pass and cast to both layouts (6 bytes a weight; 5 with
  // --fp8_weight_codes forward, one layout): where the engine keeps every layer's codes, the trained weights' once
  // per step (a grad_accum-th of it per micro-batch) and a frozen base's once per run; where it keeps one layer's
  // (ZeRO-3, a quantized base: model/memory_plan.h fp8_casts_at_each_use), at each use, the forward's and the backward's of
  // every micro-batch. --fp8_weight_codes forward casts the transposed codes again before each backward (3 bytes).
  if (fp8) {
    double outs = 0, weights = 0;
    for (const auto& [in, out] : gemms) outs += double(out), weights += double(in) * double(out);
    fp8_cast_bytes = double(n) * (4.0 * outs + 4.0 * double(qd) + 2.0 * double(2 * C + F));
    fp8_weight_bytes = (l.fp8_forward_codes ? 5.0 : 6.0) * weights;
    fp8_transposed_bytes = l.fp8_forward_codes ? 3.0 * weights : 0.0;
    fp8_weight_casts = fp8_casts_at_each_use(l) ? 2.0 : adapters ? 0.0 : 1.0 / A;
    fp8_cast = mem_time(fp8_cast_bytes + fp8_weight_bytes * fp8_weight_casts + fp8_transposed_bytes, "fp8_cast");
  }
  // QLoRA: each use of a layer's weights dequantizes them into one bf16 buffer, memory-bound (read the stored bytes,
  // write 2 per weight) at the measured copy bandwidth: once in the forward, once in the backward, once in a full
  // recompute.
  if (adapters && lora.base_quant != BaseQuant::None) {
    for (const ParamTensor& t : layout.tensors())
      if (t.layer == 0 && base_tensor_quantized(t))
        layer_quantized_bytes += base_storage_bytes(t, lora.base_quant), layer_quantized_elements += t.numel;
    dequant = double(layer_quantized_bytes + 2 * layer_quantized_elements) / copy_rate;
  }
  // Causal attention inside documents of `span` tokens: each query sees span / 2 keys on average, and the kernels
  // run at the rate measured for causal attention of that length (their blocks are those of a span-long row).
  doc_tokens = job.mean_doc_tokens > 0 ? std::min<double>(job.mean_doc_tokens, double(l.seq_len)) : double(l.seq_len);
  span = std::max<int64_t>(1, std::llround(doc_tokens));
  const double att_flops = 4.0 * double(l.micro_batch) * double(layout.tp().heads) * double(l.seq_len) * doc_tokens /
                           2 * double(c.head_dim);
  att_fwd = att_flops / (rates.attention_rate(c.head_dim, span, false) * scale.compute);
  att_bwd = 2.5 * att_flops / (rates.attention_rate(c.head_dim, span, true) * scale.compute);
  // sp: the norms run on each tp rank's seq / tp rows.
  const double norm_rows = l.sp ? double(n) / double(l.tp) : double(n);
  norm_fwd = mem_time(norm_rows * (4.0 * C + 4), "rmsnorm_fwd");
  norm_bwd = mem_time(norm_rows * 8.0 * C, "rmsnorm_bwd");
  const double rope = mem_time(4.0 * double(n) * double(qd + kvd), "rope");
  const double swiglu_fwd = mem_time(6.0 * double(n) * F, "swiglu_fwd"), swiglu_bwd = mem_time(10.0 * double(n) * F, "swiglu_bwd");
  layer_mem_fwd = 2 * norm_fwd + rope + swiglu_fwd, layer_mem_bwd = 2 * norm_bwd + rope + swiglu_bwd;
  if (l.recompute == Recompute::Full) recompute = layer_fwd_gemm + lora_fwd + dequant + att_fwd + layer_mem_fwd;
  if (l.recompute == Recompute::Selective) recompute = 2 * norm_fwd + swiglu_fwd;
  // The loss head, once per micro-batch (vocab-parallel under tp); a frozen head has no weight gradient.
  const double head_flops = 2.0 * double(n) * double(C) * double(V);
  head = (adapters ? 2 : 3) * head_flops / (rates.lm_head * scale.compute) + mem_time(4.0 * double(n) * V, "classifier") +
         norm_fwd + norm_bwd;
  layer_kernels = layer_fwd_gemm + layer_bwd_gemm + lora_fwd + lora_bwd + 2 * dequant + att_fwd + att_bwd +
                  layer_mem_fwd + layer_mem_bwd + recompute + fp8_cast;
  preference = job.objective != "sft";
  if (preference && job.objective != "dpo" && job.objective != "simpo" && job.objective != "orpo")
    fail("plan: option 'objective': expected sft, dpo, simpo or orpo, found '", job.objective, "'");
  reference_forward = job.objective == "dpo" && adapters;
  precompute = job.objective == "dpo" && !adapters;
  head_fwd = head_flops / (rates.lm_head * scale.compute) + mem_time(4.0 * double(n) * V, "classifier");
  logps_head = preference ? head_fwd : 0.0;
  layer_fwd = layer_fwd_gemm + dequant + att_fwd + layer_mem_fwd;  // one layer's forward alone
  reference_layer = reference_forward ? layer_fwd : 0.0;
  reference_head = reference_forward ? head_fwd + norm_fwd : 0.0;
}

void StepModel::time_tensor_parallel() {
  tp_bytes = 2.0 * double(n) * double(C);  // one bf16 [tokens, hidden] tensor
  tp_one = ring_factor_all_reduce(l.tp) * tp_bytes / k.intra_busbw + (l.sp ? 20e-6 : 10e-6);
  // sp keeps a norm's output split: the backward gathers it again for the weight gradient of q|k|v and of gate|up,
  // while the input-gradient GEMM of the same weights runs (Megatron's overlap): what outlasts that GEMM is exposed.
  sp = l.sp && l.tp > 1;
  regather = sp ? ring_factor_gather(l.tp) * tp_bytes / k.intra_busbw + 10e-6 : 0.0;
  regather_exposed = sp ? std::max(0.0, regather - gemm_time(C, qd + 2 * kvd, 1)) +
                              std::max(0.0, regather - gemm_time(C, 2 * F, 1))
                        : 0.0;
  // The replicated adapter factor of each group needs its r-wide product summed over tp: B^T dy of a
  // column-parallel group (for dA), A x of a row-parallel target (for dB). One all-reduce per group and layer.
  if (l.tp > 1 && adapters)
    for (const AdapterGroup& g : groups)
      adapter_tp_layer += ring_factor_all_reduce(l.tp) * 2.0 * double(n) * double(g.width) / k.intra_busbw + 10e-6;
  // --fp8 under tp: each amax of a split tensor is a maximum over the tp group (model/fp8_gpu.h fp8_operand_split), a
  // 4-byte all-reduce, latency-bound: per layer and micro-batch the row-parallel inputs and the column-parallel output
  // gradients (4), with sp the other four too, and the four weight groups' at each weight cast.
  if (l.tp > 1 && fp8) {
    fp8_tp_maxima = (sp ? 8.0 : 4.0) + 4.0 * fp8_weight_casts;
    fp8_tp_layer = fp8_tp_maxima * 10e-6;
  }
}

// The stage whose micro-batch period is longest: under 1F1B it sets every stage's pace.
int64_t slowest_stage(const StepModel& m, const std::vector<PipelineStage>& stages) {
  int64_t slow = 0;
  for (int64_t s = 1; s < m.l.pp; s++)
    if (m.period(stages[s]) > m.period(stages[slow])) slow = s;
  return slow;
}

// The data-parallel link: whether a dp group spans nodes, and that link's bandwidth, name and latency.
struct DpLink {
  bool across = false;
  double bw = 0, latency = 0;
  std::string name;
};

DpLink dp_link(const StepModel& m) {
  const MemoryLayout& l = m.l;
  DpLink d;
  for (int64_t dr = 1; dr < l.dp; dr++)
    for (int64_t s = 0; s < l.pp; s++) d.across |= m.node_of(dr, s) != m.node_of(0, s);
  d.bw = d.across ? m.k.inter_busbw : m.k.intra_busbw;
  d.name = d.across ? m.k.inter_note : m.k.intra_note;
  d.latency = (d.across ? 25e-6 : 10e-6) * (l.dp > 1 ? 1 : 0);
  return d;
}

// A stage's optimizer and data-parallel collectives, over its own parameters (with adapters, pp 1: this rank's piece
// of each layer's adapters).
struct Tail {
  int64_t owned = 0;
  double adamw = 0, grad_norm = 0, dp_s = 0, dp_hidden = 0, overlap = 0, kernels = 0;
  double base_bytes = 0;  // with adapters: the stage's frozen base, in its stored bytes (per tp rank)
  std::string dp_what;
  double length(double overhead) const { return (adamw + grad_norm) * (1 + overhead) + dp_s - dp_hidden; }
};

Tail tail_of(const StepModel& m, const DpLink& link, const PipelineStage& stage) {
  const MemoryLayout& l = m.l;
  const bool adapters = m.adapters;
  const double A = m.A, bw = link.bw, latency = link.latency;
  const double g = ring_factor_gather(l.dp), ar = ring_factor_all_reduce(l.dp);
  const std::string what = adapters ? "layer's adapter" : "unit";
  Tail t;
  int64_t params = 0, unit_count = 0;
  for (int u : pipeline_stage_units(m.layout, stage)) {
    const auto [begin, end] = m.layout.unit_range(u);
    params += end - begin, unit_count++;
    t.owned += l.zero >= 1 ? shard_range(end - begin, 0, static_cast<int>(l.dp)).size() : end - begin;
    if (adapters)
      for (const ParamTensor& x : m.layout.tensors())
        if (x.offset >= begin && x.offset < end) t.base_bytes += double(base_storage_bytes(x, m.lora.base_quant));
  }
  // With adapters: the stage's layers' adapters (a stage holds its own, model/lora.h).
  const int64_t stage_layers = stage.layers();
  if (adapters)
    t.owned = stage_layers * (l.zero >= 1 ? shard_range(m.lora_layer, 0, static_cast<int>(l.dp)).size() : m.lora_layer);
  t.adamw = m.mem_time(double(t.owned) * (4 + 2 * 4 + 4 * (l.bf16_moments ? 2 : 4) + 2),
                       l.bf16_moments ? "adamw_bf16" : "adamw_fp32");
  t.grad_norm = m.mem_time(4.0 * double(t.owned), "grad_norm");
  t.kernels = A * m.micro_kernels(stage) + t.adamw + t.grad_norm;
  // With adapters only their gradients cross dp (one unit per layer); at ZeRO-3 the frozen base's units are
  // gathered too, in their stored bytes.
  const double grads = adapters ? double(stage_layers * m.lora_layer) : double(params);
  const double units = adapters ? double(stage_layers) : double(unit_count);
  switch (l.zero) {
    case 0:
      t.dp_s = ar * 4.0 * grads / bw + latency * units;
      t.dp_what = adapters ? "all-reduce of the adapters' fp32 gradients after the backward"
                           : "all-reduce of the fp32 gradients after the backward";
      break;
    case 1:
      t.dp_s = g * (4.0 + 4.0) * grads / bw + 2 * latency * units;
      t.dp_what = str("reduce-scatter of the ", adapters ? "adapters' " : "",
                      "fp32 gradients, all-gather of the weights (fp32, through the gradient buffer)");
      break;
    case 2:
      t.dp_s = A * (g * 4.0 * grads / bw + latency * units) + g * 2.0 * grads / bw + latency * units;
      t.dp_what = str("per micro-batch a reduce-scatter of each ", what,
                      "'s fp32 gradient; after the step an all-gather of the ", adapters ? "adapters' " : "",
                      "bf16 weights");
      break;
    default:
      if (adapters) {
        const double base_units = double(unit_count);
        t.dp_s = A * (g * 2.0 * t.base_bytes / bw + 2 * latency * base_units + g * 4.0 * grads / bw + latency * units) +
                 g * 2.0 * grads / bw + latency * units;
        t.dp_what = str("per micro-batch two all-gathers of each unit of the frozen base (",
                        m.lora.base_quant == BaseQuant::None ? "bf16" : base_quant_name(m.lora.base_quant), ", ",
                        human_bytes(t.base_bytes), " per tp rank) and a reduce-scatter of each layer's adapter gradient");
      } else {
        t.dp_s = A * (g * (2.0 + 2.0 + 4.0) * grads / bw + 3 * latency * units);
        t.dp_what =
            "per micro-batch two all-gathers of each unit's bf16 weights and a reduce-scatter of its fp32 gradient";
      }
  }
  // What the engine hides behind compute: ZeRO-0/1 on cuda communicate after the backward (nothing hidden);
  // ZeRO-2/3 as designed overlap every unit but the first gather and the last reduce-scatter.
  t.overlap = m.job.overlap ? *m.job.overlap : l.zero <= 1 ? 0.0 : 1.0 - 2.0 / (units + 2);
  t.dp_hidden = std::min(t.dp_s * t.overlap, t.kernels);
  return t;
}

// The step ends with the stage whose tail is longest.
std::pair<Tail, int64_t> longest_tail(const StepModel& m, const DpLink& link, const std::vector<PipelineStage>& stages) {
  int64_t tail_stage = 0;
  Tail tail = tail_of(m, link, stages[0]);
  for (int64_t s = 1; s < m.l.pp; s++) {
    const Tail t = tail_of(m, link, stages[s]);
    if (t.length(m.rates.overhead) > tail.length(m.rates.overhead)) tail = t, tail_stage = s;
  }
  return {tail, tail_stage};
}

// The compute items of one optimizer step on the slowest stage (st), and the tail's optimizer.
void add_compute_items(const StepModel& m, const PipelineStage& st, const Tail& tail, int64_t tail_stage,
                       Prediction& p) {
  const MemoryLayout& l = m.l;
  const Rates& rates = m.rates;
  const bool adapters = m.adapters;
  const double A = m.A, Ls = double(st.layers());
  const double kernels = A * m.micro_kernels(st) + tail.adamw + tail.grad_norm;
  p.compute = {
      {"layer GEMMs", A * Ls * (m.layer_fwd_gemm + m.layer_bwd_gemm),
       str(adapters ? "frozen: forward and input gradient, no weight gradient; " : "",
           m.fp8 ? str("FP8 (--fp8 ", fp8_mode_name(l.fp8), "): ",
                       rates.fp8_measured ? "at the measured FP8 shapes; bf16 "
                                          : str(format_number(rates.fp8_ratio, 2), "x bf16 (a published ratio, not "
                                                "measured); bf16 ")) : std::string(),
           rates.gemm_shapes.empty() ? "at the measured layer rates, " : "at the nearest measured shapes, ",
           format_number(rates.gemm_fwd / 1e12, 0), "/", format_number(rates.gemm_bwd / 1e12, 0), " TFLOP/s fwd/bwd")},
  };
  if (m.fp8)
    p.compute.push_back({"FP8 casts", A * Ls * m.fp8_cast,
                         str(human_bytes(m.fp8_cast_bytes), " per layer and micro-batch (output gradients, attention "
                             "output, the fused norm and SwiGLU codes)",
                             m.fp8_weight_casts == 0 ? std::string("; the frozen base's weight codes cast once per run")
                             : m.fp8_weight_casts < 1
                                 ? str(", and ", human_bytes(m.fp8_weight_bytes), " per layer and step (the weights)")
                                 : str(", and ", human_bytes(m.fp8_weight_bytes), " per layer at each use (the weights, ",
                                       "one layer's codes kept: a forward's and a backward's cast a micro-batch)"),
                             m.fp8_transposed_bytes > 0
                                 ? str(", and ", human_bytes(m.fp8_transposed_bytes), " per layer and micro-batch (the "
                                       "transposed weight codes, --fp8_weight_codes forward)")
                                 : std::string(),
                             ", at ", format_number(100 * rates.memory_rate("fp8_cast") / rates.copy_bytes_per_s, 0),
                             "% of the copy bandwidth")});
  if (adapters)
    p.compute.push_back(
        {"adapter GEMMs", A * Ls * (m.lora_fwd + m.lora_bwd),
         str(human_count(double(m.lora_layer * st.layers())), " adapter weights on this GPU (", describe_lora(m.lora),
             "): ", format_number(2.0 * double(m.n) * double(m.lora_layer) * 3 / 1e9, 2), " GFLOP and ",
             human_bytes(m.lora_fwd_bytes + m.lora_bwd_bytes), " per layer and micro-batch, ",
             !rates.adapter_shapes.empty()
                 ? "each product at the nearest measured adapter shape (gpu-check's BM_GemmAdapter)"
             : m.lora_fwd_bytes + m.lora_bwd_bytes > 0 &&
                     (m.lora_fwd_bytes + m.lora_bwd_bytes) / m.copy_rate >
                         3 * 2.0 * double(m.n) * double(m.lora_layer) / (rates.gemm_bwd * m.scale.compute)
                 ? "bound by the bytes at the copy bandwidth (r-wide GEMMs; roofline, not measured)"
                 : "bound by the FLOPs (roofline, not measured)")});
  if (m.dequant > 0)
    p.compute.push_back({"dequantization", A * Ls * 2 * m.dequant,
                         str(base_quant_name(m.lora.base_quant), " to bf16 per layer and use (forward, backward",
                             l.recompute == Recompute::Full ? "; a full recompute's third is under recompute" : "", "): ",
                             human_bytes(double(m.layer_quantized_bytes)), " read and ",
                             human_bytes(2.0 * double(m.layer_quantized_elements)), " written at the copy bandwidth")});
  const LlamaConfig& c = m.c;
  const std::vector<TimeItem> rest = {
      {"attention", A * Ls * (m.att_fwd + m.att_bwd),
       str("hd ", c.head_dim, ", seq ", l.seq_len,
           m.span < l.seq_len ? str(", documents of ", format_number(m.doc_tokens, 0), " tokens (masked)") : std::string(),
           ": ", format_number(rates.attention_rate(c.head_dim, m.span, false) / 1e12, 0), "/",
           format_number(rates.attention_rate(c.head_dim, m.span, true) / 1e12, 0), " TFLOP/s fwd/bwd")},
      {"norms, RoPE, SwiGLU", A * Ls * (m.layer_mem_fwd + m.layer_mem_bwd),
       str("memory-bound, at their measured share of the copy bandwidth", m.sp ? "; the norms on seq / tp rows (sp)" : "")},
      {"loss head", st.head ? A * m.head : 0.0,
       str("lm_head at ", format_number(rates.lm_head / 1e12, 0), " TFLOP/s, cross-entropy",
           adapters ? "; frozen: no weight gradient" : "")},
      {"preference: log-probs pass", st.head ? A * m.logps_head : 0.0,
       m.preference ? str(m.job.objective, ": the head's logits once more (per-token log-probs, then the backward with "
                                           "per-token weights)")
                    : "none (sft)"},
      {"reference forward", A * (Ls * m.reference_layer + (st.head ? m.reference_head : 0.0)),
       m.reference_forward ? "DPO with adapters: the base's forward with the adapters off, per micro-batch"
       : m.precompute      ? "none per step: precomputed once (below)"
                           : "none"},
      {"recompute", A * Ls * m.recompute,
       l.recompute == Recompute::None ? "none" : str(recompute_name(l.recompute), " recompute")},
      {"AdamW and gradient norm", tail.adamw + tail.grad_norm,
       str(human_count(double(tail.owned)), adapters ? " adapter parameters owned" : " parameters owned",
           l.pp > 1 ? str(" (stage ", tail_stage, ")") : std::string())},
      {"launch gaps", kernels * rates.overhead, str(format_number(100 * rates.overhead, 1), "% of kernel time, measured")},
  };
  p.compute.insert(p.compute.end(), rest.begin(), rest.end());
  p.compute_s = kernels * (1 + rates.overhead);
}

// Pipeline point to point: per micro-batch an activation forward and its gradient backward across each stage boundary
// (with sp each tp rank's rows), on a stream of their own: hidden behind the next micro-batch's compute but for the
// pipe's fill (the first activation through every boundary) and drain (the last gradient back), and for whatever a
// transfer outlasts a micro-batch period. Returns the sends' seconds and those exposed.
std::pair<double, double> add_pipeline_sends(const StepModel& m, const PipelineStage& st, Prediction& p) {
  const MemoryLayout& l = m.l;
  const Cluster& k = m.k;
  const double p2p_bytes = 2.0 * (m.sp ? double(m.n) / double(l.tp) : double(m.n)) * double(m.C);
  double worst = 0, fill_drain = 0;
  bool crosses = false;
  for (int64_t b = 0; b + 1 < l.pp; b++) {
    bool across_b = false;
    for (int64_t dr = 0; dr < l.dp; dr++) across_b |= m.node_of(dr, b) != m.node_of(dr, b + 1);
    const double one = p2p_bytes / (across_b ? k.inter_busbw : k.intra_busbw) + (across_b ? 25e-6 : 10e-6);
    worst = std::max(worst, one), fill_drain += 2 * one, crosses |= across_b;
  }
  const double p2p_s = m.A * 2 * worst;
  const double p2p_exposed = fill_drain + m.A * std::max(0.0, worst - m.period(st));
  p.communication.push_back(
      {"pipeline sends (1F1B)", p2p_s,
       str("per micro-batch an activation and its gradient, ", human_bytes(p2p_bytes), " each, across the slowest ",
           "stage boundary (", crosses ? k.inter_note : k.intra_note, "); ",
           format_number(p2p_s > 0 ? 100 * (1 - p2p_exposed / p2p_s) : 100, 0),
           "% hidden behind compute (exposed: the pipe's fill and drain)")});
  return {p2p_s, p2p_exposed};
}

// The communication items of one optimizer step on the slowest stage (st): tensor parallel, pipeline, data parallel
// (the tail's stage); their sum and what of it is exposed.
void add_communication_items(const StepModel& m, const PipelineStage& st, const DpLink& link, const Tail& tail,
                             int64_t tail_stage, Prediction& p) {
  const MemoryLayout& l = m.l;
  const Cluster& k = m.k;
  const double A = m.A, Ls = double(st.layers());
  const double tp_s = A * m.tp_count(st) * m.tp_one;
  if (l.tp > 1)
    p.communication.push_back(
        {m.sp ? "tensor-parallel all-gathers and reduce-scatters (sp)" : "tensor-parallel all-reduces", tp_s,
         str(format_number(m.tp_count(st), 0), m.sp ? " pairs" : "", " per micro-batch over ", l.tp, " GPUs, ",
             human_bytes(m.tp_bytes), " each", m.sp ? " gathered or scattered (the all-reduce's bytes)" : "", ", ",
             k.intra_note)});
  const double adapter_tp_s = A * Ls * m.adapter_tp_layer;
  if (l.tp > 1 && m.adapters)
    p.communication.push_back({"tensor-parallel adapter all-reduces", adapter_tp_s,
                               str(m.groups.size(), " per layer and micro-batch (r-wide: latency-bound), ", k.intra_note)});
  const double fp8_tp_s = A * Ls * m.fp8_tp_layer;
  if (fp8_tp_s > 0)
    p.communication.push_back({"FP8 amax maxima over tp", fp8_tp_s,
                               str(format_number(m.fp8_tp_maxima, 1), " per layer and micro-batch (4 bytes each: ",
                                   "latency-bound, 10 us), ", k.intra_note)});
  const double regather_s = A * Ls * 2 * m.regather, regather_exposed_s = A * Ls * m.regather_exposed;
  if (m.sp)
    p.communication.push_back(
        {"sequence-parallel backward re-gathers", regather_s,
         str("2 per layer and micro-batch (the norm outputs for the weight gradients of q|k|v and gate|up), ",
             format_number(regather_s > 0 ? 100 * (1 - regather_exposed_s / regather_s) : 100, 0),
             "% hidden behind the input-gradient GEMMs")});
  const auto [p2p_s, p2p_exposed] = l.pp > 1 ? add_pipeline_sends(m, st, p) : std::pair<double, double>(0, 0);
  if (l.dp > 1)
    p.communication.push_back({"data-parallel (ZeRO-" + std::to_string(l.zero) + ")", tail.dp_s,
                               str(tail.dp_what, l.pp > 1 ? str(" (stage ", tail_stage, "'s own)") : std::string(), "; ",
                                   link.name, "; ", format_number(100 * tail.overlap, 0), "% hidden behind compute",
                                   m.job.overlap ? " (--overlap)"
                                   : l.zero <= 1 ? " (ZeRO-0/1 communicate between passes: nothing hidden)"
                                                 : " (ZeRO-2/3 communicate on a stream of their own: all but the first "
                                                   "gather and the last reduce-scatter, assumed hidden)")});
  p.communication_s = tp_s + adapter_tp_s + fp8_tp_s + regather_s + p2p_s + tail.dp_s;
  p.exposed_s = tp_s + adapter_tp_s + fp8_tp_s + regather_exposed_s + p2p_exposed + tail.dp_s - tail.dp_hidden;
}

// The job's figures: the step's tokens and time over the cluster, MFU, the token budget's steps, wall time and cost,
// and the verdicts against the time limit and the budget.
void job_figures(const StepModel& m, Prediction& p) {
  const JobSpec& job = m.job;
  const MemoryLayout& l = m.l;
  const Cluster& k = m.k;
  p.tokens_per_step = double(l.micro_batch * l.seq_len) * m.A * double(l.dp);
  p.tokens_per_s_per_gpu = p.tokens_per_step / p.step_s / double(k.gpus());
  // Model FLOPs count the attention a token does: over its document (the mask), not the whole window.
  p.mfu = p.tokens_per_s_per_gpu *
          (m.adapters ? lora_flops_per_token(m.c, m.lora, m.span) : model_flops_per_token(m.c, m.span)) /
          k.gpu.peak_bf16_flops;
  p.steps = std::ceil(job.tokens / p.tokens_per_step);
  p.wall_s = p.steps * p.step_s;
  if (m.precompute) {
    // One forward of the data with the starting weights (no backward, no optimizer), over the budget's tokens as
    // the step's micro-batches take them, at the slowest stage's pace.
    const PipelineStage& st = p.stages[p.slowest_stage];
    p.precompute_s = p.steps * m.A * (double(st.layers()) * m.layer_fwd + (st.head ? m.head_fwd + m.norm_fwd : 0.0)) *
                     (1 + m.rates.overhead);
    p.wall_s += p.precompute_s;
    p.notes.push_back(str("DPO's reference (a full fine-tune): precomputed once before training, ",
                          format_number(p.precompute_s / 3600, 2), " h (a forward of every token), in the wall time"));
  }
  p.cost = p.wall_s / 3600 * double(k.gpus()) * job.price_per_gpu_hour;
  p.finishes = job.hours <= 0 || p.wall_s <= job.hours * 3600;
  p.within_budget = job.budget <= 0 || p.cost <= job.budget;
}

// The notes after the figures: the pipeline's split and bubble, where the frozen base lives (and whether the other
// choice would fit), and a layout whose memory is the design.
void add_notes(const StepModel& m, const Tail& tail, int64_t tail_stage, Prediction& p) {
  const MemoryLayout& l = m.l;
  if (l.pp > 1)
    p.notes.push_back(str("pipeline: ", format_pipeline_stages(p.stages), "; 1F1B over ", m.job.grad_accum,
                          " micro-batches: the bubble is (pp - 1) / m = ", format_number(100.0 * double(l.pp - 1) / m.A, 1),
                          "% of stage ", p.slowest_stage, "'s micro-batch time (it sets the pace)",
                          m.job.grad_accum < l.pp ? str("; fewer micro-batches than stages: the pipe never fills, ",
                                                        "give --grad_accum several times ", l.pp)
                                                  : std::string()));
  if (m.adapters) {
    // The frozen base whole on every dp rank needs no gathers; say which it is, and whether the other would fit.
    MemoryLayout other = l;
    other.zero = l.zero == 3 ? 2 : 3;
    const double other_bytes = double(gpu_peak(m.c, other).peak) + m.k.reserve_bytes;
    const bool other_fits = other_bytes <= m.k.gpu.hbm_bytes;
    const std::string base = str("the frozen base (", m.lora.base_quant == BaseQuant::None ? "bf16" : base_quant_name(m.lora.base_quant),
                                 ", ", gb(tail.base_bytes), l.tp > 1 ? " per tp rank" : "",
                                 l.pp > 1 ? str(" of stage ", tail_stage) : std::string(), ")");
    if (l.zero < 3 || l.dp == 1)
      p.notes.push_back(str(base, " is whole on every dp rank: no gathers", l.dp > 1 ? ", only the adapters' gradients cross dp" : ""));
    else
      p.notes.push_back(str(base, " is sharded by ZeRO-3 and gathered a unit at a time; whole on every dp rank (ZeRO-2) it ",
                            other_fits ? str("would fit too (", gb(other_bytes), " per GPU) without gathers")
                                       : str("does not fit (", gb(other_bytes), " per GPU)")));
  }
  if (m.adapters && m.rates.adapter_shapes.empty())
    p.notes.push_back("adapter GEMMs PLANNED, NOT MEASURED: priced from the roofline (their FLOPs at the layer GEMM "
                      "rates, their bytes at the copy bandwidth) until gpu-check measures the rank-16 products "
                      "(bench_gemm_gpu's BM_GemmAdapter); the frozen base's GEMMs are at the measured rates");
  if (m.fp8)
    p.notes.push_back(str("FP8 GEMM rates ", m.rates.fp8_measured ? "measured by gpu-check" :
                          str("PLANNED, NOT MEASURED: bf16's x ", format_number(m.rates.fp8_ratio, 2), ", a published "
                              "cuBLASLt FP8/bf16 ratio, until gpu-check measures them"),
                          "; the lm_head, attention, norms and optimizer as in bf16"));
  if (!p.memory_is_engines)
    p.notes.push_back("memory as designed, not the engine's plan: the CUDA engine refuses this layout today (" +
                      p.not_implemented + ")");
}

// keep_plan false: the prediction without its memory plan (the search ranks thousands of layouts by their figures).
Prediction predict_layout(const JobSpec& job, const Rates& rates, bool keep_plan) {
  check_job(job);
  Prediction p;
  p.layout = job.layout, p.grad_accum = job.grad_accum;
  p.stages = place_layout(job.model, job.layout).stages;
  plan_stage_memory(job, keep_plan, p);

  const StepModel m(job, rates);
  if (!m.scale.note.empty()) p.notes.push_back(m.scale.note);
  p.slowest_stage = slowest_stage(m, p.stages);
  const PipelineStage& st = p.stages[p.slowest_stage];
  const DpLink link = dp_link(m);
  const auto [tail, tail_stage] = longest_tail(m, link, p.stages);
  add_compute_items(m, st, tail, tail_stage, p);
  // 1F1B: m micro-batches take m + pp - 1 periods of the slowest stage; the pp - 1 more are the pipe filling and
  // draining, when a stage waits (the bubble, (pp - 1) / m of the micro-batches' time).
  p.bubble_s = double(job.layout.pp - 1) * m.period(st);
  add_communication_items(m, st, link, tail, tail_stage, p);
  p.step_s = p.compute_s + p.bubble_s + p.exposed_s;
  job_figures(m, p);
  add_notes(m, tail, tail_stage, p);
  return p;
}

}  // namespace

Prediction predict(const JobSpec& job, const Rates& rates) { return predict_layout(job, rates, true); }

// ---- search ----

namespace {

std::vector<JobSpec> layouts_of(const JobSpec& job) {
  // The global batch stays the user's: micro_batch x grad_accum x dp sequences.
  const int64_t global = job.layout.micro_batch * job.grad_accum * job.layout.dp;
  const int64_t gpus = job.cluster.gpus();
  std::vector<JobSpec> out;
  for (int64_t tp = 1; tp <= job.cluster.gpus_per_node; tp *= 2) {
    if (job.model.num_key_value_heads % tp != 0 || gpus % tp != 0) continue;
    // Pipeline stages (with adapters too: a stage holds its layers' adapters) up to 8, as many as divide the GPUs
    // left: each stage has a plan of its own to make, and deeper pipes need more micro-batches than stages per step.
    for (int64_t pp = 1; pp <= std::min<int64_t>(8, job.model.num_hidden_layers) && gpus % (tp * pp) == 0; pp *= 2) {
      const int64_t dp = gpus / (tp * pp);
      for (bool sp : {false, true}) {
        if (sp && (tp == 1 || job.layout.seq_len % tp != 0)) continue;
        // ZeRO-3 with stages would gather a stage's weights again for every micro-batch in flight: left out.
        // At dp 1 ZeRO shards nothing (ZeRO-0 holds the least); the pp 1 search keeps every stage as before.
        for (int zero = 0; zero <= (pp == 1 ? 3 : dp == 1 ? 0 : 2); zero++)
          for (int64_t mb : {1, 2, 4, 8, 16}) {
            if (global % (mb * dp) != 0 || global / (mb * dp) < pp) continue;
            for (Recompute rc : {Recompute::None, Recompute::Selective, Recompute::Full})
              for (bool bf16 : {false, true})
                // With FP8 the weights' codes kept in both layouts or the forward's alone (--fp8_weight_codes).
                for (bool forward_codes : {false, true}) {
                  if (forward_codes && job.layout.fp8 == Fp8Mode::Off) continue;
                  JobSpec j = job;
                  j.layout.tp = tp, j.layout.pp = pp, j.layout.sp = sp, j.layout.dp = dp, j.layout.zero = zero;
                  j.layout.micro_batch = mb, j.layout.recompute = rc, j.layout.bf16_moments = bf16;
                  j.layout.fp8_forward_codes = forward_codes;
                  j.layout.dp_rank = j.layout.tp_rank = j.layout.pp_rank = 0;
                  j.grad_accum = global / (mb * dp);
                  out.push_back(j);
                }
          }
      }
    }
  }
  return out;
}

}  // namespace

std::vector<Prediction> search_layouts(const JobSpec& job, const Rates& rates, size_t limit, bool offer_adapters) {
  std::vector<Prediction> all;
  bool finished = false;
  for (const JobSpec& j : layouts_of(job)) {
    all.push_back(predict_layout(j, rates, false));
    finished |= all.back().fits && all.back().finishes;
  }
  // A full fine-tune that no layout finishes in time: the same job with adapters, the base in bf16 and in nf4.
  if (offer_adapters && !finished && job.hours > 0 && !job.layout.lora.enabled() && job.offer_lora_rank > 0)
    for (BaseQuant quant : {BaseQuant::None, BaseQuant::Nf4}) {
      JobSpec a = job;
      a.layout.lora = LoraPlan{};
      a.layout.lora.rank = job.offer_lora_rank, a.layout.lora.base_quant = quant;
      for (const JobSpec& j : layouts_of(a)) all.push_back(predict_layout(j, rates, false));
    }
  std::stable_sort(all.begin(), all.end(), [](const Prediction& a, const Prediction& b) {
    if (a.fits != b.fits) return a.fits;
    return a.step_s / a.tokens_per_step < b.step_s / b.tokens_per_step;
  });
  if (all.size() > limit) all.resize(limit);
  return all;
}

}  // namespace tuna
