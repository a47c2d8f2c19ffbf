// SwiGLU gating of the LLaMA MLP: silu(gate) * up. CPU twin of kernels/swiglu.cuh.
#pragma once
#include <cstdint>

namespace tuna::cpu {

// Over rows x cols: gate, up (and dgate, dup) have rows `stride` elements apart, so that they can be the two
// halves of one fused [rows, 2 cols] GEMM output (stride = 2 cols, up = gate + cols) or plain arrays (stride =
// cols); out and dout are contiguous [rows, cols]. stride >= cols.
//
// out[r, c] = gate[r, c] * sigmoid(gate[r, c]) * up[r, c]. Overwrites out; out may alias gate or up only when
// stride == cols.
template <typename T>
void swiglu_fwd(T* out, const T* gate, const T* up, int64_t rows, int64_t cols, int64_t stride);

// dgate, dup from dout. Overwrites dgate and dup. dgate may alias gate and dup up (in place, same stride);
// either may alias dout only when stride == cols.
template <typename T>
void swiglu_bwd(T* dgate, T* dup, const T* dout, const T* gate, const T* up, int64_t rows, int64_t cols,
                int64_t stride);

}  // namespace tuna::cpu
