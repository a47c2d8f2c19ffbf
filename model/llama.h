// Llama: LlamaForCausalLM's forward and backward on the CPU backend (fp32), over flat parameter and
// gradient buffers laid out by ParamLayout.
//
// Activation memory is planned once for (max_batch, max_seq) and reused: nothing is allocated per step.
// The loss head is chunked over rows (logits for a few thousand rows at a time, turned into dlogits in
// place), so a 128k vocabulary never needs batch x seq x vocab floats.
//
// With LoRA adapters (model/lora.h; the constructor's `lora`), the base is frozen: params holds it (or a weight store
// does: a quantized base, a ZeRO-3 shard) and it stays as it is, grads stays empty, no weight gradient of the base is
// computed (no dW GEMM, no norm or embedding gradient), and the adapters train: lora_params and lora_grads, laid out
// by lora_layout(), reached a unit (decoder layer) at a time through a second WeightStore (set_lora_store; by default
// the model's own buffers).
//
// Loss convention: forward_backward returns the SUM of per-token losses and the count of trained
// tokens, and accumulates the gradient of that sum. The trainer divides by the total count over all
// micro-batches (and ranks) once, before clipping: the mean over every trained token of the step,
// whatever the split into micro-batches.
#pragma once

#include <array>
#include <initializer_list>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/fp8.h"     // Fp8Mode, Fp8GroupCpu
#include "model/layout.h"  // ParamLayout, TpDims (and comm.h: Range)
#include "model/lora.h"       // LoraConfig, LoraLayout
#include "model/optimizer.h"  // Segment
#include "model/pipeline.h"   // PipelineStage

namespace tuna {

class Comm;
struct MemoryLayout;  // model/memory_plan.h

// Where the decoder finds weights and puts gradients, a unit at a time (units: see layout.h). Pointers
// address the unit's range of the flat layout: element `offset` of the layout is at ptr[offset - begin].
// The GPU model's store (GpuWeightStore, model/llama_gpu.h) is a separate interface: it says why.
class WeightStore {
 public:
  virtual ~WeightStore() = default;
  // The order in which the next pass will acquire units (a prefetch schedule); called before each pass.
  virtual void plan(const std::vector<int>& order) {}
  virtual const float* acquire(int unit) = 0;  // valid until release(unit)
  virtual void release(int unit) = 0;
  virtual float* grads(int unit) = 0;           // accumulate the unit's gradient here
  virtual void grads_done(int unit) = 0;        // the backward will not touch the unit's gradient again
};

struct LlamaParallel {
  Comm* tp = nullptr;          // tensor-parallel group (null or size 1: none)
  bool external_weights = false;  // params and grads stay empty; set_weight_store() supplies them (ZeRO-3)
  bool external_grads = false;    // grads stays empty; the weight store takes each unit's gradient (ZeRO-2)
  // Sequence parallelism (Megatron's) over the tp group: the residual stream and the RMSNorms hold only this rank's
  // rows of the batch x seq tokens (shard_range of the rows); an all-gather of the normed rows goes before each
  // column-parallel GEMM group and a reduce-scatter after each row-parallel GEMM and the embedding, where tp alone
  // has one all-reduce. Nothing changes with tp 1.
  bool sequence = false;
  // Pipeline parallelism (--pp): the stage this model runs (layout and layers: ParamLayout's stage constructor), and
  // how many micro-batches' activations it keeps at once (1F1B: pp - stage). Null: the whole model, one at a time.
  const PipelineStage* stage = nullptr;
  int64_t in_flight = 1;
  // LoRA: lora_params and lora_grads stay empty; set_lora_store() supplies the adapters and takes their gradients
  // (ZeRO-3 over the adapters).
  bool external_adapters = false;
};

// What the CPU engine's Zero (dist/zero.h) and a frozen base hold instead of the model for one rank of a placed run
// layout: ZeRO-3 the weights (and the adapters), ZeRO-2 the gradients, a quantized base its weights. The stage points
// into `run`.
LlamaParallel llama_parallel(const MemoryLayout& run, Comm* tp);

// How a packed window treats the documents in it (options --document_mask and --document_positions). The
// boundaries come with each batch as the loader's positions (DataLoader::next: each token's position inside its
// document); a batch given without them is one document per row, as before.
struct DocumentMode {
  bool mask = true;               // attention stays inside each token's document (Llama 3, packed SFT)
  bool restart_positions = true;  // RoPE positions restart at 0 where a document starts in the window (what
                                  // transformers does with packed position_ids); false: the window's index
};
// The mode's option values: "restart" / "continue".
const char* document_positions_name(bool restart);
bool parse_document_positions(const std::string& value);  // fails naming the option unless restart|continue

struct LossSum {
  double sum = 0;     // sum of cross-entropy over trained tokens
  int64_t count = 0;  // tokens whose target is not the ignore index
};

// Generation's memory of the past: the keys and values (after RoPE) of every layer at every position decoded
// so far, so that each new token costs one position's forward instead of the whole context's.
struct KvCache {
  int64_t batch = 0, capacity = 0;  // sequences; positions each can hold
  int64_t length = 0;               // positions filled (the same for every sequence)
  std::vector<std::vector<float>> keys, values;  // per layer: [batch, capacity, kv_dim] (tp-local kv heads)
};

class Llama {
 public:
  // lora.enabled(): adapters on the targeted projections, the base frozen: external_grads applies to the adapters'
  // gradients, and external weights to the base (set_weight_store: a quantized base, model/quantized_weights.h).
  Llama(const LlamaConfig& config, int64_t max_batch, int64_t max_seq, const LlamaParallel& parallel = {},
        const LoraConfig& lora = {});
  // One rank of a run's placed layout (model/support.h place_layout), as the CPU engine trains it: its batch shape, its
  // pipeline stage and activation slots, sp over `tp`, its adapters, and which buffers are held outside the model
  // (llama_parallel).
  Llama(const LlamaConfig& config, const MemoryLayout& run, Comm* tp);

