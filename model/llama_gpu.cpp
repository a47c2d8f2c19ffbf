// LlamaGpu: the decoder on one GPU, op for op the sequence of model/llama.cpp (see there for the math):
//   x = embed(tokens)
//   per layer: h = x + o_proj(attention(rope(q_proj(n1)), rope(k_proj(n1)), v_proj(n1)))  with n1 = rmsnorm(x)
//              x = h + down_proj(silu(gate_proj(n2)) * up_proj(n2))                      with n2 = rmsnorm(h)
//   logits = lm_head(rmsnorm(x)), chunked over rows; softmax -> loss -> dlogits in place.
// q_proj, k_proj, v_proj are adjacent in every tp rank's layout, and so are gate_proj, up_proj (model/layout.cpp,
// checked at construction): each group is one [out, C] weight block, so q|k|v and gate|up are one GEMM each, forward
// (one wider output) and backward (one dX GEMM with K = the block's rows, one dW GEMM over the block): fewer,
// larger GEMMs, and the second dX GEMM's re-read and re-write of d_norm gone.
// The residual adds ride in the o_proj and down_proj GEMMs' epilogues (beta = 1 with the residual as C), so
// the residual stream costs no separate pass. Everything runs on one stream. The host waits for the loss once
// per forward_backward, after the backward is queued (so the device never idles for it), and once per
// adamw_step for the gradient norm.
#if TUNA_CUDA

#include "model/llama_gpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <dlfcn.h>
#include <map>
#include <mutex>

#include "core/cuda_check.h"
#include "core/dtype.h"
#include "core/error.h"
#include "comm/comm.h"
#include "kernels/adamw.cuh"
#include "kernels/attention.cuh"
#include "kernels/classifier.cuh"
#include "kernels/cpu/attention.h"  // doc_starts_from_positions
#include "kernels/cpu/classifier.h"
#include "kernels/cpu/rope.h"
#include "kernels/init.cuh"
#include "kernels/lora.cuh"
#include "kernels/nf4.cuh"
#include "kernels/cpu/nf4.h"
#include "kernels/rmsnorm.cuh"
#include "kernels/rope.cuh"
#include "kernels/swiglu.cuh"

namespace tuna {

DeviceArena::DeviceArena(const MemoryPlan& plan) : plan_(plan) {
  for (const MemoryItem& item : plan_.items) {
    if (!item.in_arena) continue;
    TUNA_CHECK(item.bytes % 256 == 0, "plan item '", item.name, "' of ", item.bytes, " bytes is not 256-aligned");
    TUNA_CHECK(slots_.emplace(item.name, Slot{bytes_, item.bytes}).second, "plan item '", item.name, "' repeats");
    bytes_ += item.bytes;
  }
  TUNA_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&base_), static_cast<size_t>(std::max<int64_t>(bytes_, 256))));
}

DeviceArena::~DeviceArena() {
  if (base_) cudaFree(base_);
}

void* DeviceArena::take_bytes(const std::string& name, int64_t bytes) {
  auto it = slots_.find(name);
  TUNA_CHECK(it != slots_.end(), "device buffer '", name, "' is not in the memory plan (model/memory_plan_gpu.cpp)");
  Slot& slot = it->second;
  TUNA_CHECK(!slot.taken, "device buffer '", name, "' taken twice");
  TUNA_CHECK(device_arena_bytes(bytes) == slot.bytes, "device buffer '", name, "': the memory plan has ", slot.bytes,
             " bytes, the engine uses ", bytes);
  slot.taken = true;
  return base_ + slot.offset;
}

void DeviceArena::check_all_taken() const {
  for (const auto& [name, slot] : slots_)
    TUNA_CHECK(slot.taken, "device buffer '", name, "' is in the memory plan but the engine never uses it");
}

void copy_rows(__nv_bfloat16* dst, int64_t dst_stride, const __nv_bfloat16* src, int64_t src_stride, int64_t rows,
               int64_t cols, cudaStream_t stream) {
  constexpr size_t kBytes = sizeof(__nv_bfloat16);
  TUNA_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_stride * kBytes, src, src_stride * kBytes, cols * kBytes, rows,
                                    cudaMemcpyDeviceToDevice, stream));
}

void require_fused_weight_blocks(const ParamLayout& layout, int64_t hidden_size) {
  const TpDims& d = layout.tp();
  const int64_t C = hidden_size;
  for (int64_t l = layout.layer_begin(); l < layout.layer_end(); l++) {  // a pipeline stage's layers
    const LayerOffsets& o = layout.layer(l);
    TUNA_CHECK(o.k_proj == o.q_proj + d.q_dim * C && o.v_proj == o.k_proj + d.kv_dim * C &&
                   o.up_proj == o.gate_proj + d.ffn * C,
               "layer ", l, ": q/k/v or gate/up weights are not adjacent in the parameter layout (tp rank ",
               d.tp_rank, " of ", d.tp_size, ")");
  }
}

// The GpuWeightStore of a model that holds its whole weights and gradient (ZeRO-0 and 1, forward only). Its
// gradient is fresh from zero_grads() to the end of the next backward, which writes all of it.
class LlamaGpu::OwnWeights final : public GpuWeightStore {
 public:
  explicit OwnWeights(LlamaGpu& model) : m_(model) {}
  const __nv_bfloat16* acquire(int unit) override { return m_.params_ + m_.layout_.unit_range(unit).first; }
  void release(int) override {}
  UnitGrads grads(int unit) override {
    return {m_.grads_ + m_.layout_.unit_range(unit).first, m_.grads_unwritten_};
  }
  void grads_done(int) override {}

 private:
  LlamaGpu& m_;
};

// QLoRA's store of the frozen base: the embedding and head units in place (bf16), a decoder layer dequantized from
// NF4 into the one layer buffer with its norm weights copied beside, so the GEMMs read it at the unit's own offsets.
// One layer is acquired at a time (the model's pass order), so one buffer serves every layer. A frozen base has
// no gradient: asking for one is an error.
class LlamaGpu::QuantizedBase final : public GpuWeightStore {
 public:
  explicit QuantizedBase(LlamaGpu& model) : m_(model) {}
  const __nv_bfloat16* acquire(int unit) override {
    const ParamLayout& layout = m_.layout_;
    const int64_t begin = layout.unit_range(unit).first;
    if (unit == 0 || unit == layout.head_unit()) return m_.plain_at_.at(begin);
    const int64_t l = unit - 1;
    std::vector<cuda::Nf4Dequant> batch;
    for (const Nf4Slot& t : m_.nf4_[l])
      batch.push_back({m_.dequant_ + (t.offset - begin), t.packed, t.qabsmax, t.absmax2, t.mean_value, t.n});
    cuda::nf4_dequantize(batch.data(), static_cast<int>(batch.size()), m_.stream_);
    for (const ParamTensor& t : layout.tensors())
      if (t.layer == l && !base_tensor_quantized(t))
        TUNA_CUDA_CHECK(cudaMemcpyAsync(m_.dequant_ + (t.offset - begin), m_.plain_at_.at(t.offset),
                                        t.numel * sizeof(__nv_bfloat16), cudaMemcpyDeviceToDevice, m_.stream_));
    return m_.dequant_;
  }
  void release(int) override {}
  UnitGrads grads(int unit) override { fail("the quantized base is frozen: no gradient of unit ", unit); }
  void grads_done(int unit) override { fail("the quantized base is frozen: no gradient of unit ", unit); }

 private:
  LlamaGpu& m_;
};

// The weight-gradient writes of one backward pass, so that which call overwrites is decided in one place. A
// unit's buffer comes from the store, fresh or not (GpuWeightStore::UnitGrads); the first write of each tensor
// into a fresh buffer overwrites it (kernels/cpu/grad_write.h), every other write adds. Within a pass each tensor
// has one writer, except:
//   - the lm_head: a dW GEMM per row chunk (LlamaGpu::head), of which the first overwrites;
//   - the tied embedding: the lm_head's chunks write the whole [vocab, hidden] block first, then the lookup's
//     backward adds its rows;
//   - an untied embedding: the lookup's backward touches only the rows of the batch's tokens, so its first write
//     zeroes the tensor and then adds (LlamaGpu::backward).
// So a pass writes every element of every unit it takes, and a fresh buffer needs no zeroing. Host bookkeeping
// only: a flag per tensor and per unit, cleared per pass.
class LlamaGpu::GradWrites {
 public:
  explicit GradWrites(const ParamLayout& layout) {
    for (int u = 0; u < layout.num_units(); u++)
      for (const ParamTensor& t : layout.tensors())
        if (t.offset >= layout.unit_range(u).first && t.offset < layout.unit_range(u).second)
          tensors_.push_back({t.offset, u});
    std::sort(tensors_.begin(), tensors_.end(), [](const Tensor& a, const Tensor& b) { return a.offset < b.offset; });
    unit_fresh_.resize(layout.num_units());
  }

  void begin_pass(GpuWeightStore& store) {
    store_ = &store;
    for (Tensor& t : tensors_) t.written = false;
    std::fill(unit_fresh_.begin(), unit_fresh_.end(), Unit::NotTaken);
  }
  // The unit's gradient buffer (the store's answer to the pass's first request says whether it is fresh).
  float* unit(int unit) {
    const GpuWeightStore::UnitGrads g = store_->grads(unit);
    unit_fresh_[unit] = g.fresh ? Unit::Fresh : Unit::Holding;
    return g.data;
  }
  // How this write of the tensor at layout offset `offset` goes: Overwrite if it is the pass's first write of the
  // tensor and the unit's buffer is fresh, else Accumulate.
  GradWrite write(int64_t offset) {
    const auto it = std::lower_bound(tensors_.begin(), tensors_.end(), offset,
                                     [](const Tensor& t, int64_t o) { return t.offset < o; });
    TUNA_CHECK(it != tensors_.end() && it->offset == offset, "no parameter tensor starts at offset ", offset);
    TUNA_CHECK(unit_fresh_[it->unit] != Unit::NotTaken, "a gradient write into unit ", it->unit,
               " before its buffer was taken in this pass");
    const bool first = !it->written;
    it->written = true;
    return first && unit_fresh_[it->unit] == Unit::Fresh ? GradWrite::Overwrite : GradWrite::Accumulate;
  }
  // One write of adjacent tensors at once (a fused GEMM's weight-gradient block): their one mode.
  GradWrite write_block(std::initializer_list<int64_t> offsets) {
    const GradWrite mode = write(*offsets.begin());
    for (const int64_t* o = offsets.begin() + 1; o != offsets.end(); o++)
      TUNA_CHECK(write(*o) == mode, "the tensors at offsets ", *offsets.begin(), " and ", *o,
                 " of one fused gradient write disagree on overwriting");
    return mode;
  }

 private:
  struct Tensor {
    int64_t offset;
    int unit;
    bool written = false;
  };
  enum class Unit { NotTaken, Fresh, Holding };
  std::vector<Tensor> tensors_;  // by offset
  std::vector<Unit> unit_fresh_;
  GpuWeightStore* store_ = nullptr;
};

void LlamaGpu::set_tp_comm(Comm* tp) {
  TUNA_CHECK(tp != nullptr && tp->size() == run_.tp && tp->rank() == run_.tp_rank, "tp comm of ",
             tp ? tp->size() : 0, " ranks for a model of tp ", run_.tp);
  tp_ = tp;
}

void LlamaGpu::tp_all_reduce(__nv_bfloat16* x, int64_t n, const char* what) {
  if (run_.tp == 1) return;
  TUNA_CHECK(tp_ != nullptr, "tensor parallelism without a tp comm (set_tp_comm)");
  tp_->all_reduce(x, n, CommType::BF16, ReduceOp::Sum, what);
}

// Sequence parallelism moves every row in pieces of sp_chunk_ rows, one per rank (the last ones padded past the
// batch), so that each gathered piece is whole rows whatever batch x seq is.
const __nv_bfloat16* LlamaGpu::sp_gather(const __nv_bfloat16* local, const char* what) {
  tp_->all_gather(local, gathered_, run_.tp * sp_chunk_ * config_.hidden_size, CommType::BF16, what);
  return gathered_;
}

