// SwiGLU gating of the LLaMA MLP on the GPU, the twin of kernels/cpu/swiglu.cpp. Elementwise over n.
//
//   forward:  out = silu(gate) * up,  silu(x) = x sigmoid(x)                        out: OVERWRITTEN
//   backward: dup = dout silu(gate);  dgate = dout up sigmoid(gate) (1 + gate (1 - sigmoid(gate)))
//                                                                                   dgate, dup: OVERWRITTEN
//
// 8 elements per thread with 16-byte accesses; a tail of n % 8 elements is done one by one by the first
// threads. sigmoid(x) = 1 / (1 + exp(-x)) in fp32 saturates cleanly at both ends (exp overflow gives 0).
#include "kernels/swiglu.cuh"

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common.cuh"

namespace tuna::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

__device__ __forceinline__ float swiglu_value(float g, float u) { return g * sigmoid(g) * u; }

__device__ __forceinline__ void swiglu_grad(float d, float g, float u, float& dg, float& du) {
  const float sig = sigmoid(g);
  du = d * g * sig;
  dg = d * u * sig * (1.0f + g * (1.0f - sig));
}

__global__ void swiglu_fwd_kernel(bf16* out, const bf16* gate, const bf16* up, int64_t n) {
  const int64_t v = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t n_vec = n / 8;
  if (v < n_vec) {
    const Bf16x8 g = load8_stream(gate + v * 8), u = load8_stream(up + v * 8);
    Bf16x8 y;
#pragma unroll
    for (int j = 0; j < 8; ++j) y.v[j] = __float2bfloat16(swiglu_value(__bfloat162float(g.v[j]), __bfloat162float(u.v[j])));
    store8(out + v * 8, y);
  }
  const int64_t tail = n_vec * 8 + v;
  if (tail < n && v < 8)
    out[tail] = __float2bfloat16(swiglu_value(__bfloat162float(gate[tail]), __bfloat162float(up[tail])));
}

__global__ void swiglu_bwd_kernel(bf16* dgate, bf16* dup, const bf16* dout, const bf16* gate, const bf16* up,
                                  int64_t n) {
  const int64_t v = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t n_vec = n / 8;
  if (v < n_vec) {
    const Bf16x8 d = load8_stream(dout + v * 8), g = load8_stream(gate + v * 8), u = load8_stream(up + v * 8);
    Bf16x8 dg, du;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float a, b;
      swiglu_grad(__bfloat162float(d.v[j]), __bfloat162float(g.v[j]), __bfloat162float(u.v[j]), a, b);
      dg.v[j] = __float2bfloat16(a);
      du.v[j] = __float2bfloat16(b);
    }
    store8(dgate + v * 8, dg);
    store8(dup + v * 8, du);
  }
  const int64_t tail = n_vec * 8 + v;
  if (tail < n && v < 8) {
    float a, b;
    swiglu_grad(__bfloat162float(dout[tail]), __bfloat162float(gate[tail]), __bfloat162float(up[tail]), a, b);
    dgate[tail] = __float2bfloat16(a);
    dup[tail] = __float2bfloat16(b);
  }
}

unsigned grid_for(int64_t n) { return static_cast<unsigned>(ceil_div(ceil_div(n, 8) + 1, kThreads)); }

}  // namespace

void swiglu_fwd(bf16* out, const bf16* gate, const bf16* up, int64_t n, cudaStream_t stream) {
  TUNA_CHECK(n >= 0, "n ", n);
  if (n == 0) return;
  launch_kernel(swiglu_fwd_kernel, grid_for(n), kThreads, 0, stream, out, gate, up, n);
  TUNA_CUDA_CHECK_LAUNCH();
}

void swiglu_bwd(bf16* dgate, bf16* dup, const bf16* dout, const bf16* gate, const bf16* up, int64_t n,
                cudaStream_t stream) {
  TUNA_CHECK(n >= 0, "n ", n);
  if (n == 0) return;
  launch_kernel(swiglu_bwd_kernel, grid_for(n), kThreads, 0, stream, dgate, dup, dout, gate, up, n);
  TUNA_CUDA_CHECK_LAUNCH();
}

}  // namespace tuna::cuda
