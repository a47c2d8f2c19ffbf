// AdamW fused over every tensor of a flat parameter buffer, and the deterministic global gradient norm.
// Contract of kernels/cpu/adamw.h with the GPU's storage: fp32 master weights, fp32 or bf16 moments, bf16
// working copy of the parameters (what the forward reads), fp32 gradients.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace tuna::cuda {

struct AdamWArgs {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;        // applied to elements of tensors whose decay flag is set
  int64_t step;               // 1-based, for bias correction
  double grad_scale;          // gradients are multiplied by this first (loss normalization x clipping)
  bool stochastic_rounding;   // bf16 outputs (params, bf16 moments) rounded at random instead of to nearest
  uint32_t seed;              // stochastic rounding's random stream: a pure function of (seed, step, index)
};

// The tensors of the flat buffer as a device table: starts[s] is the first element of segment s (sorted,
// starts[0] = 0), decays[s] whether weight decay applies to it. n_segments >= 1.
struct AdamWSegments {
  const int64_t* starts;
  const uint8_t* decays;
  int n_segments;
};

// For each i < n: g = grad[i] grad_scale; master *= 1 - lr wd; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
// master -= lr / (1 - b1^t) m / (sqrt(v) / sqrt(1 - b2^t) + eps); param_bf16 = bf16(master) (when not null).
// master, m, v, param_bf16 UPDATED IN PLACE; grad read only. Math in fp32; elements are independent.
// n % 4 == 0 and 16-byte aligned buffers (the flat buffers are).
void adamw_update(float* master, __nv_bfloat16* param_bf16, const float* grad, float* m, float* v, int64_t n,
                  const AdamWSegments& segments, const AdamWArgs& args, cudaStream_t stream);
// The same with bf16 moments (stored with stochastic rounding when args.stochastic_rounding).
void adamw_update(float* master, __nv_bfloat16* param_bf16, const float* grad, __nv_bfloat16* m,
                  __nv_bfloat16* v, int64_t n, const AdamWSegments& segments, const AdamWArgs& args,
                  cudaStream_t stream);

// Doubles of scratch sum_of_squares needs.
int64_t sum_of_squares_scratch_doubles();

// *total = sum_i x[i]^2 in double. Deterministic: the split into partial sums depends on n only (never on the
// device), and the partials are added in order by one block. OVERWRITES *total (device memory).
void sum_of_squares(double* total, const float* x, int64_t n, double* scratch, cudaStream_t stream);

// dst[i] += src[i] in fp32 over n elements: sharded gradient accumulation (ZeRO-2/3 add each micro-batch's
// reduce-scattered unit gradient into the shard). ACCUMULATES dst.
void accumulate(float* dst, const float* src, int64_t n, cudaStream_t stream);
// out[i] = bf16(in[i]) (round to nearest even): the bf16 working copy of fp32 master weights.
void f32_to_bf16(__nv_bfloat16* out, const float* in, int64_t n, cudaStream_t stream);

// The bf16 working copy of `master` exactly as adamw_update with these args (their step, seed and rounding
// mode) wrote it: with stochastic rounding, the same random bits. What a resume needs to continue bit for
// bit, since checkpoints keep only the fp32 master. OVERWRITES out.
void bf16_params_as_updated(__nv_bfloat16* out, const float* master, int64_t n, const AdamWArgs& args,
                            cudaStream_t stream);

}  // namespace tuna::cuda
