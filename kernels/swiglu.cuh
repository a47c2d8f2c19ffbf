// SwiGLU gating on the GPU. Contract of kernels/cpu/swiglu.h, bf16 tensors, fp32 math.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace tuna::cuda {

// Over rows x cols: gate, up (and dgate, dup) rows `stride` elements apart (the halves of a fused gate|up GEMM
// output: stride = 2 cols, up = gate + cols; or stride = cols), out and dout contiguous [rows, cols]; stride >= cols.
// The 16-byte path needs cols and stride multiples of 8 (or stride == cols) and 16-byte aligned pointers; any
// other shape takes an element-wise path.
//
// out = gate sigmoid(gate) up. OVERWRITES out; out may alias gate or up only when stride == cols.
void swiglu_fwd(__nv_bfloat16* out, const __nv_bfloat16* gate, const __nv_bfloat16* up, int64_t rows, int64_t cols,
                int64_t stride, cudaStream_t stream);

// dup = dout silu(gate); dgate = dout up sigmoid(gate) (1 + gate (1 - sigmoid(gate))). OVERWRITES dgate and
// dup; dgate may alias gate and dup up (in place), either may alias dout only when stride == cols (each element
// is read before it is written).
void swiglu_bwd(__nv_bfloat16* dgate, __nv_bfloat16* dup, const __nv_bfloat16* dout, const __nv_bfloat16* gate,
                const __nv_bfloat16* up, int64_t rows, int64_t cols, int64_t stride, cudaStream_t stream);

// The same, each also folding the largest |stored output| into *amax (ACCUMULATES): the FP8 cast's amax of the
// down_proj input (forward: out) and of the gate|up output gradient (backward: dgate and dup together), folded into
// the kernel that writes it (kernels/fp8.cuh).
void swiglu_fwd_amax(__nv_bfloat16* out, const __nv_bfloat16* gate, const __nv_bfloat16* up, int64_t rows,
                     int64_t cols, int64_t stride, float* amax, cudaStream_t stream);
void swiglu_bwd_amax(__nv_bfloat16* dgate, __nv_bfloat16* dup, const __nv_bfloat16* dout, const __nv_bfloat16* gate,
                     const __nv_bfloat16* up, int64_t rows, int64_t cols, int64_t stride, float* amax,
                     cudaStream_t stream);

}  // namespace tuna::cuda