  const LlamaConfig& config() const { return config_; }
  const ParamLayout& layout() const { return layout_; }
  int64_t max_batch() const { return max_batch_; }
  int64_t max_seq() const { return max_seq_; }

  std::vector<float> params;  // ParamLayout order (empty with external weights)
  std::vector<float> grads;   // same layout; forward_backward accumulates into it

  void set_weight_store(WeightStore* store);

  // LoRA (empty unless the constructor's lora is enabled).
  const LoraConfig& lora() const { return lora_; }
  const LoraLayout& lora_layout() const { return lora_layout_; }
  std::vector<float> lora_params;  // lora_layout().params order: this tp rank's blocks of A and B
  std::vector<float> lora_grads;   // same layout; forward_backward accumulates into it (empty: external)
  void set_lora_store(WeightStore* store);  // replaces external adapter gradients or adapters (ZeRO-2/3 over them)
  // The key of the next forward_backward's dropout masks (lora_dropout_key: run seed, step, micro-batch, dp rank).
  void set_lora_dropout_key(uint64_t key) { lora_dropout_key_ = key; }

  // HF-style initialization for training from scratch: normal(0, std) for 2-D weights, ones for norms.
  // Draws the global tensors and keeps this rank's blocks, so every tp split starts from the same model.
  // Writes into `out` (ParamLayout order; params.data() by default).
  void init_random(uint64_t seed, double std = 0.02, float* out = nullptr);  // init_random_weights
  void zero_grads();  // the base's gradients, or with adapters theirs

  // --fp8 tensorwise (model/fp8.h): the seven projections' GEMMs through FP8, simulated exactly; Off by default.
  // Every pass of the model runs so (the validation loss is the model's as it trains).
  void set_fp8(Fp8Mode mode);
  Fp8Mode fp8() const { return fp8_; }

  // How windows treat their documents (DocumentMode); the default masks and restarts.
  void set_document_mode(const DocumentMode& mode) { documents_ = mode; }
  const DocumentMode& document_mode() const { return documents_; }

