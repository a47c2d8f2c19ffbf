// The CPU engine's memory plan (model/memory_plan.h): what one rank of the CPU backend (Llama + Zero, fp32)
// allocates on the host for a model, a dp x tp x ZeRO layout and a batch shape.
//
// The persistent items are made of the figures Llama's and Zero's constructors check their allocations against
// (llama_buffer_sizes, zero_buffer_sizes), so they are exact. The transients are what the trainer allocates for a
// moment and frees (train.cu, ckpt/checkpoint.cpp, the MPI library); the trainer's measured peak resident memory
// is held against the plan by tests/dist/test_memory_plan.cpp. The plan is for the layout's dp_rank and tp_rank;
// rank 0 of each holds the most (the larger pieces of an uneven split, shard_range), so its plan is the one to fit.
#include <algorithm>

#include "core/error.h"
#include "model/optimizer.h"  // dp_unit_pieces
#include "model/layout.h"
#include "model/llama.h"
#include "model/memory_plan.h"
#include "model/quantized_weights.h"  // quantized_base_bytes
#include "model/support.h"            // place_layout, require_support

namespace tuna {

ZeroBufferSizes zero_buffer_sizes(const ParamLayout& layout, int stage, int dp_rank, int dp_size) {
  ZeroBufferSizes z;
  for (const Segment& s : dp_unit_pieces(layout, dp_rank, dp_size)) z.shard += s.size;
  for (int u = 0; u < layout.num_units(); u++)
    z.unit = std::max(z.unit, layout.unit_range(u).second - layout.unit_range(u).first);
  z.moments = stage == 0 ? layout.total() : z.shard;
  // Stages 1-2 update the model's whole fp32 weights in place (no master copy); stage 1 reads the all-reduced
  // whole gradient in place (no gradient shard).
  z.master = stage == 3 ? z.shard : 0;
  z.grad_shard = stage >= 2 ? z.shard : 0;
  z.weight_buffers = stage == 3 ? 2 : 0;
  // Llama's backward finishes one unit's gradient before it starts the next, except a tied embedding's: the
  // head takes it first and the embedding's backward finishes it last, so two are alive through the layers.
  z.grad_buffers = stage >= 2 ? (layout.is_model() && layout.lm_head_unit() == 0 ? 2 : 1) : 0;
  z.scatter_out = stage >= 2 ? shard_range(z.unit, 0, dp_size).size() : 0;
  return z;
}

namespace {

constexpr int64_t kFloat = sizeof(float), kDouble = sizeof(double);

}  // namespace

MemoryPlan plan_cpu_memory(const LlamaConfig& config, const MemoryLayout& asked) {
  // The CPU engine's own allocations: a layout it does not run has no plan here (model/support.h).
  const MemoryLayout m = place_layout(config, asked);
  require_support(config, m, Device::Cpu);

  // A pipeline stage (--pp) holds its own layers' tensors (the trainer's split, model/pipeline.h) and keeps the
  // activations of the micro-batches in flight there (1F1B), so the first stage holds the most.
  const PipelineStage& pipeline = m.stage();
  const ParamLayout layout = m.pp > 1 ? ParamLayout(config, static_cast<int>(m.tp_rank), static_cast<int>(m.tp), pipeline)
                                      : ParamLayout(config, static_cast<int>(m.tp_rank), static_cast<int>(m.tp));
  const int64_t in_flight = m.in_flight();
  // LoRA (training): the base is frozen and whole (no gradient, no optimizer state); Zero holds the adapters'.
  const bool lora = m.training && m.lora.enabled();
  const bool quantized = lora && m.lora.base_quant != BaseQuant::None;
  // A stage's adapters: its layers' (model/lora.h).
  const LoraLayout adapters = lora ? lora_layout(config, m.lora, static_cast<int>(m.tp_rank), static_cast<int>(m.tp),
                                                 m.pp > 1 ? &pipeline : nullptr)
                                   : LoraLayout{ParamLayout(TpDims{}, {}, {}), {}};
  const LlamaBufferSizes llama =
      llama_buffer_sizes(config, layout.tp(), m.micro_batch, m.seq_len,
                         lora ? static_cast<const LoraConfig&>(m.lora) : LoraConfig{}, m.sp);
  // The forward pass alone (build/eval, build/sample) is a Llama without Zero.
  const ZeroBufferSizes zero = m.training ? zero_buffer_sizes(lora ? adapters.params : layout, m.zero,
                                                              static_cast<int>(m.dp_rank), static_cast<int>(m.dp))
                                          : ZeroBufferSizes{};
  const int64_t params = layout.total(), L = pipeline.layers();
  const int64_t trained = lora ? adapters.params.total() : params;  // what gradients and moments cover

  MemoryPlan plan;
  auto add = [&](std::string name, MemoryKind kind, int64_t bytes) {
    if (bytes > 0) plan.items.push_back({std::move(name), kind, bytes});
  };
  // Llama: whole (tp-local) weights below stage 3, whole gradients below stage 2 (Zero takes them over above).
  const int stage = m.training ? m.zero : 0;
  if (quantized) {
    // model/quantized_weights.h: the projections quantized, the rest fp32, one decoder layer dequantized at a time.
    const QuantizedBaseBytes q = quantized_base_bytes(layout, m.lora.base_quant);
    add(str("frozen base: ", q.quantized_params, " projection weights in ", base_quant_name(m.lora.base_quant)),
        MemoryKind::Weights, q.quantized);
    add("frozen base: embedding, norms and lm_head (fp32)", MemoryKind::Weights, q.fp32_params * kFloat);
    add("frozen base: one decoder layer dequantized (fp32)", MemoryKind::Workspace, q.buffer);
    add("frozen base: a projection read whole to quantize its tp block (at start)", MemoryKind::Workspace, q.fill_buffer);
    add("LoRA adapters (fp32, whole)", MemoryKind::Weights, trained * kFloat);
    if (stage < 2) add("LoRA adapter gradients (fp32, whole)", MemoryKind::Gradients, trained * kFloat);
  } else if (lora && stage == 3) {
    // The frozen base sharded as a full fine-tune's stage 3 shards its weights (dist/zero.h ShardedWeights), with no
    // gradient or moment; the adapters' own shard, moments and buffers are Zero's, below.
    const ZeroBufferSizes base = zero_buffer_sizes(layout, 3, static_cast<int>(m.dp_rank), static_cast<int>(m.dp));
    add("frozen base weights (fp32, shard)", MemoryKind::Weights, base.shard * kFloat);
    add("frozen base: gathered weights (2 unit buffers)", MemoryKind::Communication, 2 * base.unit * kFloat);
  } else if (lora) {
    add("frozen base weights (fp32, whole)", MemoryKind::Weights, params * kFloat);
    add("LoRA adapters (fp32, whole)", MemoryKind::Weights, trained * kFloat);
    if (stage < 2) add("LoRA adapter gradients (fp32, whole)", MemoryKind::Gradients, trained * kFloat);
  } else {
    if (stage < 3) add("weights (fp32, whole)", MemoryKind::Weights, params * kFloat);
    if (stage < 2) add("gradients (fp32, whole)", MemoryKind::Gradients, params * kFloat);
  }
  add(str("activations kept for the backward (", L, " layers",
          in_flight > 1 ? str(" x ", in_flight, " micro-batches in flight") : std::string(), ")"),
      MemoryKind::Activations, (llama.kept_per_layer * L * in_flight + llama.final_norm) * kFloat);
  if (lora)
    add(str("LoRA: each adapter's r-wide intermediate (", L, " layers",
            in_flight > 1 ? str(" x ", in_flight, " micro-batches in flight") : std::string(), ") and the adapters' scratch"),
        MemoryKind::Activations, (llama.lora_kept_per_layer * L * in_flight + llama.lora_scratch) * kFloat);
  add(str("loss head: logits of ", llama.head_chunk_rows, " rows"), MemoryKind::Activations, llama.logits_chunk * kFloat);
  if (m.fp8 != Fp8Mode::Off) {
    // Llama::set_fp8: one byte per code of the largest group's x, W, W^T, dy and dy^T (model/fp8.h Fp8GroupCpu).
    const TpDims& d = layout.tp();
    const int64_t n = m.micro_batch * m.seq_len, C = config.hidden_size;
    const int64_t in = std::max({C, d.q_dim, d.ffn}), rows = std::max({d.q_dim + 2 * d.kv_dim, C, 2 * d.ffn});
    add(str("FP8 codes of the largest projection group (--fp8 ", fp8_mode_name(m.fp8), ")"), MemoryKind::Workspace,
        n * in + 2 * rows * in + 2 * n * rows);
  }
  add("backward scratch (one layer's activation gradients)", MemoryKind::Activations, llama.backward * kFloat);
  add(str("sequence parallelism: every tp rank's ", llama.local_rows, " rows gathered, two norm-weight gradients"),
      MemoryKind::Activations, llama.sequence * kFloat);
  add("rotary tables", MemoryKind::Workspace, llama.rope_tables * kFloat + llama.rope_inv_freq * kDouble);
  add("vocab-parallel loss statistics", MemoryKind::Workspace, llama.ce_stats * kDouble);
  add("document boundaries (mask starts, RoPE positions)", MemoryKind::Workspace, llama.documents * int64_t(sizeof(int32_t)));
  if (m.tied_across_stages(config)) {
    const ParamTensor* table = layout.has_embedding() ? layout.find("model.embed_tokens.weight") : layout.tied_copy();
    add("tied embedding: the other stage's gradient of the table", MemoryKind::Communication, table->numel * kFloat);
  }
  // Zero.
  add("master weights (fp32, shard)", MemoryKind::Master, zero.master * kFloat);
  add("gradient shard (fp32)", MemoryKind::Gradients, zero.grad_shard * kFloat);
  add(str(lora ? "LoRA adapters' " : "", m.zero == 0 ? "AdamW moments (fp32, whole)" : "AdamW moments (fp32, shard)"),
      MemoryKind::Moments, 2 * zero.moments * kFloat);
  add(str("gathered weights (", zero.weight_buffers, " unit buffers)"), MemoryKind::Communication,
      zero.weight_buffers * zero.unit * kFloat);
  add(str("unit gradients (", zero.grad_buffers, " unit buffers)"), MemoryKind::Communication,
      zero.grad_buffers * zero.unit * kFloat);
  add("reduce-scatter output (one unit's piece)", MemoryKind::Communication, zero.scatter_out * kFloat);

  if (!m.training) return plan;

  // Transients: each lives alone (start-up, a checkpoint, a collective), so the peak adds only the largest.
  int64_t largest_global = 0;
  for (const ParamTensor& t : layout.tensors()) {
    int64_t global = 1;
    for (int64_t d : t.global_shape) global *= d;
    largest_global = std::max(largest_global, global);
  }
  // Start-up: one global tensor drawn (or read and cut to this rank's block); every stage fills its own pieces in
  // place (stage 3 its shard), with no staging of the whole model (engine/engine.cpp).
  add("start-up: one global tensor drawn or read", MemoryKind::Transient, largest_global * kFloat);
  // A checkpoint adds nothing: the engine hands its own weights and moments a piece at a time to the file writer,
  // and a resume reads each piece's bytes straight into the engine's state (Engine::export_state/import_state).
  // A resume maps the checkpoint's files and releases each piece's pages once it is read (page cache, not a copy).
  // Stages 0-1 all-reduce the whole gradient in place, stages 2-3 reduce-scatter each unit's; Open MPI works
  // through a scratch copy of the message, which the MPI backend bounds by sending chunks of kMpiChunkBytes
  // (a chunked reduce-scatter also stages its chunk: comm/comm_mpi.cpp).
  if (m.dp > 1 && m.zero <= 1)
    add("gradient all-reduce: MPI's scratch for one chunk", MemoryKind::Transient,
        std::min(trained * kFloat, kMpiChunkBytes));
  if (m.dp > 1 && m.zero >= 2)
    add("unit reduce-scatter: MPI's scratch (and staging) for one chunk", MemoryKind::Transient,
        zero.unit * kFloat <= kMpiChunkBytes ? zero.unit * kFloat : 2 * kMpiChunkBytes);
  // Sequence parallelism reduce-scatters every rank's rows [tp x local_rows, C] over tp, chunked alike.
  if (m.sp) {
    const int64_t rows_bytes = m.tp * llama.local_rows * config.hidden_size * kFloat;
    add("sequence-parallel reduce-scatter: MPI's scratch (and staging) for one chunk", MemoryKind::Transient,
        rows_bytes <= kMpiChunkBytes ? rows_bytes : 2 * kMpiChunkBytes);
  }
  return plan;
}

}  // namespace tuna
