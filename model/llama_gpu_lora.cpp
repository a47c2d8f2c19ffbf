// LlamaGpu's LoRA adapters (model/llama_gpu.h): their passes, fills and gradient buffers.
#if TUNA_CUDA

#include "comm/comm.h"
#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/lora.cuh"
#include "model/llama_gpu.h"

namespace tuna {

// Per target, which local input column is which of the whole layer's: dropout draws its mask by the whole layer's
// index, so that every tp split draws the CPU model's bits.
void LlamaGpu::set_up_adapters() {
  const ParamLayout& trained = trained_layout();
  for (int t = 0; t < kLoraTargets; t++) {
    if (!lora_.has(LoraTarget(t))) continue;
    const ParamTensor* a = trained.find(lora_tensor_name(stage_.layer_begin, LoraTarget(t), 'A'));
    TUNA_CHECK(a != nullptr, "no adapter A for ", lora_target_name(LoraTarget(t)));
    lora_global_in_[t] = a->global_shape[1];
    lora_col0_[t] = a->split_dim == 1 ? a->split_begin : 0;
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

void LlamaGpu::set_adapters_piece(const Segment& piece, const float* host) {
  TUNA_CHECK(lora_params_ != nullptr && piece.begin >= 0 && piece.begin + piece.size <= lora_layout_.params.total(),
             "adapter piece [", piece.begin, ", +", piece.size, ") of ", lora_layout_.params.total(), " (a model with adapters)");
  upload_piece(lora_master_, lora_params_, piece, host);
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
}  // namespace tuna

#endif  // TUNA_CUDA
