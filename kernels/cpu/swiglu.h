// SwiGLU gating of the LLaMA MLP: silu(gate) * up. CPU twin of kernels/swiglu.cuh.
#pragma once
#include <cstdint>

namespace tuna::cpu {

// out[i] = gate[i] * sigmoid(gate[i]) * up[i] over n elements. Overwrites out.
template <typename T>
void swiglu_fwd(T* out, const T* gate, const T* up, int64_t n);

// dgate[i], dup[i] from dout[i]. Overwrites dgate and dup.
template <typename T>
void swiglu_bwd(T* dgate, T* dup, const T* dout, const T* gate, const T* up, int64_t n);

}  // namespace tuna::cpu
