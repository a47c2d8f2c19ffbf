// RMSNorm on the GPU. Contract of kernels/cpu/rmsnorm.h: bf16 activations, fp32 rstd and fp32 weight gradient.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cpu/grad_write.h"

namespace tuna::cuda {

// rstd[i] = 1 / sqrt(mean_j inp[i, j]^2 + eps),  out[i, j] = w[j] (inp[i, j] rstd[i]).
// Overwrites out and rstd; the outputs must not overlap the inputs. Sums of squares in fp32.
// dim % 8 == 0 and dim <= 16384.
void rmsnorm_fwd(__nv_bfloat16* out, float* rstd, const __nv_bfloat16* inp, const __nv_bfloat16* weight, int64_t n,
                 int64_t dim, double eps, cudaStream_t stream);

// rmsnorm_fwd, and *amax = max(*amax, max |out|) over the stored bf16 out: the FP8 cast's amax of the q/k/v or
// gate/up input folded into the norm that writes it (kernels/fp8.cuh; ACCUMULATES into *amax).
void rmsnorm_fwd_amax(__nv_bfloat16* out, float* rstd, const __nv_bfloat16* inp, const __nv_bfloat16* weight,
                      int64_t n, int64_t dim, double eps, float* amax, cudaStream_t stream);

// Floats of scratch rmsnorm_bwd needs for (n, dim): the per-row-block partial sums of dweight.
int64_t rmsnorm_bwd_scratch_floats(int64_t n, int64_t dim);

// dinp[i, j] += r (w[j] g[i, j] - x[i, j] r^2 mean_k(w[k] g[i, k] x[i, k]))   ACCUMULATES (bf16: the residual
//                                                                            stream's gradient)
// dweight[j] (= or +=, by dweight_write) sum_i g[i, j] x[i, j] r[i]            fp32; Overwrite never reads it
//                                                                            (kernels/cpu/grad_write.h); null:
//                                                                            not computed (a frozen weight)
// Deterministic: dweight sums fixed 32-row slabs into scratch, then the slabs in a fixed order. dinp must not
// overlap dout or inp. dim % 8 == 0 and dim <= 16384.
void rmsnorm_bwd(__nv_bfloat16* dinp, float* dweight, const __nv_bfloat16* dout, const __nv_bfloat16* inp,
                 const __nv_bfloat16* weight, const float* rstd, float* scratch, int64_t n, int64_t dim,
                 GradWrite dweight_write, cudaStream_t stream);

// rmsnorm_bwd, and *amax = max(*amax, max |dinp|) over the stored sums: the residual gradient's amax, the FP8 cast's
// of the o_proj and down_proj output gradients, folded into the norm that writes it (ACCUMULATES into *amax).
void rmsnorm_bwd_amax(__nv_bfloat16* dinp, float* dweight, const __nv_bfloat16* dout, const __nv_bfloat16* inp,
                      const __nv_bfloat16* weight, const float* rstd, float* scratch, int64_t n, int64_t dim,
                      GradWrite dweight_write, float* amax, cudaStream_t stream);

}  // namespace tuna::cuda
