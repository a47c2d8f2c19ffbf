// The decoder, layer by layer, as transformers' LlamaForCausalLM computes it:
//   x = embed(tokens)
//   per layer: h = x + o_proj(attention(rope(q_proj(n1)), rope(k_proj(n1)), v_proj(n1)))  with n1 = rmsnorm(x)
//              x = h + down_proj(silu(gate_proj(n2)) * up_proj(n2))                      with n2 = rmsnorm(h)
//   logits = lm_head(rmsnorm(x))
// Every activation the backward needs is kept (no recompute on the CPU backend); the backward walks
// the same list in reverse.
#include "model/llama.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "core/error.h"
#include "core/memory.h"
#include "comm/comm.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/classifier.h"
#include "kernels/cpu/decode_attention.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/lora.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/swiglu.h"
#include "model/memory_plan.h"  // MemoryLayout

namespace tuna {

namespace {
// Rows of logits computed at once: bounded so that [rows, vocab] stays near 16 MB whatever the vocab.
constexpr int64_t kHeadChunkFloats = int64_t(4) << 20;
}  // namespace

// The WeightStore of a Llama that holds its whole (tp-local) model in params and grads.
class Llama::OwnWeights final : public WeightStore {
 public:
  explicit OwnWeights(Llama& model) : m_(model) {}
  const float* acquire(int unit) override { return m_.params.data() + m_.layout_.unit_range(unit).first; }
  void release(int) override {}
  float* grads(int unit) override { return m_.grads.data() + m_.layout_.unit_range(unit).first; }
  void grads_done(int) override {}

 private:
  Llama& m_;
};

namespace {

// This tp rank's [out, in] of a projection (the whole layer's in model/lora.h lora_target_shape).
std::array<int64_t, 2> local_shape(const LlamaConfig& c, const TpDims& d, LoraTarget t) {
  switch (t) {
    case LoraTarget::Q: return {d.q_dim, c.hidden_size};
    case LoraTarget::K:
    case LoraTarget::V: return {d.kv_dim, c.hidden_size};
    case LoraTarget::O: return {c.hidden_size, d.q_dim};
    case LoraTarget::Gate:
    case LoraTarget::Up: return {d.ffn, c.hidden_size};
    case LoraTarget::Down: return {c.hidden_size, d.ffn};
  }
  return {0, 0};
}

LoraLayout adapters_of(const LlamaConfig& config, const LoraConfig& lora, const LlamaParallel& parallel) {
  const int tp_rank = parallel.tp ? parallel.tp->rank() : 0, tp_size = parallel.tp ? parallel.tp->size() : 1;
  if (lora.enabled()) return lora_layout(config, lora, tp_rank, tp_size, parallel.stage);  // a stage's: its layers'
  return LoraLayout{ParamLayout(TpDims{}, {}, {}), {}};
}

PipelineStage whole_model(const LlamaConfig& config) {
  PipelineStage s;
  s.layer_end = config.num_hidden_layers, s.embedding = s.head = true;
  return s;
}

ParamLayout layout_of(const LlamaConfig& config, const LlamaParallel& parallel) {
  const int tp_rank = parallel.tp ? parallel.tp->rank() : 0, tp_size = parallel.tp ? parallel.tp->size() : 1;
  return parallel.stage ? ParamLayout(config, tp_rank, tp_size, *parallel.stage) : ParamLayout(config, tp_rank, tp_size);
}

}  // namespace

// The WeightStore of a Llama's own adapters (lora_params / lora_grads), one unit per decoder layer.
class Llama::OwnAdapters final : public WeightStore {
 public:
  explicit OwnAdapters(Llama& model) : m_(model) {}
  const float* acquire(int unit) override {
    return m_.lora_params.data() + m_.lora_layout_.params.unit_range(unit).first;
  }
  void release(int) override {}
  float* grads(int unit) override { return m_.lora_grads.data() + m_.lora_layout_.params.unit_range(unit).first; }
  void grads_done(int) override {}

