// LlamaGpu (model/llama_gpu.h): its construction (its buffers from the memory plan's table), its weights in and out,
// and its own AdamW step (ZeRO-0). The passes are model/llama_gpu_forward.cpp and model/llama_gpu_backward.cpp, the
// quantized base model/llama_gpu_quantized.cpp, the adapters model/llama_gpu_lora.cpp.
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
#include "kernels/rmsnorm.cuh"
#include "model/gpu_buffers.h"
#include "model/llama_gpu_grad_writes.h"
#include "model/support.h"  // place_layout, require_support

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
// With pipeline stages, the adapters of the stage's layers only (global names and random streams, model/lora.h).
LoraLayout adapters_of(const LlamaConfig& config, const MemoryLayout& run) {
  if (!run.lora.enabled()) return LoraLayout{ParamLayout(TpDims{}, {}, {}), {}};
  return lora_layout(config, run.lora, static_cast<int>(run.tp_rank), static_cast<int>(run.tp),
                     run.pp > 1 ? &run.stage() : nullptr);
}

ParamLayout layout_of(const LlamaConfig& config, const MemoryLayout& run) {
  const int tp_rank = static_cast<int>(run.tp_rank), tp = static_cast<int>(run.tp);
  return run.pp > 1 ? ParamLayout(config, tp_rank, tp, run.stage()) : ParamLayout(config, tp_rank, tp);
}

// The model shapes the CUDA kernels do not take, refused before anything is allocated (what the engine runs of the
// layout is the support table's, model/support.h).
void refuse_unsupported_shapes(const LlamaConfig& c) {
  if (c.head_dim != 64 && c.head_dim != 128 && c.head_dim != 8 && c.head_dim != 16 && c.head_dim != 32)
    fail("--device cuda: attention supports head_dim 64 and 128 (and 8, 16, 32 for tiny models); this model has ",
         c.head_dim);
  if (c.hidden_size % 8 != 0 || c.intermediate_size % 8 != 0)
    fail("--device cuda: hidden_size and intermediate_size must be multiples of 8 (found ", c.hidden_size, ", ",
         c.intermediate_size, ")");
}
}  // namespace

LlamaGpu::LlamaGpu(const LlamaConfig& config, const MemoryLayout& run, const OptimizerConfig& optimizer,
                   const GpuOptions& options)
    : config_(config), run_(place_layout(config, run)), layout_(layout_of(config, run_)), opt_(optimizer),
      options_(options), max_batch_(run.micro_batch), max_seq_(run.seq_len), lora_(run.lora),
      lora_layout_(adapters_of(config, run_)) {
  TUNA_CHECK(max_batch_ > 0 && max_seq_ > 0, "batch ", max_batch_, " seq ", max_seq_);
  validate(opt_);
  require_support(config_, run_, Device::Cuda);  // what the CUDA engine runs (model/support.h)
  refuse_unsupported_shapes(config_);
  stage_ = run_.stage();
  in_flight_ = run_.in_flight();
  sp_ = run.sp;
  fp8_ = run_.fp8 == Fp8Mode::Tensorwise && run_.training;  // a training option (model/support.cpp)
  require_fused_weight_blocks(layout_, config_.hidden_size);  // and their gradients: one block each
  TUNA_CUDA_CHECK(cudaSetDevice(options_.device));
  TUNA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  head_chunk_rows_ = gpu_head_chunk_rows(layout_.tp().vocab, max_batch_ * max_seq_);
  n_segments_ = static_cast<int>(trained_layout().tensors().size());

  // Every buffer from the one table the memory plan is made of (model/gpu_buffers.h), each pointed at its row.
  const GpuBufferTable table = plan_gpu_buffers(config_, run_);
  arena_ = std::make_unique<DeviceArena>(table.plan);
  acts_.resize(in_flight_ * stage_.layers());
  for (size_t i = 0; i < table.rows.size(); i++)
    if (table.rows[i].buffer != GpuBuffer::Engine) point(table.rows[i], arena_->take(table.plan.items[i]));
  t_ = lora_.enabled() ? Trained{lora_master_, lora_grads_, lora_params_, m_, v_}
                       : Trained{master_, grads_, params_, m_, v_};
  const bool quantized = lora_.enabled() && run_.lora.base_quant != BaseQuant::None;
  if (quantized) lay_out_quantized_base();
  if (lora_.enabled()) set_up_adapters();
  set_up_fp8();
  if (run_.zero == 0) arena_->check_all_taken();  // ZeRO 1-3: the engine takes the shard's buffers, then checks
  const bool frozen_sharded = lora_.enabled() && run_.training && run_.zero == 3;  // the engine's store gathers it
  if (quantized) {
    own_store_ = make_quantized_base();
    store_ = own_store_.get();
  } else if (lora_.enabled() ? !frozen_sharded : run_.zero <= 1 || !run_.training) {  // a frozen bf16 base is whole
    own_store_ = std::make_unique<OwnWeights>(*this);                                  // at ZeRO 0-2
    store_ = own_store_.get();
  }
  grad_writes_ = std::make_unique<GradWrites>(layout_);
  const int64_t n = max_batch_ * max_seq_;
  TUNA_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&pinned_ids_), static_cast<size_t>(7 * n + 1) * sizeof(int32_t)));
  TUNA_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&pinned_scalar_), 2 * sizeof(double)));
  TUNA_CUDA_CHECK(cudaEventCreateWithFlags(&loss_copied_, cudaEventDisableTiming));
  TUNA_CUDA_CHECK(cudaEventCreateWithFlags(&tokens_uploaded_, cudaEventDisableTiming));
  TUNA_CUDA_CHECK(cudaEventCreateWithFlags(&stream_done_, cudaEventDisableTiming));
  fill_tables();
}

