// DecodeGpu: LlamaGpu's forward (model/llama_gpu_forward.cpp, same ops in the same order) for the positions appended
// to a KV cache. Per layer, for the n new positions of each sequence:
//   norm = rmsnorm(x);  q|k|v = norm @ W[q|k|v] (one GEMM);  rope(q), rope(k) -> cache[length..] at positions
//   length..length+n-1, v -> cache[length..];  att = decode_attention(q, cache);  h = x + att @ Wo
//   norm = rmsnorm(h);  gate|up = norm @ W[gate|up] (one GEMM);  x = h + down(silu(gate) * up)
// RoPE writes k straight into the cache and v is copied there from the fused rows: generation runs a few rows
// per call, where each launch's cost shows, so a layer makes as few as it can.
// then logits = lm_head(rmsnorm(x)) at each sequence's last new position only.
#if TUNA_CUDA

#include "model/decode_gpu.h"

#include <algorithm>

#include "core/cuda_check.h"
#include "core/dtype.h"
#include "core/error.h"
#include "kernels/cpu/rope.h"
#include "kernels/decode_attention.cuh"
#include "kernels/embedding.cuh"
#include "kernels/rmsnorm.cuh"
#include "kernels/rope.cuh"
#include "kernels/swiglu.cuh"
#include "model/llama_gpu.h"  // DeviceArena
#include "model/memory_plan.h"

namespace tuna {

DecodeGpu::DecodeGpu(const GpuWeights& weights, int64_t batch, int64_t capacity)
    : config_(*weights.config), layout_(*weights.layout), params_(weights.params), batch_(batch), capacity_(capacity) {
  const LlamaConfig& c = config_;
  if (batch < 1 || capacity < 1 || capacity > c.max_context())
    fail("KV cache of ", batch, " x ", capacity, " positions: expected >= 1 sequence of 1..", c.max_context(),
         " positions (the model's context: max_position_embeddings, times a dynamic or yarn rope's factor)");
  if (c.head_dim % 8 != 0 || c.head_dim > 128)
    fail("--device cuda generation: decode attention supports head_dim a multiple of 8 up to 128; this model has ",
         c.head_dim);
  TUNA_CHECK(layout_.tp().tp_size == 1, "generation runs the whole model on one device (tp 1), not tp ",
             layout_.tp().tp_size);
  require_fused_weight_blocks(layout_, c.hidden_size);
  TUNA_CUDA_CHECK(cudaSetDevice(weights.device));
  TUNA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  matmul_ = std::make_unique<cuda::MatmulContext>();

  const int64_t rows = batch * capacity, C = c.hidden_size, F = c.intermediate_size;
  const int64_t cache_elems = batch * capacity * c.kv_dim();
  // The cache and activations from one arena laid out by the decoder's memory plan (model/memory_plan_gpu.cpp).
  arena_ = std::make_unique<DeviceArena>(plan_gpu_decode_memory(c, batch, capacity));
  DeviceArena& a = *arena_;
  keys_.resize(c.num_hidden_layers), values_.resize(c.num_hidden_layers);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    keys_[l] = a.take<__nv_bfloat16>(str("layer ", l, " cached keys"), cache_elems);
    values_[l] = a.take<__nv_bfloat16>(str("layer ", l, " cached values"), cache_elems);
  }
  rope_cos_ = a.take<float>("RoPE cos", capacity * c.head_dim / 2);
  rope_sin_ = a.take<float>("RoPE sin", capacity * c.head_dim / 2);
  rstd_ = a.take<float>("rstd", rows);
  x_ = a.take<__nv_bfloat16>("residual", rows * C);
  h_ = a.take<__nv_bfloat16>("residual mid", rows * C);
  norm_ = a.take<__nv_bfloat16>("norm", rows * C);
  qkv_ = a.take<__nv_bfloat16>("q|k|v", rows * (c.q_dim() + 2 * c.kv_dim()));
  q_ = a.take<__nv_bfloat16>("q", rows * c.q_dim());
  att_ = a.take<__nv_bfloat16>("attention out", rows * c.q_dim());
  gate_up_ = a.take<__nv_bfloat16>("gate|up", rows * 2 * F);
  act_ = a.take<__nv_bfloat16>("swiglu", rows * F);
  last_ = a.take<__nv_bfloat16>("last positions", batch * C);
  logits_ = a.take<__nv_bfloat16>("logits", batch * c.vocab_size);
  tokens_ = a.take<int32_t>("tokens", rows);
  a.check_all_taken();