 private:
  Llama& m_;
};

LlamaParallel llama_parallel(const MemoryLayout& run, Comm* tp) {
  LlamaParallel p;
  p.tp = tp;
  p.external_weights = run.zero == 3 || run.lora.base_quant != BaseQuant::None;
  p.external_grads = run.zero == 2;
  p.sequence = run.sp;
  p.stage = run.pp > 1 ? &run.stage() : nullptr;
  p.in_flight = run.in_flight();
  p.external_adapters = run.lora.enabled() && run.zero == 3;
  return p;
}

Llama::Llama(const LlamaConfig& config, const MemoryLayout& run, Comm* tp)
    : Llama(config, run.micro_batch, run.seq_len, llama_parallel(run, tp), static_cast<const LoraConfig&>(run.lora)) {
  set_fp8(run.fp8);
}

Llama::Llama(const LlamaConfig& config, int64_t max_batch, int64_t max_seq, const LlamaParallel& parallel,
             const LoraConfig& lora)
    : config_(config),
      layout_(layout_of(config, parallel)),
      tp_(parallel.tp && parallel.tp->size() > 1 ? parallel.tp : nullptr),
      sp_(tp_ != nullptr && parallel.sequence),
      max_batch_(max_batch),
      max_seq_(max_seq),
      lora_(lora),
      lora_layout_(adapters_of(config, lora, parallel)) {
  TUNA_CHECK(max_batch > 0 && max_seq > 0, "batch ", max_batch, " seq ", max_seq);
  stage_ = parallel.stage ? *parallel.stage : whole_model(config);
  in_flight_ = parallel.in_flight;
  TUNA_CHECK(in_flight_ >= 1, "activation slots: ", in_flight_);
  const LlamaConfig& c = config_;
  const TpDims& d = layout_.tp();
  const int64_t n = max_batch * max_seq;
  const bool adapters = lora_.enabled();
  // Adapters: external_grads is about the adapters' gradients; external weights are the frozen base's store (a
  // quantized base), and the base never has gradients.
  // The large buffers are checked against the host's memory before they are allocated, by name and size, so
  // that a model or batch too big for this machine is an error that says so (core/memory.h), not the OOM killer.
  const int64_t weight_copies =
      (parallel.external_weights ? 0 : 1) + (adapters || parallel.external_weights || parallel.external_grads ? 0 : 1);
  allocate_host(str(adapters ? "the frozen base's weights" : "the model's weights",
                    weight_copies == 2 ? " and gradients" : "", " (", layout_.total(), " parameters, fp32)"),
                static_cast<uint64_t>(weight_copies) * layout_.total() * sizeof(float), [&] {
                  if (!parallel.external_weights) params.assign(layout_.total(), 0.0f);
                  if (weight_copies == 2) grads.assign(layout_.total(), 0.0f);
                });
  if (!parallel.external_weights && (adapters || !parallel.external_grads)) {
    own_store_ = std::make_unique<OwnWeights>(*this);
    store_ = own_store_.get();
  }
  if (adapters) {
    const int64_t total = lora_layout_.params.total();
    const int64_t copies = parallel.external_adapters ? 0 : parallel.external_grads ? 1 : 2;
    if (copies > 0)
      allocate_host(str("the LoRA adapters", copies == 2 ? " and their gradients" : "", " (", total, " parameters, fp32)"),
                    static_cast<uint64_t>(copies * total) * sizeof(float), [&] {
                      lora_params.assign(total, 0.0f);
                      if (copies == 2) lora_grads.assign(total, 0.0f);
                    });
    if (!parallel.external_grads && !parallel.external_adapters) {
      own_lora_store_ = std::make_unique<OwnAdapters>(*this);
      lora_store_ = own_lora_store_.get();
    }
    lora_tensor_index_.assign(c.num_hidden_layers, {});
    const std::vector<ParamTensor>& tensors = lora_layout_.params.tensors();
    for (size_t k = 0; k < tensors.size(); k++)
      for (int t = 0; t < kLoraTargets; t++)
        if (lora_layout_.layers[tensors[k].layer].a[t] == tensors[k].offset)
          lora_tensor_index_[tensors[k].layer][t] = static_cast<int>(k);
  }

  inv_freq_.resize(c.head_dim / 2);
  cpu::rope_inv_freq(inv_freq_.data(), c.head_dim, c.rope_theta, c.rope_scaling, max_seq);
  allocate_host(str("the rotary tables for ", max_seq, " positions"), uint64_t(max_seq) * c.head_dim * sizeof(float), [&] {
    rope_cos_.resize(max_seq * c.head_dim / 2);
    rope_sin_.resize(max_seq * c.head_dim / 2);
  });
  // The tables of a forward over max_seq positions (dynamic scaling depends on the length: a training window of
  // max_seq tokens is what transformers rotates with these; a cached forward makes its own rows, below).
  cpu::rope_table(rope_cos_.data(), rope_sin_.data(), inv_freq_.data(), max_seq, c.head_dim,
                  cpu::rope_attention_factor(c.rope_scaling));
  allocate_host(str("the document boundaries of ", max_batch, " x ", max_seq, " tokens"),
                uint64_t(2) * n * sizeof(int32_t), [&] {
                  doc_start_.resize(n);
                  rope_positions_.resize(n);
                });

  // One set of layer activations per micro-batch in flight (a pipeline stage's slots), for the stage's layers.
  const int64_t kept_layers = stage_.layers() * in_flight_;
  acts_.resize(kept_layers);
  const LlamaBufferSizes planned = llama_buffer_sizes(c, d, max_batch, max_seq, lora_, sp_);
  head_chunk_rows_ = planned.head_chunk_rows;
  // The norm and residual regions: every row, or with sp this rank's ceil(n / tp) (the last ranks' pieces are
  // shorter, but every piece is gathered and scattered at the same size).
  const int64_t rows = planned.local_rows;
  // Checked against the host's memory before anything is allocated, by name (the sizes are the plan's).
  allocate_host(str("the activations of ", max_batch, " x ", max_seq, " tokens through ", stage_.layers(), " layers",
                    in_flight_ > 1 ? str(" for ", in_flight_, " micro-batches in flight") : std::string(),
                    " (lower micro_batch or seq_len)"),
                uint64_t(planned.activation_floats(kept_layers)) * sizeof(float) + planned.ce_stats * sizeof(double),
                [&] {
    for (LayerActs& a : acts_) {
      a.resid_in.resize(rows * c.hidden_size);
      a.norm1.resize(rows * c.hidden_size);
      a.rstd1.resize(rows);
      a.q.resize(n * d.q_dim);
      a.k.resize(n * d.kv_dim);
      a.v.resize(n * d.kv_dim);
      a.att.resize(n * d.q_dim);
      a.lse.resize(n * d.heads);
      a.resid_mid.resize(rows * c.hidden_size);
      a.norm2.resize(rows * c.hidden_size);
      a.rstd2.resize(rows);
      a.gate.resize(n * d.ffn);
      a.up.resize(n * d.ffn);
      a.act.resize(n * d.ffn);
    }
    resid_out_.resize(rows * c.hidden_size);
    final_norm_out_.resize(rows * c.hidden_size);
    final_rstd_.resize(rows);
    logits_chunk_.resize(head_chunk_rows_ * d.vocab);
    if (tp_) ce_stats_.resize(3 * head_chunk_rows_);

    d_resid_.resize(rows * c.hidden_size);
    d_norm_.resize((sp_ ? tp_->size() * rows : n) * c.hidden_size);
    d_q_.resize(n * d.q_dim);
    d_k_.resize(n * d.kv_dim);
    d_v_.resize(n * d.kv_dim);
    d_att_.resize(n * d.q_dim);
    d_gate_.resize(n * d.ffn);
    d_up_.resize(n * d.ffn);
    d_act_.resize(n * d.ffn);
    d_final_norm_.resize(rows * c.hidden_size);
    if (sp_) {
      gathered_.resize(tp_->size() * rows * c.hidden_size);
      sp_norm_grads_.resize(2 * c.hidden_size);
    }
    if (adapters) {
      int64_t largest_in = 0, widest = 0, stacked = 0;
      for (int g = 0; g < kLoraInputs; g++) {
        LoraGroup& group = lora_groups_[g];
        const std::vector<LoraTarget> on_input = lora_input_targets(LoraInput(g));
        for (size_t p = 0; p < on_input.size(); p++)
          if (lora_.has(on_input[p]))
            group.targets.push_back(on_input[p]), group.place.push_back(static_cast<int>(p)),
                group.in = local_shape(c, d, on_input[p])[1];
        const int64_t width = lora_.rank * static_cast<int64_t>(group.targets.size());
        if (width == 0) continue;
        for (LayerActs& a : acts_) a.lora_u[g].resize(n * width);
        largest_in = std::max(largest_in, group.in), widest = std::max(widest, width);
        if (group.targets.size() > 1) stacked = std::max(stacked, width * group.in);
      }
      if (lora_.dropout > 0) lora_in_.resize(n * largest_in), lora_tmp_.resize(n * largest_in);
      lora_dt_.resize(n * widest);
      lora_a_.resize(stacked), lora_da_.resize(stacked);
    }
                });
  // The memory plan is made of llama_buffer_sizes: a buffer added here without it would make the plan wrong.
  TUNA_CHECK(activation_bytes() == planned.activation_floats(kept_layers) * int64_t(sizeof(float)) &&
                 static_cast<int64_t>(rope_cos_.size() + rope_sin_.size()) == planned.rope_tables &&
                 static_cast<int64_t>(inv_freq_.size()) == planned.rope_inv_freq &&
                 static_cast<int64_t>(ce_stats_.size()) == planned.ce_stats &&
                 static_cast<int64_t>(doc_start_.size() + rope_positions_.size()) == planned.documents,
             "Llama's buffers differ from llama_buffer_sizes (update it with the constructor)");
}

LlamaBufferSizes llama_buffer_sizes(const LlamaConfig& c, const TpDims& d, int64_t max_batch, int64_t max_seq,
                                    const LoraConfig& lora, bool sequence) {
  const int64_t n = max_batch * max_seq, C = c.hidden_size;
  const bool sp = sequence && d.tp_size > 1;
  LlamaBufferSizes s;
  // With sp the norm and residual regions hold this rank's rows (shard_range: ceil(n / tp) at most); the
  // attention and MLP interiors (tp-local columns) every row.
  const int64_t rows = s.local_rows = sp ? (n + d.tp_size - 1) / d.tp_size : n;
  // resid_in, norm1, resid_mid, norm2: C; rstd1, rstd2: 1 (rows); q, att: q_dim; k, v: kv_dim; lse: heads; gate,
  // up, act: ffn (n).
  s.kept_per_layer = rows * (4 * C + 2) + n * (2 * d.q_dim + 2 * d.kv_dim + d.heads + 3 * d.ffn);
  s.final_norm = rows * (2 * C + 1);  // resid_out, final_norm_out, final_rstd
  s.head_chunk_rows = std::clamp<int64_t>(kHeadChunkFloats / d.vocab, 1, n);
  s.logits_chunk = s.head_chunk_rows * d.vocab;
  // d_resid, d_final_norm: C (rows); d_norm: C (every rank's rows with sp, padded to tp pieces); d_q, d_att:
  // q_dim; d_k, d_v: kv_dim; d_gate, d_up, d_act: ffn.
  s.backward = 2 * rows * C + (sp ? d.tp_size * rows : n) * C + n * (2 * d.q_dim + 2 * d.kv_dim + 3 * d.ffn);
  // The gathered rows (tp pieces of `rows`) and a layer's two norm-weight gradients before their sum.
  s.sequence = sp ? d.tp_size * rows * C + 2 * C : 0;
  s.rope_tables = 2 * max_seq * (c.head_dim / 2);
  s.rope_inv_freq = c.head_dim / 2;
  s.ce_stats = d.tp_size > 1 ? 3 * s.head_chunk_rows : 0;
  s.documents = 2 * n;
  if (lora.enabled()) {
    // Per input (LoraInput) its adapters' u side by side; dt of the widest group; the stacked A and dA of the largest
    // group of two or more; with dropout the dropped input and its gradient.
    int64_t largest_in = 0, widest = 0, stacked = 0, targets = 0;
    for (int g = 0; g < kLoraInputs; g++) {
      int64_t count = 0, in = 0;
      for (LoraTarget t : lora_input_targets(LoraInput(g)))
        if (lora.has(t)) count++, in = local_shape(c, d, t)[1];
      if (count == 0) continue;
      targets += count;
      largest_in = std::max(largest_in, in), widest = std::max(widest, count * lora.rank);
      if (count > 1) stacked = std::max(stacked, count * lora.rank * in);
    }
    s.lora_kept_per_layer = n * lora.rank * targets;
    s.lora_scratch = (lora.dropout > 0 ? 2 * n * largest_in : 0) + n * widest + 2 * stacked;
  }
  return s;
}

int64_t Llama::activation_bytes() const {
  int64_t floats = 0;
  for (const LayerActs& a : acts_)
    for (const std::vector<float>* v : {&a.resid_in, &a.norm1, &a.rstd1, &a.q, &a.k, &a.v, &a.att, &a.lse,
                                        &a.resid_mid, &a.norm2, &a.rstd2, &a.gate, &a.up, &a.act})
      floats += static_cast<int64_t>(v->size());
  for (const LayerActs& a : acts_)
    for (const std::vector<float>& u : a.lora_u) floats += static_cast<int64_t>(u.size());
  for (const std::vector<float>* v : {&lora_in_, &lora_tmp_, &lora_dt_, &lora_a_, &lora_da_})
    floats += static_cast<int64_t>(v->size());
  for (const std::vector<float>* v :
       {&resid_out_, &final_norm_out_, &final_rstd_, &logits_chunk_, &d_resid_, &d_norm_, &d_q_, &d_k_, &d_v_,
        &d_att_, &d_gate_, &d_up_, &d_act_, &d_final_norm_, &gathered_, &sp_norm_grads_})
    floats += static_cast<int64_t>(v->size());
  return floats * static_cast<int64_t>(sizeof(float));
}

void Llama::set_weight_store(WeightStore* store) {
  TUNA_CHECK(store && grads.empty(), "a weight store replaces external weights or gradients only");
  store_ = store;
}

void Llama::set_lora_store(WeightStore* store) {
  TUNA_CHECK(store && lora_.enabled() && lora_grads.empty(), "an adapter store replaces external adapter gradients only");
  lora_store_ = store;
}

void Llama::init_random(uint64_t seed, double std, float* out) {
  if (!out) out = params.data();
  TUNA_CHECK(out != nullptr, "no buffer to initialize");
  init_random_weights(layout_, seed, std, out);
}

void init_random_weights(const ParamLayout& layout, uint64_t seed, double std, float* out) {
  init_random_weights_piece(layout, seed, std, Segment{0, layout.total()}, out);
}

void init_random_weights_piece(const ParamLayout& layout, uint64_t seed, double std, const Segment& piece, float* out) {
  for_each_tensor_piece(layout, piece.begin, piece.size, out,
                        [&](size_t index, const ParamTensor& t, int64_t lb, int64_t le, float* p) {
    if (t.shape.size() == 1) {
      std::fill(p, p + (le - lb), 1.0f);  // RMSNorm weights start at identity
      return;
    }
    std::mt19937_64 rng(tensor_stream_seed(seed, index));
    std::normal_distribution<double> normal(0.0, std);
    draw_block_piece(t, lb, le, p, [&] { return static_cast<float>(normal(rng)); });
  });
}

void Llama::zero_grads() {
  std::fill(grads.begin(), grads.end(), 0.0f);
  std::fill(lora_grads.begin(), lora_grads.end(), 0.0f);
}

void Llama::tp_all_reduce(float* x, int64_t n, const char* what) {
  if (tp_) tp_->all_reduce_sum(x, n, what);
}

// Sequence parallelism moves every row in pieces of sp_chunk_ rows, one per rank (the last ones padded past the
// batch), so that each collective's shard_range piece is whole rows whatever batch x seq is.
const float* Llama::sp_gather(const float* local, const char* what) {
  tp_->all_gather(local, gathered_.data(), tp_->size() * sp_chunk_ * config_.hidden_size, what);
  return gathered_.data();
}

void Llama::sp_reduce(float* full, float* local, int64_t rows, const char* what) {
  const int64_t C = config_.hidden_size;
  if (!sp_) {
    tp_all_reduce(full, rows * C, what);
    return;
  }
  // The padding rows sum to zeros on the last rank (never read), whatever the buffer held before.
  const int64_t padded = tp_->size() * sp_chunk_;
  std::fill(full + rows * C, full + padded * C, 0.0f);
  tp_->reduce_scatter(full, local, padded * C, what);
}

void Llama::sp_sum_norm_grads(std::initializer_list<float*> dst, const char* what) {
  if (!sp_) return;
  const int64_t C = config_.hidden_size;
  tp_->all_reduce_sum(sp_norm_grads_.data(), static_cast<int64_t>(dst.size()) * C, what);
  const float* sum = sp_norm_grads_.data();
  for (float* g : dst) {
    for (int64_t j = 0; j < C; j++) g[j] += sum[j];
    sum += C;
  }
}

// Vocab-parallel embedding: each rank looks up the tokens in its rows and writes zeros for the others;
// the all-reduce (with sp the reduce-scatter) sums the one non-zero row per token.
void Llama::embed(float* out, const int32_t* tokens, int64_t n, const float* table) {
  const TpDims& d = layout_.tp();
  float* full = sp_ ? gathered_.data() : out;
  cpu::embedding_fwd_slice(full, tokens, table, n, config_.vocab_size, d.vocab_begin, d.vocab, config_.hidden_size);
  sp_reduce(full, out, n, "tp embedding");
}

void Llama::embed_bwd(float* dtable, const float* dout, const int32_t* tokens, int64_t n) {
  const TpDims& d = layout_.tp();
  cpu::embedding_bwd_slice(dtable, dout, tokens, n, config_.vocab_size, d.vocab_begin, d.vocab, config_.hidden_size);
}

// Cross-entropy over logits split by vocabulary: the row max, the sum of exponentials and the target's
// logit are each a reduction over the split, so three per-row numbers cross the tp group, not logits.
// The same math as cpu::classifier_fwd_bwd; with want_grad, logits becomes dlogits (dloss = 1).
double Llama::parallel_cross_entropy(float* logits, const int32_t* targets, int64_t rows, bool want_grad,
                                     const float* row_weights, float* row_losses) {
  const TpDims& d = layout_.tp();
  const int64_t V = d.vocab;
  for (int64_t i = 0; i < rows; i++)
    if (targets[i] != cpu::kIgnoreIndex && (targets[i] < 0 || targets[i] >= config_.vocab_size))
      fail("classifier: target of row ", i, " is ", targets[i], ", outside the vocabulary [0, ", config_.vocab_size,
           ") and not the ignore index ", cpu::kIgnoreIndex);
  std::vector<float> row_max(rows);
  for (int64_t i = 0; i < rows; i++) row_max[i] = *std::max_element(logits + i * V, logits + (i + 1) * V);
  tp_->all_reduce_max(row_max.data(), rows, "tp loss max");
  double* sum_exp = ce_stats_.data();
  double* target_logit = ce_stats_.data() + rows;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < rows; i++) {
    const float* row = logits + i * V;
    double s = 0;
    for (int64_t j = 0; j < V; j++) s += std::exp(double(row[j]) - row_max[i]);
    sum_exp[i] = s;
    const int64_t t = targets[i] - d.vocab_begin;
    target_logit[i] = targets[i] != cpu::kIgnoreIndex && t >= 0 && t < V ? row[t] : 0.0;
  }
  tp_->all_reduce_sum(ce_stats_.data(), 2 * rows, "tp loss sums");
  double total = 0;
  for (int64_t i = 0; i < rows; i++) {
    const double loss = targets[i] == cpu::kIgnoreIndex ? 0.0 : row_max[i] + std::log(sum_exp[i]) - target_logit[i];
    if (row_losses) row_losses[i] = static_cast<float>(loss);
    total += loss;
  }
  if (want_grad) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows; i++) {
      float* row = logits + i * V;
      const double w = row_weights ? row_weights[i] : 1.0;
      if (targets[i] == cpu::kIgnoreIndex || w == 0.0) {
        std::fill(row, row + V, 0.0f);
        continue;
      }
      const double scale = w / sum_exp[i];
      for (int64_t j = 0; j < V; j++) row[j] = static_cast<float>(std::exp(double(row[j]) - row_max[i]) * scale);
      const int64_t t = targets[i] - d.vocab_begin;
      if (t >= 0 && t < V) row[t] = static_cast<float>(row[t] - w);
    }
  }
  return total;
}