  // inputs, targets: [batch, seq] token ids; targets may hold kIgnoreIndex. Accumulates into grads.
  // positions: [batch, seq], each token's position inside its document (the loader's), or null (one document
  // per row); the document mode says what they change.
  LossSum forward_backward(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                           const int32_t* positions = nullptr);
  // Preference objectives (model/objective.h) in two passes, since their per-token weights depend on the whole
  // micro-batch's log-probs. forward_logps: the forward (activations kept when backward_follows) and logps[i] =
  // log p(targets[i]) (0 where the target is ignored), no gradient formed. adapters_off: the frozen base alone, the
  // LoRA reference (one forward without the adapter branches; never with backward_follows). backward_weighted, after
  // forward_logps(backward_follows): the backward of sum_i -weights[i] * logps[i] (the head's logits computed again,
  // d logits = w * (softmax - onehot)), accumulated into the gradients as forward_backward's. A pipeline stage runs
  // both in slot 0 (its input in stage_input(0)): its layers, and on the last stage the head; backward_weighted only
  // there, its input gradient then in stage_input_grad().
  // greedy (optional): greedy[i] = 1 where targets[i] is the logits' first argmax (multiple-choice evaluation's
  // greedy test, engine/mc_eval.h), 0 elsewhere and where the target is ignored.
  void forward_logps(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                     const int32_t* positions, float* logps, bool backward_follows, bool adapters_off = false,
                     uint8_t* greedy = nullptr);
  void backward_weighted(const int32_t* inputs, const int32_t* targets, const float* weights, int64_t batch,
                         int64_t seq);
  // Multiple-choice scoring (engine/mc_eval.h): forward_logps with greedy flags, the documents masked and positions
  // restarted whatever the document mode, so that each request of a packed window scores as it would alone. A
  // pipeline stage runs its layers (its input in stage_input(0)); the last stage writes logps and greedy.
  void forward_target_logps(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                            const int32_t* positions, float* logps, uint8_t* greedy);
  // The same loss without gradients (evaluation).
  LossSum forward_loss(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                       const int32_t* positions = nullptr);
  // A pipeline stage's passes (LlamaParallel::stage), one micro-batch at a time in any interleaving of up to
  // in_flight micro-batches, each in its activation slot (0 .. in_flight - 1) from its forward to its backward.
  // The stage's input: the first stage embeds `inputs`; the others read stage_input(slot), [batch * seq, hidden],
  // which the caller fills with the previous stage's stage_output() first. forward_stage returns the loss on the
  // last stage (and, with backward_follows, has its head's gradient ready) and nothing elsewhere. backward_stage
  // takes the next stage's input gradient in stage_output_grad() (the last stage: its own loss), accumulates the
  // stage's weight gradients and leaves its input gradient in stage_input_grad() for the previous stage. The same
  // inputs and positions go to the forward and the backward of a micro-batch.
  LossSum forward_stage(int64_t slot, const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                        const int32_t* positions, bool backward_follows);
  void backward_stage(int64_t slot, const int32_t* inputs, int64_t batch, int64_t seq, const int32_t* positions);
  float* stage_input(int64_t slot);
  const float* stage_output() const { return resid_out_.data(); }  // until the next forward_stage
  float* stage_output_grad() { return d_resid_.data(); }
  const float* stage_input_grad() const { return d_resid_.data(); }  // until the next backward_stage
  const PipelineStage& stage() const { return stage_; }
  // Rows of the residual stream this rank holds for a pass over n tokens: n, or with sequence parallelism its
  // shard_range of them (what a stage sends to the next, and its input gradient back).
  int64_t residual_rows(int64_t n) const { return sp_ ? shard_range(n, tp_->rank(), tp_->size()).size() : n; }
  int64_t in_flight() const { return in_flight_; }

  // Full logits [batch, seq, vocab] (tests, generation); not under tensor parallelism. positions as above.
  void forward_logits(const int32_t* inputs, int64_t batch, int64_t seq, float* logits,
                      const int32_t* positions = nullptr);

  // Generation with a KV cache. make_kv_cache: an empty cache for `batch` sequences of up to `capacity`
  // positions (capacity <= max_seq). forward_cached: appends `n` tokens to each sequence (tokens [batch, n],
  // positions cache.length .. cache.length + n - 1), attending to the cached positions and to each other
  // causally, stores their keys and values in the cache, and writes the logits of each sequence's last new
  // position: [batch, vocab]. The function forward_logits computes at those positions over the whole context;
  // batch x n within the planned max_batch x max_seq. Not under tensor parallelism.
  KvCache make_kv_cache(int64_t batch, int64_t capacity) const;
  void forward_cached(const int32_t* tokens, int64_t batch, int64_t n, KvCache& cache, float* last_logits);
  // Multiple-choice scoring of continuations that share a context (engine/mc_eval.h): prefill_cache appends n tokens
  // to each sequence of the cache without the head; repeat_kv_cache gives `batch` sequences of capacity positions
  // that each hold sequence 0 of `cache`; forward_cached_logps appends tokens [batch, n] as forward_cached does and
  // writes each new position's target log-prob and greedy flag ([batch, n], targets may be kIgnoreIndex).
  void prefill_cache(const int32_t* tokens, int64_t batch, int64_t n, KvCache& cache);
  KvCache repeat_kv_cache(const KvCache& cache, int64_t batch, int64_t capacity) const;
  void forward_cached_logps(const int32_t* tokens, int64_t batch, int64_t n, KvCache& cache, const int32_t* targets,
                            float* logps, uint8_t* greedy);

