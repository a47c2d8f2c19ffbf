// plan_gpu_memory and plan_gpu_buffers: every device buffer of the CUDA engine (model/llama_gpu.cpp,
// dist/zero_gpu.cpp) for one rank, by name, in the order of its one device arena, as the rows of one table
// (model/gpu_buffers.h). The model lays its arena out from the table and points each of its buffers at its row; the
// engine takes ZeRO's buffers by name with their element count (DeviceArena::take checks the bytes); and the arena
// fails at construction if a listed buffer is not taken: the plan is the allocation, not an estimate of it. Plain
// C++, in every build.
#include "model/memory_plan.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>

#include "core/error.h"
#include "kernels/scratch.h"
#include "model/fp8_gpu.h"  // kFp8ScaleStride
#include "model/gpu_buffers.h"
#include "model/layout.h"
#include "model/lora.h"  // LoraTarget, lora_target_name
#include "model/lora_shape.h"
#include "model/optimizer.h"  // shard_pieces
#include "model/pipeline.h"
#include "model/support.h"  // place_layout, require_valid

namespace tuna {

namespace {

// Bytes of one GPU element type, as the engine stores it.
constexpr int64_t kBf16 = 2, kF32 = 4, kF64 = 8, kI32 = 4, kI64 = 8;
// cuBLASLt's workspace (kernels/matmul.cuh MatmulContext's default).
constexpr int64_t kMatmulWorkspaceBytes = int64_t(32) << 20;

// The table (model/gpu_buffers.h) and its plan, a row at a time.
class PlanBuilder {
 public:
  // A buffer the engine takes by name (dist/zero_gpu.h, model/decode_gpu.h).
  void add(std::string name, MemoryKind kind, int64_t count, int64_t element_bytes) {
    add(GpuBuffer::Engine, std::move(name), kind, count, element_bytes);
  }
  // One of the model's buffers.
  void add(GpuBuffer buffer, std::string name, MemoryKind kind, int64_t count, int64_t element_bytes) {
    GpuBufferRow row;
    row.buffer = buffer, row.elements = count, row.element_bytes = element_bytes;
    add(row, std::move(name), kind);
  }
  void add(const GpuBufferRow& row, std::string name, MemoryKind kind) {
    TUNA_CHECK(row.elements >= 0, name, ": ", row.elements, " elements");
    table.plan.items.push_back({std::move(name), kind, device_arena_bytes(row.elements * row.element_bytes), true});
    table.rows.push_back(row);
  }
  void add_outside_arena(std::string name, MemoryKind kind, int64_t bytes) {
    table.plan.items.push_back({std::move(name), kind, bytes, false});
    table.rows.push_back({});
  }
  GpuBufferTable table;
};

// The optimizer's norm buffers: the model's at ZeRO-0 (its own adamw_step), the engine's shard's above.
GpuBuffer optimizer_buffer(const MemoryLayout& l, GpuBuffer buffer) { return l.zero == 0 ? buffer : GpuBuffer::Engine; }

// The LoraTarget of a module name ("q_proj"), for the row of its activation.
int lora_target_index(const std::string& module) {
  for (int t = 0; t < kLoraTargets; t++)
    if (module == lora_target_name(LoraTarget(t))) return t;
  fail("no adapter target '", module, "'");
}

void check_layout(const LlamaConfig& c, const MemoryLayout& l) {
  // A layout the CUDA engine does not implement yet is planned as designed; an invalid one has no plan.
  require_valid(c, l, Device::Cuda);
  // Tensor parallelism on cuda: every rank a whole share of each split dimension, the local widths the kernels'
  // multiples of 8 (ParamLayout has already refused a tp that does not divide the kv heads).
  if (l.tp > 1) {
    if (c.vocab_size % l.tp != 0)
      fail("--tp ", l.tp, " with --device cuda: the vocabulary (vocab_size ", c.vocab_size, " in config.json) must "
           "divide into ", l.tp, " equal slices for the vocab-parallel embedding, lm_head and loss");
    if (c.intermediate_size % (8 * l.tp) != 0)
      fail("--tp ", l.tp, " with --device cuda: intermediate_size ", c.intermediate_size, " (config.json) must divide "
           "into ", l.tp, " slices of a multiple of 8 columns (the GPU kernels' vector width)");
    if (c.num_attention_heads % l.tp != 0)
      fail("--tp ", l.tp, ": num_attention_heads ", c.num_attention_heads, " (config.json) must divide into ", l.tp,
           " equal groups of heads");
  }
  if (!l.master_weights) fail("the CUDA engine keeps an fp32 master copy of the weights (no master: not implemented)");
  check_lora_plan(c, l.lora, "options lora_rank, lora_targets, lora_dropout, base_quant");
}

// The layout of one tp rank (with pp, of its stage: what the CUDA model holds, so that unit sizes and ZeRO's pieces
// are the model's), kept for the next plan of the same shape: build/plan's search plans thousands of layouts (a
// pipeline layout a plan per stage) of one model, and building the layout is most of a plan's work.
const ParamLayout& tp_rank_layout(const LlamaConfig& c, int64_t tp_rank, int64_t tp, int64_t pp,
                                  const PipelineStage& stage) {
  thread_local std::map<std::string, std::unique_ptr<const ParamLayout>> cache;
  const std::string key = c.to_json().dump() + str("|", tp_rank, "/", tp) +
                          (pp > 1 ? str("|", stage.layer_begin, "-", stage.layer_end, stage.embedding, stage.head) : "");
  auto it = cache.find(key);
  if (it != cache.end()) return *it->second;
  if (cache.size() >= 64) cache.clear();
  auto layout = pp > 1 ? std::make_unique<const ParamLayout>(c, static_cast<int>(tp_rank), static_cast<int>(tp), stage)
                       : std::make_unique<const ParamLayout>(c, static_cast<int>(tp_rank), static_cast<int>(tp));
  return *cache.emplace(key, std::move(layout)).first->second;
}

// The parameters a pipeline stage holds (model/pipeline.h pipeline_stage_units) and what their buffers need.
struct StageUnits {
  std::vector<int> units;
  int64_t params = 0, largest = 0, tensors = 0;
  bool embedding_open_through_head = false;  // the embedding and a tied head on one stage: its gradient stays open
                                             // from the head's backward to the embedding's
  bool tied_head = false;                    // the stage's head reads the embedding unit and the head unit at once
};

StageUnits stage_units(const ParamLayout& layout, const PipelineStage& stage) {
  StageUnits s;
  s.units = pipeline_stage_units(layout, stage);
  s.tied_head = layout.lm_head_unit() == 0 && stage.head;
  s.embedding_open_through_head = s.tied_head && stage.embedding;
  for (int u : s.units) {
    const auto [begin, end] = layout.unit_range(u);
    s.params += end - begin, s.largest = std::max(s.largest, end - begin);
    for (const ParamTensor& t : layout.tensors()) s.tensors += t.offset >= begin && t.offset < end;
  }
  return s;
}

// This rank's piece of each of the stage's units over dp (dp_unit_pieces, restricted to the stage).
std::vector<Segment> stage_pieces(const ParamLayout& layout, const StageUnits& stage, int64_t dp_rank, int64_t dp) {
  std::vector<Segment> out;
  for (int u : stage.units) {
    const auto [begin, end] = layout.unit_range(u);
    const Range r = shard_range(end - begin, static_cast<int>(dp_rank), static_cast<int>(dp));
    out.push_back({begin + r.begin, r.size()});
  }
  return out;
}

}  // namespace

bool gpu_keeps_activation(const std::string& field, Recompute recompute) {
  static const char* const kFields[] = {"resid_in", "norm1", "rstd1",   "q",       "k",        "v",
                                        "att",      "lse",   "resid_mid", "norm2", "rstd2", "gate_up",
                                        "act",      "lora_ax"};
  TUNA_CHECK(std::find(std::begin(kFields), std::end(kFields), field) != std::end(kFields),
             "unknown layer activation '", field, "'");
  switch (recompute) {
    case Recompute::None: return true;
    case Recompute::Selective: return field != "norm1" && field != "norm2" && field != "act";
    case Recompute::Full: return field == "resid_in";
  }
  return true;
}

int64_t gpu_head_chunk_rows(int64_t vocab, int64_t rows) {
  constexpr int64_t kMinRows = 2048, kChunkElements = int64_t(32) << 20;
  TUNA_CHECK(vocab > 0 && rows > 0, "vocab ", vocab, ", rows ", rows);
  return std::clamp<int64_t>(std::max(kMinRows, kChunkElements / vocab), 1, rows);
}

namespace {

// A full fine-tune's parameters, gradients and optimizer state: those of the stage's units.
void plan_full_state(const MemoryLayout& l, const ParamLayout& layout, const StageUnits& stage, PlanBuilder& b) {
  const int64_t P = stage.params;
  const int64_t moment_bytes = l.bf16_moments ? kBf16 : kF32;
  const bool optimizer = l.training;  // a training rank runs AdamW over what it owns

  // Parameters, gradients, optimizer state. ZeRO-0 holds everything whole; 1 shards master and moments; 2 also the
  // gradient (unit gradients live in a few unit-sized buffers until reduce-scattered); 3 also the bf16 weights
  // (gathered a unit at a time into unit-sized buffers).
  if (optimizer && l.zero == 0) b.add(GpuBuffer::Master, "fp32 master weights", MemoryKind::Master, P, kF32);
  if (l.zero <= 2 || !l.training) b.add(GpuBuffer::Weights, "bf16 weights", MemoryKind::Weights, P, kBf16);
  if (l.training && l.zero <= 1) b.add(GpuBuffer::Gradients, "fp32 gradients", MemoryKind::Gradients, P, kF32);
  if (optimizer && l.zero == 0) {
    b.add(GpuBuffer::MomentM, "AdamW m", MemoryKind::Moments, P, moment_bytes);
    b.add(GpuBuffer::MomentV, "AdamW v", MemoryKind::Moments, P, moment_bytes);
    b.add(GpuBuffer::SegmentStarts, "AdamW segment starts", MemoryKind::Workspace, stage.tensors, kI64);
    b.add(GpuBuffer::SegmentDecays, "AdamW segment decays", MemoryKind::Workspace, stage.tensors, 1);
  }
  if (optimizer && l.zero >= 1) {
    // This rank's piece of every unit, padded to the fused AdamW's 4 elements per thread.
    const std::vector<Segment> pieces = stage_pieces(layout, stage, l.dp_rank, l.dp);
    int64_t shard = 0, largest_piece = 0;
    for (const Segment& s : pieces) shard += s.size, largest_piece = std::max(largest_piece, s.size);
    const int64_t padded = (shard + 3) / 4 * 4;
    const int64_t tables = std::max<int64_t>(1, static_cast<int64_t>(shard_pieces(layout, pieces).size()));
    b.add("fp32 master weights (shard)", MemoryKind::Master, padded, kF32);
    b.add("fp32 gradients (shard)", MemoryKind::Gradients, padded, kF32);
    b.add("AdamW m (shard)", MemoryKind::Moments, padded, moment_bytes);
    b.add("AdamW v (shard)", MemoryKind::Moments, padded, moment_bytes);
    b.add("AdamW segment starts (shard)", MemoryKind::Workspace, tables, kI64);
    b.add("AdamW segment decays (shard)", MemoryKind::Workspace, tables, 1);
    if (l.zero >= 2) {
      // The update writes the bf16 weights of the shard, which ZeRO-2 gathers whole and ZeRO-3 unit by unit.
      b.add("bf16 weights (shard)", MemoryKind::Weights, padded, kBf16);
      // Unit gradients until reduce-scattered: two alternate (one filling, one in flight); a tied head's
      // embedding gradient stays open from the head to the embedding's backward, a third.
      const int gradient_buffers = stage.embedding_open_through_head ? 3 : 2;
      for (int i = 0; i < gradient_buffers; i++)
        b.add(str("gradient buffer ", i), MemoryKind::Gradients, stage.largest, kF32);
      if (l.dp > 1) b.add("reduce-scatter output", MemoryKind::Communication, largest_piece, kF32);
    }
  }
  if (l.training && l.zero == 3) {
    // Gathered unit weights: the one computing and, with prefetch, the next arriving; a tied head needs the
    // embedding and the head unit at once.
    const int gather_buffers = l.zero_prefetch || stage.tied_head ? 2 : 1;
    for (int i = 0; i < gather_buffers; i++)
      b.add(str("weight gather buffer ", i), MemoryKind::Communication, stage.largest, kBf16);
  }
  if (optimizer) {
    b.add(optimizer_buffer(l, GpuBuffer::NormScratch), "gradient norm scratch", MemoryKind::Workspace,
          gpu_scratch::sum_of_squares_doubles(), kF64);
    b.add(optimizer_buffer(l, GpuBuffer::NormTotal), "gradient norm", MemoryKind::Workspace, 1, kF64);
    if (l.tp > 1) {  // one sum of squares per piece of a replicated tensor (norm weights) that this rank updates
      const std::vector<Segment> owned =
          stage_pieces(layout, stage, l.zero == 0 ? 0 : l.dp_rank, l.zero == 0 ? 1 : l.dp);
      int64_t replicated = 0;
      for (const ShardPiece& p : shard_pieces(layout, owned)) replicated += p.tensor->split_dim < 0;
      b.add(optimizer_buffer(l, GpuBuffer::ReplicatedNorms), "replicated gradient norms", MemoryKind::Workspace,
            std::max<int64_t>(1, replicated), kF64);
    }
  }
}

// With adapters: the frozen base (no gradient, master or moments), stored bf16 or quantized, whole on every dp
// rank below ZeRO-3 and sharded at ZeRO-3; the adapters with the state a full fine-tune keeps for its weights.
// Adapter units are the layers (a layer's adapters in LoraTarget order, A then B): ZeRO shards each over dp
// as it shards a full fine-tune's units. A pipeline stage holds the base of its units (a tied table's copy on the last
// stage too) and the adapters of its layers.
void plan_lora_state(const LlamaConfig& c, const MemoryLayout& l, const ParamLayout& layout, const PipelineStage& stage,
                     const StageUnits& units, PlanBuilder& b) {
  const LoraPlan& lora = l.lora;
  const int64_t moment_bytes = l.bf16_moments ? kBf16 : kF32;
  const bool quantized = lora.base_quant != BaseQuant::None;
  const int dp_rank = static_cast<int>(l.dp_rank), dp = static_cast<int>(l.dp);

  // The base, by unit (embedding, layers, head), in its stored bytes; the stage's units only.
  std::vector<int64_t> unit_bytes(layout.num_units(), 0), unit_quantized(layout.num_units(), 0);
  int64_t layer_elements = 0;  // the stage's first layer's unit: every layer's is the same size
  for (const ParamTensor& t : layout.tensors()) {
    const int unit = t.layer >= 0 ? t.layer + 1 : t.offset < layout.unit_range(1).first ? 0 : layout.head_unit();
    const int64_t bytes = base_storage_bytes(t, lora.base_quant);
    unit_bytes[unit] += bytes;
    if (quantized && base_tensor_quantized(t)) unit_quantized[unit] += bytes;
    if (t.layer == stage.layer_begin) layer_elements += t.numel;
  }
  int64_t base_quantized = 0, base_plain = 0;
  for (int u : units.units) base_quantized += unit_quantized[u], base_plain += unit_bytes[u] - unit_quantized[u];
  const bool tied = units.tied_head;
  const int gather_buffers = l.zero_prefetch || tied ? 2 : 1;
  if (l.training && l.zero == 3 && !quantized) {
    // This rank's piece of each unit (dist/zero_gpu.h FrozenShard), gathered a unit at a time as ZeRO-3 gathers a
    // full fine-tune's weights: the one computing and, with prefetch, the next; a tied head reads two at once.
    int64_t shard = 0, largest = 0;
    for (int u : units.units) {
      const int64_t elements = layout.unit_range(u).second - layout.unit_range(u).first;
      shard += shard_range(elements, dp_rank, dp).size(), largest = std::max(largest, elements);
    }
    b.add("bf16 base weights (frozen, shard)", MemoryKind::Weights, shard, kBf16);
    for (int i = 0; i < gather_buffers; i++)
      b.add(str("base gather buffer ", i), MemoryKind::Communication, largest, kBf16);
  } else if (l.training && l.zero == 3) {
    // A quantized base sharded by its stored bytes: the design (the engines refuse it).
    int64_t shard = 0, largest = 0;
    for (int u : units.units)
      shard += shard_range(unit_bytes[u], dp_rank, dp).size(), largest = std::max(largest, unit_bytes[u]);
    b.add(str(base_quant_name(lora.base_quant), " base weights (frozen, shard)"), MemoryKind::Weights, shard, 1);
    for (int i = 0; i < gather_buffers; i++)
      b.add(str("base gather buffer ", i), MemoryKind::Communication, largest, 1);
  } else if (quantized) {
    b.add(GpuBuffer::Nf4Base, str(base_quant_name(lora.base_quant), " base weights (frozen decoder Linear weights)"),
          MemoryKind::Weights, base_quantized, 1);
    b.add(GpuBuffer::PlainBase, "bf16 base weights (frozen embedding, norms, lm_head)", MemoryKind::Weights, base_plain,
          1);
  } else {
    b.add(GpuBuffer::Weights, "bf16 base weights (frozen)", MemoryKind::Weights, units.params, kBf16);
  }
  // Quantized: each layer's GEMMs read its weights dequantized into one bf16 buffer, refilled per layer and pass,
  // shaped like the layer's unit (its norm weights copied beside), so the model reads it at the unit's offsets.
  if (quantized)
    b.add(GpuBuffer::Dequant, "dequantized layer weights (bf16, one layer)", MemoryKind::Workspace, layer_elements,
          kBf16);

  // The adapters: bf16 copies for the GEMMs, whole on every dp rank; fp32 master, gradients and moments as ZeRO says.
  const std::vector<LoraTargetShape> shapes = lora_layer_shapes(c, lora, l.tp);
  const int64_t per_layer = lora_layer_params(c, lora, l.tp), L = stage.layers(), Pa = L * per_layer;
  b.add(GpuBuffer::LoraWeights, "LoRA bf16 weights", MemoryKind::Weights, Pa, kBf16);
  if (!l.training) return;
  // Tensors of one layer's adapters that this rank's piece [begin, begin + size) touches, and of them those
  // replicated over tp (A of a column-parallel target, B of a row-parallel one: their norms are summed once).
  const Range piece = l.zero == 0 ? Range{0, per_layer} : shard_range(per_layer, dp_rank, dp);
  int64_t tables = 0, replicated = 0, at = 0;
  for (const LoraTargetShape& s : shapes)
    for (bool is_a : {true, false}) {
      const int64_t size = is_a ? s.a_rows * s.a_cols : s.b_rows * s.b_cols;
      if (at < piece.end && at + size > piece.begin) tables++, replicated += is_a == s.column_parallel;
      at += size;
    }
  tables *= L, replicated *= L;
  if (l.zero == 0) {
    b.add(GpuBuffer::LoraMaster, "LoRA fp32 master weights", MemoryKind::Master, Pa, kF32);
    b.add(GpuBuffer::LoraGradients, "LoRA fp32 gradients", MemoryKind::Gradients, Pa, kF32);
    b.add(GpuBuffer::MomentM, "LoRA AdamW m", MemoryKind::Moments, Pa, moment_bytes);
    b.add(GpuBuffer::MomentV, "LoRA AdamW v", MemoryKind::Moments, Pa, moment_bytes);
    b.add(GpuBuffer::SegmentStarts, "LoRA AdamW segment starts", MemoryKind::Workspace, tables, kI64);
    b.add(GpuBuffer::SegmentDecays, "LoRA AdamW segment decays", MemoryKind::Workspace, tables, 1);
  } else {
    // This rank's piece of every layer's adapters (dist/zero_gpu.h OptimizerShard over trained_layout()), padded
    // to the fused AdamW's 4 elements per thread; an empty shard still has one table entry.
    const int64_t padded = (L * piece.size() + 3) / 4 * 4;
    b.add("LoRA fp32 master weights (shard)", MemoryKind::Master, padded, kF32);
    b.add("LoRA fp32 gradients (shard)", MemoryKind::Gradients, padded, kF32);
    b.add("LoRA AdamW m (shard)", MemoryKind::Moments, padded, moment_bytes);
    b.add("LoRA AdamW v (shard)", MemoryKind::Moments, padded, moment_bytes);
    b.add("LoRA AdamW segment starts (shard)", MemoryKind::Workspace, std::max<int64_t>(1, tables), kI64);
    b.add("LoRA AdamW segment decays (shard)", MemoryKind::Workspace, std::max<int64_t>(1, tables), 1);
    // ZeRO-1: the whole gradient, reduce-scattered after the backward.
    if (l.zero == 1) b.add(GpuBuffer::LoraGradients, "LoRA fp32 gradients", MemoryKind::Gradients, Pa, kF32);
    if (l.zero >= 2) {
      // The update writes the shard's bf16 adapters, gathered into the whole copy after it.
      b.add("LoRA bf16 weights (shard)", MemoryKind::Weights, padded, kBf16);
      // A layer's adapter gradients until reduce-scattered: one filling, one in flight.
      for (int i = 0; i < 2; i++) b.add(str("LoRA gradient buffer ", i), MemoryKind::Gradients, per_layer, kF32);
      if (l.dp > 1) b.add("LoRA reduce-scatter output", MemoryKind::Communication, piece.size(), kF32);
    }
  }
  b.add(optimizer_buffer(l, GpuBuffer::NormScratch), "gradient norm scratch", MemoryKind::Workspace,
        gpu_scratch::sum_of_squares_doubles(), kF64);
  b.add(optimizer_buffer(l, GpuBuffer::NormTotal), "gradient norm", MemoryKind::Workspace, 1, kF64);
  if (l.tp > 1)
    b.add(optimizer_buffer(l, GpuBuffer::ReplicatedNorms), "replicated gradient norms", MemoryKind::Workspace,
          std::max<int64_t>(1, replicated), kF64);
}

// One pass's shapes on this rank: tokens, their rows in the norm and residual regions, and the tp-local widths.
struct PassShape {
  int64_t n = 0, rows = 0, C = 0, F = 0, qd = 0, kvd = 0, H = 0, V = 0;
};

PassShape pass_shape(const LlamaConfig& c, const MemoryLayout& l, const ParamLayout& layout) {
  const TpDims& d = layout.tp();
  PassShape p;
  p.n = l.micro_batch * l.seq_len, p.C = c.hidden_size;
  // Sequence parallelism: the norm and residual region (the residual stream, the norms' outputs and their rstd) is
  // split along the sequence over the tp ranks, n / tp rows each; the column-parallel GEMMs read it gathered whole.
  p.rows = l.sp ? p.n / l.tp : p.n;
  p.F = d.ffn, p.qd = d.q_dim, p.kvd = d.kv_dim, p.H = d.heads, p.V = d.vocab;
  return p;
}

// The layers' activations for (micro_batch, seq_len): the kept ones (by the recompute mode) of each layer and slot,
// one working set for the rest, and the adapters' own.
void plan_layer_activations(const LlamaConfig& c, const MemoryLayout& l, const PipelineStage& stage,
                            const PassShape& p, PlanBuilder& b) {
  const int64_t n = p.n, rows = p.rows, C = p.C;
  const Recompute recompute = l.training ? l.recompute : Recompute::Full;  // a forward alone keeps layer inputs
  // 1F1B: a stage keeps the layers' activations of the micro-batches in flight there until their backwards (the first
  // stage the most, the last one); a forward alone keeps none.
  const int64_t in_flight = l.in_flight();
  const std::pair<GpuActivation, std::pair<int64_t, int64_t>> fields[] = {
      {GpuActivation::ResidIn, {rows * C, kBf16}},    {GpuActivation::Norm1, {rows * C, kBf16}},
      {GpuActivation::Rstd1, {rows, kF32}},           {GpuActivation::Q, {n * p.qd, kBf16}},
      {GpuActivation::K, {n * p.kvd, kBf16}},         {GpuActivation::V, {n * p.kvd, kBf16}},
      {GpuActivation::Att, {n * p.qd, kBf16}},        {GpuActivation::Lse, {n * p.H, kF32}},
      {GpuActivation::ResidMid, {rows * C, kBf16}},   {GpuActivation::Norm2, {rows * C, kBf16}},
      {GpuActivation::Rstd2, {rows, kF32}},           {GpuActivation::GateUp, {n * 2 * p.F, kBf16}},
      {GpuActivation::Act, {n * p.F, kBf16}}};
  // With adapters, per target: its r-wide s A x (B's input, and dB's), needed by the backward. A dropout mask is
  // not kept: it is a pure function of its key and index (model/lora.h), drawn again by the backward.
  const std::vector<LoraTargetShape> adapters = lora_layer_shapes(c, l.lora, l.tp);
  const int64_t r = l.lora.rank;
  // A layer's activations (slot and layer), or with layer -1 the working copies every layer shares.
  const auto add_layer = [&](const std::string& prefix, int64_t slot, int64_t layer) {
    const bool kept = layer >= 0;
    GpuBufferRow row;
    row.buffer = GpuBuffer::Activation, row.slot = slot, row.layer = layer;
    for (const auto& [field, size] : fields) {
      const char* name = kGpuActivationNames[static_cast<int>(field)];
      if (gpu_keeps_activation(name, recompute) != kept) continue;
      row.field = field, row.elements = size.first, row.element_bytes = size.second;
      b.add(row, prefix + name, MemoryKind::Activations);
    }
    if (gpu_keeps_activation("lora_ax", recompute) != kept) return;
    for (const LoraTargetShape& t : adapters) {
      row.field = GpuActivation::LoraAx, row.target = lora_target_index(t.module);
      row.elements = n * r, row.element_bytes = kBf16;
      b.add(row, str(prefix, "lora_ax ", t.module), MemoryKind::Activations);
    }
  };
  for (int64_t slot = 0; slot < in_flight; slot++)
    for (int64_t layer = stage.layer_begin; layer < stage.layer_end; layer++)
      add_layer(slot == 0 ? str("layer ", layer, " ") : str("layer ", layer, " (in flight ", slot, ") "), slot, layer);
  add_layer("working ", 0, -1);
  if (adapters.empty()) return;
  int64_t widest_in = 0;
  for (const LoraTargetShape& t : adapters) widest_in = std::max(widest_in, t.in);
  // dropout(x), A's input, refilled per target in the forward and for dA in the backward, where it also holds
  // dt A before the mask takes it into dx.
  if (l.lora.dropout > 0)
    b.add(GpuBuffer::LoraDropoutInput, "LoRA dropout(x)", MemoryKind::Activations, n * widest_in, kBf16);
  // The backward's dt = s dy B of one target at a time: dA's input, and A's share of dx.
  if (l.training) b.add(GpuBuffer::LoraDt, "LoRA d(A x)", MemoryKind::Activations, n * r, kBf16);
}

// The pass's other buffers: the fused q|k|v output, sp's gathered input, the head's, and the backward's gradients of
// activations and its scratch.
void plan_pass_buffers(const MemoryLayout& l, const PipelineStage& stage, const PassShape& p, PlanBuilder& b) {
  const int64_t n = p.n, rows = p.rows, C = p.C, V = p.V;
  // The fused q|k|v GEMM's output, read into q, k, v at once; the backward's d_q|d_k|d_v in the same buffer.
  b.add(GpuBuffer::Qkv, "qkv", MemoryKind::Activations, n * (p.qd + 2 * p.kvd), kBf16);
  // sp: a norm's output all-gathered for the column-parallel GEMM that reads it (q|k|v, gate|up, lm_head); one
  // working buffer, gathered again in the backward for the weight gradient (Megatron keeps the split copy only).
  if (l.sp) b.add(GpuBuffer::Gathered, "sequence-parallel gathered input", MemoryKind::Activations, n * C, kBf16);
  if (stage.head) {
    const int64_t chunk = gpu_head_chunk_rows(V, n);
    b.add(GpuBuffer::ResidOut, "final residual", MemoryKind::Activations, rows * C, kBf16);
    b.add(GpuBuffer::FinalNorm, "final norm", MemoryKind::Activations, rows * C, kBf16);
    b.add(GpuBuffer::FinalRstd, "final rstd", MemoryKind::Activations, rows, kF32);
    b.add(GpuBuffer::LogitsChunk, "logits chunk", MemoryKind::Activations, chunk * V, kBf16);
    b.add(GpuBuffer::Losses, "per-token losses", MemoryKind::Activations, n, kF32);
    if (l.tp > 1) {  // the vocab-parallel loss: each chunk's row statistics and their max over the tp ranks
      b.add(GpuBuffer::ClassifierStats, "classifier statistics", MemoryKind::Workspace, 3 * chunk, kF32);
      b.add(GpuBuffer::ClassifierMax, "classifier global max", MemoryKind::Workspace, chunk, kF32);
    }
  }
  if (!l.training) return;
  // The residual stream's gradient is split like the stream; a norm input's gradient comes whole out of the
  // GEMMs' input gradient before sp reduce-scatters it.
  b.add(GpuBuffer::DResid, "d_resid", MemoryKind::Activations, rows * C, kBf16);
  b.add(GpuBuffer::DNorm, "d_norm", MemoryKind::Activations, n * C, kBf16);
  // The final norm's input gradient, and with sp every layer's norm input gradient reduced into this rank's rows.
  if (stage.head || l.sp) b.add(GpuBuffer::DFinalNorm, "d_final_norm", MemoryKind::Activations, n * C, kBf16);
  b.add(GpuBuffer::DQ, "d_q", MemoryKind::Activations, n * p.qd, kBf16);
  b.add(GpuBuffer::DAtt, "d_att", MemoryKind::Activations, n * p.qd, kBf16);
  b.add(GpuBuffer::DK, "d_k", MemoryKind::Activations, n * p.kvd, kBf16);
  b.add(GpuBuffer::DV, "d_v", MemoryKind::Activations, n * p.kvd, kBf16);
  // d_gate|d_up overwrite each layer's gate_up in place (model/llama_gpu_backward.cpp layer_backward).
  b.add(GpuBuffer::DAct, "d_act", MemoryKind::Activations, n * p.F, kBf16);
  b.add(GpuBuffer::RmsnormScratch, "rmsnorm backward scratch", MemoryKind::Workspace,
        gpu_scratch::rmsnorm_bwd_floats(rows, C), kF32);
  // sp: a layer's two norm-weight gradients from this rank's rows, before their sum over the tp ranks.
  if (l.sp)
    b.add(GpuBuffer::SpNormGrads, "sequence-parallel norm weight gradients", MemoryKind::Workspace, 2 * C, kF32);
  b.add(GpuBuffer::AttentionScratch, "attention backward scratch", MemoryKind::Workspace,
        gpu_scratch::attention_bwd_floats(l.micro_batch, l.seq_len, p.H, /*head_dim=*/128, l.attention), kF32);
}

// --fp8 tensorwise (model/fp8.h, model/fp8_gpu.h). The weight codes are kept per layer, both layouts (2 bytes a
// projection weight, as much as its bf16 copy): each layer is cast once per step, at its first forward after an
// update, and every micro-batch's forward, recompute and backward of the step reads those codes. ZeRO-3, whose point
// is to hold no whole model, keeps one layer's codes instead, cast from each gathered layer as it is used (forward,
// and again before its backward): a cast per pass and micro-batch (the layer's weights read once more each time,
// beside the gather that already moves them) for the memory of one layer; so does a quantized base (QLoRA), whose
// point is a base smaller than its bf16 copy: each layer is cast from the bf16 layer dequantized at each use. Each
// group's amax and inverse scale, and every scale an FP8 GEMM reads, sit kFp8ScaleStride floats apart: cuBLASLt's FP8
// GEMMs need them 16-byte aligned.
// The activations' amaxes (norm1, attention output, norm2, SwiGLU output) are kept per layer and slot for the
// backward's weight-gradient cast of the same inputs; the operand codes are one group's at a time.
void plan_fp8_buffers(const MemoryLayout& l, const PipelineStage& stage, const PassShape& p, PlanBuilder& b) {
  if (l.fp8 == Fp8Mode::Off || !l.training) return;  // a forward alone (eval, sample) runs in bf16
  const int64_t n = p.n, C = p.C, L = stage.layers(), qkv = p.qd + 2 * p.kvd;
  const int64_t layer_weights = qkv * C + C * p.qd + 2 * p.F * C + C * p.F;  // q|k|v, o, gate|up, down
  const int64_t cast = fp8_cast_layers(l);
  // --fp8_weight_codes forward: the forward's layout kept, the transposed codes of one group cast at each backward.
  const char* layouts = l.fp8_forward_codes ? "forward layout" : "both layouts";
  b.add(GpuBuffer::Fp8WeightCodes,
        cast == 1 ? str("FP8 weight codes (e4m3, ", layouts, ", one layer: cast at each use)")
                  : str("FP8 weight codes (e4m3, ", layouts, ", ", cast, " layers)"),
        MemoryKind::Weights, (l.fp8_forward_codes ? 1 : 2) * layer_weights * cast, 1);
  if (l.fp8_forward_codes)
    b.add(GpuBuffer::Fp8WeightCodesT, "FP8 transposed codes of one group's weight (e4m3, cast at each backward)",
          MemoryKind::Workspace, std::max({qkv * C, C * p.qd, 2 * p.F * C}), 1);
  b.add(GpuBuffer::Fp8WeightScales, "FP8 weight amaxes and scales", MemoryKind::Workspace,
        cast * kFp8Groups * 2 * kFp8ScaleStride, kF32);
  b.add(GpuBuffer::Fp8ActivationAmax, "FP8 activation amaxes (kept for the backward)", MemoryKind::Activations,
        l.in_flight() * L * kFp8Groups, kF32);
  b.add(GpuBuffer::Fp8InputCodes, "FP8 codes of one group's input (e4m3)", MemoryKind::Workspace,
        n * std::max({C, p.qd, p.F}), 1);
  b.add(GpuBuffer::Fp8OperandScales, "FP8 operand scales", MemoryKind::Workspace, 2 * kFp8ScaleStride, kF32);
  const int64_t rows = std::max({qkv, C, 2 * p.F});
  b.add(GpuBuffer::Fp8GradCodes, "FP8 codes of one group's output gradient (e5m2)", MemoryKind::Workspace, n * rows, 1);
  b.add(GpuBuffer::Fp8GradCodesT, "FP8 codes of one group's output gradient (e5m2, transposed)", MemoryKind::Workspace,
        n * rows, 1);
  b.add(GpuBuffer::Fp8GradAmax, "FP8 output gradient amaxes", MemoryKind::Workspace, kFp8Groups, kF32);
}

// The pipeline's buffers, and the pass's inputs as the device holds them.
void plan_pipeline_and_inputs(const LlamaConfig& c, const MemoryLayout& l, const PipelineStage& stage,
                              const PassShape& p, PlanBuilder& b) {
  const int64_t n = p.n;
  // Pipeline point to point (bf16 [tokens, hidden], with sp each tp rank's rows of it): a stage receives the previous
  // stage's activation straight into its first layer's input of the micro-batch's slot, and the next stage's
  // gradient into d_resid, and sends its input gradient from d_resid; its last layer writes the activation it sends
  // into a buffer of its own (the last stage's is the final residual). With tied embeddings the first and last
  // stages receive the other's gradient of the table (fp32, this tp rank's rows) to add to their own; a frozen table
  // (adapters) has none.
  if (l.pp > 1) {
    if (!stage.head)
      b.add(GpuBuffer::ResidOut, "pipeline send: activation to the next stage", MemoryKind::Communication,
            p.rows * p.C, kBf16);
    if (l.tied_across_stages(c))
      b.add(GpuBuffer::TiedPeerGrad, "pipeline: the tied embedding's gradient from the other stage",
            MemoryKind::Communication, p.V * p.C, kF32);
  }
  if (stage.head) b.add(GpuBuffer::LossTotal, "loss total", MemoryKind::Workspace, 1, kF64);
  if (stage.embedding) b.add(GpuBuffer::Tokens, "token ids", MemoryKind::Workspace, n, kI32);
  if (stage.head) b.add(GpuBuffer::Targets, "targets", MemoryKind::Workspace, n, kI32);
  if (stage.embedding) {
    b.add(GpuBuffer::GroupPositions, "embedding group positions", MemoryKind::Workspace, n, kI32);
    b.add(GpuBuffer::GroupTokens, "embedding group tokens", MemoryKind::Workspace, n, kI32);
    b.add(GpuBuffer::GroupOffsets, "embedding group offsets", MemoryKind::Workspace, n + 1, kI32);
  }
  // Packed documents: each token's document start (the attention mask, as a per-row start) and RoPE position.
  b.add(GpuBuffer::DocStarts, "document starts", MemoryKind::Workspace, n, kI32);
  b.add(GpuBuffer::RopePositions, "RoPE positions", MemoryKind::Workspace, n, kI32);
  // The hopper forward's work counter (kernels/attention.cuh), with the model rather than allocated at its first use.
  b.add(GpuBuffer::AttentionTileCounter, "attention tile counter", MemoryKind::Workspace, 1, kI32);
  b.add(GpuBuffer::MatmulWorkspace, "cuBLASLt workspace", MemoryKind::Workspace, kMatmulWorkspaceBytes, 1);
}

// NCCL pads a unit it reduce-scatters or gathers to a multiple of dp in a scratch buffer of its own
// (comm/comm_nccl.cpp), allocated on first use.
void plan_nccl_scratch(const LlamaConfig& c, const MemoryLayout& l, const ParamLayout& layout, const StageUnits& units,
                       PlanBuilder& b) {
  if (l.dp == 1) return;
  // The largest collective, in fp32 elements: a unit's gradient; with adapters a layer's adapter gradient, or at
  // ZeRO-3 a base unit's gathered bytes.
  int64_t largest = units.largest;
  if (l.lora.enabled()) {
    largest = lora_layer_params(c, l.lora, l.tp);
    if (l.training && l.zero == 3)
      for (int u : units.units) {
        int64_t bytes = 0;
        for (const ParamTensor& t : layout.tensors())
          if (t.offset >= layout.unit_range(u).first && t.offset < layout.unit_range(u).second)
            bytes += base_storage_bytes(t, l.lora.base_quant);
        largest = std::max(largest, (bytes + kF32 - 1) / kF32);
      }
  }
  const int64_t chunk = (largest + l.dp - 1) / l.dp;
  b.add_outside_arena("NCCL padding scratch (the comm's own)", MemoryKind::Communication,
                      (chunk * l.dp + chunk) * kF32);
}

}  // namespace

GpuBufferTable plan_gpu_buffers(const LlamaConfig& c, const MemoryLayout& asked) {
  const MemoryLayout l = place_layout(c, asked);
  check_layout(c, l);
  // This rank's pipeline stage (at pp 1, the whole model).
  const PipelineStage& stage = l.stage();
  const ParamLayout& layout = tp_rank_layout(c, l.tp_rank, l.tp, l.pp, stage);
  const StageUnits units = stage_units(layout, stage);
  PlanBuilder b;
  if (l.lora.enabled()) plan_lora_state(c, l, layout, stage, units, b);
  else plan_full_state(l, layout, units, b);
  b.add(GpuBuffer::RopeCos, "RoPE cos", MemoryKind::Workspace, l.seq_len * c.head_dim / 2, kF32);
  b.add(GpuBuffer::RopeSin, "RoPE sin", MemoryKind::Workspace, l.seq_len * c.head_dim / 2, kF32);
  const PassShape shape = pass_shape(c, l, layout);
  plan_layer_activations(c, l, stage, shape, b);
  plan_pass_buffers(l, stage, shape, b);
  plan_fp8_buffers(l, stage, shape, b);
  plan_pipeline_and_inputs(c, l, stage, shape, b);
  plan_nccl_scratch(c, l, layout, units, b);
  return b.table;
}

MemoryPlan plan_gpu_memory(const LlamaConfig& c, const MemoryLayout& l) { return plan_gpu_buffers(c, l).plan; }

bool fp8_casts_at_each_use(const MemoryLayout& l) {
  return l.zero == 3 || (l.lora.enabled() && l.lora.base_quant != BaseQuant::None);
}

int64_t fp8_cast_layers(const MemoryLayout& l) { return fp8_casts_at_each_use(l) ? 1 : l.stage().layers(); }

MemoryPlan plan_gpu_decode_memory(const LlamaConfig& c, int64_t batch, int64_t capacity) {
  TUNA_CHECK(batch >= 1 && capacity >= 1, "batch ", batch, ", capacity ", capacity);
  const int64_t rows = batch * capacity, C = c.hidden_size, F = c.intermediate_size;
  const int64_t cache = batch * capacity * c.kv_dim();
  PlanBuilder b;
  for (int64_t layer = 0; layer < c.num_hidden_layers; layer++) {
    b.add(str("layer ", layer, " cached keys"), MemoryKind::Activations, cache, kBf16);
    b.add(str("layer ", layer, " cached values"), MemoryKind::Activations, cache, kBf16);
  }
  b.add("RoPE cos", MemoryKind::Workspace, capacity * c.head_dim / 2, kF32);
  b.add("RoPE sin", MemoryKind::Workspace, capacity * c.head_dim / 2, kF32);
  b.add("rstd", MemoryKind::Activations, rows, kF32);
  for (const char* name : {"residual", "residual mid", "norm"}) b.add(name, MemoryKind::Activations, rows * C, kBf16);
  b.add("q|k|v", MemoryKind::Activations, rows * (c.q_dim() + 2 * c.kv_dim()), kBf16);
  for (const char* name : {"q", "attention out"}) b.add(name, MemoryKind::Activations, rows * c.q_dim(), kBf16);
  b.add("gate|up", MemoryKind::Activations, rows * 2 * F, kBf16);
  b.add("swiglu", MemoryKind::Activations, rows * F, kBf16);
  b.add("last positions", MemoryKind::Activations, batch * C, kBf16);
  b.add("logits", MemoryKind::Activations, batch * c.vocab_size, kBf16);
  b.add("tokens", MemoryKind::Workspace, rows, kI32);
  b.add_outside_arena("cuBLASLt workspace", MemoryKind::Workspace, kMatmulWorkspaceBytes);
  return b.table.plan;
}

int64_t gpu_headroom_bytes(const MemoryLayout& l) {
  const int64_t mib = int64_t(1) << 20;
  return (l.dp > 1 || l.tp > 1 || l.pp > 1) ? 1536 * mib : 512 * mib;
}

namespace {

std::string describe_layout(const MemoryLayout& l) {
  return str("dp ", l.dp, l.pp > 1 ? str(" x pp ", l.pp) : std::string(), " x tp ", l.tp, l.sp ? " with sp" : "",
             ", ZeRO-", l.zero, l.zero == 3 && !l.zero_prefetch ? " (no prefetch)" : "",
             ", recompute ", recompute_name(l.recompute), ", ", l.bf16_moments ? "bf16" : "fp32", " moments, ",
             l.master_weights ? "fp32 master" : "no fp32 master", ", micro_batch ", l.micro_batch, " x seq_len ",
             l.seq_len, l.lora.enabled() ? ", " + describe_lora(l.lora) : std::string(),
             l.fp8 != Fp8Mode::Off ? str(", --fp8 ", fp8_mode_name(l.fp8),
                                         l.fp8_forward_codes ? ", --fp8_weight_codes forward" : "")
                                   : std::string());
}

// --fp8's buffers, each on a line of its own below the table (the table names a kind's largest buffer only).
std::string fp8_buffer_lines(const MemoryPlan& plan) {
  std::string out;
  for (const MemoryItem& i : plan.items)
    if (i.name.rfind("FP8 ", 0) == 0)
      out += str("  ", i.name, ": ", format_bytes(i.bytes), " (", memory_kind_name(i.kind), ")\n");
  return out.empty() ? out : "of which FP8 (model/fp8_gpu.h):\n" + out;
}

int64_t needed(const LlamaConfig& c, const MemoryLayout& l) {
  return plan_gpu_memory(c, l).peak() + gpu_headroom_bytes(l);
}

}  // namespace

GpuFit check_gpu_fit(const LlamaConfig& c, const MemoryLayout& l, int64_t capacity) {
  const MemoryPlan plan = plan_gpu_memory(c, l);
  GpuFit fit;
  const int64_t need = plan.peak() + gpu_headroom_bytes(l);
  fit.fits = need <= capacity;
  // A layout the CUDA engine does not run yet (model/support.h): its plan is the design, and the table says why.
  const Support runs = support(c, l, Device::Cuda);
  fit.report = format_memory_table(plan, capacity,
                                   str("device memory per GPU (dp rank ", l.dp_rank,
                                       l.pp > 1 ? str(", pipeline stage ", l.pp_rank) : std::string(), ", tp rank ",
                                       l.tp_rank, " of ", describe_layout(l), ")",
                                       runs.runs() ? "" : str(", AS DESIGNED (", runs.reason, ")")),
                                   gpu_headroom_bytes(l));
  fit.report += fp8_buffer_lines(plan);
  if (fit.fits) return fit;
  fit.report += str("does not fit: needs ", format_bytes(need), " with headroom, the device has ", format_bytes(capacity), " free\n");
  // Cumulative changes, cheapest in speed first.
  MemoryLayout t = l;
  std::vector<std::string> changes;
  const auto fits_now = [&] { return needed(c, t) <= capacity; };
  const auto try_change = [&](bool applicable, const std::function<void()>& apply, const std::string& flag) {
    if (!applicable || fits_now()) return;
    apply();
    changes.push_back(flag);
  };
  try_change(!t.bf16_moments, [&] { t.bf16_moments = true; }, "--bf16_moments true");
  for (int z = t.zero + 1; z <= 3 && t.dp > 1; z++) try_change(true, [&, z] { t.zero = z; }, str("--zero ", z));
  try_change(t.training && t.fp8 != Fp8Mode::Off && !t.fp8_forward_codes, [&] { t.fp8_forward_codes = true; },
             "--fp8_weight_codes forward");
  try_change(t.recompute == Recompute::None, [&] { t.recompute = Recompute::Selective; }, "--recompute selective");
  if (!fits_now() && t.recompute == Recompute::Selective && !changes.empty() && changes.back() == "--recompute selective")
    changes.pop_back();
  try_change(t.recompute != Recompute::Full, [&] { t.recompute = Recompute::Full; }, "--recompute full");
  while (!fits_now() && t.micro_batch > 1) {
    t.micro_batch = (t.micro_batch + 1) / 2;
    if (!changes.empty() && changes.back().rfind("--micro_batch", 0) == 0) changes.pop_back();
    changes.push_back(str("--micro_batch ", t.micro_batch, " (raise grad_accum to keep the global batch)"));
  }
  // Adapters on a bf16 base: the base in nf4 (QLoRA) is a quarter of it.
  try_change(t.lora.enabled() && t.lora.base_quant == BaseQuant::None,
             [&] { t.lora.base_quant = BaseQuant::Nf4; }, "--base_quant nf4");
  if (fits_now()) {
    std::string flags;
    for (const std::string& f : changes) flags += " " + f;
    fit.report += str("would fit with:", flags, " (", format_bytes(needed(c, t)), " with headroom: ", describe_layout(t), ")\n");
  } else {
    fit.report += str("no option of this layout fits (", describe_layout(t), " still needs ", format_bytes(needed(c, t)),
                      "): more GPUs (a larger dp with ZeRO-3) or tensor parallelism (--tp) are needed\n");
  }
  return fit;
}

}  // namespace tuna