const char* document_positions_name(bool restart) { return restart ? "restart" : "continue"; }

bool parse_document_positions(const std::string& value) {
  if (value == "restart") return true;
  if (value == "continue") return false;
  fail("option 'document_positions': expected restart or continue, found '", value, "'");
}

void Llama::set_documents(const int32_t* positions, int64_t batch, int64_t seq) {
  attention_doc_start_ = nullptr, rope_position_ids_ = nullptr;
  if (!positions || !(documents_.mask || documents_.restart_positions)) return;
  const int64_t n = batch * seq;
  cpu::doc_starts_from_positions(doc_start_.data(), positions, batch, seq);
  if (documents_.mask) attention_doc_start_ = doc_start_.data();
  if (documents_.restart_positions) {
    // Position inside the document as far as this window sees it: a document that began in an earlier window
    // counts from the window's start (as a packed example would), so positions stay below seq_len.
    for (int64_t i = 0; i < n; ++i) rope_positions_[i] = static_cast<int32_t>(i % seq - doc_start_[i]);
    rope_position_ids_ = rope_positions_.data();
  }
}

void Llama::forward(const int32_t* inputs, int64_t batch, int64_t seq, bool backward_follows, KvCache* cache,
                    const int32_t* positions) {
  if (batch > max_batch_ || seq > max_seq_)
    fail("batch ", batch, " x seq ", seq, " exceeds the planned ", max_batch_, " x ", max_seq_);
  set_documents(positions, batch, seq);
  TUNA_CHECK(store_, "no weights: set_weight_store() first");
  const LlamaConfig& c = config_;
  const TpDims& d = layout_.tp();
  const int64_t n = batch * seq, C = c.hidden_size, F = d.ffn;
  const int H = layout_.head_unit();
  // This stage's layers (all of them without pipeline parallelism).
  const int first = static_cast<int>(stage_.layer_begin), end = static_cast<int>(stage_.layer_end);
  if (sp_) {
    sp_chunk_ = (n + tp_->size() - 1) / tp_->size();
    sp_rows_ = shard_range(n, tp_->rank(), tp_->size());
  }
  const int64_t nr = sp_ ? sp_rows_.size() : n;  // the rows of the norm and residual regions
  // Positions past .. past + seq - 1: the rotation tables start at row `past`.
  const int64_t past = cache ? cache->length : 0;
  const float* rope_cos = rope_cos_.data() + past * (c.head_dim / 2);
  const float* rope_sin = rope_sin_.data() + past * (c.head_dim / 2);
  if (cache && c.rope_scaling.type == "dynamic") {
    // Generation with dynamic scaling: the new positions turn with the frequencies of the length the cache now
    // reaches, as transformers' cached forward computes them; the cached keys keep theirs.
    cached_cos_.resize(seq * (c.head_dim / 2));
    cached_sin_.resize(seq * (c.head_dim / 2));
    cpu::rope_tables(cached_cos_.data(), cached_sin_.data(), past, seq, c.head_dim, c.rope_theta, c.rope_scaling,
                     past + seq);
    rope_cos = cached_cos_.data();
    rope_sin = cached_sin_.data();
  }

  store_->plan(layout_.unit_pass_order(backward_follows));
  lora_train_ = backward_follows && lora_.dropout > 0;  // PEFT's dropout acts in training only

  // The first stage embeds; a later stage's input is already in its first layer's resid_in (stage_input).
  if (stage_.embedding) {
    const float* embedding = store_->acquire(0);
    embed(first == end ? resid_out_.data() : acts(first).resid_in.data(), inputs, n,
          embedding + (layout_.embed_tokens() - layout_.unit_range(0).first));
    store_->release(0);
  }
  for (int l = first; l < end; l++) {
    LayerActs& a = acts(l);
    const LayerOffsets& o = layout_.layer(l);
    const float* base = store_->acquire(1 + l);
    const int64_t begin = layout_.unit_range(1 + l).first;
    auto w = [&](int64_t offset) { return base + (offset - begin); };
    float* resid_next = l + 1 < end ? acts(l + 1).resid_in.data() : resid_out_.data();
    const float* adapters = lora_store_ && !adapters_off_ ? lora_store_->acquire(l) : nullptr;
    auto adapt = [&](LoraInput g, const float* x, std::initializer_list<float*> ys) {
      if (adapters) lora_fwd(l, g, adapters, x, ys, n);
    };

    cpu::rmsnorm_fwd(a.norm1.data(), a.rstd1.data(), a.resid_in.data(), w(o.input_norm), nr, C, c.rms_norm_eps);
    const float* x1 = sp_ ? sp_gather(a.norm1.data(), "sp q/k/v input") : a.norm1.data();
    linear_fwd({{w(o.q_proj), d.q_dim}, {w(o.k_proj), d.kv_dim}, {w(o.v_proj), d.kv_dim}},
               {a.q.data(), a.k.data(), a.v.data()}, x1, n, C, /*x_split=*/false);
    adapt(LoraInput::Attention, x1, {a.q.data(), a.k.data(), a.v.data()});
    cpu::rope_fwd(a.q.data(), a.q.data(), rope_cos, rope_sin, batch, seq, d.heads, c.head_dim, d.q_dim, d.q_dim,
                  rope_position_ids_);
    cpu::rope_fwd(a.k.data(), a.k.data(), rope_cos, rope_sin, batch, seq, d.kv_heads, c.head_dim, d.kv_dim,
                  d.kv_dim, rope_position_ids_);
    if (cache) {
      for (int64_t b = 0; b < batch; b++) {  // rows b * seq .. of k, v -> positions past .. of sequence b
        const int64_t from = b * seq * d.kv_dim, to = (b * cache->capacity + past) * d.kv_dim;
        std::copy(a.k.begin() + from, a.k.begin() + from + seq * d.kv_dim, cache->keys[l].begin() + to);
        std::copy(a.v.begin() + from, a.v.begin() + from + seq * d.kv_dim, cache->values[l].begin() + to);
      }
      cpu::decode_attention_fwd(a.att.data(), a.q.data(), cache->keys[l].data(), cache->values[l].data(), batch, seq,
                                past, cache->capacity, d.heads, d.kv_heads, c.head_dim);
    } else {
      cpu::attention_fwd(a.att.data(), a.lse.data(), a.q.data(), a.k.data(), a.v.data(), batch, seq, d.heads,
                         d.kv_heads, c.head_dim, attention_doc_start_);
    }
    float* o_out = sp_ ? gathered_.data() : a.resid_mid.data();  // every row's partial sums
    linear_fwd({{w(o.o_proj), C}}, {o_out}, a.att.data(), n, d.q_dim, /*x_split=*/true);
    sp_reduce(o_out, a.resid_mid.data(), n, "tp o_proj");  // row-parallel: partial sums
    adapt(LoraInput::AttentionOut, a.att.data(), {a.resid_mid.data()});  // after the sum: added once (lora_fwd)
    for (int64_t i = 0; i < nr * C; i++) a.resid_mid[i] += a.resid_in[i];

    cpu::rmsnorm_fwd(a.norm2.data(), a.rstd2.data(), a.resid_mid.data(), w(o.post_norm), nr, C, c.rms_norm_eps);
    const float* x2 = sp_ ? sp_gather(a.norm2.data(), "sp gate/up input") : a.norm2.data();
    linear_fwd({{w(o.gate_proj), F}, {w(o.up_proj), F}}, {a.gate.data(), a.up.data()}, x2, n, C, /*x_split=*/false);
    adapt(LoraInput::Mlp, x2, {a.gate.data(), a.up.data()});
    cpu::swiglu_fwd(a.act.data(), a.gate.data(), a.up.data(), n, F, F);
    float* down_out = sp_ ? gathered_.data() : resid_next;
    linear_fwd({{w(o.down_proj), C}}, {down_out}, a.act.data(), n, F, /*x_split=*/true);
    sp_reduce(down_out, resid_next, n, "tp down_proj");
    adapt(LoraInput::MlpOut, a.act.data(), {resid_next});
    for (int64_t i = 0; i < nr * C; i++) resid_next[i] += a.resid_mid[i];
    store_->release(1 + l);
    if (adapters) lora_store_->release(l);
  }
  if (!stage_.head) return;  // the stage's output is resid_out_ (stage_output)
  // The head unit stays acquired through head() and the final norm's backward.
  head_base_ = store_->acquire(H);
  cpu::rmsnorm_fwd(final_norm_out_.data(), final_rstd_.data(), resid_out_.data(),
                   head_base_ + (layout_.final_norm() - layout_.unit_range(H).first), nr, C, c.rms_norm_eps);
}

