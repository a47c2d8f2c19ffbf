// LlamaGpu: the CUDA backend of model/llama.h — the same function (LlamaForCausalLM's forward and backward,
// loss as a SUM with one division per step), bf16 activations and weights, fp32 gradients and AdamW state, on
// one device. Only in CUDA builds (TUNA_CUDA).
//
// Memory: parameters (fp32 master + bf16 working copy), gradients (fp32), AdamW moments (fp32 or bf16) and
// every activation for (max_batch, max_seq) are allocated once, at construction, from one device arena;
// forward_backward and adamw_step allocate nothing. Activations of every layer are kept (no recompute yet).
//
// Wiring into the trainer (train.cu, --device cuda), mirroring the CPU loop:
//   LlamaGpu model(config, micro_batch, seq, opt_config);          // + GpuOptions for bf16 moments / SR
//   model.set_params(cpu_params.data());                           // from a checkpoint or init_random
//   per step: model.zero_grads();
//             for each micro-batch: LossSum l = model.forward_backward(inputs, targets, batch, seq);  (host ids)
//             (data parallel: all-reduce model.grads() over ranks here)
//             OptimizerStats s = model.adamw_step(1.0 / total_count, lr);
//   checkpoints: the engine (model/engine_gpu.cpp) reads and writes master_params() and the moments by segment.
//   logs: mfu = tokens_per_s * model.flops_per_token(seq) / gpu_peak_bf16_flops().
// model/engine_gpu.cpp does exactly this for the trainer (with data parallelism over NCCL).
#pragma once

#if TUNA_CUDA

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/embedding.cuh"
#include "kernels/matmul.cuh"
#include "model/config.h"
#include "model/layout.h"
#include "model/llama.h"      // LossSum
#include "model/optimizer.h"  // OptimizerConfig, OptimizerStats

namespace tuna {

struct GpuOptions {
  bool bf16_moments = false;         // AdamW m, v in bf16 (half the optimizer memory; for 70B on 80 GB cards)
  bool stochastic_rounding = false;  // bf16 params (and bf16 moments) written with stochastic rounding
  uint32_t seed = 0;                 // stochastic rounding's random stream
  bool with_optimizer = true;        // false: no moments (evaluation, generation, ZeRO-1's engine)
  bool keep_master = true;           // false: no fp32 master copy either (ZeRO-1 keeps it sharded in the
                                     // engine, which writes the bf16 weights with refresh_params_from)
  int device = 0;
};

class LlamaGpu {
 public:
  LlamaGpu(const LlamaConfig& config, int64_t max_batch, int64_t max_seq, const OptimizerConfig& optimizer = {},
           const GpuOptions& options = {});
  ~LlamaGpu();
  LlamaGpu(const LlamaGpu&) = delete;
  LlamaGpu& operator=(const LlamaGpu&) = delete;

  const LlamaConfig& config() const { return config_; }
  const ParamLayout& layout() const { return layout_; }
  cudaStream_t stream() const { return stream_; }

  // Device buffers in ParamLayout order (for collectives: all-reduce grads, broadcast params).
  float* master_params() { return master_; }   // fp32, what AdamW updates; null without keep_master
  const float* master_params() const { return master_; }
  __nv_bfloat16* params() { return params_; }  // bf16 copy the forward reads (refreshed by every update)
  float* grads() { return grads_; }            // fp32, accumulated by forward_backward
  // AdamW moments: float, or __nv_bfloat16 with GpuOptions::bf16_moments; null without optimizer state.
  void* moment_m() { return m_; }
  void* moment_v() { return v_; }
  const void* moment_m() const { return m_; }
  const void* moment_v() const { return v_; }
  bool bf16_moments() const { return options_.bf16_moments; }
  // Rewrites the bf16 copy from the fp32 master weights (after writing master_params() directly), rounded as
  // the last AdamW update rounded it (stochastically with its bits when GpuOptions::stochastic_rounding and
  // steps_taken() > 0), so that a restored model computes exactly what the saved one did. Queued on stream().
  void refresh_params();
  // The same from a caller's fp32 values of the whole layout (device memory; ZeRO-1's gathered weights).
  void refresh_params_from(const float* master_values);

  // Host fp32 <-> device. set_params also refreshes the bf16 copy. Synchronous.
  void set_params(const float* host);
  void get_params(float* host) const;
  void get_grads(float* host) const;
  // Training from scratch on the device: normal(0, std) for 2-D weights, ones for norm weights (as
  // Llama::init_random, with the GPU's own random stream: kernels/init.cuh).
  void init_random(uint64_t seed, double std = 0.02);
  void zero_grads();

  // inputs, targets: host [batch, seq] token ids (targets may hold cpu::kIgnoreIndex); validated here, so a
  // bad id is a tuna::Error naming its position. Accumulates into grads(). Waits for the loss (8 bytes).
  LossSum forward_backward(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq);
  LossSum forward_loss(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq);
  // Full logits [batch, seq, vocab] to host fp32 (tests, generation).
  void forward_logits(const int32_t* inputs, int64_t batch, int64_t seq, float* host_logits);