void LlamaGpu::point(const GpuBufferRow& row, void* p) {
  using bf16 = __nv_bfloat16;
  const auto set = [p]<typename T>(T*& member) { member = static_cast<T*>(p); };
  switch (row.buffer) {
    case GpuBuffer::Engine: return;
    case GpuBuffer::Master: return set(master_);
    case GpuBuffer::Weights: return set(params_);
    case GpuBuffer::Gradients: return set(grads_);
    case GpuBuffer::MomentM: return set(m_);
    case GpuBuffer::MomentV: return set(v_);
    case GpuBuffer::SegmentStarts:
      TUNA_CHECK(row.elements >= n_segments_, "AdamW segment table of ", row.elements, " entries for ", n_segments_,
                 " tensors");
      return set(segment_starts_);
    case GpuBuffer::SegmentDecays: return set(segment_decays_);
    case GpuBuffer::NormScratch: return set(norm_scratch_f64_);
    case GpuBuffer::NormTotal: return set(norm_total_);
    case GpuBuffer::ReplicatedNorms: return set(replicated_norms_);
    case GpuBuffer::Nf4Base:
      nf4_bytes_ = row.elements * row.element_bytes;
      return set(nf4_state_);
    case GpuBuffer::PlainBase:
      plain_bytes_ = row.elements * row.element_bytes;
      return set(plain_);
    case GpuBuffer::Dequant: return set(dequant_);
    case GpuBuffer::LoraWeights: return set(lora_params_);
    case GpuBuffer::LoraMaster: return set(lora_master_);
    case GpuBuffer::LoraGradients: return set(lora_grads_);
    case GpuBuffer::RopeCos: return set(rope_cos_);
    case GpuBuffer::RopeSin: return set(rope_sin_);
    case GpuBuffer::Activation: return point_activation(row, static_cast<bf16*>(p));
    case GpuBuffer::LoraDropoutInput: return set(lora_in_);
    case GpuBuffer::LoraDt: return set(lora_dt_);
    case GpuBuffer::Qkv: return set(qkv_);
    case GpuBuffer::Gathered: return set(gathered_);
    case GpuBuffer::ResidOut: return set(resid_out_);
    case GpuBuffer::FinalNorm: return set(final_norm_out_);
    case GpuBuffer::FinalRstd: return set(final_rstd_);
    case GpuBuffer::LogitsChunk: return set(logits_chunk_);
    case GpuBuffer::Losses: return set(losses_);
    case GpuBuffer::ClassifierStats: return set(ce_stats_);
    case GpuBuffer::ClassifierMax: return set(ce_max_);
    case GpuBuffer::DResid: return set(d_resid_);
    case GpuBuffer::DNorm: return set(d_norm_);
    case GpuBuffer::DFinalNorm: return set(d_final_norm_);
    case GpuBuffer::DQ: return set(d_q_);
    case GpuBuffer::DAtt: return set(d_att_);
    case GpuBuffer::DK: return set(d_k_);
    case GpuBuffer::DV: return set(d_v_);
    case GpuBuffer::DAct: return set(d_act_);
    case GpuBuffer::RmsnormScratch: return set(norm_scratch_);
    case GpuBuffer::SpNormGrads: return set(sp_norm_grads_);
    case GpuBuffer::AttentionScratch: return set(attn_scratch_);
    case GpuBuffer::TiedPeerGrad: return set(tied_peer_grad_);
    case GpuBuffer::LossTotal: return set(loss_total_);
    case GpuBuffer::Tokens: return set(tokens_);
    case GpuBuffer::Targets: return set(targets_);
    case GpuBuffer::GroupPositions: return set(group_positions_);
    case GpuBuffer::GroupTokens: return set(group_unique_);
    case GpuBuffer::GroupOffsets: return set(group_offsets_);
    case GpuBuffer::DocStarts: return set(doc_start_);
    case GpuBuffer::RopePositions: return set(rope_positions_);
    case GpuBuffer::AttentionTileCounter: return set(attention_tile_counter_);
    case GpuBuffer::Fp8WeightCodes: return set(fp8_codes_);
    case GpuBuffer::Fp8WeightCodesT: return set(fp8_codes_t_);
    case GpuBuffer::Fp8WeightScales: return set(fp8_scales_);
    case GpuBuffer::Fp8ActivationAmax:
      TUNA_CHECK(row.elements == static_cast<int64_t>(acts_.size()) * kFp8Groups, "FP8 activation amaxes: ",
                 row.elements, " for ", acts_.size(), " layer slots");
      for (size_t i = 0; i < acts_.size(); i++) acts_[i].fp8_amax = static_cast<float*>(p) + i * kFp8Groups;
      return;
    case GpuBuffer::Fp8InputCodes: return set(fp8_scratch_.x);
    case GpuBuffer::Fp8GradCodes: return set(fp8_scratch_.dy);
    case GpuBuffer::Fp8GradCodesT: return set(fp8_scratch_.dy_t);
    case GpuBuffer::Fp8OperandScales: return set(fp8_scratch_.inv);
    case GpuBuffer::Fp8GradAmax: return set(fp8_grad_amax_);
    case GpuBuffer::MatmulWorkspace:
      matmul_ = std::make_unique<cuda::MatmulContext>(p, static_cast<size_t>(row.elements * row.element_bytes));
      return;
  }
  fail("device buffer of unknown kind ", static_cast<int>(row.buffer));
}