LossSum Llama::head(const int32_t* targets, int64_t rows, bool want_grad, float* logits_out) {
  const int64_t C = config_.hidden_size, V = layout_.tp().vocab;
  const int H = layout_.head_unit(), lm_unit = layout_.lm_head_unit();
  const int64_t lm_offset = layout_.lm_head() - layout_.unit_range(lm_unit).first;
  const float* w_head = (lm_unit == H ? head_base_ : store_->acquire(lm_unit)) + lm_offset;
  // A frozen base (LoRA) has no weight gradient: the head's backward gives only its input's.
  float* g_head = want_grad && !lora_.enabled() ? store_->grads(lm_unit) + lm_offset : nullptr;
  // Column-parallel (by vocabulary): every row's normed input, gathered with sp; its gradient is every row's
  // partial sum (d_norm_ with sp), reduced into this rank's rows of d_final_norm_.
  const float* normed = sp_ ? sp_gather(final_norm_out_.data(), "sp lm_head input") : final_norm_out_.data();
  float* d_normed = sp_ ? d_norm_.data() : d_final_norm_.data();
  LossSum loss;
  for (int64_t r0 = 0; r0 < rows; r0 += head_chunk_rows_) {
    const int64_t nr = std::min(head_chunk_rows_, rows - r0);
    float* logits = logits_out ? logits_out + r0 * V : logits_chunk_.data();
    const float* x = normed + r0 * C;
    cpu::matmul_fwd(logits, x, w_head, nr, C, V);
    if (!targets) continue;
    // dloss = 1: the gradient of the summed loss (see llama.h).
    loss.sum += tp_ ? parallel_cross_entropy(logits, targets + r0, nr, want_grad)
                    : cpu::classifier_fwd_bwd(logits, nullptr, targets + r0, nr, V, want_grad ? 1.0 : 0.0);
    for (int64_t i = 0; i < nr; i++) loss.count += targets[r0 + i] != cpu::kIgnoreIndex;
    if (want_grad)
      cpu::matmul_bwd(d_normed + r0 * C, g_head, logits, x, w_head, nr, C, V, /*accumulate_dinp=*/false,
                      GradWrite::Accumulate);
  }
  if (want_grad) sp_reduce(d_normed, d_final_norm_.data(), rows, "tp lm_head input grad");
  if (lm_unit != H) store_->release(lm_unit);
  if (!want_grad) store_->release(H);  // no backward: the pass ends here
  return loss;
}

