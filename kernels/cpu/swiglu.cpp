// SwiGLU gating of the LLaMA MLP, CPU twin of kernels/swiglu.cu. Elementwise over rows x cols values; gate, up,
// dgate, dup rows are `stride` apart (the halves of a fused gate|up GEMM output), out and dout contiguous.
//
//   forward:  out = silu(gate) * up,  silu(x) = x * sigmoid(x)                      out: OVERWRITTEN
//   backward: dup   = dout * silu(gate)                                             OVERWRITTEN
//             dgate = dout * up * sigmoid(gate) * (1 + gate * (1 - sigmoid(gate)))  OVERWRITTEN
//
// sigmoid(x) = 1 / (1 + exp(-x)) is safe at both ends in IEEE arithmetic: exp(-x) overflows to inf for very
// negative x and the quotient is 0, never NaN. The loops run in blocks (threads over blocks, each block a
// vectorized loop compiled for the CPU's vector units, with exp_lanes: kernels/cpu/vector_math.h); every
// element is computed alone, so neither the split nor the vector width changes a result. Contiguous rows
// (stride == cols) are one long row, so the blocks do not depend on the row width.
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
    // Read everything before writing: a caller may hand dout back as dgate or dup, or gate and up (in place).
    const T grad_out = dout[i];
    const T up_value = up[i];
    dup[i] = grad_out * silu;
    dgate[i] = grad_out * up_value * dsilu;
  }
}

// The work items of rows x cols: blocks of up to kBlock columns of a row. Contiguous rows are one long row
// (row 0 only, so the callers' row offsets vanish).
struct Blocks {
  int64_t rows, cols, per_row;
  Blocks(int64_t r, int64_t c, int64_t stride) : rows(stride == c ? 1 : r), cols(stride == c ? r * c : c),
                                                 per_row((cols + kBlock - 1) / kBlock) {}
  int64_t count() const { return rows * per_row; }
  int64_t row(int64_t b) const { return b / per_row; }
  int64_t col(int64_t b) const { return b % per_row * kBlock; }
  int64_t size(int64_t b) const { return std::min(kBlock, cols - col(b)); }
};

void check_shape(int64_t rows, int64_t cols, int64_t stride) {
  TUNA_CHECK(rows >= 0 && cols >= 0 && stride >= cols, "rows ", rows, ", cols ", cols, ", stride ", stride);
}

}  // namespace

template <typename T>
void swiglu_fwd(T* out, const T* gate, const T* up, int64_t rows, int64_t cols, int64_t stride) {
  check_shape(rows, cols, stride);
  const Blocks blocks(rows, cols, stride);
#pragma omp parallel for schedule(static) if (rows * cols >= kMinParallelWork)
  for (int64_t b = 0; b < blocks.count(); ++b) {
    const int64_t r = blocks.row(b), c = blocks.col(b);
    swiglu_fwd_block(out + r * cols + c, gate + r * stride + c, up + r * stride + c, blocks.size(b));
  }
}

template <typename T>
void swiglu_bwd(T* dgate, T* dup, const T* dout, const T* gate, const T* up, int64_t rows, int64_t cols,
                int64_t stride) {
  check_shape(rows, cols, stride);
  const Blocks blocks(rows, cols, stride);
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks.count(); ++b) {
    const int64_t r = blocks.row(b), c = blocks.col(b), at = r * stride + c;
    swiglu_bwd_block(dgate + at, dup + at, dout + r * cols + c, gate + at, up + at, blocks.size(b));
  }
}

template void swiglu_fwd<float>(float*, const float*, const float*, int64_t, int64_t, int64_t);
template void swiglu_fwd<double>(double*, const double*, const double*, int64_t, int64_t, int64_t);
template void swiglu_bwd<float>(float*, float*, const float*, const float*, const float*, int64_t, int64_t, int64_t);
template void swiglu_bwd<double>(double*, double*, const double*, const double*, const double*, int64_t, int64_t,
                                 int64_t);

}  // namespace tuna::cpu
