// LlamaGpu: the CUDA backend of model/llama.h — the same function (LlamaForCausalLM's forward and backward,
// loss as a SUM with one division per step), bf16 activations and weights, fp32 gradients and AdamW state, on
// one device. Only in CUDA builds (TUNA_CUDA).
//
// Memory: every buffer is a row of one table (model/gpu_buffers.h plan_gpu_buffers, whose sizes are the memory plan)
// for (max_batch, max_seq), pointed into one device arena at construction; forward_backward and adamw_step allocate
// nothing. Which
// activations are kept for the backward is MemoryLayout::recompute: none keeps every layer's; selective keeps the
// GEMM and attention outputs and recomputes the two norms and SwiGLU in the backward; full keeps each layer's
// input only and recomputes the layer (all but its down projection) just before its backward. The kernels are
// deterministic, so every mode computes the same bits.
//
// Weights and gradients come unit by unit (embedding, each layer, head: model/layout.h) from a GpuWeightStore, as
// the CPU model's from its WeightStore: the model's own whole buffers (ZeRO-0 and 1), or ZeRO-2/3's sharded store
// (dist/zero_gpu.h). The CUDA engine (engine/engine_gpu.cpp) is what drives a LlamaGpu for the trainer.
//
// With LoRA adapters (MemoryLayout::lora, model/lora.h), the base is frozen in bf16: no gradient, master copy or
// moments, and no weight-gradient GEMM or norm / embedding gradient for it; the fused q|k|v and gate|up GEMMs stay
// fused. Each targeted projection adds s B A dropout(x) (s = alpha / r) with the adapters' bf16 copy, laid out by
// lora_layout() (PEFT's names, one unit per layer, Megatron's tp splits); what trains and what AdamW updates is the
// adapters' fp32 master, gradient and moments (trained_layout(), master_params(), grads(), moment_m/v()); at ZeRO
// 1-3 the engine holds them sharded (dist/zero_gpu.h), at 2-3 the gradients a layer at a time, and at ZeRO-3 it
// also shards the frozen base and hands its units to the model gathered. Dropout masks come from model/lora.h's
// counter-based stream, the CPU model's bits, regenerated in the backward.
// Pipeline stages (MemoryLayout::pp > 1): the model holds its stage's units (the stage's ParamLayout: the embedding on
// the first, the final norm and lm_head on the last, a copy of a tied table there) and one set of its layers'
// activations per micro-batch in flight (forward_stage, backward_stage: model/llama.h's contract). With adapters (a
// bf16 or nf4 base), the stage's frozen units and its layers' adapters (lora_layout with the stage: global names, the
// other layers' units empty); a frozen tied table needs no gradient from the other stage.
// FP8 (MemoryLayout::fp8 tensorwise, model/fp8.h): each layer's four projection GEMM groups (q|k|v, o, gate|up, down)
// run forward and backward through model/fp8_gpu.h, the CPU model's Fp8GroupCpu recipe. A layer's weights are cast
// at its first forward after they changed (weights_changed: every write of them, the updates included) into codes
// the step's passes share (at ZeRO-3 and with an nf4 base into one layer's codes, cast from each gathered or
// dequantized layer as it is used; a frozen bf16 base's codes are cast once per run, the adapters staying bf16); the
// activations' amaxes are folded into the kernels that write them (rmsnorm_fwd_amax, swiglu_fwd_amax; fp8_amax for
// the attention output) and kept per layer for the backward; the output gradients' into rmsnorm_bwd_amax and
// swiglu_bwd_amax (fp8_amax for d_q|d_k|d_v, and for a later pipeline stage's input gradient), and each taken over tp
// where its tensor is split there (fp8_operand_split). Every layout the bf16 model runs. A training option: a
// forward-only model runs bf16.
// QLoRA (MemoryLayout::lora.base_quant nf4): the decoder's Linear weights are held in NF4 (bitsandbytes' layout,
// quantized on the host as kernels/cpu/nf4.h does), the embedding, norms and lm_head in bf16, and each layer is
// dequantized (kernels/nf4.cu) into one reused bf16 buffer shaped like the layer's unit whenever it is acquired:
// before its forward and again before its backward. A stage quantizes and dequantizes its own layers only.
//
// Files: model/llama_gpu.cpp (construction, weights in and out, the own AdamW step), llama_gpu_forward.cpp and
// llama_gpu_backward.cpp (the passes), llama_gpu_quantized.cpp (the quantized base), llama_gpu_lora.cpp (the adapters).
#pragma once

#if TUNA_CUDA

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernels/embedding.cuh"
#include "kernels/matmul.cuh"
#include "model/config.h"
#include "model/fp8_gpu.h"      // Fp8GpuWeight, Fp8GpuScratch, Fp8Group
#include "model/gpu_buffers.h"  // GpuBufferRow
#include "model/gpu_options.h"
#include "model/layout.h"
#include "model/llama.h"        // LossSum
#include "model/lora.h"         // LoraConfig, LoraLayout
#include "model/memory_plan.h"  // MemoryPlan, plan_gpu_memory
#include "model/optimizer.h"    // OptimizerConfig, OptimizerStats, ShardPiece

namespace tuna {
class Comm;
}