  // Activation bytes planned at construction (for logs and memory planning).
  int64_t activation_bytes() const;

 private:
  struct LayerActs {
    std::vector<float> resid_in, norm1, rstd1, q, k, v, att, lse, resid_mid, norm2, rstd2, gate, up, act;
    // per input (LoraInput): s A_j dropout_j(x) of the adapters on it side by side, [n, r x adapters] (whole)
    std::array<std::vector<float>, kLoraInputs> lora_u;
  };
  class OwnWeights;  // the WeightStore over params / grads
  class OwnAdapters;  // the WeightStore over lora_params / lora_grads
  // The adapters on each input of a layer (model/lora.h's LoraInput), in forward order, each one's place among the
  // projections on that input (lora_fwd's ys), and the input's local width.
  struct LoraGroup {
    std::vector<LoraTarget> targets;
    std::vector<int> place;
    int64_t in = 0;
  };
  // y_j += s B_j A_j dropout_j(x) for the adapters on input g of layer l (forward), and its backward (dB_j, dA_j, and
  // the input gradient added to dx); ys / dys: the outputs / their gradients of every projection on g in forward
  // order (lora_input_targets), whether adapted or not. `adapters` is layer l's unit of the adapter buffer, `grads`
  // its gradient. Tensor-parallel collectives as in llama.cpp.
  void lora_fwd(int64_t l, LoraInput g, const float* adapters, const float* x, std::initializer_list<float*> ys,
                int64_t n);
  void lora_bwd(int64_t l, LoraInput g, const float* adapters, float* grads, const float* x,
                std::initializer_list<const float*> dys, float* dx, int64_t n);
  // The A's of the adapters on input g, stacked [r x adapters, in]: the one A itself, or copied into lora_a_.
  const float* lora_stacked_a(int64_t l, LoraInput g, const float* adapters);
  // The adapter's input for target t of layer l: x with this pass's dropout mask applied, into lora_in_ (or x itself
  // without dropout).
  const float* lora_input(int64_t l, LoraTarget t, const float* x, int64_t n);
  // dst (= or +=) src with target t of layer l's dropout mask applied and survivors scaled by 1 / (1 - p).
  void lora_dropout_apply(int64_t l, LoraTarget t, const float* src, float* dst, int64_t n, bool accumulate);
  // A projection group's GEMMs (q|k|v, o, gate|up or down: parts sharing the input x [n, in]): fp32 products, or
  // through FP8 by fp8_ (Fp8GroupCpu: x_split and dy_split say which operands tp splits). Forward OVERWRITES each
  // out; backward: dx (= or +=, by accumulate_dx) sum_i dy_i W_i, dW_i += dy_i^T x (a null dweights entry, or none:
  // not computed).
  void linear_fwd(const std::vector<Fp8GroupCpu::Part>& parts, const std::vector<float*>& outs, const float* x,
                  int64_t n, int64_t in, bool x_split);
  void linear_bwd(const std::vector<Fp8GroupCpu::Part>& parts, const std::vector<const float*>& dys,
                  const std::vector<float*>& dweights, float* dx, bool accumulate_dx, const float* x, int64_t n,
                  int64_t in, bool x_split, bool dy_split);
  // forward() over a KV cache (its checks; the head unit left acquired for the caller's head pass).
  void cached_forward(const int32_t* tokens, int64_t batch, int64_t n, KvCache& cache);
  // With a cache: positions cache->length.., keys and values appended to it, attention over it too.
  void forward(const int32_t* inputs, int64_t batch, int64_t seq, bool backward_follows, KvCache* cache = nullptr,
               const int32_t* positions = nullptr);
  // From the loader's positions and the document mode: doc_start_ and rope_positions_ for this batch, and the
  // pointers attention and RoPE take (null: plain causal, positions 0..seq-1).
  void set_documents(const int32_t* positions, int64_t batch, int64_t seq);
  // Runs the head over rows in chunks; with targets computes the loss and (if want_grad) writes
  // d(final norm output) into d_final_norm_ and accumulates the head's weight gradient.
  LossSum head(const int32_t* targets, int64_t rows, bool want_grad, float* logits_out);
  // The preference passes of the head: per-row target log-probs (the head unit kept acquired when keep_head), and the
  // weighted backward (the logits again, then as head()'s backward).
  void head_logps(const int32_t* targets, int64_t rows, float* logps, bool keep_head, uint8_t* greedy = nullptr);
  // Under tp: greedy[i] = targets[i] is the first argmax of logits row i over the whole vocabulary (this rank holds
  // a slice: the maximum and the first index holding it agreed over tp).
  void greedy_targets(const float* logits, const int32_t* targets, int64_t rows, uint8_t* greedy);
  void head_weighted_bwd(const int32_t* targets, const float* weights, int64_t rows);
  void backward(const int32_t* inputs, int64_t batch, int64_t seq);
  // Layer l's activations in the current slot (a stage's layers only).
  LayerActs& acts(int64_t l) { return acts_[slot_ * stage_.layers() + (l - stage_.layer_begin)]; }
  void select_slot(int64_t slot);