void Llama::backward(const int32_t* inputs, int64_t batch, int64_t seq) {
  const LlamaConfig& c = config_;
  const TpDims& d = layout_.tp();
  const int64_t n = batch * seq, C = c.hidden_size, F = d.ffn;
  const int H = layout_.head_unit();

  const int64_t nr = sp_ ? sp_rows_.size() : n;  // the rows of the norm and residual regions (forward's)
  // d_resid_ carries the gradient of the residual stream from the top down; a stage before the last finds the next
  // stage's input gradient there (stage_output_grad).
  // A frozen base (LoRA): no weight gradient of it is computed or stored (null dweight: the kernels skip it).
  const bool frozen = lora_.enabled();
  // With sp a norm weight's gradient from this rank's rows is partial: written to sp_norm_grads_ (slot 0 or 1),
  // then summed over tp and added (sp_sum_norm_grads), so that every tp rank holds the whole gradient.
  const GradWrite norm_write = sp_ ? GradWrite::Overwrite : GradWrite::Accumulate;
  auto norm_grad = [&](float* grad, int slot) { return sp_ && grad ? sp_norm_grads_.data() + slot * C : grad; };
  if (stage_.head) {
    std::fill(d_resid_.begin(), d_resid_.begin() + nr * C, 0.0f);
    const int64_t norm = layout_.final_norm() - layout_.unit_range(H).first;
    float* g_norm = frozen ? nullptr : store_->grads(H) + norm;
    cpu::rmsnorm_bwd(d_resid_.data(), norm_grad(g_norm, 0), d_final_norm_.data(), resid_out_.data(),
                     head_base_ + norm, final_rstd_.data(), nr, C, norm_write);
    if (g_norm) sp_sum_norm_grads({g_norm}, "sp final norm weight grad");
    store_->release(H);
    if (!frozen) store_->grads_done(H);
  }
  for (int64_t l = stage_.layer_end - 1; l >= stage_.layer_begin; l--) {
    LayerActs& a = acts(l);
    const LayerOffsets& o = layout_.layer(l);
    const int unit = static_cast<int>(1 + l);
    const int64_t begin = layout_.unit_range(unit).first;
    const float* wb = store_->acquire(unit);
    float* gb = frozen ? nullptr : store_->grads(unit);
    auto w = [&](int64_t offset) { return wb + (offset - begin); };
    auto g = [&](int64_t offset) { return gb ? gb + (offset - begin) : nullptr; };
    const float* adapters = lora_store_ ? lora_store_->acquire(static_cast<int>(l)) : nullptr;
    float* adapter_grads = lora_store_ ? lora_store_->grads(static_cast<int>(l)) : nullptr;
    auto adapt = [&](LoraInput g, const float* x, std::initializer_list<const float*> dys, float* dx) {
      if (adapters) lora_bwd(l, g, adapters, adapter_grads, x, dys, dx, n);
    };
    // With sp: the row-parallel GEMMs' output gradient and the column-parallel ones' inputs are every row,
    // gathered (each into gathered_, used before the next gather); the column-parallel input gradients are every
    // row's partial sums in d_norm_, reduce-scattered into this rank's rows (dnorm).
    float* dnorm = sp_ ? d_final_norm_.data() : d_norm_.data();
    // MLP block: x_out = resid_mid + down(act)
    const float* dy2 = sp_ ? sp_gather(d_resid_.data(), "sp down_proj output grad") : d_resid_.data();
    linear_bwd({{w(o.down_proj), C}}, {dy2}, {g(o.down_proj)}, d_act_.data(), /*accumulate_dx=*/false, a.act.data(),
               n, F, /*x_split=*/true, /*dy_split=*/false);
    adapt(LoraInput::MlpOut, a.act.data(), {dy2}, d_act_.data());
    cpu::swiglu_bwd(d_gate_.data(), d_up_.data(), d_act_.data(), a.gate.data(), a.up.data(), n, F, F);
    const float* x2 = sp_ ? sp_gather(a.norm2.data(), "sp gate/up input") : a.norm2.data();
    linear_bwd({{w(o.gate_proj), F}, {w(o.up_proj), F}}, {d_gate_.data(), d_up_.data()},
               {g(o.gate_proj), g(o.up_proj)}, d_norm_.data(), /*accumulate_dx=*/false, x2, n, C, /*x_split=*/false,
               /*dy_split=*/true);
    adapt(LoraInput::Mlp, x2, {d_gate_.data(), d_up_.data()}, d_norm_.data());
    sp_reduce(d_norm_.data(), dnorm, n, "tp gate/up input grad");  // column-parallel: partial input grads
    cpu::rmsnorm_bwd(d_resid_.data(), norm_grad(g(o.post_norm), 0), dnorm, a.resid_mid.data(), w(o.post_norm),
                     a.rstd2.data(), nr, C, norm_write);
    // Attention block: resid_mid = resid_in + o_proj(att)
    const float* dy1 = sp_ ? sp_gather(d_resid_.data(), "sp o_proj output grad") : d_resid_.data();
    linear_bwd({{w(o.o_proj), C}}, {dy1}, {g(o.o_proj)}, d_att_.data(), /*accumulate_dx=*/false, a.att.data(), n,
               d.q_dim, /*x_split=*/true, /*dy_split=*/false);
    adapt(LoraInput::AttentionOut, a.att.data(), {dy1}, d_att_.data());
    cpu::attention_bwd(d_q_.data(), d_k_.data(), d_v_.data(), d_att_.data(), a.att.data(), a.lse.data(),
                       a.q.data(), a.k.data(), a.v.data(), batch, seq, d.heads, d.kv_heads, c.head_dim,
                       attention_doc_start_);
    cpu::rope_bwd(d_q_.data(), d_q_.data(), rope_cos_.data(), rope_sin_.data(), batch, seq, d.heads, c.head_dim,
                  d.q_dim, d.q_dim, rope_position_ids_);
    cpu::rope_bwd(d_k_.data(), d_k_.data(), rope_cos_.data(), rope_sin_.data(), batch, seq, d.kv_heads, c.head_dim,
                  d.kv_dim, d.kv_dim, rope_position_ids_);
    const float* x1 = sp_ ? sp_gather(a.norm1.data(), "sp q/k/v input") : a.norm1.data();
    linear_bwd({{w(o.q_proj), d.q_dim}, {w(o.k_proj), d.kv_dim}, {w(o.v_proj), d.kv_dim}},
               {d_q_.data(), d_k_.data(), d_v_.data()}, {g(o.q_proj), g(o.k_proj), g(o.v_proj)}, d_norm_.data(),
               /*accumulate_dx=*/false, x1, n, C, /*x_split=*/false, /*dy_split=*/true);
    adapt(LoraInput::Attention, x1, {d_q_.data(), d_k_.data(), d_v_.data()}, d_norm_.data());
    sp_reduce(d_norm_.data(), dnorm, n, "tp q/k/v input grad");
    cpu::rmsnorm_bwd(d_resid_.data(), norm_grad(g(o.input_norm), 1), dnorm, a.resid_in.data(), w(o.input_norm),
                     a.rstd1.data(), nr, C, norm_write);
    if (gb) sp_sum_norm_grads({g(o.post_norm), g(o.input_norm)}, "sp norm weight grads");
    store_->release(unit);
    if (!frozen) store_->grads_done(unit);
    if (adapters) {
      lora_store_->release(static_cast<int>(l));
      lora_store_->grads_done(static_cast<int>(l));
    }
  }
  if (frozen || !stage_.embedding) return;  // a later stage's input gradient is d_resid_ (stage_input_grad)
  // The vocab-parallel table's gradient takes every token's row.
  const float* d_embedded = sp_ ? sp_gather(d_resid_.data(), "sp embedding grad") : d_resid_.data();
  embed_bwd(store_->grads(0) + (layout_.embed_tokens() - layout_.unit_range(0).first), d_embedded, inputs, n);
  store_->grads_done(0);
}