namespace tuna {

// Where the GPU model finds a unit's bf16 weights and puts its fp32 gradient (units: model/layout.h), the GPU
// counterpart of model/llama.h's WeightStore. Pointers address the unit's range of the flat layout (element
// `offset` at ptr[offset - unit begin]); each is valid for work the model queues on its stream after the call
// that returned it and before the matching release / grads_done. A store orders its own copies and collectives
// against that stream (events), so the model never waits on the host for it.
// Not one interface with model/llama.h's WeightStore: the weights differ in type (bf16 here, fp32 there), the
// gradient contract differs (here a fresh buffer is overwritten by the pass's first writes, so no store zeroes
// one; there every write adds), and so does when a pointer is valid (for work queued on a stream, not until a
// host call). Nothing handles both kinds (each model takes its own), so a shared base would join them in name
// only.
class GpuWeightStore {
 public:
  virtual ~GpuWeightStore() = default;
  // The order in which the next pass acquires units (a prefetch schedule); called before each pass.
  virtual void plan(const std::vector<int>& order) {}
  virtual const __nv_bfloat16* acquire(int unit) = 0;
  virtual void release(int unit) = 0;
  // The unit's fp32 gradient buffer for this pass. fresh: it holds nothing of this step yet, and its bytes may be
  // anything (no store zeroes one): the pass's first write of each of the unit's tensors overwrites it, and the
  // pass writes every element of the unit (LlamaGpu::GradWrites). Not fresh: it holds the step's earlier
  // micro-batches, and every write adds. Asked again in the same pass (the head's unit, the tied embedding's), a
  // store returns the same buffer and the same answer.
  struct UnitGrads {
    float* data;
    bool fresh;
  };
  virtual UnitGrads grads(int unit) = 0;
  // The backward will not touch the unit's gradient again in this pass.
  virtual void grads_done(int unit) = 0;
};

// One cudaMalloc laid out from a memory plan (model/memory_plan.h): every item with in_arena, in plan order, each
// at a 256-byte aligned offset, zero-filled. The model and the engine take each buffer by its plan name with the
// element count they use: take() fails when the name is not planned, is taken twice or its bytes differ, and
// check_all_taken() when a planned buffer was never taken; so the plan is exactly what is allocated.
class DeviceArena {
 public:
  explicit DeviceArena(const MemoryPlan& plan);
  ~DeviceArena();
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  template <typename T>
  T* take(const std::string& name, int64_t count) {
    return static_cast<T*>(take_bytes(name, count * static_cast<int64_t>(sizeof(T))));
  }
  // The buffer of one of the plan's items (the model's rows of model/gpu_buffers.h, whose bytes are the plan's).
  void* take(const MemoryItem& item) { return take_bytes(item.name, item.bytes); }
  void check_all_taken() const;
  const MemoryPlan& plan() const { return plan_; }
  int64_t bytes() const { return bytes_; }

 private:
  void* take_bytes(const std::string& name, int64_t bytes);
  struct Slot {
    int64_t offset, bytes;
    bool taken = false;
  };
  MemoryPlan plan_;
  std::map<std::string, Slot> slots_;
  char* base_ = nullptr;
  int64_t bytes_ = 0;
};

class LlamaGpu {
 public:
  // One rank of `run` (its parallel layout, batch shape, ZeRO stage, recompute and attention path: the layout the
  // memory plan is made for). training false: the forward pass alone (eval, generation): bf16 weights and
  // activations, no gradients, no fp32 master, no optimizer state. ZeRO 0: this model holds the fp32 master and
  // AdamW moments and runs adamw_step; 1: the engine keeps them sharded in this model's arena and writes the bf16
  // weights with refresh_params_from; 2: no whole gradient; 3: no whole weights either (set_weight_store).
  LlamaGpu(const LlamaConfig& config, const MemoryLayout& run, const OptimizerConfig& optimizer = {},
           const GpuOptions& options = {});
  // One rank training alone on batches of up to max_batch x max_seq.
  LlamaGpu(const LlamaConfig& config, int64_t max_batch, int64_t max_seq, const OptimizerConfig& optimizer = {},
           const GpuOptions& options = {});
  ~LlamaGpu();
  LlamaGpu(const LlamaGpu&) = delete;
  LlamaGpu& operator=(const LlamaGpu&) = delete;

  const LlamaConfig& config() const { return config_; }
  const ParamLayout& layout() const { return layout_; }  // the model's (with adapters: the frozen base's)
  cudaStream_t stream() const { return stream_; }

  // Adapters (MemoryLayout::lora enabled): their layout, and what trains. trained_layout() is the layout of
  // master_params(), grads() and the moments: the model's, or with adapters theirs.
  bool has_adapters() const { return lora_.enabled(); }
  const LoraConfig& lora() const { return lora_; }
  const LoraLayout& lora_layout() const { return lora_layout_; }
  const ParamLayout& trained_layout() const { return lora_.enabled() ? lora_layout_.params : layout_; }
  // The key of the next forward_backward's dropout masks (lora_dropout_key: run seed, step, micro-batch, dp rank).
  void set_lora_dropout_key(uint64_t key) { lora_dropout_key_ = key; }
  // Elements [piece.begin, piece.begin + piece.size) of the adapters (trained_layout() order) from host fp32 into
  // their fp32 master and bf16 copy (rounded to nearest), before any update. Synchronous.
  void set_adapters_piece(const Segment& piece, const float* host);
  // The adapters' bf16 copy the GEMMs read (trained_layout() order), whole at every ZeRO stage; null without adapters.
  __nv_bfloat16* adapter_params() { return lora_params_; }
  // ZeRO 2-3 with adapters: the engine's store of the adapters' gradients, a layer (a unit of trained_layout()) at
  // a time: grads(l) before layer l's backward, grads_done(l) after it. At ZeRO-0/1 the adapters' whole gradient
  // buffer, grads(). (At ZeRO-3 the frozen base's units come from the engine's store too: set_weight_store.)
  void set_adapter_grad_store(GpuWeightStore* store);

