// LlamaGpu's forward pass (model/llama_gpu.h): op for op the sequence of model/llama.cpp (see there for the math):
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
// adamw_step for the gradient norm. The backward is model/llama_gpu_backward.cpp, the adapters' part of both
// model/llama_gpu_lora.cpp.
#if TUNA_CUDA

#include <algorithm>
#include <cstring>

#include "comm/comm.h"
#include "core/cuda_check.h"
#include "core/dtype.h"
#include "core/error.h"
#include "kernels/attention.cuh"
#include "kernels/classifier.cuh"
#include "kernels/cpu/attention.h"  // doc_starts_from_positions
#include "kernels/cpu/classifier.h"
#include "kernels/fp8.cuh"  // fp8_amax
#include "kernels/rmsnorm.cuh"
#include "kernels/rope.cuh"
#include "kernels/swiglu.cuh"
#include "model/llama_gpu.h"
#include "model/llama_gpu_grad_writes.h"

namespace tuna {
namespace {

// The forward's norm and SwiGLU, each folding its output's amax into *amax when one is given (--fp8: that output is
// the next FP8 GEMM group's input), the plain kernel otherwise.
void norm_fwd(__nv_bfloat16* out, float* rstd, const __nv_bfloat16* inp, const __nv_bfloat16* weight, int64_t n,
              int64_t dim, double eps, float* amax, cudaStream_t s) {
  if (amax != nullptr) cuda::rmsnorm_fwd_amax(out, rstd, inp, weight, n, dim, eps, amax, s);
  else cuda::rmsnorm_fwd(out, rstd, inp, weight, n, dim, eps, s);
}
void swiglu_forward(__nv_bfloat16* out, const __nv_bfloat16* gate, const __nv_bfloat16* up, int64_t rows, int64_t cols,
                    int64_t stride, float* amax, cudaStream_t s) {
  if (amax != nullptr) cuda::swiglu_fwd_amax(out, gate, up, rows, cols, stride, amax, s);
  else cuda::swiglu_fwd(out, gate, up, rows, cols, stride, s);
}

}  // namespace

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