  // Vocab-parallel pieces (tp > 1); see llama.cpp.
  void embed(float* out, const int32_t* tokens, int64_t n, const float* table);
  void embed_bwd(float* dtable, const float* dout, const int32_t* tokens, int64_t n);
  // row_weights: each row's dloss (null: 1); row_losses: each row's loss out (may be null).
  double parallel_cross_entropy(float* logits, const int32_t* targets, int64_t rows, bool want_grad,
                                const float* row_weights = nullptr, float* row_losses = nullptr);
  void tp_all_reduce(float* x, int64_t n, const char* what);
  // Sequence parallelism (sp_): `rows` is this pass's whole batch x seq. sp_gather: every rank's rows of `local`
  // ([sp_chunk_, C] each) into gathered_, returned. sp_reduce: `full` holds this rank's partial sums of every row
  // ([rows, C], the row-parallel GEMM's output or a column-parallel GEMM's input gradient); `local` gets the sum
  // of this rank's rows (sp) or, without sp, `full` == `local` is all-reduced in place.
  const float* sp_gather(const float* local, const char* what);
  void sp_reduce(float* full, float* local, int64_t rows, const char* what);
  // Without sp, nothing. With sp, the norm weights' gradients of this micro-batch are partial (this rank's rows):
  // they were written to sp_norm_grads_ (count x C), summed over tp here and added to `dst` (count pointers).
  void sp_sum_norm_grads(std::initializer_list<float*> dst, const char* what);

