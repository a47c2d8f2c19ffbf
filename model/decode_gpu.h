// DecodeGpu: generation with a KV cache on the GPU (build/sample --device cuda), over the bf16 weights of a GPU
// model. Only in CUDA builds (TUNA_CUDA).
//
// It computes what LlamaGpu::forward_logits computes at the new positions (the same ops: embedding, RMSNorm,
// cuBLASLt GEMMs with the residual in the epilogue, RoPE, SwiGLU), with the keys and values of earlier positions
// kept per layer in a cache and attention by kernels/decode_attention.cuh; so each new token costs one
// position's forward, not the whole context's. It borrows the weights (a view of LlamaGpu's params(), in
// ParamLayout order) and owns only the cache and one position-set's activations, allocated at construction.
#pragma once

#if TUNA_CUDA

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/matmul.cuh"
#include "model/config.h"
#include "model/layout.h"

namespace tuna {

class DeviceArena;  // model/llama_gpu.h

// What decoding needs of a GPU model: its configuration, parameter layout and bf16 weights on `device`.
struct GpuWeights {
  const LlamaConfig* config;
  const ParamLayout* layout;
  const __nv_bfloat16* params;  // ParamLayout order, device memory; must outlive the DecodeGpu
  int device = 0;
};

class DecodeGpu {
 public:
  // A cache for `batch` sequences of up to `capacity` positions (at most the config's max_context()).
  DecodeGpu(const GpuWeights& weights, int64_t batch, int64_t capacity);
  ~DecodeGpu();
  DecodeGpu(const DecodeGpu&) = delete;
  DecodeGpu& operator=(const DecodeGpu&) = delete;

  int64_t batch() const { return batch_; }
  int64_t length() const { return length_; }  // positions cached so far (every sequence alike)
  void clear() { length_ = 0; }

  // Appends n tokens to each sequence (host tokens [batch, n], validated here: a bad id is a tuna::Error
  // naming its position), stores their keys and values, and writes the logits of each sequence's last new
  // position to host_last_logits: [batch, vocab] fp32. Synchronous.
  void append(const int32_t* tokens, int64_t n, float* host_last_logits);

 private:
  const LlamaConfig& config_;
  const ParamLayout& layout_;
  const __nv_bfloat16* params_;
  int64_t batch_, capacity_, length_ = 0;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<cuda::MatmulContext> matmul_;
  std::unique_ptr<DeviceArena> arena_;  // the cache and activations (plan_gpu_decode_memory)
  std::vector<__nv_bfloat16*> keys_, values_;  // per layer: [batch, capacity, kv_dim]
  float *rope_cos_ = nullptr, *rope_sin_ = nullptr, *rstd_ = nullptr;
  std::vector<float> dynamic_cos_, dynamic_sin_;  // dynamic rope: an append's rows, on the host
  // Activations of up to batch x capacity new positions, reused by every layer.
  __nv_bfloat16 *x_ = nullptr, *h_ = nullptr, *norm_ = nullptr, *qkv_ = nullptr, *q_ = nullptr, *att_ = nullptr,
                *gate_up_ = nullptr, *act_ = nullptr, *last_ = nullptr, *logits_ = nullptr;
  int32_t* tokens_ = nullptr;
};

}  // namespace tuna

#endif  // TUNA_CUDA
