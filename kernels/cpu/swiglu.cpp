// SwiGLU gating of the LLaMA MLP, CPU twin of kernels/swiglu.cu. Elementwise over n values.
//
//   forward:  out = silu(gate) * up,  silu(x) = x * sigmoid(x)                      out: OVERWRITTEN
//   backward: dup   = dout * silu(gate)                                             OVERWRITTEN
//             dgate = dout * up * sigmoid(gate) * (1 + gate * (1 - sigmoid(gate)))  OVERWRITTEN
//
// sigmoid(x) = 1 / (1 + exp(-x)) is safe at both ends in IEEE arithmetic: exp(-x) overflows to inf for very
// negative x and the quotient is 0, never NaN.
#include "kernels/cpu/swiglu.h"

#include <cmath>

#include "core/error.h"

namespace tuna::cpu {
namespace {

template <typename T>
T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

}  // namespace

template <typename T>
void swiglu_fwd(T* out, const T* gate, const T* up, int64_t n) {
  TUNA_CHECK(n >= 0, "n ", n);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] * sigmoid(gate[i]) * up[i];
}

template <typename T>
void swiglu_bwd(T* dgate, T* dup, const T* dout, const T* gate, const T* up, int64_t n) {
  TUNA_CHECK(n >= 0, "n ", n);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const T g = gate[i];
    const T sig = sigmoid(g);
    const T silu = g * sig;
    const T dsilu = sig * (T(1) + g * (T(1) - sig));
    // Read everything before writing: a caller may hand dout back as dgate or dup.
    const T grad_out = dout[i];
    const T up_value = up[i];
    dup[i] = grad_out * silu;
    dgate[i] = grad_out * up_value * dsilu;
  }
}

template void swiglu_fwd<float>(float*, const float*, const float*, int64_t);
template void swiglu_fwd<double>(double*, const double*, const double*, int64_t);
template void swiglu_bwd<float>(float*, float*, const float*, const float*, const float*, int64_t);
template void swiglu_bwd<double>(double*, double*, const double*, const double*, const double*, int64_t);

}  // namespace tuna::cpu
