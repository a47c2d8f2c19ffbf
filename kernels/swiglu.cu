// SwiGLU gating of the LLaMA MLP on the GPU, the twin of kernels/cpu/swiglu.cpp. Elementwise over rows x cols;
// gate, up, dgate, dup rows `stride` apart (the model passes the two halves of its fused gate|up GEMM output,
// stride 2F), out and dout contiguous.
//
//   forward:  out = silu(gate) * up,  silu(x) = x sigmoid(x)                        out: OVERWRITTEN
//   backward: dup = dout silu(gate);  dgate = dout up sigmoid(gate) (1 + gate (1 - sigmoid(gate)))
//                                                                                   dgate, dup: OVERWRITTEN
//
// Memory-bound (6 bytes an element forward, 10 backward; an exp and a divide are far below the issue rate). A
// thread owns kVecs 8-wide vectors (16-byte accesses, a warp's access one 512-byte run) and issues every load
// before any math, so each SM has several times the bytes in flight that DRAM latency asks. With strided rows a
// vector never crosses a row end (its row: one 32-bit division per vector); contiguous rows are one long row
// with an element-wise tail; rows off 16-byte alignment (tests) take the element-wise path. sigmoid(x) =
// 1 / (1 + exp(-x)) in fp32 saturates cleanly at both ends. The _amax variants fold max |output| into one fp32 (FP8
// training's per-tensor scale, kernels/fp8.cuh) from the values they store: no pass of its own. out may alias gate or up when stride == cols; dgate
// and dup may alias gate and up, and dout when stride == cols: a thread reads its elements before writing them.
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

// Where the kernels work: rows x cols, gate/up/dgate/dup rows `stride` apart, out/dout rows `cols` apart. The
// first vecs_per_row * 8 columns of each row go as 16-byte vectors (none on the element-wise path), the
// tail_cols after them one element a thread.
struct Shape {
  int64_t cols, stride, vecs_per_row, n_vec, tail_cols, n_tail;
};

// Offsets (in gate/up, in out/dout) of this thread's vector k, or -1 past the last vector.
struct VectorAt {
  int64_t in, out;
};
__device__ __forceinline__ VectorAt vector_at(const Shape& sh, int k) {
  const int64_t v = (static_cast<int64_t>(blockIdx.x) * kVecs + k) * kThreads + threadIdx.x;
  if (v >= sh.n_vec) return {-1, -1};
  // One long row has no row to find; strided rows take a 32-bit division (make_shape checks n_vec < 2^32): a
  // few instructions per vector where a 64-bit one costs dozens, in a kernel that should run at copy speed.
  const int64_t row =
      sh.vecs_per_row == sh.n_vec ? 0 : static_cast<uint32_t>(v) / static_cast<uint32_t>(sh.vecs_per_row);
  const int64_t col = (v - row * sh.vecs_per_row) * 8;
  return {row * sh.stride + col, row * sh.cols + col};
}

// This thread's kVecs vectors of src (zeros past the last vector).
__device__ __forceinline__ void load_vectors(Packed8 (&dst)[kVecs], const bf16* src, const VectorAt (&at)[kVecs],
                                             bool out_side) {
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int64_t offset = out_side ? at[k].out : at[k].in;
    dst[k] = offset >= 0 ? load_packed_stream(src + offset) : zeros_packed();
  }
}

// The elements past the vectors, a grid-stride loop (the element-wise path has no vectors, so the whole tensor
// comes this way): f(in offset, out offset).
template <typename F>
__device__ __forceinline__ void for_tail_elements(const Shape& sh, F f) {
  const int64_t threads = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; t < sh.n_tail; t += threads) {
    const int64_t row = t / sh.tail_cols, col = sh.vecs_per_row * 8 + (t - row * sh.tail_cols);
    f(row * sh.stride + col, row * sh.cols + col);
  }
}

