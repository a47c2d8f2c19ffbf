// SwiGLU gating on the GPU. Contract of kernels/cpu/swiglu.h, bf16 tensors, fp32 math.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace tuna::cuda {

// out[i] = gate[i] sigmoid(gate[i]) up[i] over n elements. OVERWRITES out (out may alias gate or up).
void swiglu_fwd(__nv_bfloat16* out, const __nv_bfloat16* gate, const __nv_bfloat16* up, int64_t n,
                cudaStream_t stream);

// dup = dout silu(gate); dgate = dout up sigmoid(gate) (1 + gate (1 - sigmoid(gate))). OVERWRITES dgate and
// dup; either may alias dout (each element is read before it is written).
void swiglu_bwd(__nv_bfloat16* dgate, __nv_bfloat16* dup, const __nv_bfloat16* dout, const __nv_bfloat16* gate,
                const __nv_bfloat16* up, int64_t n, cudaStream_t stream);

}  // namespace tuna::cuda