  LlamaConfig config_;
  ParamLayout layout_;
  Comm* tp_ = nullptr;
  bool sp_ = false;                 // sequence parallelism (LlamaParallel::sequence with tp > 1)
  int64_t sp_chunk_ = 0;            // this pass's rows per rank: ceil(batch x seq / tp) (sp)
  Range sp_rows_;                   // this rank's rows of the pass: shard_range(batch x seq, rank, tp) (sp)
  std::vector<float> gathered_;     // sp: [tp x chunk, C], every rank's rows (gathered or about to be scattered)
  std::vector<float> sp_norm_grads_;  // sp: [2, C], a layer's two norm-weight gradients before their sum over tp
  std::unique_ptr<WeightStore> own_store_;
  WeightStore* store_ = nullptr;
  const float* head_base_ = nullptr;  // the head unit, acquired from the final norm's forward to its backward
  std::vector<double> ce_stats_;  // per-row statistics of the vocab-parallel loss
  int64_t max_batch_, max_seq_, head_chunk_rows_;
  std::vector<double> inv_freq_;
  std::vector<float> rope_cos_, rope_sin_;
  std::vector<float> cached_cos_, cached_sin_;  // dynamic rope: the rows of a cached forward's new positions
  PipelineStage stage_;     // the whole model unless pipelined
  int64_t in_flight_ = 1;   // activation slots
  int64_t slot_ = 0;        // the slot of the pass under way
  std::vector<LayerActs> acts_;  // [slot][the stage's layers]
  DocumentMode documents_;
  std::vector<int32_t> doc_start_, rope_positions_;  // [max_batch, max_seq] each
  const int32_t* attention_doc_start_ = nullptr;      // this batch's: doc_start_ or null
  const int32_t* rope_position_ids_ = nullptr;        // rope_positions_ or null
  std::vector<float> resid_out_, final_norm_out_, final_rstd_, logits_chunk_;
  // backward scratch. With sp, d_resid_ and d_final_norm_ hold this rank's rows (d_final_norm_ then serves every
  // norm's output gradient in turn) and d_norm_ the whole rows' partial sums before their reduce-scatter.
  std::vector<float> d_resid_, d_norm_, d_q_, d_k_, d_v_, d_att_, d_gate_, d_up_, d_act_, d_final_norm_;
  Fp8Mode fp8_ = Fp8Mode::Off;
  Fp8GroupCpu fp8_group_;
  // LoRA
  LoraConfig lora_;
  LoraLayout lora_layout_;
  std::unique_ptr<WeightStore> own_lora_store_;
  WeightStore* lora_store_ = nullptr;
  uint64_t lora_dropout_key_ = 0;
  std::vector<std::array<int, kLoraTargets>> lora_tensor_index_;  // per layer and target: A's index in the layout
  bool lora_train_ = false;  // this pass applies dropout
  bool adapters_off_ = false;  // this pass runs the base alone (the LoRA reference)
  std::array<LoraGroup, kLoraInputs> lora_groups_;
  // scratch: with dropout the dropped input and its gradient [n, largest in] each; a group's dt [n, r x adapters];
  // a group's stacked A and its gradient [r x adapters, in] each (groups of two or more adapters)
  std::vector<float> lora_in_, lora_tmp_, lora_dt_, lora_a_, lora_da_;
};

// The buffers a Llama allocates at construction for (max_batch, max_seq) on one tensor-parallel rank, in
// floats (doubles where noted). Llama's constructor checks its allocations against these figures, and the
// memory plan (model/memory_plan_cpu.cpp) is made of them, so the plan cannot drift from the model.
struct LlamaBufferSizes {
  int64_t kept_per_layer = 0;   // what one layer's forward keeps for its backward (inputs, norms, q/k/v, ...)
  int64_t final_norm = 0;       // the last residual, the final norm's output and rstd
  int64_t head_chunk_rows = 0;  // rows of logits computed at once
  int64_t logits_chunk = 0;     // head_chunk_rows x vocab (this rank's)
  int64_t backward = 0;         // the backward's scratch (gradients of one layer's activations)
  int64_t rope_tables = 0;      // cos and sin for max_seq positions
  int64_t rope_inv_freq = 0;    // doubles
  int64_t ce_stats = 0;         // doubles: per-row statistics of the vocab-parallel loss (tp > 1)
  int64_t documents = 0;        // int32s: each token's document start and RoPE position (packed documents)
  int64_t lora_kept_per_layer = 0;  // LoRA: each adapter's r-wide intermediate, kept for the backward
  int64_t lora_scratch = 0;     // LoRA: the dropped input and its gradient, a group's dt, stacked A and its gradient
  // Sequence parallelism: the rows a rank's residual stream and norms hold (max_batch x max_seq without it, its
  // ceil(/ tp) with it), and the gather/scatter buffer of every rank's rows plus two norm-weight gradients.
  int64_t local_rows = 0;
  int64_t sequence = 0;
  // What activation_bytes() reports: kept activations of every layer, final norm, logits chunk, backward.
  int64_t activation_floats(int64_t layers) const {
    return (kept_per_layer + lora_kept_per_layer) * layers + final_norm + logits_chunk + backward + lora_scratch +
           sequence;
  }
};
// sequence: sequence parallelism over tp.tp_size ranks (LlamaParallel::sequence; nothing changes at tp 1).
LlamaBufferSizes llama_buffer_sizes(const LlamaConfig& config, const TpDims& tp, int64_t max_batch, int64_t max_seq,
                                    const LoraConfig& lora = {}, bool sequence = false);

// HF-style initialization of a flat buffer laid out by `layout` (any tp rank's): normal(0, std) for 2-D
// weights, each tensor's global values drawn in order from its own random stream (seed, tensor index) and cut to
// this rank's block; ones for norm weights.
void init_random_weights(const ParamLayout& layout, uint64_t seed, double std, float* out);
// The same values for elements [piece.begin, piece.begin + piece.size) of the flat layout only, into out: a
// piece draws its tensors' streams up to its last element, never the rest of the model.
void init_random_weights_piece(const ParamLayout& layout, uint64_t seed, double std, const Segment& piece, float* out);

}  // namespace tuna
