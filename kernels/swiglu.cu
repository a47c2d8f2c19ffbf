// SwiGLU gating of the LLaMA MLP on the GPU, the twin of kernels/cpu/swiglu.cpp. Elementwise over n.
//
//   forward:  out = silu(gate) * up,  silu(x) = x sigmoid(x)                        out: OVERWRITTEN
//   backward: dup = dout silu(gate);  dgate = dout up sigmoid(gate) (1 + gate (1 - sigmoid(gate)))
//                                                                                   dgate, dup: OVERWRITTEN
//
// Memory-bound: per element the forward moves 6 bytes (gate, up read; out written), the backward 10 (dout,
// gate, up read; dgate, dup written). A thread owns kVecs 8-wide vectors (16-byte accesses; vector k of a
// block's thread t is block_vector0 + k * kThreads + t, so each warp access is one 512-byte run) and issues
// every load before any math: 64 B of each input in flight per thread (128 B forward, 192 B backward). At
// 58 / 72 registers (ptxas, sm_90a) an SM holds 4 / 3 blocks of 256, ~130 / ~150 KB in flight, five times the
// ~26 KB per SM that Little's law asks at 4.8 TB/s and ~0.7 us (the old kernel had one vector per thread
// and tensor in flight, ~48-96 KB a full SM, with no slack for the tail of a wave). Unmeasured
// on hardware so far: bench/bench_memory_gpu.cpp reports both against a device copy. The math per element
// (an exp and a divide) is far below the issue rate at these byte counts. A tail of n % 8 elements is done
// one by one by the first threads. sigmoid(x) = 1 / (1 + exp(-x)) in fp32 saturates cleanly at both ends
// (exp overflow gives 0). out may alias gate or up (and dgate, dup may alias dout): each thread reads its
// elements before it writes the same elements.
#include "kernels/swiglu.cuh"

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common.cuh"

namespace tuna::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kVecs = 4;

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

__device__ __forceinline__ float swiglu_value(float g, float u) { return g * sigmoid(g) * u; }

__device__ __forceinline__ void swiglu_grad(float d, float g, float u, float& dg, float& du) {
  const float sig = sigmoid(g);
  du = d * g * sig;
  dg = d * u * sig * (1.0f + g * (1.0f - sig));
}

// Index of this thread's vector k.
__device__ __forceinline__ int64_t vector_index(int k) {
  return (static_cast<int64_t>(blockIdx.x) * kVecs + k) * kThreads + threadIdx.x;
}

// This thread's kVecs vectors of src (zeros past the n_vec whole vectors).
__device__ __forceinline__ void load_vectors(Packed8 (&dst)[kVecs], const bf16* src, int64_t n_vec) {
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int64_t v = vector_index(k);
    dst[k] = v < n_vec ? load_packed_stream(src + v * 8) : zeros_packed();
  }
}

// The n % 8 trailing elements, one per thread of the grid's first threads.
__device__ __forceinline__ int64_t tail_element(int64_t n) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  return t < n % 8 ? n / 8 * 8 + t : -1;
}

__global__ void __launch_bounds__(kThreads) swiglu_fwd_kernel(bf16* out, const bf16* gate, const bf16* up, int64_t n) {
  const int64_t n_vec = n / 8;
  Packed8 g[kVecs], u[kVecs];
  load_vectors(g, gate, n_vec);
  load_vectors(u, up, n_vec);
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int64_t v = vector_index(k);
    if (v >= n_vec) break;
    float y[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) y[j] = swiglu_value(unpack(g[k], j), unpack(u[k], j));
    store_packed(out + v * 8, pack8(y));
  }
  const int64_t tail = tail_element(n);
  if (tail >= 0) out[tail] = __float2bfloat16(swiglu_value(__bfloat162float(gate[tail]), __bfloat162float(up[tail])));
}

__global__ void __launch_bounds__(kThreads)
    swiglu_bwd_kernel(bf16* dgate, bf16* dup, const bf16* dout, const bf16* gate, const bf16* up, int64_t n) {
  const int64_t n_vec = n / 8;
  Packed8 d[kVecs], g[kVecs], u[kVecs];
  load_vectors(d, dout, n_vec);
  load_vectors(g, gate, n_vec);
  load_vectors(u, up, n_vec);
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int64_t v = vector_index(k);
    if (v >= n_vec) break;
    float dg[8], du[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) swiglu_grad(unpack(d[k], j), unpack(g[k], j), unpack(u[k], j), dg[j], du[j]);
    store_packed(dgate + v * 8, pack8(dg));
    store_packed(dup + v * 8, pack8(du));
  }
  const int64_t tail = tail_element(n);
  if (tail >= 0) {
    float a, b;
    swiglu_grad(__bfloat162float(dout[tail]), __bfloat162float(gate[tail]), __bfloat162float(up[tail]), a, b);
    dgate[tail] = __float2bfloat16(a);
    dup[tail] = __float2bfloat16(b);
  }
}

unsigned grid_for(int64_t n) { return static_cast<unsigned>(std::max<int64_t>(1, ceil_div(n / 8, kThreads * kVecs))); }

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