// ---- the projections' GEMMs, fp32 or FP8 ----

void Llama::set_fp8(Fp8Mode mode) {
  fp8_ = mode;
  if (mode == Fp8Mode::Off) return;
  // The scratch of the largest group (n x the widest input; the widest output block), taken now: no allocation in
  // a step.
  const TpDims& d = layout_.tp();
  const int64_t C = config_.hidden_size;
  const int64_t in = std::max({C, d.q_dim, d.ffn}), rows = std::max({d.q_dim + 2 * d.kv_dim, C, 2 * d.ffn});
  fp8_group_.reserve(max_batch_ * max_seq_, in, rows);
}

void Llama::linear_fwd(const std::vector<Fp8GroupCpu::Part>& parts, const std::vector<float*>& outs, const float* x,
                       int64_t n, int64_t in, bool x_split) {
  if (fp8_ == Fp8Mode::Tensorwise) return fp8_group_.forward(parts, outs, x, n, in, x_split, tp_);
  for (size_t i = 0; i < parts.size(); ++i) cpu::matmul_fwd(outs[i], x, parts[i].weight, n, in, parts[i].out);
}

void Llama::linear_bwd(const std::vector<Fp8GroupCpu::Part>& parts, const std::vector<const float*>& dys,
                       const std::vector<float*>& dweights, float* dx, bool accumulate_dx, const float* x, int64_t n,
                       int64_t in, bool x_split, bool dy_split) {
  if (fp8_ == Fp8Mode::Tensorwise)
    return fp8_group_.backward(parts, dys, dweights, dx, accumulate_dx, x, n, in, x_split, dy_split, tp_);
  for (size_t i = 0; i < parts.size(); ++i)
    cpu::matmul_bwd(dx, dweights[i], dys[i], x, parts[i].weight, n, in, parts[i].out,
                    /*accumulate_dinp=*/accumulate_dx || i > 0, GradWrite::Accumulate);
}