  // Device buffers in trained_layout() order (for collectives: all-reduce grads, broadcast params).
  float* master_params() { return t_.master; }   // fp32, what AdamW updates; null unless ZeRO-0 training
  const float* master_params() const { return t_.master; }
  __nv_bfloat16* params() { return params_; }  // bf16 copy of the model (the base) the forward reads (refreshed by
                                               // every update of a full fine-tune); null at ZeRO-3
  float* grads();                              // fp32, accumulated by forward_backward; null without training
                                               // and at ZeRO-2 and 3. Zero after zero_grads() until a backward
                                               // writes it (zeroed here when nothing has since)
  // ZeRO-2/3: the engine's store of weights and gradients (before the first pass); until then, and at ZeRO-0/1,
  // the model's own buffers.
  void set_weight_store(GpuWeightStore* store);
  // Tensor parallelism: the device comm over the tp group, enqueuing on stream() (NCCL; the staged comm when
  // ranks share a GPU). The model all-reduces activations with it: after the row-parallel o_proj and down_proj
  // forward, after the column-parallel input gradients, around the vocab-parallel embedding and loss. With
  // sequence parallelism (MemoryLayout::sp) it also all-gathers the normed rows before the column-parallel GEMMs
  // and the residual stream's gradient before the row-parallel ones' backward.
  void set_tp_comm(Comm* tp);
  // Waits on the host for everything queued on stream() so far. With tensor parallelism the tp collectives run
  // there, so the wait goes through the tp comm (Comm::wait_event): bounded by --comm_timeout and naming `what`, the
  // tp group and its last collective, where a plain synchronize would never return once a tp peer hangs.
  void wait_for_stream(const char* what);
  // AdamW moments: float, or __nv_bfloat16 with GpuOptions::bf16_moments; null without optimizer state.
  void* moment_m() { return t_.m; }
  void* moment_v() { return t_.v; }
  const void* moment_m() const { return t_.m; }
  const void* moment_v() const { return t_.v; }
  bool bf16_moments() const { return run_.bf16_moments; }
  // Rewrites the bf16 copy from the fp32 master weights (after writing master_params() directly), rounded as
  // the last AdamW update rounded it (stochastically with its bits when GpuOptions::stochastic_rounding and
  // steps_taken() > 0), so that a restored model computes exactly what the saved one did. Queued on stream().
  void refresh_params();
  // The same from a caller's fp32 values of the whole layout (device memory; ZeRO-1's gathered weights).
  // Both act on trained_layout(): with adapters, their bf16 copy.
  void refresh_params_from(const float* master_values);

  // The bf16 weights changed outside this model's own writes (ZeRO-2's gathers after the update: dist/zero_gpu.h):
  // with --fp8 each layer is cast again at its next forward. This model's writes (set_params*, refresh_params*,
  // init_random, adamw_step) call it themselves.
  void weights_changed();
  // --fp8 (Engine::fp8_amaxes): the amaxes the last passes cast with, synchronous: each cast slot's four weight groups
  // (a slot not cast since the weights changed gives its stale values), the current slot's layers' four inputs, and the
  // output gradients of q|k|v, o and gate|up of the last backward (the stage's first layer). Empty without FP8.
  std::vector<float> fp8_amaxes();

  // Host fp32 <-> device, in layout() order (the model; with adapters the frozen base, and get_params /
  // get_grads then the adapters', trained_layout()). set_params also refreshes the bf16 copy. Synchronous.
  void set_params(const float* host);
  // Elements [piece.begin, piece.begin + piece.size) of the weights from host fp32, before any update: into the
  // fp32 master (ZeRO-0 training) and the bf16 copy rounded to nearest. Synchronous. How the engine fills a model
  // a unit at a time.
  void set_params_piece(const Segment& piece, const float* host);
  void get_params(float* host) const;
  void get_grads(float* host) const;
  // Training from scratch on the device: normal(0, std) for 2-D weights, ones for norm weights (as
  // Llama::init_random, with the GPU's own random stream: kernels/init.cuh).
  void init_random(uint64_t seed, double std = 0.02);
  // The gradient is zero from here on, without a memset: the next backward's first write of each tensor
  // overwrites it (GpuWeightStore::UnitGrads::fresh), and grads(), get_grads() and adamw_step() zero it first
  // when they come before any backward.
  void zero_grads();