  std::vector<int> order = layout_.unit_pass_order(backward_follows);
  // A tied lm_head (the embedding's unit) is acquired once more by the weighted backward's head, right after the
  // forward's: planned, so that ZeRO-3's prefetch keeps following the pass.
  if (weighted_head_ && stage_.head && layout_.lm_head_unit() != layout_.head_unit()) {
    const auto at = std::find(order.begin(), order.end(), layout_.head_unit());
    order.insert(at + 1, layout_.lm_head_unit());
  }
  store_->plan(order);
  lora_train_ = backward_follows && lora_.enabled() && lora_.dropout > 0;  // PEFT's dropout acts in training only
  if (sp_) {
    sp_chunk_ = (n + run_.tp - 1) / run_.tp;
    sp_rows_ = shard_range(n, static_cast<int>(run_.tp_rank), static_cast<int>(run_.tp));
    if (sp_rows_.size() == 0)
      fail("sequence parallelism (--sp): a pass of ", n, " tokens leaves tp rank ", run_.tp_rank, " of ", run_.tp,
           " no rows (the CUDA engine needs at least one token per tp rank)");
  }
  const int64_t nr = sp_ ? sp_rows_.size() : n;  // the rows of the norm and residual regions
  if (fp8_ && n % 16 != 0)
    fail("--fp8 ", fp8_mode_name(run_.fp8), " with --device cuda: a pass of batch ", batch, " x seq ", seq, " = ", n,
         " tokens; the FP8 GEMMs (cuBLASLt) take a multiple of 16 tokens");

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
  // FP8: the layer's weight codes (cast now if the weights changed since), and each group's input amax folded into
  // the kernel that writes the input, from zero, then taken over tp where the input is split there (folded): complete
  // as soon as it is written, for the forward's cast and the backward's (a recompute folds it again, to the same value).
  const Fp8GpuWeight* w8 = fp8_ ? fp8_weights(l, wb) : nullptr;
  if (fp8_) TUNA_CUDA_CHECK(cudaMemsetAsync(a.fp8_amax, 0, kFp8Groups * sizeof(float), s));
  const auto amax_of = [&](Fp8Group g) { return fp8_ ? a.fp8_amax + static_cast<int>(g) : nullptr; };
  const auto folded = [&](Fp8Group g) {
    if (fp8_) fp8_amax_over_tp(amax_of(g), g, /*output_gradient=*/false);
  };
  norm_fwd(a.norm1, a.rstd1, a.resid_in, w(o.input_norm), nr, C, c.rms_norm_eps, amax_of(Fp8Group::Qkv), s);
  folded(Fp8Group::Qkv);
  // One GEMM over the q|k|v weight block into qkv_; RoPE reads q and k out of its rows into the contiguous a.q, a.k
  // the attention kernels take, and v is copied out (a strided copy). With sp it reads every rank's rows gathered.
  const int64_t qkv = d.q_dim + 2 * d.kv_dim;
  const __nv_bfloat16* x1 = sp_ ? sp_gather(a.norm1, "sp q/k/v input") : a.norm1;
  if (fp8_) fp8_fwd(l, Fp8Group::Qkv, w8, qkv_, x1, n);
  else cuda::matmul_fwd(mm, qkv_, x1, w(o.q_proj), n, C, qkv, s);
  // Adapters add into their column blocks of the fused outputs, before RoPE and SwiGLU read them; with sp they read
  // every row of the gathered input, as the GEMM does.
  const auto adapt = [&](LoraTarget t, const __nv_bfloat16* x, __nv_bfloat16* y, int64_t ld_y, bool add = true) {
    if (lora_.enabled() && lora_.has(t) && !adapters_off_) lora_fwd(l, t, x, y, ld_y, n, add);
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
  if (fp8_) cuda::fp8_amax(amax_of(Fp8Group::O), a.att, n, d.q_dim, d.q_dim, s);  // o_proj's input: no producer folds it
  folded(Fp8Group::O);
  // Row-parallel o_proj (and down_proj below): each tp rank's partial product, the residual added by rank 0
  // only, then summed over the ranks. With sp every row's partial product goes to gathered_, each rank adding the
  // residual of its own rows (the GEMM split at them), and the sum of this rank's rows comes back into `out`.
  // With FP8 the input is cast once, whole, and the products read their rows of its codes.
  const auto row_parallel = [&](__nv_bfloat16* out, const __nv_bfloat16* inp, int64_t weight, Fp8Group group,
                                const __nv_bfloat16* residual, int64_t ic, const char* what) {
    if (fp8_) fp8_cast_input(fp8_scratch_, inp, n, ic, amax_of(group), s);
    // dst = rows row0 .. row0 + rows of inp @ W^T (+ res)
    const auto product = [&](__nv_bfloat16* dst, int64_t row0, int64_t rows, const __nv_bfloat16* res) {
      if (fp8_) return fp8_linear_fwd(mm, dst, res, w8[static_cast<int>(group)], fp8_scratch_, row0, rows, s);
      if (res != nullptr) cuda::matmul_residual_fwd(mm, dst, inp + row0 * ic, w(weight), res, rows, ic, C, s);
      else cuda::matmul_fwd(mm, dst, inp + row0 * ic, w(weight), rows, ic, C, s);
    };
    if (!sp_) {
      product(out, 0, n, d.tp_rank == 0 ? residual : nullptr);
      return tp_all_reduce(out, n * C, what);
    }
    const int64_t begin = sp_rows_.begin, end = sp_rows_.end;
    if (begin > 0) product(gathered_, 0, begin, nullptr);
    if (end > begin) product(gathered_ + begin * C, begin, end - begin, residual);
    if (n > end) product(gathered_ + end * C, end, n - end, nullptr);
    sp_reduce(gathered_, out, n, what);
  };
  row_parallel(a.resid_mid, a.att, o.o_proj, Fp8Group::O, a.resid_in, d.q_dim, "tp o_proj");
  adapt(LoraTarget::O, a.att, a.resid_mid, C);  // after the sum: every rank adds the same whole product once
  norm_fwd(a.norm2, a.rstd2, a.resid_mid, w(o.post_norm), nr, C, c.rms_norm_eps, amax_of(Fp8Group::GateUp), s);
  folded(Fp8Group::GateUp);
  const __nv_bfloat16* x2 = sp_ ? sp_gather(a.norm2, "sp gate/up input") : a.norm2;
  if (fp8_) fp8_fwd(l, Fp8Group::GateUp, w8, a.gate_up, x2, n);
  else cuda::matmul_fwd(mm, a.gate_up, x2, w(o.gate_proj), n, C, 2 * F, s);  // the gate|up block
  adapt(LoraTarget::Gate, x2, a.gate_up, 2 * F);
  adapt(LoraTarget::Up, x2, a.gate_up + F, 2 * F);
  swiglu_forward(a.act, a.gate_up, a.gate_up + F, n, F, 2 * F, amax_of(Fp8Group::Down), s);
  folded(Fp8Group::Down);
  if (!write_output) {  // a recompute: the down adapter's u is needed by its backward, its output is not
    adapt(LoraTarget::Down, a.act, nullptr, C, /*add=*/false);
    return;
  }
  __nv_bfloat16* resid_next = l + 1 < stage_.layer_end ? acts(l + 1).resid_in : resid_out_;
  row_parallel(resid_next, a.act, o.down_proj, Fp8Group::Down, a.resid_mid, F, "tp down_proj");
  adapt(LoraTarget::Down, a.act, resid_next, C);
}

// What the recompute mode dropped of layer l's activations, recomputed from what it kept, with the same kernels
// on the same inputs: the same bits as the forward wrote. (With FP8 the input amaxes are kept per layer, so the
// selective recompute need not fold them again; a full one recomputes them, to the same values.)
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

LossSum LlamaGpu::head(const int32_t* host_targets, int64_t rows, bool want_grad, const LogitsSink* logits,
                       const float* token_weights, bool keep_head) {
  TUNA_CHECK(token_weights == nullptr || (want_grad && host_targets != nullptr), "a weighted head is a backward");
  const int64_t C = config_.hidden_size, V = layout_.tp().vocab;
  const int H = layout_.head_unit(), lm_unit = layout_.lm_head_unit();
  const int64_t lm_offset = layout_.lm_head() - layout_.unit_range(lm_unit).first;
  const __nv_bfloat16* w_head = (lm_unit == H ? head_base_ : store_->acquire(lm_unit)) + lm_offset;
  // A frozen base (adapters) has no weight gradient: the head's backward gives only its input's.
  float* g_head = want_grad && !lora_.enabled() ? grad_writes_->unit(lm_unit) + lm_offset : nullptr;
  cudaStream_t s = stream_;
  std::vector<uint16_t> chunk_bits;
  std::vector<float> chunk_logits;
  // Column-parallel (by vocabulary): every row's normed input, gathered with sp; its input gradient is every
  // row's partial sum in d_final_norm_, with sp reduced into this rank's rows of d_norm_ (the final norm's).
  const __nv_bfloat16* normed = sp_ ? sp_gather(final_norm_out_, "sp lm_head input") : final_norm_out_;
  for (int64_t r0 = 0; r0 < rows; r0 += head_chunk_rows_) {
    const int64_t nr = std::min(head_chunk_rows_, rows - r0);
    const __nv_bfloat16* x = normed + r0 * C;
    cuda::matmul_fwd(*matmul_, logits_chunk_, x, w_head, nr, C, V, s);
    if (logits != nullptr) {
      chunk_bits.resize(nr * V);
      chunk_logits.resize(nr * V);
      TUNA_CUDA_CHECK(cudaMemcpyAsync(chunk_bits.data(), logits_chunk_, nr * V * sizeof(uint16_t),
                                      cudaMemcpyDeviceToHost, s));
      TUNA_CUDA_CHECK(cudaStreamSynchronize(s));
      convert_to_f32(chunk_bits.data(), DType::BF16, chunk_logits.data(), nr * V);
      (*logits)(r0, nr, chunk_logits.data());
    }
    if (host_targets == nullptr) continue;
    cross_entropy(r0, nr, want_grad, token_weights);
    if (want_grad)  // the first chunk's dW overwrites a fresh lm_head gradient, the others add
      cuda::matmul_bwd(*matmul_, d_final_norm_ + r0 * C, g_head, logits_chunk_, x, w_head, nr, C, V,
                       /*accumulate_dinp=*/false,
                       g_head != nullptr ? grad_writes_->write(layout_.lm_head()) : GradWrite::Accumulate, s);
  }
  if (want_grad)  // vocab-parallel: partial sums
    sp_reduce(d_final_norm_, sp_ ? d_norm_ : d_final_norm_, rows, "tp lm_head input grad");
  if (lm_unit != H) store_->release(lm_unit);
  if (!want_grad && !keep_head) store_->release(H);  // no backward: the pass ends here
  LossSum loss;
  if (host_targets == nullptr || token_weights != nullptr) return loss;
  cuda::loss_sum(loss_total_, losses_, rows, s);
  TUNA_CUDA_CHECK(cudaMemcpyAsync(pinned_scalar_, loss_total_, sizeof(double), cudaMemcpyDeviceToHost, s));
  TUNA_CUDA_CHECK(cudaEventRecord(loss_copied_, s));
  for (int64_t i = 0; i < rows; ++i) loss.count += host_targets[i] != cpu::kIgnoreIndex;
  return loss;
}

const Fp8GpuWeight* LlamaGpu::fp8_weights(int64_t l, const __nv_bfloat16* wb) {
  const int64_t i = l - stage_.layer_begin, slot = i % static_cast<int64_t>(fp8_cast_.size());
  Fp8GpuWeight* w = fp8_w_.data() + slot * kFp8Groups;
  if (fp8_cast_[slot] == i) return w;  // the layer's current weights (weights_changed clears every slot)
  const LayerOffsets& o = layout_.layer(l);
  const int64_t begin = layout_.unit_range(1 + static_cast<int>(l)).first;
  const int64_t offsets[kFp8Groups] = {o.q_proj, o.o_proj, o.gate_proj, o.down_proj};  // Fp8Group order
  for (int g = 0; g < kFp8Groups; g++) fp8_cast_weight(w[g], wb + (offsets[g] - begin), tp_, stream_);
  fp8_cast_[slot] = i;
  return w;
}

void LlamaGpu::fp8_amax_over_tp(float* amax, Fp8Group g, bool output_gradient) {
  if (run_.tp == 1 || !fp8_operand_split(g, output_gradient, sp_)) return;
  TUNA_CHECK(tp_ != nullptr, "tensor parallelism without a tp comm (set_tp_comm)");
  tp_->all_reduce(amax, 1, CommType::F32, ReduceOp::Max, output_gradient ? "tp fp8 gradient amax" : "tp fp8 input amax");
}

void LlamaGpu::fp8_fwd(int64_t l, Fp8Group g, const Fp8GpuWeight* w, __nv_bfloat16* out, const __nv_bfloat16* x,
                       int64_t n) {
  const Fp8GpuWeight& wg = w[static_cast<int>(g)];
  fp8_cast_input(fp8_scratch_, x, n, wg.in, acts(l).fp8_amax + static_cast<int>(g), stream_);
  fp8_linear_fwd(*matmul_, out, nullptr, wg, fp8_scratch_, /*row0=*/0, n, stream_);
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

void LlamaGpu::cross_entropy(int64_t r0, int64_t rows, bool want_grad, const float* weights) {
  const TpDims& d = layout_.tp();
  const float dloss = want_grad ? 1.0f : 0.0f;  // the gradient of the summed loss (see model/llama.h)
  cudaStream_t s = stream_;
  if (run_.tp == 1) {
    if (weights != nullptr)
      return cuda::classifier_weighted_bwd(logits_chunk_, targets_ + r0, weights + r0, rows, d.vocab, s);
    return cuda::classifier_fwd_bwd(logits_chunk_, losses_ + r0, targets_ + r0, rows, d.vocab, dloss, s);
  }
  // Vocab-parallel: three rows of statistics cross the tp group, not logits.
  cuda::classifier_partial_stats(logits_chunk_, ce_stats_, targets_ + r0, rows, d.vocab, d.vocab_begin,
                                 config_.vocab_size, s);
  TUNA_CUDA_CHECK(cudaMemcpyAsync(ce_max_, ce_stats_, rows * sizeof(float), cudaMemcpyDeviceToDevice, s));
  tp_->all_reduce(ce_max_, rows, CommType::F32, ReduceOp::Max, "tp loss max");
  cuda::classifier_rescale_sums(ce_stats_, ce_max_, rows, s);
  tp_->all_reduce(ce_stats_ + rows, 2 * rows, CommType::F32, ReduceOp::Sum, "tp loss sums");
  if (weights != nullptr)
    return cuda::classifier_parallel_weighted_bwd(logits_chunk_, targets_ + r0, ce_max_, ce_stats_ + rows,
                                                  weights + r0, rows, d.vocab, d.vocab_begin, s);
  cuda::classifier_parallel_fwd_bwd(logits_chunk_, losses_ + r0, targets_ + r0, ce_max_, ce_stats_ + rows, rows,
                                    d.vocab, d.vocab_begin, dloss, s);
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

void LlamaGpu::forward_to_logits(const int32_t* inputs, int64_t batch, int64_t seq, const LogitsSink& sink) {
  TUNA_CHECK(run_.tp == 1, "whole-vocabulary logits: not with tensor parallelism");
  TUNA_CHECK(layout_.whole(), "whole-vocabulary logits of a pipeline stage");
  if (batch > max_batch_ || seq > max_seq_)
    fail("batch ", batch, " x seq ", seq, " exceeds the planned ", max_batch_, " x ", max_seq_);
  select_slot(0);
  upload_tokens(inputs, nullptr, batch, seq);
  forward(batch, seq, /*backward_follows=*/false);
  head(nullptr, batch * seq, /*want_grad=*/false, &sink);
  TUNA_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void LlamaGpu::forward_logits(const int32_t* inputs, int64_t batch, int64_t seq, float* host_logits) {
  const int64_t V = config_.vocab_size;
  forward_to_logits(inputs, batch, seq, [&](int64_t r0, int64_t rows, const float* logits) {
    std::copy(logits, logits + rows * V, host_logits + r0 * V);
  });
}

void LlamaGpu::forward_target_logps(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                                    float* logps, uint8_t* greedy) {
  const int64_t V = config_.vocab_size;
  // FP8's GEMMs take a multiple of 16 tokens (forward refuses the rest): each row is padded at its end (ignored
  // targets, which causal attention keeps out of the tokens before them) to the shortest length that gives one within
  // the planned seq, else the pass is the planned max_batch x max_seq (a multiple of 16: model/support.cpp), with
  // empty rows added.
  int64_t rows = batch, len = seq;
  if (fp8_) {
    while (len < max_seq_ && (rows * len) % 16 != 0) len++;
    if ((rows * len) % 16 != 0) rows = max_batch_, len = max_seq_;
  }
  if (rows == batch && len == seq)
    return forward_to_logits(inputs, batch, seq, [&](int64_t r0, int64_t n, const float* logits) {
      cpu::classifier_target_logps(logits, targets + r0, n, V, logps + r0, greedy + r0);
    });
  std::vector<int32_t> in(rows * len, 0), tg(rows * len, cpu::kIgnoreIndex);
  for (int64_t r = 0; r < batch; r++) {
    std::copy(inputs + r * seq, inputs + (r + 1) * seq, in.begin() + r * len);
    std::copy(targets + r * seq, targets + (r + 1) * seq, tg.begin() + r * len);
  }
  std::vector<float> lp(rows * len);
  std::vector<uint8_t> gr(rows * len);
  forward_target_logps(in.data(), tg.data(), rows, len, lp.data(), gr.data());
  for (int64_t r = 0; r < batch; r++) {
    std::copy(lp.begin() + r * len, lp.begin() + r * len + seq, logps + r * seq);
    std::copy(gr.begin() + r * len, gr.begin() + r * len + seq, greedy + r * seq);
  }
}

void LlamaGpu::forward_logps(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                             const int32_t* positions, float* logps, bool backward_follows, bool adapters_off) {
  TUNA_CHECK(!(adapters_off && backward_follows), "the base alone is the reference: no backward follows it");
  TUNA_CHECK(!backward_follows || run_.training, "a backward on a forward-only model (MemoryLayout::training)");
  TUNA_CHECK(batch > 0 && seq > 0, "forward_logps of batch ", batch, " x seq ", seq);
  if (batch > max_batch_ || seq > max_seq_)
    fail("batch ", batch, " x seq ", seq, " exceeds the planned ", max_batch_, " x ", max_seq_);
  const int64_t n = batch * seq;
  // A pipeline stage runs in slot 0: the last stage holds one micro-batch at a time (1F1B runs each of its forwards
  // just before that micro-batch's backward), and the passes without a backward run outside a step's slots.
  select_slot(0);
  upload_tokens(inputs, targets, batch, seq, positions);
  adapters_off_ = adapters_off && lora_.enabled();
  weighted_head_ = backward_follows;
  try {
    forward(batch, seq, backward_follows);
  } catch (...) {
    adapters_off_ = weighted_head_ = false;
    throw;
  }
  adapters_off_ = weighted_head_ = false;
  if (!stage_.head) return;  // a stage before the last: its output is resid_out_ (stage_output)
  // The loss kernel without a gradient (dloss 0, or the vocab-parallel steps) leaves each token's -log p in losses_.
  head(targets, n, /*want_grad=*/false, nullptr, nullptr, /*keep_head=*/backward_follows);
  TUNA_CUDA_CHECK(cudaMemcpyAsync(logps, losses_, n * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  wait_for_stream("the forward, before its per-token log-probs are read");
  for (int64_t i = 0; i < n; ++i) logps[i] = targets[i] == cpu::kIgnoreIndex ? 0.0f : -logps[i];
}

void LlamaGpu::backward_weighted(const int32_t* targets, const float* weights, int64_t batch, int64_t seq) {
  TUNA_CHECK(run_.training, "backward_weighted on a forward-only model (MemoryLayout::training)");
  TUNA_CHECK(stage_.head, "backward_weighted of a pipeline stage before the last (backward_stage takes the next "
             "stage's input gradient)");
  TUNA_CHECK(working_slot_ == slot_,
             "backward_weighted without forward_logps(backward_follows) on its batch just before");
  const int64_t n = batch * seq;
  // The weights go where the forward's per-token losses were (read back, dead now): losses_ holds [n] fp32 for any
  // planned batch, so the pass needs no buffer of its own. Staged through the pinned upload buffer, free again once
  // the forward's token copies are done (its inputs' rows: n 4-byte words).
  wait_for_event(tokens_uploaded_, "the compute stream's work before the token weights' upload");
  std::memcpy(pinned_ids_, weights, n * sizeof(float));
  TUNA_CUDA_CHECK(cudaMemcpyAsync(losses_, pinned_ids_, n * sizeof(float), cudaMemcpyHostToDevice, stream_));
  TUNA_CUDA_CHECK(cudaEventRecord(tokens_uploaded_, stream_));
  grad_writes_->begin_pass(*store_);
  head(targets, n, /*want_grad=*/true, nullptr, losses_);
  backward(batch, seq);
}

}  // namespace tuna

#endif  // TUNA_CUDA