// A layer activation's row: one slot's layer, or the working copy every slot and layer share. The rstd and lse fields
// are fp32, the rest bf16.
void LlamaGpu::point_activation(const GpuBufferRow& row, __nv_bfloat16* p) {
  const auto set = [&](LayerActs& a) {
    float* f = reinterpret_cast<float*>(p);
    switch (row.field) {
      case GpuActivation::ResidIn: a.resid_in = p; return;
      case GpuActivation::Norm1: a.norm1 = p; return;
      case GpuActivation::Rstd1: a.rstd1 = f; return;
      case GpuActivation::Q: a.q = p; return;
      case GpuActivation::K: a.k = p; return;
      case GpuActivation::V: a.v = p; return;
      case GpuActivation::Att: a.att = p; return;
      case GpuActivation::Lse: a.lse = f; return;
      case GpuActivation::ResidMid: a.resid_mid = p; return;
      case GpuActivation::Norm2: a.norm2 = p; return;
      case GpuActivation::Rstd2: a.rstd2 = f; return;
      case GpuActivation::GateUp: a.gate_up = p; return;
      case GpuActivation::Act: a.act = p; return;
      case GpuActivation::LoraAx: a.lora_ax.at(static_cast<size_t>(row.target)) = p; return;
    }
  };
  if (row.layer < 0) {
    for (LayerActs& a : acts_) set(a);
    return;
  }
  TUNA_CHECK(row.slot < in_flight_ && row.layer >= stage_.layer_begin && row.layer < stage_.layer_end,
             "activation row of slot ", row.slot, ", layer ", row.layer, " outside the stage");
  set(acts_[row.slot * stage_.layers() + (row.layer - stage_.layer_begin)]);
}