  // inputs, targets: host [batch, seq] token ids (targets may hold cpu::kIgnoreIndex); validated here, so a
  // bad id is a tuna::Error naming its position. Adds into grads() (the step's first call, after zero_grads(),
  // overwrites it instead). Waits for the loss (8 bytes).
  // positions: host [batch, seq], each token's position inside its document (the loader's), or null: one document
  // per row; the document mode (Llama's DocumentMode, set_document_mode) says what they change.
  LossSum forward_backward(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                           const int32_t* positions = nullptr);
  LossSum forward_loss(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                       const int32_t* positions = nullptr);
  // A pipeline stage's passes (MemoryLayout::pp > 1), the CPU model's contract (model/llama.h forward_stage): one
  // micro-batch at a time in any interleaving of up to in_flight() micro-batches, each in its activation slot from its
  // forward to its backward. A later stage than the first reads stage_input(slot) ([residual_rows(batch x seq),
  // hidden] bf16 on the device), which the caller fills with the previous stage's stage_output() first (queued on
  // stream() before the forward, or complete). forward_stage returns the loss on the last stage (waited for; with
  // backward_follows the head's gradient is queued) and nothing elsewhere. backward_stage takes the next stage's input
  // gradient in stage_output_grad() (the last stage: its own loss), adds the stage's weight gradients and leaves its
  // input gradient in stage_input_grad(). The same inputs and positions go to a micro-batch's forward and backward
  // (the first stage's embedding backward reads the tokens again). Host inputs as forward_backward's.
  LossSum forward_stage(int64_t slot, const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                        const int32_t* positions, bool backward_follows);
  void backward_stage(int64_t slot, const int32_t* inputs, int64_t batch, int64_t seq, const int32_t* positions);
  __nv_bfloat16* stage_input(int64_t slot);
  const __nv_bfloat16* stage_output() const { return resid_out_; }  // until the next forward_stage
  __nv_bfloat16* stage_output_grad() { return d_resid_; }
  const __nv_bfloat16* stage_input_grad() const { return d_resid_; }  // until the next backward_stage
  const PipelineStage& stage() const { return stage_; }
  int64_t in_flight() const { return in_flight_; }
  // Rows of the residual stream this rank holds for a pass over n tokens: n, or with sp its shard_range of them
  // (what a stage sends to the next, and its input gradient back).
  int64_t residual_rows(int64_t n) const {
    return sp_ ? shard_range(n, static_cast<int>(run_.tp_rank), static_cast<int>(run_.tp)).size() : n;
  }
  // Pipeline stages: the host comm over the stages (comm/comm.h Mesh::pp), over which adamw_step sums the gradient
  // norm's squares (each stage counts its own tensors; the last stage's copy of a tied table is not counted).
  void set_pp_comm(Comm* pp) { pp_ = pp; }
  // Tied embeddings over stages (training): where the first or last stage receives the other's gradient of the
  // table (fp32, this tp rank's rows; the plan's buffer); null elsewhere.
  float* tied_peer_grad() { return tied_peer_grad_; }
  void set_document_mode(const DocumentMode& mode) { documents_ = mode; }
  // Full logits [batch, seq, vocab] to host fp32 (tests, generation).
  void forward_logits(const int32_t* inputs, int64_t batch, int64_t seq, float* host_logits);
  // Multiple-choice scoring (the CPU model's forward_target_logps, one request per row: no positions): each
  // target's log-prob and whether it is its row's first argmax, host [batch, seq], from the head's logits a chunk at a
  // time on the host (cpu::classifier_target_logps), so the host holds one chunk's logits, not the batch's. One rank
  // of tp (whole-vocabulary logits), the whole model (no pipeline stage). With --fp8 the rows are padded to a pass of
  // a multiple of 16 tokens.
  void forward_target_logps(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq, float* logps,
                            uint8_t* greedy);
  // Preference objectives in two passes, the CPU model's contract (model/llama.h forward_logps, backward_weighted):
  // forward_logps writes logps[i] = log p(targets[i]) (host [batch, seq], 0 where the target is ignored; the fused
  // loss kernel's per-token losses, negated), keeping the activations and the head's input when backward_follows;
  // adapters_off runs the frozen base alone (the LoRA reference; never with a backward). backward_weighted, right after
  // forward_logps(backward_follows) on the same batch (targets: the forward's; the device still holds them and the
  // tokens): the backward of sum_i -weights[i] * logps[i] (weights: host [batch, seq]), the head's logits again a chunk
  // at a time with d logits = w (softmax - onehot), then the layers', into the gradients as forward_backward's (tp: the
  // vocab-parallel steps, cuda::classifier_parallel_weighted_bwd). A pipeline stage runs both in slot 0 (its input in
  // stage_input(0)): its layers, on the last stage the head; backward_weighted there only (then stage_input_grad()).
  void forward_logps(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                     const int32_t* positions, float* logps, bool backward_follows, bool adapters_off = false);
  void backward_weighted(const int32_t* targets, const float* weights, int64_t batch, int64_t seq);

  // Global grad norm (deterministic), clipping as torch's clip_grad_norm_, then one fused AdamW launch.
  // loss_scale = 1 / trained tokens of the step. Same semantics as AdamW::step in model/optimizer.h. Under
  // tensor parallelism the norm sums the tp ranks' squares, with the replicated tensors counted once.
  // No update (stats.applied false) when the norm, read back here anyway, or the step's loss is not finite.
  OptimizerStats adamw_step(double loss_scale, double lr, bool loss_is_finite = true);
  int64_t steps_taken() const { return steps_taken_; }
  void set_steps_taken(int64_t steps) { steps_taken_ = steps; }