// With sp, every row's partial sums are reduce-scattered in bf16 by pieces of sp_chunk_ rows: this rank gets the
// sum of its rows, at half the bytes of tp's all-reduce. The padding rows past the pass's are zeroed: their sums
// land past the last ranks' rows, never read.
void LlamaGpu::sp_reduce(__nv_bfloat16* full, __nv_bfloat16* local, int64_t rows, const char* what) {
  const int64_t C = config_.hidden_size;
  if (!sp_) return tp_all_reduce(full, rows * C, what);
  const int64_t padded = run_.tp * sp_chunk_;
  if (padded > rows)
    TUNA_CUDA_CHECK(cudaMemsetAsync(full + rows * C, 0, (padded - rows) * C * sizeof(__nv_bfloat16), stream_));
  tp_->reduce_scatter(full, local, padded * C, CommType::BF16, what);
}

void LlamaGpu::sp_add_norm_grads(std::initializer_list<std::pair<float*, GradWrite>> dst, const char* what) {
  const int64_t C = config_.hidden_size;
  tp_->all_reduce(sp_norm_grads_, static_cast<int64_t>(dst.size()) * C, CommType::F32, ReduceOp::Sum, what);
  const float* sum = sp_norm_grads_;
  for (const auto& [grad, write] : dst) {
    if (write == GradWrite::Overwrite)
      TUNA_CUDA_CHECK(cudaMemcpyAsync(grad, sum, C * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
    else
      cuda::accumulate(grad, sum, C, stream_);
    sum += C;
  }
}

void LlamaGpu::set_adapter_grad_store(GpuWeightStore* store) {
  TUNA_CHECK(store != nullptr && lora_.enabled() && run_.training && lora_grads_ == nullptr,
             "an adapter gradient store replaces the adapters' whole gradient at ZeRO 2 and 3 only");
  adapter_grads_ = store;
}

void LlamaGpu::take_adapter_grads(int l) {
  lora_grad_begin_ = lora_layout_.params.unit_range(l).first;
  if (adapter_grads_ == nullptr) {
    TUNA_CHECK(lora_grads_ != nullptr, "ZeRO 2-3 with adapters: no adapter gradient store (set_adapter_grad_store)");
    lora_grad_unit_ = lora_grads_ + lora_grad_begin_;
    return;
  }
  const GpuWeightStore::UnitGrads g = adapter_grads_->grads(l);
  if (g.fresh)
    TUNA_CUDA_CHECK(cudaMemsetAsync(g.data, 0, (lora_layout_.params.unit_range(l).second - lora_grad_begin_) *
                                                   sizeof(float), stream_));
  lora_grad_unit_ = g.data;
}

void LlamaGpu::set_weight_store(GpuWeightStore* store) {
  TUNA_CHECK(store != nullptr && own_store_ == nullptr,
             "an external weight store replaces the whole buffers of ZeRO-2 and 3 only");
  store_ = store;
}

int64_t LlamaGpu::state_bytes() const {
  const MemoryPlan& plan = arena_->plan();
  return plan.bytes(MemoryKind::Weights) + plan.bytes(MemoryKind::Gradients) + plan.bytes(MemoryKind::Master) +
         plan.bytes(MemoryKind::Moments);
}

LlamaGpu::LlamaGpu(const LlamaConfig& config, int64_t max_batch, int64_t max_seq, const OptimizerConfig& optimizer,
                   const GpuOptions& options)
    : LlamaGpu(config, single_rank_layout(max_batch, max_seq), optimizer, options) {}

namespace {
// This rank's pipeline stage (model/pipeline.h's split, as the memory plan takes it), or the whole model.
PipelineStage stage_of(const LlamaConfig& config, const MemoryLayout& run) {
  if (run.pp > 1) return pipeline_stages(config, run.pp, run.seq_len).at(static_cast<size_t>(run.pp_rank));
  PipelineStage whole;
  whole.layer_end = config.num_hidden_layers;
  whole.embedding = whole.head = true;
  return whole;
}

// With pipeline stages, the adapters of the stage's layers only (global names and random streams, model/lora.h).
LoraLayout adapters_of(const LlamaConfig& config, const MemoryLayout& run) {
  if (!run.lora.enabled()) return LoraLayout{ParamLayout(TpDims{}, {}, {}), {}};
  const PipelineStage stage = stage_of(config, run);
  return lora_layout(config, run.lora, static_cast<int>(run.tp_rank), static_cast<int>(run.tp),
                     run.pp > 1 ? &stage : nullptr);
}

ParamLayout layout_of(const LlamaConfig& config, const MemoryLayout& run) {
  const int tp_rank = static_cast<int>(run.tp_rank), tp = static_cast<int>(run.tp);
  return run.pp > 1 ? ParamLayout(config, tp_rank, tp, stage_of(config, run)) : ParamLayout(config, tp_rank, tp);
}
}  // namespace

LlamaGpu::LlamaGpu(const LlamaConfig& config, const MemoryLayout& run, const OptimizerConfig& optimizer,
                   const GpuOptions& options)
    : config_(config), layout_(layout_of(config, run)), opt_(optimizer),
      run_(run), options_(options), max_batch_(run.micro_batch), max_seq_(run.seq_len), lora_(run.lora),
      lora_layout_(adapters_of(config, run)) {
  const int64_t max_batch = max_batch_, max_seq = max_seq_;
  TUNA_CHECK(max_batch > 0 && max_seq > 0, "batch ", max_batch, " seq ", max_seq);
  validate(opt_);
  stage_ = stage_of(config, run);
  // 1F1B: stage s keeps the activations of pp - s micro-batches (model/pipeline.h); a forward alone one.
  in_flight_ = run.training ? run.pp - run.pp_rank : 1;
  if (run.pp > 1 && run.training && run.zero >= 2)
    fail("--device cuda: --zero ", run.zero, " with pipeline stages (--pp ", run.pp, ") is not implemented in the CUDA "
         "engine; use --zero 0 or 1");
  if (run.sp && run.tp < 2)
    fail("option 'sp': sequence parallelism splits the sequence over --tp > 1 ranks (found tp ", run.tp, ")");
  sp_ = run.sp;
  const LlamaConfig& c = config_;
  if (c.head_dim != 64 && c.head_dim != 128 && c.head_dim != 8 && c.head_dim != 16 && c.head_dim != 32)
    fail("--device cuda: attention supports head_dim 64 and 128 (and 8, 16, 32 for tiny models); this model has ",
         c.head_dim);
  if (c.hidden_size % 8 != 0 || c.intermediate_size % 8 != 0)
    fail("--device cuda: hidden_size and intermediate_size must be multiples of 8 (found ", c.hidden_size, ", ",
         c.intermediate_size, ")");
  const int64_t n = max_batch * max_seq, C = c.hidden_size, P = layout_.total();
  // The rows of the norm and residual regions: every row, or with sp this rank's share (at most ceil(n / tp)).
  const int64_t rows = sp_ ? (n + run.tp - 1) / run.tp : n;
  const TpDims& d = layout_.tp();
  const int64_t F = d.ffn, qd = d.q_dim, kvd = d.kv_dim, H = d.heads;
  require_fused_weight_blocks(layout_, C);  // and their gradients: one block each
  TUNA_CUDA_CHECK(cudaSetDevice(options_.device));
  TUNA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));

  head_chunk_rows_ = gpu_head_chunk_rows(d.vocab, n);
  const bool training = run_.training, own_optimizer = training && run_.zero == 0;
  const bool adapters = lora_.enabled();
  const bool quantized = adapters && run_.lora.base_quant != BaseQuant::None;
  if (adapters && run_.lora.base_quant == BaseQuant::Int8)
    fail("--base_quant int8 with --device cuda: an int8 frozen base is not implemented on the CUDA engine; use "
         "--base_quant nf4 (QLoRA) or none (a bf16 base), or --device cpu");
  // ZeRO-3 with adapters: the frozen bf16 base sharded over dp, its units gathered by the engine's store
  // (set_weight_store); a quantized base is not sharded (the memory plan's design only, as on cpu).
  const bool sharded_base = adapters && training && run_.zero == 3;
  if (sharded_base && quantized)
    fail("--base_quant ", base_quant_name(run_.lora.base_quant), " with --device cuda and --zero 3: sharding a "
         "quantized base over dp is not implemented; use --zero 2 (the base whole on every rank) or a bf16 base");
  const ParamLayout& trained = trained_layout();
  const int64_t Pt = trained.total();
  n_segments_ = static_cast<int>(trained.tensors().size());

  // Every buffer from the memory plan (model/memory_plan_gpu.cpp), by its name there.
  arena_ = std::make_unique<DeviceArena>(plan_gpu_memory(c, run_));
  DeviceArena& arena = *arena_;
  using bf16 = __nv_bfloat16;
  // A full fine-tune's state is the model's; with adapters the base is frozen bf16 (no master, gradient or
  // moments) and the adapters have the state, under the plan's "LoRA" names.
  const std::string state = adapters ? "LoRA " : "";
  if (quantized) {
    // The NF4 state of every projection in one byte buffer: all codes (8-byte aligned for the kernel's vector
    // path when the sizes allow), then the fp32 scales and means, then the 8-bit absmax: no padding, so the
    // bytes are the plan's.
    int64_t packed = 0, stats = 0, blocks = 0, plain = 0;
    for (const ParamTensor& t : layout_.tensors()) {
      if (!base_tensor_quantized(t)) {
        plain += t.numel;
        continue;
      }
      const cpu::Nf4Sizes z = cpu::nf4_sizes(t.numel);
      packed += z.packed_bytes, stats += z.stat_blocks + 1, blocks += z.blocks;
    }
    if (packed % 4 != 0)
      fail("--base_quant nf4 with --device cuda: the NF4 codes of this model's projections take ", packed, " bytes, not "
           "a multiple of 4 (a projection with an odd number of elements), which the device layout does not take");
    uint8_t* bytes = arena.take<uint8_t>("nf4 base weights (frozen decoder Linear weights)", packed + 4 * stats + blocks);
    plain_ = arena.take<bf16>("bf16 base weights (frozen embedding, norms, lm_head)", plain);
    // Shaped like the stage's first layer unit (every layer's is the same size; a later stage lacks layer 0's).
    const auto [l0_begin, l0_end] = layout_.unit_range(1 + static_cast<int>(stage_.layer_begin));
    dequant_ = arena.take<bf16>("dequantized layer weights (bf16, one layer)", l0_end - l0_begin);
    uint8_t* at_packed = bytes;
    float* at_stats = reinterpret_cast<float*>(bytes + packed);
    uint8_t* at_blocks = bytes + packed + 4 * stats;
    // bf16 values of the unquantized tensors: the embedding unit, the head unit (each whole, in layout order, so
    // that a pointer to its first tensor is the unit), then every norm weight.
    bf16* at_plain = plain_;
    const int H = layout_.head_unit();
    for (int u : {0, H})
      for (const ParamTensor& t : layout_.tensors())
        if (t.offset >= layout_.unit_range(u).first && t.offset < layout_.unit_range(u).second)
          plain_at_[t.offset] = at_plain, at_plain += t.numel;
    nf4_.resize(c.num_hidden_layers);
    for (const ParamTensor& t : layout_.tensors()) {
      if (t.layer < 0) continue;
      if (!base_tensor_quantized(t)) {
        plain_at_[t.offset] = at_plain, at_plain += t.numel;
        continue;
      }
      const cpu::Nf4Sizes z = cpu::nf4_sizes(t.numel);
      Nf4Slot slot;
      slot.offset = t.offset, slot.n = t.numel;
      slot.packed = at_packed, at_packed += z.packed_bytes;
      slot.absmax2 = at_stats, slot.mean = at_stats + z.stat_blocks, at_stats += z.stat_blocks + 1;
      slot.qabsmax = at_blocks, at_blocks += z.blocks;
      nf4_[t.layer].push_back(slot);
    }
    TUNA_CHECK(at_plain == plain_ + plain, "the quantized base's bf16 tensors do not fill their buffer");
  } else if (adapters) {
    if (!sharded_base) params_ = arena.take<bf16>("bf16 base weights (frozen)", P);
  } else {
    if (own_optimizer) master_ = arena.take<float>("fp32 master weights", P);
    if (run_.zero <= 2 || !training) params_ = arena.take<bf16>("bf16 weights", P);
    if (training && run_.zero <= 1) grads_ = arena.take<float>("fp32 gradients", P);
    t_ = Trained{master_, grads_, params_, nullptr, nullptr};
  }
  if (adapters) {
    lora_params_ = arena.take<bf16>("LoRA bf16 weights", Pt);
    t_.weights = lora_params_;
    if (own_optimizer) lora_master_ = t_.master = arena.take<float>("LoRA fp32 master weights", Pt);
    // ZeRO 2-3: no whole gradient; a layer's at a time in the engine's store (set_adapter_grad_store).
    if (training && run_.zero <= 1) lora_grads_ = t_.grads = arena.take<float>("LoRA fp32 gradients", Pt);
  }
  if (own_optimizer) {
    const int64_t moment_bytes = run_.bf16_moments ? 2 : 4;
    m_ = t_.m = arena.take<char>(state + "AdamW m", Pt * moment_bytes);
    v_ = t_.v = arena.take<char>(state + "AdamW v", Pt * moment_bytes);
    segment_starts_ = arena.take<int64_t>(state + "AdamW segment starts", n_segments_);
    segment_decays_ = arena.take<uint8_t>(state + "AdamW segment decays", n_segments_);
    norm_scratch_f64_ = arena.take<double>("gradient norm scratch", cuda::sum_of_squares_scratch_doubles());
    norm_total_ = arena.take<double>("gradient norm", 1);
    if (run_.tp > 1)
      replicated_norms_ = arena.take<double>(
          "replicated gradient norms",
          std::max<int64_t>(1, replicated_piece_count(shard_pieces(trained, {Segment{0, Pt}}))));
  }
  rope_cos_ = arena.take<float>("RoPE cos", max_seq * c.head_dim / 2);
  rope_sin_ = arena.take<float>("RoPE sin", max_seq * c.head_dim / 2);
  // Each layer's activations: its own buffer where the recompute mode keeps the field, else the working one.
  const Recompute recompute = training ? run_.recompute : Recompute::Full;
  // Per slot (a micro-batch in flight) and layer of the stage, by the plan's names.
  acts_.resize(in_flight_ * stage_.layers());
  const auto kept_name = [](int64_t slot, int64_t l, const std::string& name) {
    return slot == 0 ? str("layer ", l, " ", name) : str("layer ", l, " (in flight ", slot, ") ", name);
  };
  const auto field = [&]<typename T>(T* LayerActs::*member, const char* name, int64_t count) {
    T* working = gpu_keeps_activation(name, recompute) ? nullptr : arena.take<T>(str("working ", name), count);
    for (int64_t slot = 0; slot < in_flight_; slot++)
      for (int64_t l = stage_.layer_begin; l < stage_.layer_end; l++)
        acts_[slot * stage_.layers() + l - stage_.layer_begin].*member =
            working != nullptr ? working : arena.take<T>(kept_name(slot, l, name), count);
  };
  field(&LayerActs::resid_in, "resid_in", rows * C);
  field(&LayerActs::norm1, "norm1", rows * C);
  field(&LayerActs::rstd1, "rstd1", rows);
  field(&LayerActs::q, "q", n * qd);
  field(&LayerActs::k, "k", n * kvd);
  field(&LayerActs::v, "v", n * kvd);
  field(&LayerActs::att, "att", n * qd);
  field(&LayerActs::lse, "lse", n * H);
  field(&LayerActs::resid_mid, "resid_mid", rows * C);
  field(&LayerActs::norm2, "norm2", rows * C);
  field(&LayerActs::rstd2, "rstd2", rows);
  field(&LayerActs::gate_up, "gate_up", n * 2 * F);
  field(&LayerActs::act, "act", n * F);
  if (adapters) {
    // Per target, which local input column is which of the whole layer's (dropout's index) and its u = s A x.
    const int64_t r = lora_.rank;
    for (int t = 0; t < kLoraTargets; t++) {
      if (!lora_.has(LoraTarget(t))) continue;
      const ParamTensor* a = trained.find(lora_tensor_name(stage_.layer_begin, LoraTarget(t), 'A'));
      TUNA_CHECK(a != nullptr, "no adapter A for ", lora_target_name(LoraTarget(t)));
      lora_global_in_[t] = a->global_shape[1];
      lora_col0_[t] = a->split_dim == 1 ? a->split_begin : 0;
      const std::string module = lora_target_name(LoraTarget(t));
      const bool kept = gpu_keeps_activation("lora_ax", recompute);
      bf16* working = kept ? nullptr : arena.take<bf16>(str("working lora_ax ", module), n * r);
      for (int64_t slot = 0; slot < in_flight_; slot++)
        for (int64_t l = stage_.layer_begin; l < stage_.layer_end; l++)
          acts_[slot * stage_.layers() + l - stage_.layer_begin].lora_ax[t] =
              working != nullptr ? working : arena.take<bf16>(kept_name(slot, l, str("lora_ax ", module)), n * r);
    }
    int64_t widest_in = 0;
    for (const ParamTensor& t : trained.tensors())
      if (t.layer == stage_.layer_begin && t.name.find("lora_A") != std::string::npos) widest_in = std::max(widest_in, t.shape[1]);
    if (lora_.dropout > 0) lora_in_ = arena.take<bf16>("LoRA dropout(x)", n * widest_in);
    if (training) lora_dt_ = arena.take<bf16>("LoRA d(A x)", n * r);
  }
  qkv_ = arena.take<bf16>("qkv", n * (qd + 2 * kvd));
  if (sp_) gathered_ = arena.take<bf16>("sequence-parallel gathered input", n * C);
  // The last stage's final residual; an earlier stage's last layer writes what it sends to the next stage.
  resid_out_ = arena.take<bf16>(stage_.head ? "final residual" : "pipeline send: activation to the next stage", rows * C);
  if (stage_.head) {
    final_norm_out_ = arena.take<bf16>("final norm", rows * C);
    final_rstd_ = arena.take<float>("final rstd", rows);
    logits_chunk_ = arena.take<bf16>("logits chunk", head_chunk_rows_ * d.vocab);
    losses_ = arena.take<float>("per-token losses", n);
    if (run_.tp > 1) {
      ce_stats_ = arena.take<float>("classifier statistics", 3 * head_chunk_rows_);
      ce_max_ = arena.take<float>("classifier global max", head_chunk_rows_);
    }
  }
  if (training) {
    d_resid_ = arena.take<bf16>("d_resid", rows * C);
    d_norm_ = arena.take<bf16>("d_norm", n * C);
    if (stage_.head || sp_) d_final_norm_ = arena.take<bf16>("d_final_norm", n * C);
    d_q_ = arena.take<bf16>("d_q", n * qd);
    d_att_ = arena.take<bf16>("d_att", n * qd);
    d_k_ = arena.take<bf16>("d_k", n * kvd);
    d_v_ = arena.take<bf16>("d_v", n * kvd);
    d_act_ = arena.take<bf16>("d_act", n * F);
    norm_scratch_ = arena.take<float>("rmsnorm backward scratch", cuda::rmsnorm_bwd_scratch_floats(rows, C));
    if (sp_) sp_norm_grads_ = arena.take<float>("sequence-parallel norm weight gradients", 2 * C);
    attn_scratch_ = arena.take<float>("attention backward scratch", cuda::attention_bwd_scratch_floats(max_batch, max_seq, H, /*head_dim=*/128, run_.attention));
  }
  // (A frozen table, with adapters, has no gradient to exchange.)
  if (run_.pp > 1 && training && !adapters && c.tie_word_embeddings && (stage_.embedding || stage_.head))
    tied_peer_grad_ = arena.take<float>("pipeline: the tied embedding's gradient from the other stage", d.vocab * C);
  if (stage_.head) loss_total_ = arena.take<double>("loss total", 1);
  if (stage_.embedding) tokens_ = arena.take<int32_t>("token ids", n);
  if (stage_.head) targets_ = arena.take<int32_t>("targets", n);
  if (stage_.embedding) {
    group_positions_ = arena.take<int32_t>("embedding group positions", n);
    group_unique_ = arena.take<int32_t>("embedding group tokens", n);
    group_offsets_ = arena.take<int32_t>("embedding group offsets", n + 1);
  }
  doc_start_ = arena.take<int32_t>("document starts", n);
  rope_positions_ = arena.take<int32_t>("RoPE positions", n);
  attention_tile_counter_ = arena.take<int32_t>("attention tile counter", 1);
  constexpr int64_t kMatmulWorkspace = int64_t(32) << 20;
  matmul_ = std::make_unique<cuda::MatmulContext>(arena.take<char>("cuBLASLt workspace", kMatmulWorkspace),
                                                  static_cast<size_t>(kMatmulWorkspace));
  if (run_.zero == 0) arena.check_all_taken();  // ZeRO 1-3: the engine takes the shard's buffers, then checks
  if (quantized) {
    own_store_ = std::make_unique<QuantizedBase>(*this);
    store_ = own_store_.get();
  } else if (adapters ? !sharded_base : run_.zero <= 1 || !training) {  // a frozen bf16 base is whole at ZeRO 0-2
    own_store_ = std::make_unique<OwnWeights>(*this);
    store_ = own_store_.get();
  }
  grad_writes_ = std::make_unique<GradWrites>(layout_);
  TUNA_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&pinned_ids_), static_cast<size_t>(7 * n + 1) * sizeof(int32_t)));
  TUNA_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&pinned_scalar_), 2 * sizeof(double)));
  TUNA_CUDA_CHECK(cudaEventCreateWithFlags(&loss_copied_, cudaEventDisableTiming));
  TUNA_CUDA_CHECK(cudaEventCreateWithFlags(&tokens_uploaded_, cudaEventDisableTiming));
  TUNA_CUDA_CHECK(cudaEventCreateWithFlags(&stream_done_, cudaEventDisableTiming));

  // The segment table of the fused AdamW over the whole layout: one segment per tensor, in offset order.
  if (segment_starts_ != nullptr) {
    const AdamWTable table = adamw_table(trained, {Segment{0, Pt}});
    TUNA_CUDA_CHECK(cudaMemcpy(segment_starts_, table.starts.data(), table.starts.size() * sizeof(int64_t),
                               cudaMemcpyHostToDevice));
    TUNA_CUDA_CHECK(cudaMemcpy(segment_decays_, table.decays.data(), table.decays.size(), cudaMemcpyHostToDevice));
  }

  // RoPE tables from the CPU twin's functions (double math, llama3 scaling), so both backends agree exactly.
  std::vector<double> inv_freq(c.head_dim / 2);
  cpu::rope_inv_freq(inv_freq.data(), c.head_dim, c.rope_theta, c.rope_scaling);
  std::vector<float> cos_table(max_seq * c.head_dim / 2), sin_table(max_seq * c.head_dim / 2);
  cpu::rope_table(cos_table.data(), sin_table.data(), inv_freq.data(), max_seq, c.head_dim);
  TUNA_CUDA_CHECK(cudaMemcpy(rope_cos_, cos_table.data(), cos_table.size() * sizeof(float), cudaMemcpyHostToDevice));
  TUNA_CUDA_CHECK(cudaMemcpy(rope_sin_, sin_table.data(), sin_table.size() * sizeof(float), cudaMemcpyHostToDevice));

  // The state starts at zero (a step before set_params trains from zero weights, not from garbage); activations
  // are written before they are read, and stay poisoned where the emulator poisons fresh memory, as does the
  // gradient until the first backward overwrites it (zero_grads).
  if (t_.master != nullptr) TUNA_CUDA_CHECK(cudaMemset(t_.master, 0, Pt * sizeof(float)));
  if (params_ != nullptr) TUNA_CUDA_CHECK(cudaMemset(params_, 0, P * sizeof(__nv_bfloat16)));
  if (lora_params_ != nullptr) TUNA_CUDA_CHECK(cudaMemset(lora_params_, 0, Pt * sizeof(__nv_bfloat16)));
  if (t_.m != nullptr) {
    const size_t moment_bytes = static_cast<size_t>(Pt) * (run_.bf16_moments ? 2 : 4);
    TUNA_CUDA_CHECK(cudaMemset(t_.m, 0, moment_bytes));
    TUNA_CUDA_CHECK(cudaMemset(t_.v, 0, moment_bytes));
  }
  if (t_.grads != nullptr) zero_grads();
  TUNA_CUDA_CHECK(cudaMemset(attention_tile_counter_, 0, sizeof(int32_t)));  // every launch leaves it 0
  TUNA_CUDA_CHECK(cudaDeviceSynchronize());
}