  // Global grad norm (deterministic), clipping as torch's clip_grad_norm_, then one fused AdamW launch.
  // loss_scale = 1 / trained tokens of the step. Same semantics as AdamW::step in model/optimizer.h.
  // No update (stats.applied false) when the norm, read back here anyway, or the step's loss is not finite.
  OptimizerStats adamw_step(double loss_scale, double lr, bool loss_is_finite = true);
  int64_t steps_taken() const { return steps_taken_; }
  void set_steps_taken(int64_t steps) { steps_taken_ = steps; }

  // Model FLOPs per trained token at this sequence length (forward + backward): 6 per matmul weight (the
  // lm_head included, the embedding lookup not) plus causal attention's 6 * seq * q_dim per layer.
  double flops_per_token(int64_t seq) const;
  // Device bytes allocated at construction: in all, and for parameters + gradients + moments (the rest is
  // activations, their gradients and scratch).
  int64_t device_bytes() const { return arena_bytes_; }
  int64_t state_bytes() const { return state_bytes_; }

 private:
  struct LayerActs {
    __nv_bfloat16 *resid_in, *norm1, *q, *k, *v, *att, *resid_mid, *norm2, *gate, *up, *act;
    float *rstd1, *lse, *rstd2;
  };
  void upload_tokens(const int32_t* inputs, const int32_t* targets, int64_t n);
  void forward(int64_t batch, int64_t seq);
  LossSum head(const int32_t* host_targets, int64_t rows, bool want_grad, float* host_logits);
  void backward(int64_t batch, int64_t seq);

  LlamaConfig config_;
  ParamLayout layout_;
  OptimizerConfig opt_;
  GpuOptions options_;
  int64_t max_batch_, max_seq_, head_chunk_rows_, steps_taken_ = 0;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<cuda::MatmulContext> matmul_;

  char* arena_ = nullptr;
  int64_t arena_bytes_ = 0, state_bytes_ = 0;
  float *master_ = nullptr, *grads_ = nullptr;
  __nv_bfloat16* params_ = nullptr;
  void *m_ = nullptr, *v_ = nullptr;
  int64_t* segment_starts_ = nullptr;
  uint8_t* segment_decays_ = nullptr;
  int n_segments_ = 0;
  float *rope_cos_ = nullptr, *rope_sin_ = nullptr;
  std::vector<LayerActs> acts_;
  __nv_bfloat16 *resid_out_, *final_norm_out_, *logits_chunk_;
  float *final_rstd_, *losses_;
  __nv_bfloat16 *d_resid_, *d_norm_, *d_q_, *d_k_, *d_v_, *d_att_, *d_gate_, *d_up_, *d_act_, *d_final_norm_;
  float *norm_scratch_, *attn_scratch_;
  double *loss_total_, *norm_scratch_f64_, *norm_total_;
  int32_t *tokens_, *targets_, *group_positions_, *group_unique_, *group_offsets_;
  int64_t n_unique_ = 0;
  // Pinned staging for uploads and the two scalars read back per step.
  int32_t* pinned_ids_ = nullptr;  // 5 * n + 1 ints: inputs, targets, positions, unique, offsets
  double* pinned_scalar_ = nullptr;
  cuda::EmbeddingGroups groups_;
};

// Bump allocation from one cudaMalloc: add() every buffer first, then cudaMalloc bytes() and assign() the base.
// Every buffer is 256-byte aligned (cuBLASLt's preferred alignment; 16 bytes would do for the vector kernels).
class DeviceArenaPlan {
 public:
  template <typename T>
  void add(T** ptr, int64_t count) {
    entries_.push_back({reinterpret_cast<void**>(ptr), offset_});
    offset_ += (count * static_cast<int64_t>(sizeof(T)) + 255) / 256 * 256;
  }
  int64_t bytes() const { return offset_; }
  void assign(char* base) const {
    for (const Entry& e : entries_) *e.ptr = base + e.offset;
  }

 private:
  struct Entry {
    void** ptr;
    int64_t offset;
  };
  std::vector<Entry> entries_;
  int64_t offset_ = 0;
};

// The fused AdamW's segment table (kernels/adamw.cuh) for `segments` of `layout`, in shard order: where each
// piece (model/optimizer.h shard_pieces) starts and whether its tensor decays. Never empty.
struct AdamWTable {
  std::vector<int64_t> starts;
  std::vector<uint8_t> decays;
};
AdamWTable adamw_table(const ParamLayout& layout, const std::vector<Segment>& segments);

// Dense bf16 tensor-core peak of a device in FLOP/s, for MFU: TUNA_PEAK_TFLOPS when set (the bench measures
// and reports its own), else the datasheet figure scaled by the multiprocessor count (sm_90: 989 TFLOP/s at
// 132 SMs; sm_80: 312 at 108), else a clock x SM estimate.
double gpu_peak_bf16_flops(int device = 0);

// Device memory for the log line: in use now (cudaMemGetInfo: total - free, all processes) and the card's total.
// LlamaGpu allocates everything at construction, so its peak equals its use after construction.
struct GpuMemory {
  int64_t used_bytes = 0, total_bytes = 0;
};
GpuMemory gpu_memory(int device = 0);

// Percent of the last sample period (about 1/6 s to 1 s, driver-chosen) in which a kernel ran on the device,
// from NVML; NaN where NVML is not available. NVML is loaded at run time (libnvidia-ml.so.1 comes with the
// driver), so binaries still start on machines without one.
double gpu_utilization_percent(int device = 0);

}  // namespace tuna

#endif  // TUNA_CUDA