  // Model FLOPs per trained token at this sequence length (forward + backward): 6 per matmul weight (the
  // lm_head included, the embedding lookup not) plus causal attention's 6 * seq * q_dim per layer; with adapters
  // lora_flops_per_token (a frozen weight costs 4).
  double flops_per_token(int64_t seq) const;
  // The device arena, laid out from plan_gpu_memory; the engine takes ZeRO's shard buffers from it.
  DeviceArena& arena() { return *arena_; }
  const MemoryPlan& memory_plan() const { return arena_->plan(); }
  // Device bytes allocated at construction: in all, and for parameters + gradients + master + moments (the rest
  // is activations, their gradients and scratch).
  int64_t device_bytes() const { return arena_->bytes(); }
  int64_t state_bytes() const;

 private:
  // Pointers into the arena; with recompute, the buffers not kept per layer point at one shared working set.
  // gate_up: [n, 2 ffn], the fused gate|up GEMM's output, gate in columns [0, ffn) of a row and up in [ffn, 2 ffn);
  // the backward overwrites it with d_gate|d_up.
  struct LayerActs {
    __nv_bfloat16 *resid_in, *norm1, *q, *k, *v, *att, *resid_mid, *norm2, *gate_up, *act;
    float *rstd1, *lse, *rstd2;
    std::array<__nv_bfloat16*, kLoraTargets> lora_ax{};  // per adapter: s A dropout(x), [n, r]
    float* fp8_amax = nullptr;  // --fp8: [kFp8Groups] each group's input amax (Fp8Group order), device fp32
  };
  // What AdamW updates, in trained_layout() order: the model's buffers, or with adapters theirs.
  struct Trained {
    float *master = nullptr, *grads = nullptr;
    __nv_bfloat16* weights = nullptr;
    void *m = nullptr, *v = nullptr;
  };
  // Construction: each of the table's rows pointed at its buffer (point; a layer activation's at its slot and layer),
  // then what the device holds from the start (the AdamW segment table, RoPE, zeros).
  void point(const GpuBufferRow& row, void* p);
  void point_activation(const GpuBufferRow& row, __nv_bfloat16* p);
  void fill_tables();
  // Adapters: which local input column of each target is which of the whole layer's (dropout's index).
  void set_up_adapters();  // model/llama_gpu_lora.cpp
  // QLoRA: each projection's NF4 state carved out of nf4_state_, each unquantized tensor's bf16 out of plain_.
  void lay_out_quantized_base();  // model/llama_gpu_quantized.cpp
  class OwnWeights;  // the GpuWeightStore over params_ and grads_
  class QuantizedBase;  // QLoRA's GpuWeightStore: nf4 layers dequantized on acquire, the rest bf16
  std::unique_ptr<GpuWeightStore> make_quantized_base();  // model/llama_gpu_quantized.cpp
  class GradWrites;  // which weight-gradient write of a backward pass overwrites and which adds
  // Also the batch's document starts and RoPE positions (from the loader's positions and the document mode).
  void upload_tokens(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                     const int32_t* positions = nullptr);
  void forward(int64_t batch, int64_t seq, bool backward_follows);
  // One layer's forward into acts_[l] from its weights (unit base w); with write_output its down projection
  // writes the next layer's input, without (recomputing for the backward) it is skipped.
  void layer_forward(int64_t l, const __nv_bfloat16* w, int64_t batch, int64_t seq, bool write_output);
  void recompute_layer(int64_t l, const __nv_bfloat16* w, int64_t batch, int64_t seq);
  void layer_backward(int64_t l, const __nv_bfloat16* w, float* g, int64_t batch, int64_t seq);
  // The lm_head and loss. With targets, the loss sum's copy to the host is queued, not waited for: the returned
  // LossSum has its count only, and queued_loss_sum() gives the sum once that copy has landed.
  // token_weights (device [rows], or null): the weighted backward's head (want_grad): d logits = w (softmax - onehot)
  // instead of the loss's gradient, and no loss. keep_head (no gradient now): the head unit stays acquired for a
  // weighted backward that follows.
  // logits (or null): each chunk's logits, fp32 on the host, rows r0 .. r0 + rows of the pass.
  using LogitsSink = std::function<void(int64_t r0, int64_t rows, const float* logits)>;
  // The forward of batch x seq tokens (one document per row) and the head's logits, a chunk at a time, into sink.
  void forward_to_logits(const int32_t* inputs, int64_t batch, int64_t seq, const LogitsSink& sink);
  LossSum head(const int32_t* host_targets, int64_t rows, bool want_grad, const LogitsSink* logits,
               const float* token_weights = nullptr, bool keep_head = false);
  double queued_loss_sum();
  // The host waits for `event` (recorded on stream_): through the tp comm when there is one (wait_for_stream).
  void wait_for_event(cudaEvent_t event, const char* what);
  // Cross-entropy of a chunk of logits, in place (dlogits with want_grad): the fused kernel, or under tensor
  // parallelism the vocab-parallel steps around their two all-reduces. weights (device, the pass's rows; want_grad):
  // the weighted backward's dlogits instead, no losses.
  void cross_entropy(int64_t r0, int64_t rows, bool want_grad, const float* weights = nullptr);
  void tp_all_reduce(__nv_bfloat16* x, int64_t n, const char* what);
  // Sequence parallelism (MemoryLayout::sp): the norm and residual regions hold this rank's rows sp_rows_ of the
  // pass's batch x seq, every rank's piece moved as sp_chunk_ rows. sp_gather: every rank's rows of `local` into
  // gathered_, returned. sp_reduce: `full` holds this rank's partial sums of every row (`rows` of them); without
  // sp it is all-reduced in place (`local` is `full`), with sp reduce-scattered: `local` gets the sums of this
  // rank's rows (sp_chunk_ of them written, so both buffers hold tp x sp_chunk_ and sp_chunk_ rows).
  const __nv_bfloat16* sp_gather(const __nv_bfloat16* local, const char* what);
  void sp_reduce(__nv_bfloat16* full, __nv_bfloat16* local, int64_t rows, const char* what);
  // A norm weight's gradient: `dweight` itself, or with sp slot `slot` of sp_norm_grads_ (this rank's rows' part,
  // overwritten); sp_add_norm_grads sums the slots over tp and writes or adds them into the gradients.
  float* norm_grad(float* dweight, int slot) const {
    return sp_ ? sp_norm_grads_ + slot * config_.hidden_size : dweight;
  }
  void sp_add_norm_grads(std::initializer_list<std::pair<float*, GradWrite>> dst, const char* what);
  void backward(int64_t batch, int64_t seq);
  // Layer l's activations in the current slot (a stage's layers only).
  LayerActs& acts(int64_t l) { return acts_[slot_ * stage_.layers() + (l - stage_.layer_begin)]; }
  void select_slot(int64_t slot);
  // --fp8: layer l's four group casts (Fp8Group order), cast from its weights (unit base wb) first when stale.
  const Fp8GpuWeight* fp8_weights(int64_t l, const __nv_bfloat16* wb);
  // --fp8: group g's output-gradient amax, zeroed on the stream for the kernel that folds it; null without --fp8.
  float* fp8_grad_amax(Fp8Group g);
  // --fp8: *amax, group g's input or output-gradient amax from this rank's part, made the maximum over tp where that
  // operand is split there (fp8_operand_split), so every tp rank casts with one rank's scale.
  void fp8_amax_over_tp(float* amax, Fp8Group g, bool output_gradient);
  // --fp8: out = x @ W^T for a column-parallel group g of layer l, x cast with its amax in acts(l).fp8_amax[g]
  // (folded by x's producer and taken over tp).
  void fp8_fwd(int64_t l, Fp8Group g, const Fp8GpuWeight* w, __nv_bfloat16* out, const __nv_bfloat16* x, int64_t n);
  // Adapters of layer l (model/llama.cpp's lora_fwd / lora_bwd, and the tp collectives described there). Forward:
  // u = s A dropout(x) into lora_ax, then y (rows ld_y apart) += u B^T unless add_output is false (a recompute that
  // needs u alone). Backward: dB += dy^T u, dt = s dy B, dA += dt^T dropout(x), dx += dropout'(dt A).
  void lora_fwd(int64_t l, LoraTarget t, const __nv_bfloat16* x, __nv_bfloat16* y, int64_t ld_y, int64_t n,
                bool add_output);
  void lora_bwd(int64_t l, LoraTarget t, const __nv_bfloat16* x, const __nv_bfloat16* dy, int64_t ld_dy,
                __nv_bfloat16* dx, int64_t n);
  // Where layer l's adapter gradients go in this pass (lora_grad_unit_): the whole buffer, or the store's unit buffer,
  // zeroed when fresh (every adapter gradient write adds).
  void take_adapter_grads(int l);
  // The adapter's input for target t of layer l: x with this pass's dropout mask into lora_in_, or x itself.
  const __nv_bfloat16* lora_input(int64_t l, LoraTarget t, const __nv_bfloat16* x, int64_t n);
  const __nv_bfloat16* lora_a(int64_t l, LoraTarget t) const;
  std::array<int64_t, 2> lora_shape(int64_t l, LoraTarget t) const;  // this tp rank's [out, in] of the projection
  const __nv_bfloat16* lora_b(int64_t l, LoraTarget t) const;
  // The memset zero_grads() skipped, for a reader that comes before any backward has written the gradient.
  void zero_unwritten_grads();