// ---- LoRA adapters: y += s B A dropout(x), s = alpha / r ----
//
// The adapters on one input (model/lora.h's LoraInput: q, k and v share theirs, gate and up theirs) run as a group.
// Forward: without dropout one GEMM gives every u_j = s A_j x at once, side by side in u [n, r x adapters] (their A's
// stacked: x is read and packed once, not once per adapter), with s as the GEMM's alpha; then each y_j += u_j B_j^T
// with beta = 1, the base GEMM's output taken as the product's C (no product buffer, no pass adding it). Backward:
// dB_j += dy_j^T u_j and dt_j = s dy_j B_j (alpha = s) side by side in dt; then, without dropout, one GEMM for the
// input gradient dx += dt A_stacked (beta = 1) and one for dA_stacked = dt^T x. Dropout draws a mask per adapter, so
// then each adapter's input is its own (x masked into lora_in_, its input gradient masked back from lora_tmp_) and
// these products are one per adapter.
//
// Tensor parallelism (the splits of model/lora.h):
//   column-parallel (q, k, v, gate, up): x is whole on every rank and A replicated, so t = A x is whole; B's block
//     gives this rank's rows of y. Backward: dB from the local dy; this rank's partial dt = s B_local^T dy gives a
//     partial input gradient that joins the input gradient's existing all-reduce, while dA = dt^T x needs the whole
//     dt: one all-reduce of the group's [n, r x adapters] over tp.
//   row-parallel (o, down): x and A are split by columns, so t = sum over tp of A_local x_local: one all-reduce of
//     [n, r]. The adapter's output is added after the layer's own all-reduce of y: every rank then adds the same
//     s B t (B replicated, t whole) to the same whole y, so it counts once, as on one rank. Backward: dy is whole,
//     so dB and dt are whole (and equal on every rank); dA_local and the (split) input gradient come from them.

void Llama::lora_dropout_apply(int64_t l, LoraTarget t, const float* src, float* dst, int64_t n, bool accumulate) {
  const int i = static_cast<int>(t);
  const int64_t in = local_shape(config_, layout_.tp(), t)[1];
  const ParamTensor& a = lora_layout_.params.tensors()[lora_tensor_index_[l][i]];
  const int64_t global_in = a.global_shape[1], col0 = a.split_dim == 1 ? a.split_begin : 0;
  cpu::lora_dropout(dst, src, n, in, global_in, col0, lora_dropout_stream(lora_dropout_key_, l, t), lora_.dropout,
                    accumulate);
}

const float* Llama::lora_input(int64_t l, LoraTarget t, const float* x, int64_t n) {
  if (!lora_train_) return x;
  lora_dropout_apply(l, t, x, lora_in_.data(), n, /*accumulate=*/false);
  return lora_in_.data();
}

const float* Llama::lora_stacked_a(int64_t l, LoraInput g, const float* adapters) {
  const LoraGroup& group = lora_groups_[static_cast<int>(g)];
  const LoraOffsets& o = lora_layout_.layers[l];
  const int64_t begin = lora_layout_.params.unit_range(static_cast<int>(l)).first, size = lora_.rank * group.in;
  auto a = [&](LoraTarget t) { return adapters + (o.a[static_cast<int>(t)] - begin); };
  if (group.targets.size() == 1) return a(group.targets[0]);
  // The A's are apart in the adapter buffer (each followed by its B); a copy of r x in each is small beside the
  // product over n rows that reads it.
  for (size_t j = 0; j < group.targets.size(); j++) std::copy_n(a(group.targets[j]), size, lora_a_.data() + j * size);
  return lora_a_.data();
}

void Llama::lora_fwd(int64_t l, LoraInput g, const float* adapters, const float* x, std::initializer_list<float*> ys,
                     int64_t n) {
  const LoraGroup& group = lora_groups_[static_cast<int>(g)];
  if (group.targets.empty()) return;
  TUNA_CHECK(static_cast<size_t>(group.place.back()) < ys.size(), "LoRA: ", ys.size(), " outputs on input ",
             static_cast<int>(g));
  const LoraOffsets& o = lora_layout_.layers[l];
  const int64_t begin = lora_layout_.params.unit_range(static_cast<int>(l)).first, r = lora_.rank;
  const int64_t width = r * static_cast<int64_t>(group.targets.size()), in = group.in;
  const bool row_parallel = lora_target_row_parallel(group.targets[0]);
  const float s = static_cast<float>(lora_.scale());
  float* u = acts(l).lora_u[static_cast<int>(g)].data();
  // u = s A dropout(x), kept: then dB = dy^T u directly, and y adds u B^T.
  if (lora_train_) {
    for (size_t j = 0; j < group.targets.size(); j++) {
      const LoraTarget t = group.targets[j];
      cpu::gemm(false, true, n, r, in, s, lora_input(l, t, x, n), in, adapters + (o.a[static_cast<int>(t)] - begin), in,
                0.0f, u + j * r, width);
    }
  } else {
    cpu::gemm(false, true, n, width, in, s, x, in, lora_stacked_a(l, g, adapters), in, 0.0f, u, width);
  }
  if (row_parallel) tp_all_reduce(u, n * width, "tp LoRA A x");  // A x over the split input
  // With sp a row-parallel target's y (the reduce-scatter's output) holds this rank's rows only.
  const bool rows_only = sp_ && row_parallel;
  const int64_t row0 = rows_only ? sp_rows_.begin : 0, rows = rows_only ? sp_rows_.size() : n;
  for (size_t j = 0; j < group.targets.size(); j++) {
    const LoraTarget t = group.targets[j];
    const int64_t out = local_shape(config_, layout_.tp(), t)[0];
    cpu::gemm(false, true, rows, out, r, 1.0f, u + row0 * width + j * r, width,
              adapters + (o.b[static_cast<int>(t)] - begin), r, 1.0f, ys.begin()[group.place[j]], out);
  }
}