// kAmax (here and below): also folds max |output| (the stored bf16 values) into *amax, the FP8 cast's scale.
template <bool kAmax>
__global__ void __launch_bounds__(kThreads)
    swiglu_fwd_kernel(bf16* out, const bf16* gate, const bf16* up, Shape sh, float* amax) {
  uint32_t amax_bits = 0;
  VectorAt at[kVecs];
#pragma unroll
  for (int k = 0; k < kVecs; ++k) at[k] = vector_at(sh, k);
  Packed8 g[kVecs], u[kVecs];
  load_vectors(g, gate, at, /*out_side=*/false);
  load_vectors(u, up, at, /*out_side=*/false);
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    if (at[k].in < 0) break;
    float y[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) y[j] = swiglu_value(unpack(g[k], j), unpack(u[k], j));
    const Packed8 packed = pack8(y);
    if constexpr (kAmax) amax_bits = max(amax_bits, abs_max_bits(packed));
    store_packed(out + at[k].out, packed);
  }
  for_tail_elements(sh, [&](int64_t in, int64_t o) {
    const bf16 y = __float2bfloat16(swiglu_value(__bfloat162float(gate[in]), __bfloat162float(up[in])));
    if constexpr (kAmax) amax_bits = max(amax_bits, abs_bits(__bfloat162float(y)));
    out[o] = y;
  });
  if constexpr (kAmax) fold_amax(amax, amax_bits);
}

template <bool kAmax>
__global__ void __launch_bounds__(kThreads)
    swiglu_bwd_kernel(bf16* dgate, bf16* dup, const bf16* dout, const bf16* gate, const bf16* up, Shape sh,
                      float* amax) {
  uint32_t amax_bits = 0;
  VectorAt at[kVecs];
#pragma unroll
  for (int k = 0; k < kVecs; ++k) at[k] = vector_at(sh, k);
  Packed8 d[kVecs], g[kVecs], u[kVecs];
  load_vectors(d, dout, at, /*out_side=*/true);
  load_vectors(g, gate, at, /*out_side=*/false);
  load_vectors(u, up, at, /*out_side=*/false);
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    if (at[k].in < 0) break;
    float dg[8], du[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) swiglu_grad(unpack(d[k], j), unpack(g[k], j), unpack(u[k], j), dg[j], du[j]);
    const Packed8 packed_dg = pack8(dg), packed_du = pack8(du);
    if constexpr (kAmax) amax_bits = max(amax_bits, max(abs_max_bits(packed_dg), abs_max_bits(packed_du)));
    store_packed(dgate + at[k].in, packed_dg);
    store_packed(dup + at[k].in, packed_du);
  }
  for_tail_elements(sh, [&](int64_t in, int64_t o) {
    float a, b;
    swiglu_grad(__bfloat162float(dout[o]), __bfloat162float(gate[in]), __bfloat162float(up[in]), a, b);
    const bf16 ga = __float2bfloat16(a), gb = __float2bfloat16(b);
    if constexpr (kAmax)
      amax_bits = max(amax_bits, max(abs_bits(__bfloat162float(ga)), abs_bits(__bfloat162float(gb))));
    dgate[in] = ga;
    dup[in] = gb;
  });
  if constexpr (kAmax) fold_amax(amax, amax_bits);
}

// The shape the kernels see: contiguous rows become one long row (vectors across row ends, a tail at the very
// end only); strided rows take vectors when every row starts 16-byte aligned.
Shape make_shape(int64_t rows, int64_t cols, int64_t stride, bool pointers_aligned) {
  TUNA_CHECK(rows >= 0 && cols >= 0 && stride >= cols, "swiglu: rows ", rows, ", cols ", cols, ", stride ", stride);
  if (stride == cols) cols *= rows, rows = 1, stride = cols;
  Shape sh{};
  sh.cols = cols, sh.stride = stride;
  const bool vectors = pointers_aligned && stride % 8 == 0 && (cols % 8 == 0 || rows == 1);
  sh.vecs_per_row = vectors ? cols / 8 : 0;
  sh.n_vec = rows * sh.vecs_per_row;
  TUNA_CHECK(rows == 1 || sh.n_vec < (int64_t{1} << 32), "swiglu: ", sh.n_vec, " vectors over ", rows,
             " rows (the kernel's row arithmetic is 32-bit)");
  sh.tail_cols = cols - sh.vecs_per_row * 8;
  sh.n_tail = rows * sh.tail_cols;
  return sh;
}