  LlamaConfig config_;
  MemoryLayout run_;  // placed (model/support.h): this rank's stage and activation slots are its
  ParamLayout layout_;
  OptimizerConfig opt_;
  GpuOptions options_;
  int64_t max_batch_, max_seq_, head_chunk_rows_, steps_taken_ = 0;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<cuda::MatmulContext> matmul_;

  std::unique_ptr<DeviceArena> arena_;
  Comm* tp_ = nullptr;                        // the tp device comm; null without tensor parallelism
  bool sp_ = false;                           // sequence parallelism (MemoryLayout::sp, tp > 1)
  int64_t sp_chunk_ = 0;                      // sp: this pass's rows per rank, ceil(batch x seq / tp)
  Range sp_rows_;                             // sp: this rank's rows of the pass (shard_range)
  __nv_bfloat16* gathered_ = nullptr;         // sp: [tp x sp_chunk_, C], every rank's rows, or every row's partials
  float* sp_norm_grads_ = nullptr;            // sp: [2, C], a layer's two norm-weight gradients before their sum
  float *ce_stats_ = nullptr, *ce_max_ = nullptr;  // vocab-parallel loss statistics of a chunk
  double* replicated_norms_ = nullptr;        // tp: sums of squares of the replicated tensors' gradients
  std::unique_ptr<GpuWeightStore> own_store_;
  GpuWeightStore* store_ = nullptr;
  std::unique_ptr<GradWrites> grad_writes_;   // of the running backward pass
  bool grads_unwritten_ = false;              // zero_grads() was called and no backward has written grads_ since:
                                              // it is zero, its bytes are stale
  const __nv_bfloat16* head_base_ = nullptr;  // the head unit, acquired from the final norm to its backward
  float *master_ = nullptr, *grads_ = nullptr;
  __nv_bfloat16* params_ = nullptr;
  void *m_ = nullptr, *v_ = nullptr;
  Trained t_;
  // Adapters.
  LoraConfig lora_;
  LoraLayout lora_layout_;
  std::array<int64_t, kLoraTargets> lora_global_in_{}, lora_col0_{};  // the dropout index of a local input column
  __nv_bfloat16 *lora_params_ = nullptr, *lora_in_ = nullptr, *lora_dt_ = nullptr;
  float *lora_master_ = nullptr, *lora_grads_ = nullptr;
  GpuWeightStore* adapter_grads_ = nullptr;  // ZeRO 2-3: the engine's store of the adapters' gradients
  float* lora_grad_unit_ = nullptr;          // the running layer's adapter gradients: element `offset` of
  int64_t lora_grad_begin_ = 0;              // trained_layout() at lora_grad_unit_[offset - lora_grad_begin_]
  uint64_t lora_dropout_key_ = 0;
  bool lora_train_ = false;  // this pass applies dropout
  bool adapters_off_ = false;  // this forward runs the frozen base alone (forward_logps: the LoRA reference)
  bool weighted_head_ = false;  // this pass's head runs twice (forward_logps, then backward_weighted): ZeRO-3's plan
  // FP8 (run_.fp8 tensorwise): per cast slot (one per stage layer, or at ZeRO-3 one for every layer:
  // fp8_cast_layers) its groups' casts (fp8_w_[slot * kFp8Groups + group]) and the stage layer whose current weights
  // they hold (-1: none); one group's operand codes; the output gradients' amaxes (Fp8Group order: the residual
  // gradient's for o and down).
  bool fp8_ = false;
  std::vector<Fp8GpuWeight> fp8_w_;
  std::vector<int64_t> fp8_cast_;
  uint8_t* fp8_codes_ = nullptr;
  uint8_t* fp8_codes_t_ = nullptr;  // --fp8_weight_codes forward: one group's transposed codes, cast at each backward
  float *fp8_scales_ = nullptr, *fp8_grad_amax_ = nullptr;
  Fp8GpuScratch fp8_scratch_;
  void set_up_fp8();
  // The trained tensors' bf16 copy (t_.weights) was rewritten: the model's weights, whose FP8 casts go stale
  // (weights_changed), or with adapters the adapters', whose frozen base keeps its casts (cast once per run).
  void trained_weights_written();
  // QLoRA: per layer, its projections' NF4 state in nf4_state_; the unquantized tensors (embedding unit, head unit,
  // then the layers' norms) in plain_; dequant_ one layer unit in bf16.
  struct Nf4Slot {
    int64_t offset = 0, n = 0;  // the tensor in the layout
    uint8_t *packed = nullptr, *qabsmax = nullptr;
    float* absmax2 = nullptr;
    float* mean = nullptr;      // the absmax mean, on the device as planned (the kernel takes it by value)
    float mean_value = 0;
  };
  std::vector<std::vector<Nf4Slot>> nf4_;      // per layer
  std::map<int64_t, __nv_bfloat16*> plain_at_;  // layout offset of an unquantized tensor -> its bf16 values
  __nv_bfloat16 *plain_ = nullptr, *dequant_ = nullptr;
  uint8_t* nf4_state_ = nullptr;  // every projection's NF4 state, nf4_bytes_ of it; plain_: plain_bytes_ of values
  int64_t nf4_bytes_ = 0, plain_bytes_ = 0;
  // Fills unit u of the quantized base from host fp32 (quantizing its projections); the piece is the whole unit.
  void set_quantized_unit(int u, const float* host);
  // Elements [piece.begin, +piece.size) from the host: into the fp32 master and then its bf16 copy, or with no master
  // straight into the bf16 weights (rounded to nearest on the host). The base's and the adapters' fills.
  void upload_piece(float* master, __nv_bfloat16* params, const Segment& piece, const float* host);
  int64_t* segment_starts_ = nullptr;
  uint8_t* segment_decays_ = nullptr;
  int n_segments_ = 0;
  float *rope_cos_ = nullptr, *rope_sin_ = nullptr;
  // Pipeline stages: this rank's (the whole model without them), its activation slots ([slot][the stage's layers] in
  // acts_), the slot of the pass under way, and the slot whose top layer the working activations still hold (-1:
  // none; a backward right after its forward need not recompute that layer).
  PipelineStage stage_;
  int64_t in_flight_ = 1, slot_ = 0, working_slot_ = -1;
  Comm* pp_ = nullptr;  // the host comm over the stages (norm); null without pp
  float* tied_peer_grad_ = nullptr;
  cudaEvent_t tokens_uploaded_ = nullptr;  // after upload_tokens' copies from pinned_ids_ (a stage's forward waits
                                           // for no loss before the next upload rewrites the staging)
  std::vector<LayerActs> acts_;
  // The last stage's final residual, or an earlier stage's output to the next; the rest: the last stage's only.
  __nv_bfloat16 *resid_out_ = nullptr, *final_norm_out_ = nullptr, *logits_chunk_ = nullptr;
  float *final_rstd_ = nullptr, *losses_ = nullptr;
  // qkv_: [n, q_dim + 2 kv_dim], the fused q|k|v GEMM's output in the forward (rope_fwd reads q and k out of it,
  // v is copied out), and d_q|d_k|d_v, the fused dX and dW GEMMs' input, in the backward: a full-recompute
  // layer_forward runs before, never during, its layer_backward, so the two uses never overlap.
  __nv_bfloat16* qkv_ = nullptr;
  __nv_bfloat16 *d_resid_ = nullptr, *d_norm_ = nullptr, *d_q_ = nullptr, *d_k_ = nullptr, *d_v_ = nullptr,
                *d_att_ = nullptr, *d_act_ = nullptr, *d_final_norm_ = nullptr;
  float *norm_scratch_ = nullptr, *attn_scratch_ = nullptr;
  double *loss_total_ = nullptr, *norm_scratch_f64_ = nullptr, *norm_total_ = nullptr;
  int32_t *tokens_ = nullptr, *targets_ = nullptr, *group_positions_ = nullptr, *group_unique_ = nullptr,
          *group_offsets_ = nullptr;  // tokens and groups: the first stage's; targets: the last's
  int64_t n_unique_ = 0;
  // Packed documents: this batch's document starts and RoPE positions on the device, and the pointers the kernels
  // take (null: plain causal attention, positions 0..seq-1).
  DocumentMode documents_;
  int32_t *doc_start_ = nullptr, *rope_positions_ = nullptr;
  int32_t* attention_tile_counter_ = nullptr;  // the hopper forward's work counter (attention_fwd), 0 between launches
  const int32_t* attention_doc_start_ = nullptr;
  const int32_t* rope_position_ids_ = nullptr;
  // Pinned staging for uploads and the two scalars read back per step.
  int32_t* pinned_ids_ = nullptr;  // 7 * n + 1 ints: inputs, targets, positions, unique, offsets, doc starts, RoPE
  double* pinned_scalar_ = nullptr;
  cudaEvent_t stream_done_ = nullptr;  // wait_for_stream's
  cudaEvent_t loss_copied_ = nullptr;  // recorded after head() queues the loss sum's copy into pinned_scalar_[0]
  cuda::EmbeddingGroups groups_;
};

// The fused AdamW's segment table (kernels/adamw.cuh) for `segments` of `layout`, in shard order: where each
// piece (model/optimizer.h shard_pieces) starts and whether its tensor decays. Never empty.
struct AdamWTable {
  std::vector<int64_t> starts;
  std::vector<uint8_t> decays;
};
AdamWTable adamw_table(const ParamLayout& layout, const std::vector<Segment>& segments);

// The sum of squares of the gradient elements of `pieces` (of a buffer in shard order) that belong to tensors
// replicated over the tensor-parallel ranks (the norm weights), one launch per piece into parts (device, a double
// per replicated piece), added on the host in piece order: what tp ranks other than 0 subtract from their sum of
// squares so that the sum over the tp group counts each replicated tensor once.
int64_t replicated_piece_count(const std::vector<ShardPiece>& pieces);
double replicated_sum_of_squares(const float* grad, const std::vector<ShardPiece>& pieces, double* parts,
                                 double* scratch, cudaStream_t stream);
// The same for the pieces of a tensor another pipeline stage holds too (ParamTensor::copy: the last stage's tied
// lm_head), which that stage's norm counts: what this stage subtracts from its sum of squares. part: one device
// double, used for each piece in turn. Synchronous; 0 without such pieces.
double copy_sum_of_squares(const float* grad, const std::vector<ShardPiece>& pieces, double* part, double* scratch,
                           cudaStream_t stream);

// The fused GEMMs (LlamaGpu, DecodeGpu) read each layer's q|k|v and gate|up as one weight block: fails, naming
// the layer, unless k_proj follows q_proj, v_proj k_proj, and up_proj gate_proj in `layout`.
void require_fused_weight_blocks(const ParamLayout& layout, int64_t hidden_size);

// rows x cols bf16 values from rows src_stride apart to rows dst_stride apart (v out of the fused q|k|v rows, d_v
// into them, v into the KV cache), queued on the stream.
void copy_rows(__nv_bfloat16* dst, int64_t dst_stride, const __nv_bfloat16* src, int64_t src_stride, int64_t rows,
               int64_t cols, cudaStream_t stream);

}  // namespace tuna

#endif  // TUNA_CUDA