void Llama::lora_bwd(int64_t l, LoraInput g, const float* adapters, float* grads, const float* x,
                     std::initializer_list<const float*> dys, float* dx, int64_t n) {
  const LoraGroup& group = lora_groups_[static_cast<int>(g)];
  if (group.targets.empty()) return;
  TUNA_CHECK(static_cast<size_t>(group.place.back()) < dys.size(), "LoRA: ", dys.size(), " output gradients on input ",
             static_cast<int>(g));
  const LoraOffsets& o = lora_layout_.layers[l];
  const int64_t begin = lora_layout_.params.unit_range(static_cast<int>(l)).first, r = lora_.rank;
  const int64_t width = r * static_cast<int64_t>(group.targets.size()), in = group.in;
  const bool row_parallel = lora_target_row_parallel(group.targets[0]);
  const float s = static_cast<float>(lora_.scale());
  const float* u = acts(l).lora_u[static_cast<int>(g)].data();
  float* dt = lora_dt_.data();
  auto a = [&](LoraTarget t) { return adapters + (o.a[static_cast<int>(t)] - begin); };
  auto da = [&](LoraTarget t) { return grads + (o.a[static_cast<int>(t)] - begin); };
  // dB_j += dy_j^T u_j; dt_j = s dy_j B_j, the gradient of A_j x.
  for (size_t j = 0; j < group.targets.size(); j++) {
    const LoraTarget t = group.targets[j];
    const int i = static_cast<int>(t);
    const int64_t out = local_shape(config_, layout_.tp(), t)[0];
    const float* dy = dys.begin()[group.place[j]];
    cpu::gemm(true, false, out, r, n, 1.0f, dy, out, u + j * r, width, 1.0f, grads + (o.b[i] - begin), r);
    cpu::gemm(false, false, n, r, out, s, dy, out, adapters + (o.b[i] - begin), r, 0.0f, dt + j * r, width);
  }
  // Column-parallel under tp: this rank's dt is partial. Its input gradient is too (summed by the caller's all-reduce
  // of dx), but dA needs the whole dt.
  const bool partial_dt = tp_ && !row_parallel;
  if (!lora_train_) {
    cpu::gemm(false, false, n, in, width, 1.0f, dt, width, lora_stacked_a(l, g, adapters), in, 1.0f, dx, in);
    if (partial_dt) tp_all_reduce(dt, n * width, "tp LoRA dt");
    if (group.targets.size() == 1)
      return cpu::gemm(true, false, r, in, n, 1.0f, dt, width, x, in, 1.0f, da(group.targets[0]), in);
    cpu::gemm(true, false, width, in, n, 1.0f, dt, width, x, in, 0.0f, lora_da_.data(), in);
    for (size_t j = 0; j < group.targets.size(); j++) {
      float* dA = da(group.targets[j]);
      const float* part = lora_da_.data() + j * r * in;
      for (int64_t k = 0; k < r * in; k++) dA[k] += part[k];
    }
    return;
  }
  // Dropout: each adapter's input gradient through its mask (from lora_tmp_), and dA from its masked input again (the
  // forward's mask: a pure function of the key).
  for (size_t j = 0; j < group.targets.size(); j++) {
    const LoraTarget t = group.targets[j];
    cpu::gemm(false, false, n, in, r, 1.0f, dt + j * r, width, a(t), in, 0.0f, lora_tmp_.data(), in);
    lora_dropout_apply(l, t, lora_tmp_.data(), dx, n, /*accumulate=*/true);
  }
  if (partial_dt) tp_all_reduce(dt, n * width, "tp LoRA dt");
  for (size_t j = 0; j < group.targets.size(); j++) {
    const LoraTarget t = group.targets[j];
    cpu::gemm(true, false, r, in, n, 1.0f, dt + j * r, width, lora_input(l, t, x, n), in, 1.0f, da(t), in);
  }
}

void Llama::select_slot(int64_t slot) {
  TUNA_CHECK(slot >= 0 && slot < in_flight_, "activation slot ", slot, " of ", in_flight_);
  slot_ = slot;
}

float* Llama::stage_input(int64_t slot) {
  TUNA_CHECK(!stage_.embedding && stage_.layers() > 0, "the first stage embeds its input");
  select_slot(slot);
  return acts(stage_.layer_begin).resid_in.data();
}

LossSum Llama::forward_stage(int64_t slot, const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                             const int32_t* positions, bool backward_follows) {
  select_slot(slot);
  forward(inputs, batch, seq, backward_follows, nullptr, positions);
  return stage_.head ? head(targets, batch * seq, backward_follows, nullptr) : LossSum{};
}

void Llama::backward_stage(int64_t slot, const int32_t* inputs, int64_t batch, int64_t seq, const int32_t* positions) {
  select_slot(slot);
  // Other micro-batches' forwards ran since this one's: its document boundaries again (the forward's, recomputed).
  set_documents(positions, batch, seq);
  backward(inputs, batch, seq);
}

LossSum Llama::forward_backward(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                                const int32_t* positions) {
  TUNA_CHECK(layout_.whole(), "forward_backward of a pipeline stage: use forward_stage and backward_stage");
  select_slot(0);
  forward(inputs, batch, seq, /*backward_follows=*/true, nullptr, positions);
  LossSum loss = head(targets, batch * seq, /*want_grad=*/true, nullptr);
  backward(inputs, batch, seq);
  return loss;
}

LossSum Llama::forward_loss(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                            const int32_t* positions) {
  TUNA_CHECK(layout_.whole(), "forward_loss of a pipeline stage: use forward_stage");
  select_slot(0);
  forward(inputs, batch, seq, /*backward_follows=*/false, nullptr, positions);
  return head(targets, batch * seq, /*want_grad=*/false, nullptr);
}

void Llama::forward_logits(const int32_t* inputs, int64_t batch, int64_t seq, float* logits,
                           const int32_t* positions) {
  TUNA_CHECK(!tp_, "forward_logits returns whole-vocabulary logits: not with tensor parallelism");
  TUNA_CHECK(layout_.whole(), "forward_logits of a pipeline stage");
  select_slot(0);
  forward(inputs, batch, seq, /*backward_follows=*/false, nullptr, positions);
  head(nullptr, batch * seq, /*want_grad=*/false, logits);
}

}  // namespace tuna
