// LlamaGpu's backward pass (model/llama_gpu.h), the forward's (model/llama_gpu_forward.cpp) in reverse: the head's
// final norm, then each layer from the top (recomputing what the recompute mode dropped), then the embedding; each
// weight gradient written or added as GradWrites decides (model/llama_gpu_grad_writes.h).
#if TUNA_CUDA

#include "comm/comm.h"
#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/adamw.cuh"  // accumulate
#include "kernels/attention.cuh"
#include "kernels/fp8.cuh"  // fp8_amax
#include "kernels/rmsnorm.cuh"
#include "kernels/rope.cuh"
#include "kernels/swiglu.cuh"
#include "model/llama_gpu.h"
#include "model/llama_gpu_grad_writes.h"

namespace tuna {
namespace {

// The backward's norm and SwiGLU, each folding its input gradient's amax into *amax when one is given (--fp8: that
// gradient is the FP8 GEMM group's output gradient below it), the plain kernel otherwise.
void norm_bwd(__nv_bfloat16* dinp, float* dweight, const __nv_bfloat16* dout, const __nv_bfloat16* inp,
              const __nv_bfloat16* weight, const float* rstd, float* scratch, int64_t n, int64_t dim, GradWrite write,
              float* amax, cudaStream_t s) {
  if (amax != nullptr) cuda::rmsnorm_bwd_amax(dinp, dweight, dout, inp, weight, rstd, scratch, n, dim, write, amax, s);
  else cuda::rmsnorm_bwd(dinp, dweight, dout, inp, weight, rstd, scratch, n, dim, write, s);
}
void swiglu_backward(__nv_bfloat16* dgate, __nv_bfloat16* dup, const __nv_bfloat16* dout, const __nv_bfloat16* gate,
                     const __nv_bfloat16* up, int64_t rows, int64_t cols, int64_t stride, float* amax, cudaStream_t s) {
  if (amax != nullptr) cuda::swiglu_bwd_amax(dgate, dup, dout, gate, up, rows, cols, stride, amax, s);
  else cuda::swiglu_bwd(dgate, dup, dout, gate, up, rows, cols, stride, s);
}

}  // namespace

float* LlamaGpu::fp8_grad_amax(Fp8Group g) {
  if (!fp8_) return nullptr;
  float* amax = fp8_grad_amax_ + static_cast<int>(g);
  TUNA_CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float), stream_));
  return amax;
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
  // --fp8 at a stage before the last: its top layer's down_proj output gradient came from the next stage, where no
  // kernel of this one folded its amax: a pass of its own over this rank's rows.
  if (fp8_ && !stage_.head) cuda::fp8_amax(fp8_grad_amax(Fp8Group::Down), d_resid_, nr, C, C, s);
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
    // The residual gradient: the top layer's down_proj output gradient (--fp8: its amax folded here).
    norm_bwd(d_resid_, frozen ? nullptr : norm_grad(g_head_unit + norm, 0), sp_ ? d_norm_ : d_final_norm_, resid_out_,
             head_base_ + norm, final_rstd_, norm_scratch_, nr, C, sp_ ? GradWrite::Overwrite : write,
             fp8_grad_amax(Fp8Group::Down), s);
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
  // FP8: each group's three GEMMs through fp8_linear_bwd, with the input's amax the forward kept (over tp) and the
  // output gradient's folded into the kernel that wrote it, from zero (the residual gradient's, down_proj's and
  // o_proj's, by the norm backward above it), then taken over tp where the gradient is split there.
  const Fp8GpuWeight* w8 = fp8_ ? fp8_weights(l, wb) : nullptr;
  const auto fp8_bwd = [&](Fp8Group group, __nv_bfloat16* dx, int64_t weight, GradWrite write,
                           const __nv_bfloat16* dy, const __nv_bfloat16* x) {
    const int i = static_cast<int>(group);
    fp8_amax_over_tp(fp8_grad_amax_ + i, group, /*output_gradient=*/true);
    fp8_cast_weight_transposed(w8[i], w(weight), s);  // --fp8_weight_codes forward: cast for this use
    fp8_linear_bwd(mm, dx, g(weight), dy, fp8_grad_amax_ + i, x, a.fp8_amax + i, w8[i], n, /*accumulate_dx=*/false,
                   write, fp8_scratch_, s);
  };
  const GradWrite post_norm_write = grad_write(o.post_norm), input_norm_write = grad_write(o.input_norm);
  const auto norm_write = [&](GradWrite w) { return sp_ ? GradWrite::Overwrite : w; };
  // MLP block: x_out = resid_mid + down(act)
  const __nv_bfloat16* dy2 = sp_ ? sp_gather(d_resid_, "sp down_proj output grad") : d_resid_;
  if (fp8_)
    fp8_bwd(Fp8Group::Down, d_act_, o.down_proj, grad_write(o.down_proj), dy2, a.act);
  else
    cuda::matmul_bwd(mm, d_act_, g(o.down_proj), dy2, a.act, w(o.down_proj), n, F, C, /*accumulate_dinp=*/false,
                     grad_write(o.down_proj), s);
  adapt(LoraTarget::Down, a.act, dy2, C, d_act_);
  // d_gate|d_up in place over gate|up (dead after this), then one dX and one dW GEMM over the gate|up block.
  __nv_bfloat16* d_gate_up = a.gate_up;
  swiglu_backward(d_gate_up, d_gate_up + F, d_act_, a.gate_up, a.gate_up + F, n, F, 2 * F,
                  fp8_grad_amax(Fp8Group::GateUp), s);
  const __nv_bfloat16* x2 = sp_ ? sp_gather(a.norm2, "sp gate/up input") : a.norm2;
  if (fp8_)
    fp8_bwd(Fp8Group::GateUp, d_norm_, o.gate_proj, grad_write_block({o.gate_proj, o.up_proj}), d_gate_up, x2);
  else
    cuda::matmul_bwd(mm, d_norm_, g(o.gate_proj), d_gate_up, x2, w(o.gate_proj), n, C, 2 * F,
                     /*accumulate_dinp=*/false, grad_write_block({o.gate_proj, o.up_proj}), s);
  adapt(LoraTarget::Gate, x2, d_gate_up, 2 * F, d_norm_);
  adapt(LoraTarget::Up, x2, d_gate_up + F, 2 * F, d_norm_);
  sp_reduce(d_norm_, dnorm, n, "tp gate/up input grad");  // column-parallel: each rank's part of the sum
  // The residual gradient: o_proj's output gradient (--fp8: its amax folded here).
  norm_bwd(d_resid_, gb ? norm_grad(g(o.post_norm), 0) : nullptr, dnorm, a.resid_mid, w(o.post_norm), a.rstd2,
           norm_scratch_, nr, C, norm_write(post_norm_write), fp8_grad_amax(Fp8Group::O), s);
  // Attention block: resid_mid = resid_in + o_proj(att)
  const __nv_bfloat16* dy1 = sp_ ? sp_gather(d_resid_, "sp o_proj output grad") : d_resid_;
  if (fp8_)
    fp8_bwd(Fp8Group::O, d_att_, o.o_proj, grad_write(o.o_proj), dy1, a.att);
  else
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
  if (fp8_) {  // d_q|d_k|d_v comes out of RoPE's backward and a copy: its amax is a pass of its own
    cuda::fp8_amax(fp8_grad_amax(Fp8Group::Qkv), d_qkv, n, qkv, qkv, s);
    fp8_bwd(Fp8Group::Qkv, d_norm_, o.q_proj, grad_write_block({o.q_proj, o.k_proj, o.v_proj}), d_qkv, x1);
  } else {
    cuda::matmul_bwd(mm, d_norm_, g(o.q_proj), d_qkv, x1, w(o.q_proj), n, C, qkv, /*accumulate_dinp=*/false,
                     grad_write_block({o.q_proj, o.k_proj, o.v_proj}), s);
  }
  adapt(LoraTarget::Q, x1, d_qkv, qkv, d_norm_);
  adapt(LoraTarget::K, x1, d_qkv + d.q_dim, qkv, d_norm_);
  adapt(LoraTarget::V, x1, d_qkv + d.q_dim + d.kv_dim, qkv, d_norm_);
  sp_reduce(d_norm_, dnorm, n, "tp q/k/v input grad");
  // The residual gradient: the layer below's down_proj output gradient (--fp8: its amax folded here).
  norm_bwd(d_resid_, gb ? norm_grad(g(o.input_norm), 1) : nullptr, dnorm, a.resid_in, w(o.input_norm), a.rstd1,
           norm_scratch_, nr, C, norm_write(input_norm_write), fp8_grad_amax(Fp8Group::Down), s);
  if (sp_ && gb)
    sp_add_norm_grads({{g(o.post_norm), post_norm_write}, {g(o.input_norm), input_norm_write}},
                      "sp norm weight grads");
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

}  // namespace tuna

#endif  // TUNA_CUDA