  // The rotation tables from the CPU twin's function, as LlamaGpu uploads them (dynamic scaling: replaced row by
  // row as the sequence grows, in append).
  std::vector<float> cos_table(capacity * c.head_dim / 2), sin_table(capacity * c.head_dim / 2);
  cpu::rope_tables(cos_table.data(), sin_table.data(), 0, capacity, c.head_dim, c.rope_theta, c.rope_scaling, 0);
  TUNA_CUDA_CHECK(cudaMemcpyAsync(rope_cos_, cos_table.data(), cos_table.size() * sizeof(float),
                                  cudaMemcpyHostToDevice, stream_));
  TUNA_CUDA_CHECK(cudaMemcpyAsync(rope_sin_, sin_table.data(), sin_table.size() * sizeof(float),
                                  cudaMemcpyHostToDevice, stream_));
  TUNA_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

DecodeGpu::~DecodeGpu() {
  matmul_.reset();
  arena_.reset();
  if (stream_) cudaStreamDestroy(stream_);
}

void DecodeGpu::append(const int32_t* tokens, int64_t n, float* host_last_logits) {
  const LlamaConfig& c = config_;
  if (n < 1 || length_ + n > capacity_)
    fail("generation: ", n, " new positions after ", length_, " do not fit the KV cache's ", capacity_);
  const int64_t rows = batch_ * n, C = c.hidden_size, F = c.intermediate_size, V = c.vocab_size;
  const int64_t H = c.num_attention_heads, KV = c.num_key_value_heads, D = c.head_dim, kvd = c.kv_dim();
  const int64_t qkv = c.q_dim() + 2 * kvd;  // a row of the fused q|k|v activation
  for (int64_t i = 0; i < rows; ++i)
    if (tokens[i] < 0 || tokens[i] >= V)
      fail("generation: token at position ", i, " is ", tokens[i], ", outside the vocabulary [0, ", V, ")");
  cudaStream_t s = stream_;
  cuda::MatmulContext& mm = *matmul_;
  const __nv_bfloat16* w = params_;
  const float* cos = rope_cos_ + length_ * (D / 2);
  const float* sin = rope_sin_ + length_ * (D / 2);
  if (c.rope_scaling.type == "dynamic") {
    // Dynamic scaling: the new positions turn with the frequencies of the length the cache now reaches (what
    // transformers' cached forward computes); the cached keys keep the rotation they were cached with.
    dynamic_cos_.resize(n * (D / 2));
    dynamic_sin_.resize(n * (D / 2));
    cpu::rope_tables(dynamic_cos_.data(), dynamic_sin_.data(), length_, n, D, c.rope_theta, c.rope_scaling,
                     length_ + n);
    TUNA_CUDA_CHECK(cudaMemcpyAsync(rope_cos_ + length_ * (D / 2), dynamic_cos_.data(),
                                    dynamic_cos_.size() * sizeof(float), cudaMemcpyHostToDevice, s));
    TUNA_CUDA_CHECK(cudaMemcpyAsync(rope_sin_ + length_ * (D / 2), dynamic_sin_.data(),
                                    dynamic_sin_.size() * sizeof(float), cudaMemcpyHostToDevice, s));
    TUNA_CUDA_CHECK(cudaStreamSynchronize(s));  // the host rows are rewritten by the next append
  }
  TUNA_CUDA_CHECK(cudaMemcpyAsync(tokens_, tokens, rows * sizeof(int32_t), cudaMemcpyHostToDevice, s));

  cuda::embedding_fwd(x_, tokens_, w + layout_.embed_tokens(), rows, V, C, s);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const LayerOffsets& o = layout_.layer(l);
    cuda::rmsnorm_fwd(norm_, rstd_, x_, w + o.input_norm, rows, C, c.rms_norm_eps, s);
    cuda::matmul_fwd(mm, qkv_, norm_, w + o.q_proj, rows, C, qkv, s);  // the q|k|v block
    cuda::rope_fwd(q_, qkv_, cos, sin, batch_, n, H, D, H * D, qkv, /*positions=*/nullptr, s);
    for (int64_t b = 0; b < batch_; ++b) {  // rows b * n .. of k, v -> positions length_ .. of sequence b
      const int64_t to = (b * capacity_ + length_) * kvd, from = b * n * qkv + c.q_dim();
      cuda::rope_fwd(keys_[l] + to, qkv_ + from, cos, sin, 1, n, KV, D, kvd, qkv, /*positions=*/nullptr, s);
      copy_rows(values_[l] + to, kvd, qkv_ + from + kvd, qkv, n, kvd, s);
    }
    cuda::decode_attention_fwd(att_, q_, keys_[l], values_[l], batch_, n, length_, capacity_, H, KV, D, s);
    cuda::matmul_residual_fwd(mm, h_, att_, w + o.o_proj, x_, rows, c.q_dim(), C, s);
    cuda::rmsnorm_fwd(norm_, rstd_, h_, w + o.post_norm, rows, C, c.rms_norm_eps, s);
    cuda::matmul_fwd(mm, gate_up_, norm_, w + o.gate_proj, rows, C, 2 * F, s);  // the gate|up block
    cuda::swiglu_fwd(act_, gate_up_, gate_up_ + F, rows, F, 2 * F, s);
    cuda::matmul_residual_fwd(mm, x_, act_, w + o.down_proj, h_, rows, F, C, s);
  }
  cuda::rmsnorm_fwd(norm_, rstd_, x_, w + layout_.final_norm(), rows, C, c.rms_norm_eps, s);
  for (int64_t b = 0; b < batch_; ++b)  // each sequence's last new position
    TUNA_CUDA_CHECK(cudaMemcpyAsync(last_ + b * C, norm_ + (b * n + n - 1) * C, C * sizeof(__nv_bfloat16),
                                    cudaMemcpyDeviceToDevice, s));
  cuda::matmul_fwd(mm, logits_, last_, w + layout_.lm_head(), batch_, C, V, s);
  std::vector<uint16_t> bits(batch_ * V);
  TUNA_CUDA_CHECK(cudaMemcpyAsync(bits.data(), logits_, bits.size() * sizeof(uint16_t), cudaMemcpyDeviceToHost, s));
  TUNA_CUDA_CHECK(cudaStreamSynchronize(s));
  convert_to_f32(bits.data(), DType::BF16, host_last_logits, batch_ * V);
  length_ += n;
}

}  // namespace tuna

#endif  // TUNA_CUDA
