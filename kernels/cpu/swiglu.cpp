// SwiGLU gating of the LLaMA MLP, CPU twin of kernels/swiglu.cu. Elementwise over n values.
//
//   forward:  out = silu(gate) * up,  silu(x) = x * sigmoid(x)                      out: OVERWRITTEN
//   backward: dup   = dout * silu(gate)                                             OVERWRITTEN
//             dgate = dout * up * sigmoid(gate) * (1 + gate * (1 - sigmoid(gate)))  OVERWRITTEN
//
// sigmoid(x) = 1 / (1 + exp(-x)) is safe at both ends in IEEE arithmetic: exp(-x) overflows to inf for very
// negative x and the quotient is 0, never NaN. The loops run in blocks (threads over blocks, each block a
// vectorized loop compiled for the CPU's vector units, with exp_lanes: kernels/cpu/vector_math.h); every
// element is computed alone, so neither the split nor the vector width changes a result.
#include "kernels/cpu/swiglu.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/vector_math.h"

namespace tuna::cpu {
namespace {

// Elements per parallel work item: big enough to amortize the scheduling, small enough to share 2-16 cores.
constexpr int64_t kBlock = 4096;

template <typename T>
T sigmoid(T x) {
  return T(1) / (T(1) + exp_lanes(-x));
}

template <typename T>
TUNA_CPU_CLONES void swiglu_fwd_block(T* out, const T* gate, const T* up, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] * sigmoid(gate[i]) * up[i];
}

template <typename T>
TUNA_CPU_CLONES void swiglu_bwd_block(T* dgate, T* dup, const T* dout, const T* gate, const T* up, int64_t n) {
#pragma omp simd
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

}  // namespace

template <typename T>
void swiglu_fwd(T* out, const T* gate, const T* up, int64_t n) {
  TUNA_CHECK(n >= 0, "n ", n);
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (n >= kMinParallelWork)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kBlock, count = std::min(kBlock, n - begin);
    swiglu_fwd_block(out + begin, gate + begin, up + begin, count);
  }
}

template <typename T>
void swiglu_bwd(T* dgate, T* dup, const T* dout, const T* gate, const T* up, int64_t n) {
  TUNA_CHECK(n >= 0, "n ", n);
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kBlock, count = std::min(kBlock, n - begin);
    swiglu_bwd_block(dgate + begin, dup + begin, dout + begin, gate + begin, up + begin, count);
  }
}

template void swiglu_fwd<float>(float*, const float*, const float*, int64_t);
template void swiglu_fwd<double>(double*, const double*, const double*, int64_t);
template void swiglu_bwd<float>(float*, float*, const float*, const float*, const float*, int64_t);
template void swiglu_bwd<double>(double*, double*, const double*, const double*, const double*, int64_t);

}  // namespace tuna::cpu