LlamaGpu::~LlamaGpu() {
  matmul_.reset();
  if (pinned_ids_) cudaFreeHost(pinned_ids_);
  if (pinned_scalar_) cudaFreeHost(pinned_scalar_);
  if (loss_copied_) cudaEventDestroy(loss_copied_);
  if (tokens_uploaded_) cudaEventDestroy(tokens_uploaded_);
  if (stream_done_) cudaEventDestroy(stream_done_);
  arena_.reset();
  if (stream_) cudaStreamDestroy(stream_);
}

// Host copies go through cudaMemcpyAsync on stream_: a plain cudaMemcpy runs on the legacy stream, which a
// cudaStreamNonBlocking stream does not wait for, and from pageable memory it may return before the data has
// landed, so a kernel on stream_ could read the old contents.
void LlamaGpu::set_params(const float* host) {
  if (dequant_ != nullptr) {  // QLoRA: a unit at a time, quantized on the way
    for (int u = 0; u < layout_.num_units(); u++) set_quantized_unit(u, host + layout_.unit_range(u).first);
    return;
  }
  TUNA_CHECK(params_ != nullptr, "ZeRO-3 keeps no whole weights: the engine writes its shard");
  const int64_t P = layout_.total();
  if (master_ == nullptr && grads_ == nullptr) {  // forward only: rounded to nearest on the host, as f32_to_bf16
    std::vector<uint16_t> bits(P);
    convert_from_f32(host, DType::BF16, bits.data(), P);
    TUNA_CUDA_CHECK(cudaMemcpyAsync(params_, bits.data(), P * sizeof(uint16_t), cudaMemcpyHostToDevice, stream_));
    TUNA_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return;
  }
  // Without a master copy, the values pass through the gradient buffer (which reads as zero again after).
  float* dst = master_ != nullptr ? master_ : grads_;
  TUNA_CUDA_CHECK(cudaMemcpyAsync(dst, host, P * sizeof(float), cudaMemcpyHostToDevice, stream_));
  refresh_params_from(dst);
  if (master_ == nullptr) zero_grads();
  TUNA_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void LlamaGpu::set_quantized_unit(int u, const float* host) {
  const int64_t begin = layout_.unit_range(u).first;
  std::vector<uint16_t> bits;
  std::vector<uint8_t> packed, qabsmax;
  std::vector<float> absmax2, scratch;
  for (const ParamTensor& t : layout_.tensors()) {
    if (t.offset < begin || t.offset >= layout_.unit_range(u).second) continue;
    const float* x = host + (t.offset - begin);
    if (!base_tensor_quantized(t)) {  // bf16, rounded to nearest on the host as f32_to_bf16
      bits.resize(t.numel);
      convert_from_f32(x, DType::BF16, bits.data(), t.numel);
      TUNA_CUDA_CHECK(cudaMemcpyAsync(plain_at_.at(t.offset), bits.data(), t.numel * sizeof(uint16_t),
                                      cudaMemcpyHostToDevice, stream_));
      TUNA_CUDA_CHECK(cudaStreamSynchronize(stream_));
      continue;
    }
    Nf4Slot* slot = nullptr;
    for (Nf4Slot& s : nf4_[t.layer]) slot = s.offset == t.offset ? &s : slot;
    TUNA_CHECK(slot != nullptr, "no NF4 slot for ", t.name);
    const cpu::Nf4Sizes z = cpu::nf4_sizes(t.numel);
    packed.resize(z.packed_bytes), qabsmax.resize(z.blocks), absmax2.resize(z.stat_blocks), scratch.resize(z.blocks);
    cpu::nf4_quantize(x, t.numel, packed.data(), qabsmax.data(), absmax2.data(), &slot->mean_value, scratch.data(),
                      t.name.c_str());
    TUNA_CUDA_CHECK(cudaMemcpyAsync(slot->packed, packed.data(), packed.size(), cudaMemcpyHostToDevice, stream_));
    TUNA_CUDA_CHECK(cudaMemcpyAsync(slot->qabsmax, qabsmax.data(), qabsmax.size(), cudaMemcpyHostToDevice, stream_));
    TUNA_CUDA_CHECK(cudaMemcpyAsync(slot->absmax2, absmax2.data(), absmax2.size() * sizeof(float),
                                    cudaMemcpyHostToDevice, stream_));
    TUNA_CUDA_CHECK(cudaMemcpyAsync(slot->mean, &slot->mean_value, sizeof(float), cudaMemcpyHostToDevice, stream_));
    TUNA_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the host buffers are refilled next
  }
}

void LlamaGpu::set_params_piece(const Segment& piece, const float* host) {
  if (dequant_ != nullptr) {  // QLoRA: whole units (the engine fills a unit at a time), quantized on the way
    for (int u = 0; u < layout_.num_units(); u++)
      if (layout_.unit_range(u).first == piece.begin &&
          layout_.unit_range(u).second - layout_.unit_range(u).first == piece.size)
        return set_quantized_unit(u, host);
    fail("a quantized base is filled a whole unit at a time: piece [", piece.begin, ", +", piece.size, ") is not a unit");
  }
  TUNA_CHECK(params_ != nullptr && piece.begin >= 0 && piece.begin + piece.size <= layout_.total(),
             "piece [", piece.begin, ", +", piece.size, ") of ", layout_.total(), " weights (ZeRO-3 keeps no whole copy)");
  upload_piece(master_, params_, piece, host);
}

void LlamaGpu::refresh_params() {
  TUNA_CHECK(t_.master != nullptr, "this model keeps no fp32 master copy (ZeRO-0 training only)");
  refresh_params_from(t_.master);
}

void LlamaGpu::refresh_params_from(const float* master_values) {
  const int64_t total = trained_layout().total();
  if (!options_.stochastic_rounding || steps_taken_ == 0)
    return cuda::f32_to_bf16(t_.weights, master_values, total, stream_);
  cuda::AdamWArgs args{};
  args.step = steps_taken_, args.stochastic_rounding = true, args.seed = options_.seed;
  cuda::bf16_params_as_updated(t_.weights, master_values, total, args, stream_);
}

void LlamaGpu::set_adapters_piece(const Segment& piece, const float* host) {
  TUNA_CHECK(lora_params_ != nullptr && piece.begin >= 0 && piece.begin + piece.size <= lora_layout_.params.total(),
             "adapter piece [", piece.begin, ", +", piece.size, ") of ", lora_layout_.params.total(), " (a model with adapters)");
  upload_piece(lora_master_, lora_params_, piece, host);
}

void LlamaGpu::upload_piece(float* master, __nv_bfloat16* params, const Segment& piece, const float* host) {
  if (master != nullptr) {
    TUNA_CUDA_CHECK(cudaMemcpyAsync(master + piece.begin, host, piece.size * sizeof(float), cudaMemcpyHostToDevice,
                                    stream_));
    cuda::f32_to_bf16(params + piece.begin, master + piece.begin, piece.size, stream_);
  } else {  // rounded to nearest on the host, as f32_to_bf16
    std::vector<uint16_t> bits(piece.size);
    convert_from_f32(host, DType::BF16, bits.data(), piece.size);
    TUNA_CUDA_CHECK(cudaMemcpyAsync(params + piece.begin, bits.data(), piece.size * sizeof(uint16_t),
                                    cudaMemcpyHostToDevice, stream_));
  }
  TUNA_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the host buffer is refilled next
}

void LlamaGpu::init_random(uint64_t seed, double std) {
  TUNA_CHECK(master_ != nullptr, "this model keeps no fp32 master copy (ZeRO-0 training only)");
  TUNA_CUDA_CHECK(cudaStreamSynchronize(stream_));
  for (const ParamTensor& t : layout_.tensors()) {
    if (t.shape.size() == 1) cuda::fill_constant(master_ + t.offset, t.numel, 1.0f, stream_);
    else cuda::fill_normal(master_ + t.offset, t.numel, seed + static_cast<uint64_t>(t.offset), static_cast<float>(std), stream_);
  }
  cuda::f32_to_bf16(params_, master_, layout_.total(), stream_);
  TUNA_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void LlamaGpu::get_params(float* host) const {
  TUNA_CHECK(t_.master != nullptr, "this model keeps no fp32 master copy (ZeRO-0 training only)");
  TUNA_CUDA_CHECK(cudaStreamSynchronize(stream_));
  TUNA_CUDA_CHECK(cudaMemcpy(host, t_.master, trained_layout().total() * sizeof(float), cudaMemcpyDeviceToHost));
}

void LlamaGpu::get_grads(float* host) const {
  TUNA_CHECK(t_.grads != nullptr, "a forward-only model has no gradients");
  const int64_t total = trained_layout().total();
  if (grads_unwritten_) return std::fill(host, host + total, 0.0f);
  TUNA_CUDA_CHECK(cudaStreamSynchronize(stream_));
  TUNA_CUDA_CHECK(cudaMemcpy(host, t_.grads, total * sizeof(float), cudaMemcpyDeviceToHost));
}

float* LlamaGpu::grads() {
  if (t_.grads != nullptr) zero_unwritten_grads();
  return t_.grads;
}

void LlamaGpu::zero_grads() {
  TUNA_CHECK(t_.grads != nullptr, "a forward-only model has no gradients");
  grads_unwritten_ = true;
}

void LlamaGpu::zero_unwritten_grads() {
  if (!grads_unwritten_) return;
  TUNA_CUDA_CHECK(cudaMemsetAsync(t_.grads, 0, trained_layout().total() * sizeof(float), stream_));
  grads_unwritten_ = false;
}

void LlamaGpu::upload_tokens(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                             const int32_t* positions) {
  const int64_t V = config_.vocab_size, n = batch * seq;
  // A pipeline stage takes what it uses: the first stage the tokens, the last the targets.
  if (!stage_.head) targets = nullptr;
  if (targets != nullptr)
    for (int64_t i = 0; i < n; ++i)
      if (targets[i] != cpu::kIgnoreIndex && (targets[i] < 0 || targets[i] >= V))
        fail("target at position ", i, " is ", targets[i], ", outside the vocabulary [0, ", V, ")");
  const TpDims& d = layout_.tp();
  // Also validates the inputs. Under tensor parallelism, only the tokens of this rank's vocabulary slice.
  if (stage_.embedding) {
    if (run_.tp > 1) cuda::embedding_groups_slice(groups_, inputs, n, V, d.vocab_begin, d.vocab);
    else cuda::embedding_groups(groups_, inputs, n, V);
    n_unique_ = static_cast<int64_t>(groups_.unique_tokens.size());
  }
  // The previous call's copies out of the pinned staging are done before it is rewritten (a pipeline stage's forward
  // returns without waiting for anything the stream does after them).
  wait_for_event(tokens_uploaded_, "the compute stream's work before a token upload");
  int32_t* staged = pinned_ids_;
  const auto up = [&](int32_t* dst, const int32_t* src, int64_t count) {
    TUNA_CUDA_CHECK(cudaMemcpyAsync(dst, src, count * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  };
  if (targets != nullptr) {
    std::memcpy(staged + n, targets, n * sizeof(int32_t));
    up(targets_, staged + n, n);
  }
  if (stage_.embedding) {
    std::memcpy(staged, inputs, n * sizeof(int32_t));
    std::memcpy(staged + 2 * n, groups_.positions.data(), n * sizeof(int32_t));
    std::memcpy(staged + 3 * n, groups_.unique_tokens.data(), n_unique_ * sizeof(int32_t));
    std::memcpy(staged + 4 * n, groups_.offsets.data(), (n_unique_ + 1) * sizeof(int32_t));
    up(tokens_, staged, n);
    up(group_positions_, staged + 2 * n, n);
    up(group_unique_, staged + 3 * n, n_unique_);
    up(group_offsets_, staged + 4 * n, n_unique_ + 1);
  }
  // Documents: derived and checked on the host (cpu::doc_starts_from_positions), as the CPU model does.
  attention_doc_start_ = nullptr, rope_position_ids_ = nullptr;
  if (positions != nullptr && (documents_.mask || documents_.restart_positions)) {
    int32_t* starts = staged + 5 * n + 1;
    cpu::doc_starts_from_positions(starts, positions, batch, seq);
    if (documents_.mask) {
      up(doc_start_, starts, n);
      attention_doc_start_ = doc_start_;
    }
    if (documents_.restart_positions) {
      int32_t* rope = starts + n;
      for (int64_t i = 0; i < n; ++i) rope[i] = static_cast<int32_t>(i % seq - starts[i]);
      up(rope_positions_, rope, n);
      rope_position_ids_ = rope_positions_;
    }
  }
  TUNA_CUDA_CHECK(cudaEventRecord(tokens_uploaded_, stream_));
}

void LlamaGpu::forward(int64_t batch, int64_t seq, bool backward_follows) {
  TUNA_CHECK(store_ != nullptr, "no weights: the engine sets the weight store of ZeRO-2 and 3 (set_weight_store)");
  const LlamaConfig& c = config_;
  const int64_t n = batch * seq, C = c.hidden_size;
  const int H = layout_.head_unit();
  // This stage's layers (all of them without pipeline stages).
  const int first = static_cast<int>(stage_.layer_begin), end = static_cast<int>(stage_.layer_end);
  cudaStream_t s = stream_;

  store_->plan(layout_.unit_pass_order(backward_follows));
  lora_train_ = backward_follows && lora_.enabled() && lora_.dropout > 0;  // PEFT's dropout acts in training only
  if (sp_) {
    sp_chunk_ = (n + run_.tp - 1) / run_.tp;
    sp_rows_ = shard_range(n, static_cast<int>(run_.tp_rank), static_cast<int>(run_.tp));
    if (sp_rows_.size() == 0)
      fail("sequence parallelism (--sp): a pass of ", n, " tokens leaves tp rank ", run_.tp_rank, " of ", run_.tp,
           " no rows (the CUDA engine needs at least one token per tp rank)");
  }
  const int64_t nr = sp_ ? sp_rows_.size() : n;  // the rows of the norm and residual regions

  // The first stage embeds; a later stage's input is already in its first layer's resid_in (stage_input).
  if (stage_.embedding) {
    const __nv_bfloat16* embedding = store_->acquire(0);
    __nv_bfloat16* x0 = first == end ? resid_out_ : acts(first).resid_in;
    __nv_bfloat16* embedded = sp_ ? gathered_ : x0;  // every row (with sp, before this rank's are kept)
    const TpDims& d = layout_.tp();
    cuda::embedding_fwd_slice(embedded, tokens_, embedding + (layout_.embed_tokens() - layout_.unit_range(0).first),
                              n, c.vocab_size, d.vocab_begin, d.vocab, C, s);
    store_->release(0);
    sp_reduce(embedded, x0, n, "tp embedding");  // one rank holds each token's row, the others add zeros: exact
  }
  for (int l = first; l < end; l++) {
    layer_forward(l, store_->acquire(1 + l), batch, seq, /*write_output=*/true);
    store_->release(1 + l);
  }
  working_slot_ = backward_follows ? slot_ : -1;  // the top layer's working activations are this pass's
  if (!stage_.head) return;  // the stage's output is resid_out_ (stage_output)
  // The head unit stays acquired through head() and, when a backward follows, the final norm's backward.
  head_base_ = store_->acquire(H);
  cuda::rmsnorm_fwd(final_norm_out_, final_rstd_, resid_out_,
                    head_base_ + (layout_.final_norm() - layout_.unit_range(H).first), nr, C, c.rms_norm_eps, s);
}

void LlamaGpu::layer_forward(int64_t l, const __nv_bfloat16* wb, int64_t batch, int64_t seq, bool write_output) {
  const LlamaConfig& c = config_;
  const TpDims& d = layout_.tp();
  const int64_t n = batch * seq, C = c.hidden_size, F = d.ffn, D = c.head_dim;
  const LayerOffsets& o = layout_.layer(l);
  const int64_t begin = layout_.unit_range(1 + static_cast<int>(l)).first;
  const auto w = [&](int64_t offset) { return wb + (offset - begin); };
  LayerActs& a = acts(l);
  cudaStream_t s = stream_;
  cuda::MatmulContext& mm = *matmul_;
  const int64_t nr = sp_ ? sp_rows_.size() : n;  // the rows of the norm and residual regions
  cuda::rmsnorm_fwd(a.norm1, a.rstd1, a.resid_in, w(o.input_norm), nr, C, c.rms_norm_eps, s);
  // One GEMM over the q|k|v weight block into qkv_; RoPE reads q and k out of its rows into the contiguous a.q, a.k
  // the attention kernels take, and v is copied out (a strided copy). With sp it reads every rank's rows gathered.
  const int64_t qkv = d.q_dim + 2 * d.kv_dim;
  const __nv_bfloat16* x1 = sp_ ? sp_gather(a.norm1, "sp q/k/v input") : a.norm1;
  cuda::matmul_fwd(mm, qkv_, x1, w(o.q_proj), n, C, qkv, s);
  // Adapters add into their column blocks of the fused outputs, before RoPE and SwiGLU read them; with sp they read
  // every row of the gathered input, as the GEMM does.
  const auto adapt = [&](LoraTarget t, const __nv_bfloat16* x, __nv_bfloat16* y, int64_t ld_y, bool add = true) {
    if (lora_.enabled() && lora_.has(t)) lora_fwd(l, t, x, y, ld_y, n, add);
  };
  adapt(LoraTarget::Q, x1, qkv_, qkv);
  adapt(LoraTarget::K, x1, qkv_ + d.q_dim, qkv);
  adapt(LoraTarget::V, x1, qkv_ + d.q_dim + d.kv_dim, qkv);
  cuda::rope_fwd(a.q, qkv_, rope_cos_, rope_sin_, batch, seq, d.heads, D, d.q_dim, qkv, rope_position_ids_, s);
  cuda::rope_fwd(a.k, qkv_ + d.q_dim, rope_cos_, rope_sin_, batch, seq, d.kv_heads, D, d.kv_dim, qkv,
                 rope_position_ids_, s);
  copy_rows(a.v, d.kv_dim, qkv_ + d.q_dim + d.kv_dim, qkv, n, d.kv_dim, s);
  cuda::attention_fwd(a.att, a.lse, a.q, a.k, a.v, batch, seq, d.heads, d.kv_heads, D, attention_doc_start_, s,
                      run_.attention, attention_tile_counter_);
  // Row-parallel o_proj (and down_proj below): each tp rank's partial product, the residual added by rank 0
  // only, then summed over the ranks. With sp every row's partial product goes to gathered_, each rank adding the
  // residual of its own rows (the GEMM split at them), and the sum of this rank's rows comes back into `out`.
  const auto row_parallel = [&](__nv_bfloat16* out, const __nv_bfloat16* inp, int64_t weight,
                                const __nv_bfloat16* residual, int64_t ic, const char* what) {
    if (!sp_) {
      if (d.tp_rank == 0) cuda::matmul_residual_fwd(mm, out, inp, w(weight), residual, n, ic, C, s);
      else cuda::matmul_fwd(mm, out, inp, w(weight), n, ic, C, s);
      return tp_all_reduce(out, n * C, what);
    }
    const int64_t begin = sp_rows_.begin, end = sp_rows_.end;
    if (begin > 0) cuda::matmul_fwd(mm, gathered_, inp, w(weight), begin, ic, C, s);
    if (end > begin)
      cuda::matmul_residual_fwd(mm, gathered_ + begin * C, inp + begin * ic, w(weight), residual, end - begin, ic, C,
                                s);
    if (n > end) cuda::matmul_fwd(mm, gathered_ + end * C, inp + end * ic, w(weight), n - end, ic, C, s);
    sp_reduce(gathered_, out, n, what);
  };
  row_parallel(a.resid_mid, a.att, o.o_proj, a.resid_in, d.q_dim, "tp o_proj");
  adapt(LoraTarget::O, a.att, a.resid_mid, C);  // after the sum: every rank adds the same whole product once
  cuda::rmsnorm_fwd(a.norm2, a.rstd2, a.resid_mid, w(o.post_norm), nr, C, c.rms_norm_eps, s);
  const __nv_bfloat16* x2 = sp_ ? sp_gather(a.norm2, "sp gate/up input") : a.norm2;
  cuda::matmul_fwd(mm, a.gate_up, x2, w(o.gate_proj), n, C, 2 * F, s);  // the gate|up block
  adapt(LoraTarget::Gate, x2, a.gate_up, 2 * F);
  adapt(LoraTarget::Up, x2, a.gate_up + F, 2 * F);
  cuda::swiglu_fwd(a.act, a.gate_up, a.gate_up + F, n, F, 2 * F, s);
  if (!write_output) {  // a recompute: the down adapter's u is needed by its backward, its output is not
    adapt(LoraTarget::Down, a.act, nullptr, C, /*add=*/false);
    return;
  }
  __nv_bfloat16* resid_next = l + 1 < stage_.layer_end ? acts(l + 1).resid_in : resid_out_;
  row_parallel(resid_next, a.act, o.down_proj, a.resid_mid, F, "tp down_proj");
  adapt(LoraTarget::Down, a.act, resid_next, C);
}

// What the recompute mode dropped of layer l's activations, recomputed from what it kept, with the same kernels
// on the same inputs: the same bits as the forward wrote.
void LlamaGpu::recompute_layer(int64_t l, const __nv_bfloat16* wb, int64_t batch, int64_t seq) {
  switch (run_.recompute) {
    case Recompute::None: return;
    case Recompute::Full: return layer_forward(l, wb, batch, seq, /*write_output=*/false);
    case Recompute::Selective: {
      const LlamaConfig& c = config_;
      const int64_t n = batch * seq, C = c.hidden_size, F = layout_.tp().ffn;
      const int64_t nr = sp_ ? sp_rows_.size() : n;  // the norms' rows (this rank's with sp)
      const LayerOffsets& o = layout_.layer(l);
      const int64_t begin = layout_.unit_range(1 + static_cast<int>(l)).first;
      LayerActs& a = acts(l);
      cuda::rmsnorm_fwd(a.norm1, a.rstd1, a.resid_in, wb + (o.input_norm - begin), nr, C, c.rms_norm_eps, stream_);
      cuda::rmsnorm_fwd(a.norm2, a.rstd2, a.resid_mid, wb + (o.post_norm - begin), nr, C, c.rms_norm_eps, stream_);
      cuda::swiglu_fwd(a.act, a.gate_up, a.gate_up + F, n, F, 2 * F, stream_);
      return;
    }
  }
}

LossSum LlamaGpu::head(const int32_t* host_targets, int64_t rows, bool want_grad, float* host_logits) {
  const int64_t C = config_.hidden_size, V = layout_.tp().vocab;
  const int H = layout_.head_unit(), lm_unit = layout_.lm_head_unit();
  const int64_t lm_offset = layout_.lm_head() - layout_.unit_range(lm_unit).first;
  const __nv_bfloat16* w_head = (lm_unit == H ? head_base_ : store_->acquire(lm_unit)) + lm_offset;
  // A frozen base (adapters) has no weight gradient: the head's backward gives only its input's.
  float* g_head = want_grad && !lora_.enabled() ? grad_writes_->unit(lm_unit) + lm_offset : nullptr;
  cudaStream_t s = stream_;
  std::vector<uint16_t> chunk_bits;
  // Column-parallel (by vocabulary): every row's normed input, gathered with sp; its input gradient is every
  // row's partial sum in d_final_norm_, with sp reduced into this rank's rows of d_norm_ (the final norm's).
  const __nv_bfloat16* normed = sp_ ? sp_gather(final_norm_out_, "sp lm_head input") : final_norm_out_;
  for (int64_t r0 = 0; r0 < rows; r0 += head_chunk_rows_) {
    const int64_t nr = std::min(head_chunk_rows_, rows - r0);
    const __nv_bfloat16* x = normed + r0 * C;
    cuda::matmul_fwd(*matmul_, logits_chunk_, x, w_head, nr, C, V, s);
    if (host_logits != nullptr) {
      chunk_bits.resize(nr * V);
      TUNA_CUDA_CHECK(cudaMemcpyAsync(chunk_bits.data(), logits_chunk_, nr * V * sizeof(uint16_t),
                                      cudaMemcpyDeviceToHost, s));
      TUNA_CUDA_CHECK(cudaStreamSynchronize(s));
      convert_to_f32(chunk_bits.data(), DType::BF16, host_logits + r0 * V, nr * V);
    }
    if (host_targets == nullptr) continue;
    cross_entropy(r0, nr, want_grad);
    if (want_grad)  // the first chunk's dW overwrites a fresh lm_head gradient, the others add
      cuda::matmul_bwd(*matmul_, d_final_norm_ + r0 * C, g_head, logits_chunk_, x, w_head, nr, C, V,
                       /*accumulate_dinp=*/false,
                       g_head != nullptr ? grad_writes_->write(layout_.lm_head()) : GradWrite::Accumulate, s);
  }
  if (want_grad)  // vocab-parallel: partial sums
    sp_reduce(d_final_norm_, sp_ ? d_norm_ : d_final_norm_, rows, "tp lm_head input grad");
  if (lm_unit != H) store_->release(lm_unit);
  if (!want_grad) store_->release(H);  // no backward: the pass ends here
  LossSum loss;
  if (host_targets == nullptr) return loss;
  cuda::loss_sum(loss_total_, losses_, rows, s);
  TUNA_CUDA_CHECK(cudaMemcpyAsync(pinned_scalar_, loss_total_, sizeof(double), cudaMemcpyDeviceToHost, s));
  TUNA_CUDA_CHECK(cudaEventRecord(loss_copied_, s));
  for (int64_t i = 0; i < rows; ++i) loss.count += host_targets[i] != cpu::kIgnoreIndex;
  return loss;
}

double LlamaGpu::queued_loss_sum() {
  wait_for_event(loss_copied_, "the forward, before its loss is read");
  return pinned_scalar_[0];
}

void LlamaGpu::wait_for_event(cudaEvent_t event, const char* what) {
  if (tp_ != nullptr && tp_->wait_event(event, str("tp group: ", what).c_str())) return;
  TUNA_CUDA_CHECK(cudaEventSynchronize(event));
}

void LlamaGpu::wait_for_stream(const char* what) {
  TUNA_CUDA_CHECK(cudaEventRecord(stream_done_, stream_));
  wait_for_event(stream_done_, what);
}

void LlamaGpu::cross_entropy(int64_t r0, int64_t rows, bool want_grad) {
  const TpDims& d = layout_.tp();
  const float dloss = want_grad ? 1.0f : 0.0f;  // the gradient of the summed loss (see model/llama.h)
  cudaStream_t s = stream_;
  if (run_.tp == 1) return cuda::classifier_fwd_bwd(logits_chunk_, losses_ + r0, targets_ + r0, rows, d.vocab, dloss, s);
  // Vocab-parallel: three rows of statistics cross the tp group, not logits.
  cuda::classifier_partial_stats(logits_chunk_, ce_stats_, targets_ + r0, rows, d.vocab, d.vocab_begin,
                                 config_.vocab_size, s);
  TUNA_CUDA_CHECK(cudaMemcpyAsync(ce_max_, ce_stats_, rows * sizeof(float), cudaMemcpyDeviceToDevice, s));
  tp_->all_reduce(ce_max_, rows, CommType::F32, ReduceOp::Max, "tp loss max");
  cuda::classifier_rescale_sums(ce_stats_, ce_max_, rows, s);
  tp_->all_reduce(ce_stats_ + rows, 2 * rows, CommType::F32, ReduceOp::Sum, "tp loss sums");
  cuda::classifier_parallel_fwd_bwd(logits_chunk_, losses_ + r0, targets_ + r0, ce_max_, ce_stats_ + rows, rows,
                                    d.vocab, d.vocab_begin, dloss, s);
}

void LlamaGpu::backward(int64_t batch, int64_t seq) {
  const LlamaConfig& c = config_;
  const int64_t n = batch * seq, C = c.hidden_size;
  const int H = layout_.head_unit();
  const int first = static_cast<int>(stage_.layer_begin), end = static_cast<int>(stage_.layer_end);
  cudaStream_t s = stream_;

  // d_resid_ carries the residual stream's gradient from the top down (with sp this rank's rows, every piece
  // zeroed whole, as it is gathered whole); the rmsnorm backwards add into it. A stage before the last finds the
  // next stage's input gradient there (stage_output_grad: this rank's rows, the rest of its piece zeroed here).
  const int64_t nr = sp_ ? sp_rows_.size() : n;
  if (stage_.head)
    TUNA_CUDA_CHECK(cudaMemsetAsync(d_resid_, 0, (sp_ ? sp_chunk_ : n) * C * sizeof(__nv_bfloat16), s));
  else if (sp_ && sp_chunk_ > nr)
    TUNA_CUDA_CHECK(cudaMemsetAsync(d_resid_ + nr * C, 0, (sp_chunk_ - nr) * C * sizeof(__nv_bfloat16), s));
  // A frozen base (adapters): no weight gradient of it is computed (null dweight: the kernels skip it); the
  // adapters' gradients accumulate into their buffer, which the step's first pass found zeroed (at ZeRO 2-3 a
  // layer's buffer from the engine's store, zeroed for each pass: take_adapter_grads).
  const bool frozen = lora_.enabled();
  if (frozen && t_.grads != nullptr) zero_unwritten_grads();
  if (stage_.head) {
    const int64_t norm = layout_.final_norm() - layout_.unit_range(H).first;
    float* g_head_unit = frozen ? nullptr : grad_writes_->unit(H);
    // With sp a norm weight's gradient from this rank's rows is partial: written to sp_norm_grads_, summed over
    // tp and then written or added (sp_add_norm_grads), so every tp rank holds the micro-batch's whole gradient.
    const GradWrite write = frozen ? GradWrite::Accumulate : grad_writes_->write(layout_.final_norm());
    cuda::rmsnorm_bwd(d_resid_, frozen ? nullptr : norm_grad(g_head_unit + norm, 0), sp_ ? d_norm_ : d_final_norm_,
                      resid_out_, head_base_ + norm, final_rstd_, norm_scratch_, nr, C,
                      sp_ ? GradWrite::Overwrite : write, s);
    if (sp_ && !frozen) sp_add_norm_grads({{g_head_unit + norm, write}}, "sp final norm weight grad");
    store_->release(H);
    if (!frozen) store_->grads_done(H);
  }
  for (int l = end - 1; l >= first; l--) {
    const __nv_bfloat16* wb = store_->acquire(1 + l);
    float* gb = frozen ? nullptr : grad_writes_->unit(1 + l);
    if (frozen) take_adapter_grads(l);
    // The top layer's working activations are still this micro-batch's forward's when no other pass came between.
    if (l != end - 1 || working_slot_ != slot_) recompute_layer(l, wb, batch, seq);
    layer_backward(l, wb, gb, batch, seq);
    store_->release(1 + l);
    if (!frozen) store_->grads_done(1 + l);
    else if (adapter_grads_ != nullptr) adapter_grads_->grads_done(l);
  }
  working_slot_ = -1;
  if (frozen) return;
  if (stage_.embedding) {  // a later stage's input gradient is d_resid_ (stage_input_grad)
    // The lookup's backward adds the batch's rows only: a first write zeroes the whole (tp-local) table first.
    float* g_embed = grad_writes_->unit(0) + (layout_.embed_tokens() - layout_.unit_range(0).first);
    if (grad_writes_->write(layout_.embed_tokens()) == GradWrite::Overwrite)
      TUNA_CUDA_CHECK(cudaMemsetAsync(g_embed, 0, layout_.tp().vocab * C * sizeof(float), s));
    const __nv_bfloat16* d_embedded = sp_ ? sp_gather(d_resid_, "sp embedding grad") : d_resid_;  // every token's
    cuda::embedding_bwd(g_embed, d_embedded, group_positions_, group_unique_, group_offsets_, n_unique_, C, s);
    store_->grads_done(0);
  }
  grads_unwritten_ = false;  // the pass wrote every element of the stage (GradWrites)
}

void LlamaGpu::layer_backward(int64_t l, const __nv_bfloat16* wb, float* gb, int64_t batch, int64_t seq) {
  const LlamaConfig& c = config_;
  const TpDims& d = layout_.tp();
  const int64_t n = batch * seq, C = c.hidden_size, F = d.ffn, D = c.head_dim;
  const LayerOffsets& o = layout_.layer(l);
  const int64_t begin = layout_.unit_range(1 + static_cast<int>(l)).first;
  const auto w = [&](int64_t offset) { return wb + (offset - begin); };
  // A frozen base (gb null): no weight gradients, and no GradWrites bookkeeping for them.
  const auto g = [&](int64_t offset) { return gb != nullptr ? gb + (offset - begin) : nullptr; };
  // Overwrite on the step's first micro-batch, else add: each tensor of a layer has this one writer.
  const auto grad_write = [&](int64_t offset) {
    return gb != nullptr ? grad_writes_->write(offset) : GradWrite::Accumulate;
  };
  const auto grad_write_block = [&](std::initializer_list<int64_t> offsets) {
    return gb != nullptr ? grad_writes_->write_block(offsets) : GradWrite::Accumulate;
  };
  const auto adapt = [&](LoraTarget t, const __nv_bfloat16* x, const __nv_bfloat16* dy, int64_t ld_dy,
                         __nv_bfloat16* dx) {
    if (lora_.enabled() && lora_.has(t)) lora_bwd(l, t, x, dy, ld_dy, dx, n);
  };
  const LayerActs& a = acts(l);
  cudaStream_t s = stream_;
  cuda::MatmulContext& mm = *matmul_;
  // With sp: the row-parallel GEMMs' output gradient and the column-parallel ones' input are every row, gathered
  // (each into gathered_, used before the next gather); the column-parallel input gradients are every row's
  // partial sums in d_norm_, reduced into this rank's rows (dnorm); the norms run on this rank's rows (nr).
  const int64_t nr = sp_ ? sp_rows_.size() : n;
  __nv_bfloat16* dnorm = sp_ ? d_final_norm_ : d_norm_;
  const GradWrite post_norm_write = grad_write(o.post_norm), input_norm_write = grad_write(o.input_norm);
  const auto norm_write = [&](GradWrite w) { return sp_ ? GradWrite::Overwrite : w; };
  // MLP block: x_out = resid_mid + down(act)
  const __nv_bfloat16* dy2 = sp_ ? sp_gather(d_resid_, "sp down_proj output grad") : d_resid_;
  cuda::matmul_bwd(mm, d_act_, g(o.down_proj), dy2, a.act, w(o.down_proj), n, F, C, /*accumulate_dinp=*/false,
                   grad_write(o.down_proj), s);
  adapt(LoraTarget::Down, a.act, dy2, C, d_act_);
  // d_gate|d_up in place over gate|up (dead after this), then one dX and one dW GEMM over the gate|up block.
  __nv_bfloat16* d_gate_up = a.gate_up;
  cuda::swiglu_bwd(d_gate_up, d_gate_up + F, d_act_, a.gate_up, a.gate_up + F, n, F, 2 * F, s);
  const __nv_bfloat16* x2 = sp_ ? sp_gather(a.norm2, "sp gate/up input") : a.norm2;
  cuda::matmul_bwd(mm, d_norm_, g(o.gate_proj), d_gate_up, x2, w(o.gate_proj), n, C, 2 * F,
                   /*accumulate_dinp=*/false, grad_write_block({o.gate_proj, o.up_proj}), s);
  adapt(LoraTarget::Gate, x2, d_gate_up, 2 * F, d_norm_);
  adapt(LoraTarget::Up, x2, d_gate_up + F, 2 * F, d_norm_);
  sp_reduce(d_norm_, dnorm, n, "tp gate/up input grad");  // column-parallel: each rank's part of the sum
  cuda::rmsnorm_bwd(d_resid_, gb ? norm_grad(g(o.post_norm), 0) : nullptr, dnorm, a.resid_mid, w(o.post_norm),
                    a.rstd2, norm_scratch_, nr, C, norm_write(post_norm_write), s);
  // Attention block: resid_mid = resid_in + o_proj(att)
  const __nv_bfloat16* dy1 = sp_ ? sp_gather(d_resid_, "sp o_proj output grad") : d_resid_;
  cuda::matmul_bwd(mm, d_att_, g(o.o_proj), dy1, a.att, w(o.o_proj), n, d.q_dim, C, /*accumulate_dinp=*/false,
                   grad_write(o.o_proj), s);
  adapt(LoraTarget::O, a.att, dy1, C, d_att_);
  cuda::attention_bwd(d_q_, d_k_, d_v_, d_att_, a.att, a.lse, a.q, a.k, a.v, attn_scratch_, batch, seq, d.heads,
                      d.kv_heads, D, attention_doc_start_, s, run_.attention);
  // RoPE's backward writes d_q, d_k into the rows of d_qkv (qkv_, free since the forward's copies), d_v is
  // copied in; then one dX and one dW GEMM over the q|k|v block.
  const int64_t qkv = d.q_dim + 2 * d.kv_dim;
  __nv_bfloat16* d_qkv = qkv_;
  cuda::rope_bwd(d_qkv, d_q_, rope_cos_, rope_sin_, batch, seq, d.heads, D, qkv, d.q_dim, rope_position_ids_, s);
  cuda::rope_bwd(d_qkv + d.q_dim, d_k_, rope_cos_, rope_sin_, batch, seq, d.kv_heads, D, qkv, d.kv_dim,
                 rope_position_ids_, s);
  copy_rows(d_qkv + d.q_dim + d.kv_dim, qkv, d_v_, d.kv_dim, n, d.kv_dim, s);
  const __nv_bfloat16* x1 = sp_ ? sp_gather(a.norm1, "sp q/k/v input") : a.norm1;
  cuda::matmul_bwd(mm, d_norm_, g(o.q_proj), d_qkv, x1, w(o.q_proj), n, C, qkv, /*accumulate_dinp=*/false,
                   grad_write_block({o.q_proj, o.k_proj, o.v_proj}), s);
  adapt(LoraTarget::Q, x1, d_qkv, qkv, d_norm_);
  adapt(LoraTarget::K, x1, d_qkv + d.q_dim, qkv, d_norm_);
  adapt(LoraTarget::V, x1, d_qkv + d.q_dim + d.kv_dim, qkv, d_norm_);
  sp_reduce(d_norm_, dnorm, n, "tp q/k/v input grad");
  cuda::rmsnorm_bwd(d_resid_, gb ? norm_grad(g(o.input_norm), 1) : nullptr, dnorm, a.resid_in, w(o.input_norm),
                    a.rstd1, norm_scratch_, nr, C, norm_write(input_norm_write), s);
  if (sp_ && gb)
    sp_add_norm_grads({{g(o.post_norm), post_norm_write}, {g(o.input_norm), input_norm_write}},
                      "sp norm weight grads");
}

LossSum LlamaGpu::forward_backward(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                                   const int32_t* positions) {
  TUNA_CHECK(run_.training, "forward_backward on a forward-only model (MemoryLayout::training)");
  TUNA_CHECK(layout_.whole(), "forward_backward of a pipeline stage: use forward_stage and backward_stage");
  // At least one row: the lm_head's dW is written by its row chunks (GradWrites).
  TUNA_CHECK(batch > 0 && seq > 0, "forward_backward of batch ", batch, " x seq ", seq);
  if (batch > max_batch_ || seq > max_seq_)
    fail("batch ", batch, " x seq ", seq, " exceeds the planned ", max_batch_, " x ", max_seq_);
  upload_tokens(inputs, targets, batch, seq, positions);
  forward(batch, seq, /*backward_follows=*/true);
  grad_writes_->begin_pass(*store_);
  LossSum loss = head(targets, batch * seq, /*want_grad=*/true, nullptr);
  backward(batch, seq);
  // Waited for only now: the device runs the backward queued behind the loss's copy meanwhile, and the caller
  // prepares the next micro-batch while that backward runs.
  loss.sum = queued_loss_sum();
  return loss;
}

LossSum LlamaGpu::forward_loss(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                               const int32_t* positions) {
  TUNA_CHECK(layout_.whole(), "forward_loss of a pipeline stage: use forward_stage");
  if (batch > max_batch_ || seq > max_seq_)
    fail("batch ", batch, " x seq ", seq, " exceeds the planned ", max_batch_, " x ", max_seq_);
  upload_tokens(inputs, targets, batch, seq, positions);
  forward(batch, seq, /*backward_follows=*/false);
  LossSum loss = head(targets, batch * seq, /*want_grad=*/false, nullptr);
  loss.sum = queued_loss_sum();
  return loss;
}

void LlamaGpu::select_slot(int64_t slot) {
  TUNA_CHECK(slot >= 0 && slot < in_flight_, "activation slot ", slot, " of ", in_flight_);
  slot_ = slot;
}

__nv_bfloat16* LlamaGpu::stage_input(int64_t slot) {
  TUNA_CHECK(!stage_.embedding && stage_.layers() > 0, "the first stage embeds its input");
  select_slot(slot);
  return acts(stage_.layer_begin).resid_in;
}

LossSum LlamaGpu::forward_stage(int64_t slot, const int32_t* inputs, const int32_t* targets, int64_t batch,
                                int64_t seq, const int32_t* positions, bool backward_follows) {
  TUNA_CHECK(!backward_follows || run_.training, "a backward on a forward-only model (MemoryLayout::training)");
  TUNA_CHECK(batch > 0 && seq > 0, "forward_stage of batch ", batch, " x seq ", seq);
  if (batch > max_batch_ || seq > max_seq_)
    fail("batch ", batch, " x seq ", seq, " exceeds the planned ", max_batch_, " x ", max_seq_);
  select_slot(slot);
  upload_tokens(inputs, targets, batch, seq, positions);
  forward(batch, seq, backward_follows);
  if (!stage_.head) return LossSum{};
  // The last stage's pass of a micro-batch starts with the head's weight gradient (its backward follows at once:
  // one slot there).
  if (backward_follows) grad_writes_->begin_pass(*store_);
  LossSum loss = head(targets, batch * seq, backward_follows, nullptr);
  loss.sum = queued_loss_sum();
  return loss;
}

void LlamaGpu::backward_stage(int64_t slot, const int32_t* inputs, int64_t batch, int64_t seq,
                              const int32_t* positions) {
  TUNA_CHECK(run_.training, "backward_stage on a forward-only model (MemoryLayout::training)");
  select_slot(slot);
  // Other micro-batches' forwards ran since this one's: its tokens (the embedding's backward) and document
  // boundaries again. The last stage's pass began with its forward's head.
  upload_tokens(inputs, nullptr, batch, seq, positions);
  if (sp_) {
    sp_chunk_ = (batch * seq + run_.tp - 1) / run_.tp;
    sp_rows_ = shard_range(batch * seq, static_cast<int>(run_.tp_rank), static_cast<int>(run_.tp));
  }
  if (!stage_.head) grad_writes_->begin_pass(*store_);
  backward(batch, seq);
}

void LlamaGpu::forward_logits(const int32_t* inputs, int64_t batch, int64_t seq, float* host_logits) {
  TUNA_CHECK(run_.tp == 1, "forward_logits returns whole-vocabulary logits: not with tensor parallelism");
  TUNA_CHECK(layout_.whole(), "forward_logits of a pipeline stage");
  if (batch > max_batch_ || seq > max_seq_)
    fail("batch ", batch, " x seq ", seq, " exceeds the planned ", max_batch_, " x ", max_seq_);
  upload_tokens(inputs, nullptr, batch, seq);
  forward(batch, seq, /*backward_follows=*/false);
  head(nullptr, batch * seq, /*want_grad=*/false, host_logits);
  TUNA_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

OptimizerStats LlamaGpu::adamw_step(double loss_scale, double lr, bool loss_is_finite) {
  TUNA_CHECK(t_.m != nullptr, "model built without optimizer state (forward only, or ZeRO-1's engine holds it)");
  const ParamLayout& trained = trained_layout();
  const int64_t P = trained.total();
  cudaStream_t s = stream_;
  zero_unwritten_grads();  // a step without a backward: its gradient is zero
  cuda::sum_of_squares(norm_total_, t_.grads, P, norm_scratch_f64_, s);
  TUNA_CUDA_CHECK(cudaMemcpyAsync(pinned_scalar_ + 1, norm_total_, sizeof(double), cudaMemcpyDeviceToHost, s));
  wait_for_stream("the backward, before the gradient norm is read");
  if (layout_.tied_copy() != nullptr)  // the last stage's copy of the tied table: the first stage counts it
    pinned_scalar_[1] -= copy_sum_of_squares(t_.grads, shard_pieces(trained, {Segment{0, P}}), norm_total_,
                                             norm_scratch_f64_, s);
  if (run_.tp > 1) {  // the tp ranks' squares summed, each replicated tensor (norm weights) counted once
    if (run_.tp_rank > 0)
      pinned_scalar_[1] -= replicated_sum_of_squares(t_.grads, shard_pieces(trained, {Segment{0, P}}),
                                                     replicated_norms_, norm_scratch_f64_, s);
    TUNA_CUDA_CHECK(cudaMemcpyAsync(norm_total_, pinned_scalar_ + 1, sizeof(double), cudaMemcpyHostToDevice, s));
    tp_->all_reduce(norm_total_, 1, CommType::F64, ReduceOp::Sum, "tp grad norm");
    TUNA_CUDA_CHECK(cudaMemcpyAsync(pinned_scalar_ + 1, norm_total_, sizeof(double), cudaMemcpyDeviceToHost, s));
    wait_for_stream("the gradient norm's all-reduce");
  }
  if (pp_ != nullptr && pp_->size() > 1) pp_->all_reduce_sum(pinned_scalar_ + 1, 1, "grad norm (pp)");
  OptimizerStats stats;
  stats.grad_norm = std::sqrt(pinned_scalar_[1]) * loss_scale;
  stats.clip_scale = clip_scale(opt_, stats.grad_norm);
  stats.applied = loss_is_finite && std::isfinite(stats.grad_norm);
  if (!stats.applied) return stats;  // decided on the host from the norm the step reads back anyway: no extra sync
  ++steps_taken_;
  cuda::AdamWArgs args{lr,
                       opt_.beta1,
                       opt_.beta2,
                       opt_.eps,
                       opt_.weight_decay,
                       steps_taken_,
                       loss_scale * stats.clip_scale,
                       options_.stochastic_rounding,
                       options_.seed};
  const cuda::AdamWSegments segments{segment_starts_, segment_decays_, n_segments_};
  if (run_.bf16_moments)
    cuda::adamw_update(t_.master, t_.weights, t_.grads, static_cast<__nv_bfloat16*>(t_.m),
                       static_cast<__nv_bfloat16*>(t_.v), P, segments, args, s);
  else
    cuda::adamw_update(t_.master, t_.weights, t_.grads, static_cast<float*>(t_.m), static_cast<float*>(t_.v), P,
                       segments, args, s);
  return stats;
}

double LlamaGpu::flops_per_token(int64_t seq) const {
  return lora_.enabled() ? lora_flops_per_token(config_, lora_, seq) : model_flops_per_token(config_, seq);
}

// ---- LoRA adapters: y += s B A dropout(x), s = alpha / r (model/llama.cpp's lora_fwd / lora_bwd, bf16 here) ----
//
// Tensor parallelism as there: a column-parallel target (q, k, v, gate, up) has A whole and B's rows of this rank,
// so u is whole and the output local; its backward's input gradient from this rank's dt joins the layer's all-reduce
// of the input gradient, and dA needs the whole dt (an all-reduce of [n, r]). A row-parallel target (o, down) sums
// u = A_local x_local over tp (an all-reduce of [n, r]) and adds its whole output after the layer's all-reduce; its
// backward is local. The adapters' bf16 copy is whole on this rank at every ZeRO stage (the engine gathers it after
// each update at ZeRO 1-2); their gradients go to the whole buffer, or at ZeRO-2 a layer at a time to the engine's
// store (take_adapter_grads).

const __nv_bfloat16* LlamaGpu::lora_a(int64_t l, LoraTarget t) const {
  return lora_params_ + lora_layout_.layers[l].a[static_cast<int>(t)];
}
const __nv_bfloat16* LlamaGpu::lora_b(int64_t l, LoraTarget t) const {
  return lora_params_ + lora_layout_.layers[l].b[static_cast<int>(t)];
}

const __nv_bfloat16* LlamaGpu::lora_input(int64_t l, LoraTarget t, const __nv_bfloat16* x, int64_t n) {
  if (!lora_train_) return x;
  const int i = static_cast<int>(t);
  const int64_t in = lora_shape(l, t)[1];
  cuda::lora_dropout(lora_in_, x, n, in, lora_global_in_[i], lora_col0_[i],
                     lora_dropout_stream(lora_dropout_key_, l, t), lora_.dropout, /*accumulate=*/false, stream_);
  return lora_in_;
}

void LlamaGpu::lora_fwd(int64_t l, LoraTarget t, const __nv_bfloat16* x, __nv_bfloat16* y, int64_t ld_y, int64_t n,
                        bool add_output) {
  const int i = static_cast<int>(t);
  const int64_t r = lora_.rank;
  const auto [out, in] = lora_shape(l, t);
  __nv_bfloat16* u = acts(l).lora_ax[i];
  cuda::MatmulContext& mm = *matmul_;
  cuda::matmul_fwd(mm, u, lora_input(l, t, x, n), lora_a(l, t), n, in, r, stream_);
  if (lora_target_row_parallel(t)) tp_all_reduce(u, n * r, "tp LoRA A x");  // over the split input
  cuda::scale_bf16(u, n * r, static_cast<float>(lora_.scale()), stream_);   // kept as s A x: dB = dy^T u
  if (!add_output) return;
  // With sp a row-parallel target's y (the reduce-scatter's output) holds this rank's rows only.
  if (sp_ && lora_target_row_parallel(t))
    return cuda::matmul_add_fwd(mm, y, ld_y, u + sp_rows_.begin * r, lora_b(l, t), sp_rows_.size(), r, out, stream_);
  cuda::matmul_add_fwd(mm, y, ld_y, u, lora_b(l, t), n, r, out, stream_);
}

void LlamaGpu::lora_bwd(int64_t l, LoraTarget t, const __nv_bfloat16* x, const __nv_bfloat16* dy, int64_t ld_dy,
                        __nv_bfloat16* dx, int64_t n) {
  const int i = static_cast<int>(t);
  const int64_t r = lora_.rank;
  const auto [out, in] = lora_shape(l, t);
  const LoraOffsets& o = lora_layout_.layers[l];
  float* dA = lora_grad_unit_ + (o.a[i] - lora_grad_begin_);
  float* dB = lora_grad_unit_ + (o.b[i] - lora_grad_begin_);
  const __nv_bfloat16* A = lora_a(l, t);
  cuda::MatmulContext& mm = *matmul_;
  cudaStream_t s = stream_;
  __nv_bfloat16* dt = lora_dt_;
  // dB += dy^T u and dt = dy B in one call; then dt = s dy B, the gradient of A x.
  cuda::matmul_bwd_strided(mm, dt, dB, dy, ld_dy, acts(l).lora_ax[i], lora_b(l, t), n, r, out,
                           /*accumulate_dinp=*/false, GradWrite::Accumulate, s);
  cuda::scale_bf16(dt, n * r, static_cast<float>(lora_.scale()), s);
  // The input gradient from this rank's dt: straight into dx, or with dropout through the mask from lora_in_.
  if (lora_train_) {
    cuda::matmul_bwd(mm, lora_in_, nullptr, dt, x, A, n, in, r, /*accumulate_dinp=*/false, GradWrite::Accumulate, s);
    cuda::lora_dropout(dx, lora_in_, n, in, lora_global_in_[i], lora_col0_[i],
                       lora_dropout_stream(lora_dropout_key_, l, t), lora_.dropout, /*accumulate=*/true, s);
  } else {
    cuda::matmul_bwd(mm, dx, nullptr, dt, x, A, n, in, r, /*accumulate_dinp=*/true, GradWrite::Accumulate, s);
  }
  if (!lora_target_row_parallel(t)) tp_all_reduce(dt, n * r, "tp LoRA dt");  // dA needs the whole dt
  // dA += dt^T dropout(x), the forward's mask drawn again (a pure function of the key).
  cuda::matmul_bwd(mm, nullptr, dA, dt, lora_input(l, t, x, n), A, n, in, r, /*accumulate_dinp=*/false,
                   GradWrite::Accumulate, s);
}

std::array<int64_t, 2> LlamaGpu::lora_shape(int64_t l, LoraTarget t) const {
  const TpDims& d = layout_.tp();
  const int64_t C = config_.hidden_size;
  switch (t) {
    case LoraTarget::Q: return {d.q_dim, C};
    case LoraTarget::K:
    case LoraTarget::V: return {d.kv_dim, C};
    case LoraTarget::O: return {C, d.q_dim};
    case LoraTarget::Gate:
    case LoraTarget::Up: return {d.ffn, C};
    case LoraTarget::Down: return {C, d.ffn};
  }
  return {0, 0};
}

double gpu_peak_bf16_flops(int device) {
  if (const char* env = std::getenv("TUNA_PEAK_TFLOPS")) return std::atof(env) * 1e12;
  cudaDeviceProp prop{};
  TUNA_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  const double sms = prop.multiProcessorCount;
  if (prop.major == 9) return 989.4e12 * sms / 132.0;  // H100/H200 SXM dense bf16
  if (prop.major == 8 && prop.minor == 0) return 312e12 * sms / 108.0;  // A100
  int clock_khz = 0;
  TUNA_CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device));
  return sms * 1024.0 * clock_khz * 1e3;  // 512 bf16 MACs per SM per clock (sm_86/89 class)
}

GpuMemory gpu_memory(int device) {
  int previous = 0;
  TUNA_CUDA_CHECK(cudaGetDevice(&previous));
  TUNA_CUDA_CHECK(cudaSetDevice(device));
  size_t free_bytes = 0, total_bytes = 0;
  TUNA_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  TUNA_CUDA_CHECK(cudaSetDevice(previous));
  return {static_cast<int64_t>(total_bytes - free_bytes), static_cast<int64_t>(total_bytes)};
}

int64_t replicated_piece_count(const std::vector<ShardPiece>& pieces) {
  int64_t count = 0;
  for (const ShardPiece& p : pieces) count += p.tensor->split_dim < 0;
  return count;
}

double replicated_sum_of_squares(const float* grad, const std::vector<ShardPiece>& pieces, double* parts,
                                 double* scratch, cudaStream_t stream) {
  int64_t count = 0;
  for (const ShardPiece& p : pieces)
    if (p.tensor->split_dim < 0) cuda::sum_of_squares(parts + count++, grad + p.shard_offset, p.size, scratch, stream);
  std::vector<double> host(count);
  if (count > 0)
    TUNA_CUDA_CHECK(cudaMemcpyAsync(host.data(), parts, count * sizeof(double), cudaMemcpyDeviceToHost, stream));
  TUNA_CUDA_CHECK(cudaStreamSynchronize(stream));
  double sum = 0;
  for (double x : host) sum += x;
  return sum;
}

double copy_sum_of_squares(const float* grad, const std::vector<ShardPiece>& pieces, double* part, double* scratch,
                           cudaStream_t stream) {
  double sum = 0;
  for (const ShardPiece& p : pieces) {
    if (!p.tensor->copy) continue;
    double host = 0;
    cuda::sum_of_squares(part, grad + p.shard_offset, p.size, scratch, stream);
    TUNA_CUDA_CHECK(cudaMemcpyAsync(&host, part, sizeof(double), cudaMemcpyDeviceToHost, stream));
    TUNA_CUDA_CHECK(cudaStreamSynchronize(stream));
    sum += host;
  }
  return sum;
}

AdamWTable adamw_table(const ParamLayout& layout, const std::vector<Segment>& segments) {
  AdamWTable table;
  for (const ShardPiece& piece : shard_pieces(layout, segments))
    table.starts.push_back(piece.shard_offset), table.decays.push_back(piece.tensor->decays ? 1 : 0);
  if (table.starts.empty()) table.starts.push_back(0), table.decays.push_back(0);  // an empty shard
  return table;
}

// NVML's C ABI, the few calls used (nvml.h is not part of the CUDA toolkit here): every call returns 0 on
// success; a device handle is an opaque pointer; utilization is two unsigned percentages.
namespace {
struct NvmlUtilization {
  unsigned int gpu, memory;
};
struct Nvml {
  int (*init)() = nullptr;
  int (*handle_by_pci_bus_id)(const char*, void**) = nullptr;
  int (*utilization_rates)(void*, NvmlUtilization*) = nullptr;
  bool ready = false;
  std::map<int, void*> handles;  // CUDA device index -> NVML handle (matched by PCI bus id, so that
                                 // CUDA_VISIBLE_DEVICES renumbering does not pick the wrong card)
};

Nvml& nvml() {
  static Nvml n = [] {
    Nvml x;
    void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) return x;
    x.init = reinterpret_cast<int (*)()>(dlsym(lib, "nvmlInit_v2"));
    x.handle_by_pci_bus_id = reinterpret_cast<int (*)(const char*, void**)>(dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2"));
    x.utilization_rates = reinterpret_cast<int (*)(void*, NvmlUtilization*)>(dlsym(lib, "nvmlDeviceGetUtilizationRates"));
    x.ready = x.init && x.handle_by_pci_bus_id && x.utilization_rates && x.init() == 0;
    return x;
  }();
  return n;
}
}  // namespace

double gpu_utilization_percent(int device) {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  Nvml& n = nvml();
  if (!n.ready) return NAN;
  auto it = n.handles.find(device);
  if (it == n.handles.end()) {
    char bus_id[32] = {};
    void* handle = nullptr;
    if (cudaDeviceGetPCIBusId(bus_id, sizeof bus_id, device) != cudaSuccess ||
        n.handle_by_pci_bus_id(bus_id, &handle) != 0)
      handle = nullptr;
    it = n.handles.emplace(device, handle).first;
  }
  NvmlUtilization u{};
  if (it->second == nullptr || n.utilization_rates(it->second, &u) != 0) return NAN;
  return u.gpu;
}

}  // namespace tuna

#endif  // TUNA_CUDA