// FP8: each cast slot's four group casts (a slot per stage layer, or at ZeRO-3 one: fp8_cast_layers) carved out of
// the plan's codes (the groups' [rows, in] and [in, rows] codes in turn, slot after slot, as
// model/memory_plan_gpu.cpp sizes them) and scales (an amax and an inverse scale
// per group, kFp8ScaleStride floats apart: 16-byte aligned, as cuBLASLt's FP8 GEMMs need).
void LlamaGpu::set_up_fp8() {
  if (!fp8_) return;
  TUNA_CHECK(fp8_codes_ != nullptr &&
                 fp8_scales_ != nullptr && fp8_scratch_.x != nullptr && fp8_scratch_.inv != nullptr,
             "--fp8 on the CUDA model: a layout model/support.cpp refuses, or its buffers not planned");
  TUNA_CHECK(fp8_scratch_.dy && fp8_scratch_.dy_t && fp8_grad_amax_, "FP8 backward buffers not planned");
  const TpDims& d = layout_.tp();
  const int64_t C = config_.hidden_size;
  const std::array<std::array<int64_t, 2>, kFp8Groups> shapes = {  // [rows, in], Fp8Group order
      {{d.q_dim + 2 * d.kv_dim, C}, {C, d.q_dim}, {2 * d.ffn, C}, {C, d.ffn}}};
  const int64_t L = fp8_cast_layers(run_);
  fp8_w_.resize(L * kFp8Groups);
  fp8_cast_.assign(L, -1);
  uint8_t* codes = fp8_codes_;
  float* scales = fp8_scales_;
  const bool forward_codes = run_.fp8_forward_codes;
  TUNA_CHECK(!forward_codes || fp8_codes_t_ != nullptr, "--fp8_weight_codes forward: the transposed codes not planned");
  for (int64_t l = 0; l < L; l++)
    for (int g = 0; g < kFp8Groups; g++) {
      Fp8GpuWeight& w = fp8_w_[l * kFp8Groups + g];
      w.rows = shapes[g][0], w.in = shapes[g][1];
      w.codes = codes, w.codes_t = forward_codes ? fp8_codes_t_ : codes + w.rows * w.in;
      w.codes_t_at_use = forward_codes;
      codes += (forward_codes ? 1 : 2) * w.rows * w.in;
      w.amax = scales, w.inv_scale = scales + kFp8ScaleStride;
      scales += 2 * kFp8ScaleStride;
    }
}

void LlamaGpu::weights_changed() { std::fill(fp8_cast_.begin(), fp8_cast_.end(), -1); }

void LlamaGpu::trained_weights_written() {
  if (!lora_.enabled()) weights_changed();  // with adapters they are the adapters': the base's casts stay
}

std::vector<float> LlamaGpu::fp8_amaxes() {
  if (!fp8_) return {};
  TUNA_CUDA_CHECK(cudaStreamSynchronize(stream_));
  std::vector<float> out;
  const auto take = [&](const float* device) {
    float v = 0;
    TUNA_CUDA_CHECK(cudaMemcpy(&v, device, sizeof(float), cudaMemcpyDeviceToHost));
    out.push_back(v);
  };
  for (const Fp8GpuWeight& w : fp8_w_) take(w.amax);
  for (int64_t l = stage_.layer_begin; l < stage_.layer_end; l++)
    for (int g = 0; g < kFp8Groups; g++) take(acts(l).fp8_amax + g);
  // down_proj's is left out: the last it holds is the fold of the stage's first input norm backward, for a layer
  // below that this stage does not have (a stage before folds its own: LlamaGpu::backward).
  for (Fp8Group g : {Fp8Group::Qkv, Fp8Group::O, Fp8Group::GateUp}) take(fp8_grad_amax_ + static_cast<int>(g));
  return out;
}

// What the device holds from the start: the fused AdamW's segment table over the whole layout (one segment per
// tensor, in offset order), the RoPE tables, and zeros for the weights and the optimizer state (a step before
// set_params trains from zero weights, not from garbage). Activations are written before they are read, and stay
// poisoned where the emulator poisons fresh memory, as does the gradient until the first backward overwrites it
// (zero_grads).
void LlamaGpu::fill_tables() {
  const ParamLayout& trained = trained_layout();
  const int64_t Pt = trained.total(), P = layout_.total();
  if (segment_starts_ != nullptr) {
    const AdamWTable table = adamw_table(trained, {Segment{0, Pt}});
    TUNA_CUDA_CHECK(cudaMemcpy(segment_starts_, table.starts.data(), table.starts.size() * sizeof(int64_t),
                               cudaMemcpyHostToDevice));
    TUNA_CUDA_CHECK(cudaMemcpy(segment_decays_, table.decays.data(), table.decays.size(), cudaMemcpyHostToDevice));
  }
  // RoPE tables from the CPU twin's function (double math, the rope scaling, yarn's attention factor, dynamic's
  // frequencies for a forward of max_seq positions), so both backends agree exactly.
  const LlamaConfig& c = config_;
  std::vector<float> cos_table(max_seq_ * c.head_dim / 2), sin_table(max_seq_ * c.head_dim / 2);
  cpu::rope_tables(cos_table.data(), sin_table.data(), 0, max_seq_, c.head_dim, c.rope_theta, c.rope_scaling, max_seq_);
  TUNA_CUDA_CHECK(cudaMemcpy(rope_cos_, cos_table.data(), cos_table.size() * sizeof(float), cudaMemcpyHostToDevice));
  TUNA_CUDA_CHECK(cudaMemcpy(rope_sin_, sin_table.data(), sin_table.size() * sizeof(float), cudaMemcpyHostToDevice));

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
  weights_changed();
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
  weights_changed();
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
  trained_weights_written();
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
  weights_changed();
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
  trained_weights_written();  // the update below rewrites their bf16 copy
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