// Enough blocks for the vectors, and at least enough threads for the tail up to a cap (the tail loop strides).
unsigned grid_for(const Shape& sh) {
  const int64_t vector_blocks = ceil_div(sh.n_vec, kThreads * kVecs);
  const int64_t tail_blocks = std::min<int64_t>(ceil_div(sh.n_tail, kThreads), int64_t(1) << 16);
  return static_cast<unsigned>(std::max<int64_t>(1, std::max(vector_blocks, tail_blocks)));
}

template <bool kAmax>
void launch_fwd(bf16* out, const bf16* gate, const bf16* up, int64_t rows, int64_t cols, int64_t stride, float* amax,
                cudaStream_t stream) {
  const Shape sh = make_shape(rows, cols, stride, aligned16(out) && aligned16(gate) && aligned16(up));
  if (sh.n_vec == 0 && sh.n_tail == 0) return;
  launch_kernel(swiglu_fwd_kernel<kAmax>, grid_for(sh), kThreads, 0, stream, out, gate, up, sh, amax);
  TUNA_CUDA_CHECK_LAUNCH();
}

template <bool kAmax>
void launch_bwd(bf16* dgate, bf16* dup, const bf16* dout, const bf16* gate, const bf16* up, int64_t rows, int64_t cols,
                int64_t stride, float* amax, cudaStream_t stream) {
  const bool aligned = aligned16(dgate) && aligned16(dup) && aligned16(dout) && aligned16(gate) && aligned16(up);
  const Shape sh = make_shape(rows, cols, stride, aligned);
  if (sh.n_vec == 0 && sh.n_tail == 0) return;
  launch_kernel(swiglu_bwd_kernel<kAmax>, grid_for(sh), kThreads, 0, stream, dgate, dup, dout, gate, up, sh, amax);
  TUNA_CUDA_CHECK_LAUNCH();
}

}  // namespace

void swiglu_fwd(bf16* out, const bf16* gate, const bf16* up, int64_t rows, int64_t cols, int64_t stride,
                cudaStream_t stream) {
  launch_fwd</*kAmax=*/false>(out, gate, up, rows, cols, stride, nullptr, stream);
}

void swiglu_fwd_amax(bf16* out, const bf16* gate, const bf16* up, int64_t rows, int64_t cols, int64_t stride,
                     float* amax, cudaStream_t stream) {
  TUNA_CHECK(amax != nullptr, "swiglu_fwd_amax: no amax (swiglu_fwd is the gating alone)");
  launch_fwd</*kAmax=*/true>(out, gate, up, rows, cols, stride, amax, stream);
}

void swiglu_bwd(bf16* dgate, bf16* dup, const bf16* dout, const bf16* gate, const bf16* up, int64_t rows,
                int64_t cols, int64_t stride, cudaStream_t stream) {
  launch_bwd</*kAmax=*/false>(dgate, dup, dout, gate, up, rows, cols, stride, nullptr, stream);
}

void swiglu_bwd_amax(bf16* dgate, bf16* dup, const bf16* dout, const bf16* gate, const bf16* up, int64_t rows,
                     int64_t cols, int64_t stride, float* amax, cudaStream_t stream) {
  TUNA_CHECK(amax != nullptr, "swiglu_bwd_amax: no amax (swiglu_bwd is the gradient alone)");
  launch_bwd</*kAmax=*/true>(dgate, dup, dout, gate, up, rows, cols, stride, amax, stream);
}

}  // namespace tuna::cuda
