// LlamaGpu (model/llama_gpu.h): its construction (the buffers from the memory plan), its weights in and out, and its
// own AdamW step (ZeRO-0). The passes are model/llama_gpu_forward.cpp and model/llama_gpu_backward.cpp, the quantized
// base model/llama_gpu_quantized.cpp, the adapters model/llama_gpu_lora.cpp.
#if TUNA_CUDA

#include "model/llama_gpu.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "core/cuda_check.h"
#include "core/dtype.h"
#include "core/error.h"
#include "comm/comm.h"
#include "kernels/adamw.cuh"
#include "kernels/attention.cuh"
#include "kernels/cpu/rope.h"
#include "kernels/init.cuh"
#include "kernels/cpu/nf4.h"
#include "kernels/rmsnorm.cuh"
#include "model/llama_gpu_grad_writes.h"

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

void LlamaGpu::set_tp_comm(Comm* tp) {
  TUNA_CHECK(tp != nullptr && tp->size() == run_.tp && tp->rank() == run_.tp_rank, "tp comm of ",
             tp ? tp->size() : 0, " ranks for a model of tp ", run_.tp);
  tp_ = tp;
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
  constexpr int64_t kMatmulWorkspace = int64_t(32) << 20;
  matmul_ = std::make_unique<cuda::MatmulContext>(arena.take<char>("cuBLASLt workspace", kMatmulWorkspace),
                                                  static_cast<size_t>(kMatmulWorkspace));
  if (run_.zero == 0) arena.check_all_taken();  // ZeRO 1-3: the engine takes the shard's buffers, then checks
  if (quantized) {
    own_store_ = make_quantized_base();
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
  TUNA_CUDA_CHECK(cudaDeviceSynchronize());
}

LlamaGpu::~LlamaGpu() {
  matmul_.reset();
  if (pinned_ids_) cudaFreeHost(pinned_ids_);
  if (pinned_scalar_) cudaFreeHost(pinned_scalar_);
  if (loss_copied_) cudaEventDestroy(loss_copied_);
  if (tokens_uploaded_) cudaEventDestroy(tokens_uploaded_);
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

OptimizerStats LlamaGpu::adamw_step(double loss_scale, double lr, bool loss_is_finite) {
  TUNA_CHECK(t_.m != nullptr, "model built without optimizer state (forward only, or ZeRO-1's engine holds it)");
  const ParamLayout& trained = trained_layout();
  const int64_t P = trained.total();
  cudaStream_t s = stream_;
  zero_unwritten_grads();  // a step without a backward: its gradient is zero
  cuda::sum_of_squares(norm_total_, t_.grads, P, norm_scratch_f64_, s);
  TUNA_CUDA_CHECK(cudaMemcpyAsync(pinned_scalar_ + 1, norm_total_, sizeof(double), cudaMemcpyDeviceToHost, s));
  TUNA_CUDA_CHECK(cudaStreamSynchronize(s));
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
    TUNA_CUDA_CHECK(cudaStreamSynchronize(s));
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

}  // namespace tuna

#endif  // TUNA_CUDA
