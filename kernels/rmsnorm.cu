// RMSNorm (HF LlamaRMSNorm) on the GPU, the twin of kernels/cpu/rmsnorm.cpp; the contract is rmsnorm.cuh's.
//
// Memory-bound (per element the forward moves 4 bytes, the backward 8), so the rule is one read of each row and
// enough bytes in flight to cover DRAM latency (~26 KB per SM on an H200, by Little's law):
// - A block spans a row; each thread keeps its 8-wide vectors of the row in registers (16-byte loads, a warp's
//   access one contiguous 512-byte run), loaded before the row's reduction, kRows rows per batched reduction
//   (one barrier). Row and vector counts per dim: fwd_shape, bwd_shape; every register array is unrolled, so
//   nothing spills.
// - dweight is deterministic without atomics: each block sums a fixed slab of kSlabRows rows (a function of n
//   alone) into scratch, and a second kernel adds the slabs in slab order.
// - The _amax variants fold max |output| into one fp32 (FP8 training's per-tensor scale, kernels/fp8.cuh) from the
//   registers they store from: the amax costs no pass over the tensor, one barrier and one atomic a block.
#include "kernels/rmsnorm.cuh"

#include <type_traits>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common.cuh"
#include "kernels/scratch.h"

namespace tuna::cuda {
namespace {

constexpr int kMaxThreads = 512;
constexpr int kMaxVecs = 4;
constexpr int64_t kMaxDim = int64_t(kMaxThreads) * kMaxVecs * 8;
// Rows per dweight partial sum (kernels/scratch.h sizes the scratch): 32, as 64-row slabs would leave half of an
// H200's SMs without a block at n = 4096 (70B, one sequence a rank).
constexpr int kSlabRows = 32;
constexpr int kFwdRows = 2;            // rows loaded together in the forward
constexpr int kFwdRowsPerBlock = 8;    // rows per forward block (4 batches): amortizes the weight load
constexpr int kReduceColumnLanes = 8;  // dweight reduction: float4 column groups per block (32 columns)
constexpr int kReduceSlabLanes = 32;   // ... and slab lanes per column group

// Block shape for a row of `dim`: `vecs` 8-wide vectors per thread, a multiple of 32 threads covering them,
// and (backward) `rows` rows loaded together.
struct RowShape {
  int vecs, threads, rows;
};
RowShape row_shape(int64_t dim, int vecs, int rows) {
  return {vecs, static_cast<int>(ceil_div(ceil_div(dim / 8, vecs), 32) * 32), rows};
}
// Forward: 4 vectors a thread from dim 520 up (fewer below, so a block is never less than a warp).
RowShape fwd_shape(int64_t dim) {
  const int64_t vectors = dim / 8;
  return row_shape(dim, vectors <= 32 ? 1 : vectors <= 64 ? 2 : kMaxVecs, kFwdRows);
}
// Backward: what one block has in flight is rows x 3 tensors x dim x 2 bytes whatever the vectors a thread,
// so small dims load more rows at once (the slab count, n / 32, bounds the blocks: 256 at n = 8192). dim 2048
// (LLaMA 1B): 2 vectors x 4 rows, 128 threads, 48 KB; 4096: 4 x 2, 128 threads, 48 KB; 8192: 4 x 2, 256
// threads, 96 KB; 16384: 4 x 1 (512 threads allow 128 registers), 96 KB.
RowShape bwd_shape(int64_t dim) {
  const int64_t vectors = dim / 8;
  if (vectors <= 32) return row_shape(dim, 1, 2);
  if (vectors <= 256) return row_shape(dim, 2, 4);
  if (vectors <= 1024) return row_shape(dim, kMaxVecs, 2);
  return row_shape(dim, kMaxVecs, 1);
}

// Column of thread `t`'s vector v, or -1 past the row's end.
__device__ __forceinline__ int vector_column(int v, int dim) {
  const int c = (v * static_cast<int>(blockDim.x) + static_cast<int>(threadIdx.x)) * 8;
  return c < dim ? c : -1;
}

// The row's vectors and the weight stay packed across the reduction (kernels/common.cuh: keep_packed).
template <int kRows, int kVecs>
__device__ __forceinline__ void keep_row_packed(Packed8 (&row)[kRows][kVecs], Packed8 (&w)[kVecs]) {
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int v = 0; v < kVecs; ++v) keep_packed(row[r][v]);
#pragma unroll
  for (int v = 0; v < kVecs; ++v) keep_packed(w[v]);
}

template <int kVecs>
__device__ __forceinline__ void load_weight(Packed8 (&w)[kVecs], const bf16* weight, int dim) {
#pragma unroll
  for (int v = 0; v < kVecs; ++v) {
    const int c = vector_column(v, dim);
    w[v] = c >= 0 ? load_packed(weight + c) : zeros_packed();
  }
}

// The kRows x kVecs vectors of this thread in rows row0, row0 + 1, ...; zeros for a row at or past row_end
// and for a column past the row's end.
template <int kRows, int kVecs>
__device__ __forceinline__ void load_rows(Packed8 (&dst)[kRows][kVecs], const bf16* src, int64_t row0,
                                          int64_t row_end, int dim) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t row = row0 + r;
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const int c = vector_column(v, dim);
      dst[r][v] = row < row_end && c >= 0 ? load_packed_stream(src + row * dim + c) : zeros_packed();
    }
  }
}

// kAmax: also folds max |out| (the stored bf16 values) into *amax, the FP8 cast's scale (kernels/fp8.cuh).
template <int kVecs, bool kAmax>
__global__ void __launch_bounds__(kMaxThreads)
    rmsnorm_fwd_kernel(bf16* __restrict__ out, float* __restrict__ rstd, const bf16* __restrict__ inp,
                       const bf16* __restrict__ weight, int64_t n, int dim, float eps, float* __restrict__ amax) {
  __shared__ float scratch[2 * kFwdRows * (kMaxThreads / 32)];
  uint32_t amax_bits = 0;
  Packed8 w[kVecs];
  load_weight(w, weight, dim);
  const int64_t block_row0 = static_cast<int64_t>(blockIdx.x) * kFwdRowsPerBlock;
  const int64_t block_rows_end = min(n, block_row0 + kFwdRowsPerBlock);
  int parity = 0;
  for (int64_t row0 = block_row0; row0 < block_rows_end; row0 += kFwdRows, parity ^= 1) {
    // Every load of the kFwdRows rows first; a row past the block's end reads as zeros and stores nothing.
    Packed8 x[kFwdRows][kVecs];
    load_rows(x, inp, row0, block_rows_end, dim);
    float sum_sq[kFwdRows];
#pragma unroll
    for (int r = 0; r < kFwdRows; ++r) {
      sum_sq[r] = 0.0f;
#pragma unroll
      for (int v = 0; v < kVecs; ++v)
#pragma unroll
        for (int j = 0; j < 8; ++j) sum_sq[r] += unpack(x[r][v], j) * unpack(x[r][v], j);
    }
    block_sum_batched(sum_sq, scratch, parity);
    keep_row_packed(x, w);
#pragma unroll
    for (int r = 0; r < kFwdRows; ++r) {
      const int64_t row = row0 + r;
      if (row >= block_rows_end) break;
      const float rs = rsqrtf(sum_sq[r] / static_cast<float>(dim) + eps);
      if (threadIdx.x == 0) rstd[row] = rs;
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        const int c = vector_column(v, dim);
        if (c < 0) continue;
        float y[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) y[j] = unpack(w[v], j) * (unpack(x[r][v], j) * rs);
        const Packed8 packed = pack8(y);
        if constexpr (kAmax) amax_bits = max(amax_bits, abs_max_bits(packed));
        store_packed(out + row * dim + c, packed);
      }
    }
  }
  if constexpr (kAmax) fold_amax(amax, amax_bits);
}

// The backward's register budget decides kRows (bwd_shape): several rows in flight fit 255 registers with up
// to 256 threads; 512 threads (dims above 8192) cap a thread at 128, so one row.
constexpr int bwd_max_threads(int rows) { return rows > 1 ? 256 : kMaxThreads; }

// One block per slab of kSlabRows rows; writes the slab's dweight sums to partial[slab, :].
// kAmax: also folds max |dinp| (the stored sums) into *amax, the FP8 cast's scale of the residual gradient.
template <int kVecs, int kRows, bool kAmax>
__global__ void __launch_bounds__(bwd_max_threads(kRows))
    rmsnorm_bwd_kernel(bf16* __restrict__ dinp, float* __restrict__ partial, const bf16* __restrict__ dout,
                       const bf16* __restrict__ inp, const bf16* __restrict__ weight, const float* __restrict__ rstd,
                       int64_t n, int dim, float* __restrict__ amax) {
  __shared__ float scratch[2 * kRows * (kMaxThreads / 32)];
  uint32_t amax_bits = 0;
  const int64_t slab_row0 = static_cast<int64_t>(blockIdx.x) * kSlabRows;
  const int64_t slab_end = min(n, slab_row0 + kSlabRows);
  Packed8 w[kVecs];
  load_weight(w, weight, dim);
  float dw[kVecs][8];
#pragma unroll
  for (int v = 0; v < kVecs; ++v)
#pragma unroll
    for (int j = 0; j < 8; ++j) dw[v][j] = 0.0f;
  int parity = 0;
  for (int64_t row0 = slab_row0; row0 < slab_end; row0 += kRows, parity ^= 1) {
    // All three tensors of the kRows rows are loaded before the reduction; a row past the slab reads as
    // zeros (adding nothing to dweight) and stores nothing.
    Packed8 g[kRows][kVecs], x[kRows][kVecs], d[kRows][kVecs];
    load_rows(g, dout, row0, slab_end, dim);
    load_rows(x, inp, row0, slab_end, dim);
    load_rows(d, dinp, row0, slab_end, dim);
    float r[kRows];
#pragma unroll
    for (int k = 0; k < kRows; ++k) r[k] = row0 + k < slab_end ? rstd[row0 + k] : 0.0f;
    float dot[kRows];
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
      dot[k] = 0.0f;
#pragma unroll
      for (int v = 0; v < kVecs; ++v)
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float gj = unpack(g[k][v], j), xj = unpack(x[k][v], j);
          dot[k] += unpack(w[v], j) * gj * xj;
          dw[v][j] += gj * xj * r[k];  // rows in order: the slab's sum is fixed
        }
    }
    block_sum_batched(dot, scratch, parity);
    keep_row_packed(g, w);
    keep_row_packed(x, w);
    keep_row_packed(d, w);
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
      const int64_t row = row0 + k;
      if (row >= slab_end) break;
      const float correction = r[k] * r[k] * dot[k] / static_cast<float>(dim);
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        const int c = vector_column(v, dim);
        if (c < 0) continue;
        float y[8];
#pragma unroll
        for (int j = 0; j < 8; ++j)
          y[j] = unpack(d[k][v], j) + r[k] * (unpack(w[v], j) * unpack(g[k][v], j) - unpack(x[k][v], j) * correction);
        const Packed8 packed = pack8(y);
        if constexpr (kAmax) amax_bits = max(amax_bits, abs_max_bits(packed));
        store_packed(dinp + row * dim + c, packed);
      }
    }
  }
  if constexpr (kAmax) fold_amax(amax, amax_bits);
#pragma unroll
  for (int v = 0; v < kVecs; ++v) {
    const int c = vector_column(v, dim);
    if (c < 0) continue;
    float4* dst = reinterpret_cast<float4*>(partial + static_cast<int64_t>(blockIdx.x) * dim + c);
    dst[0] = make_float4(dw[v][0], dw[v][1], dw[v][2], dw[v][3]);
    dst[1] = make_float4(dw[v][4], dw[v][5], dw[v][6], dw[v][7]);
  }
}

// dweight[j] (= or +=, by overwrite) the sum over slabs s, in a fixed order, of partial[s, j]. Block:
// kReduceColumnLanes float4 column groups x kReduceSlabLanes slab lanes; lane l sums slabs l, l + 32, ... in
// order, then the lanes' sums are added in lane order. dweight may sit at any float offset (a parameter of the
// flat gradient), so it is written one float at a time.
__global__ void __launch_bounds__(kReduceColumnLanes* kReduceSlabLanes)
    rmsnorm_dweight_kernel(float* __restrict__ dweight, const float* __restrict__ partial, int n_slabs, int dim,
                           bool overwrite) {
  __shared__ float4 lane_sums[kReduceSlabLanes][kReduceColumnLanes];
  const int group = static_cast<int>(threadIdx.x) % kReduceColumnLanes;
  const int lane = static_cast<int>(threadIdx.x) / kReduceColumnLanes;
  const int c = (static_cast<int>(blockIdx.x) * kReduceColumnLanes + group) * 4;
  float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (c < dim) {
#pragma unroll 4
    for (int s = lane; s < n_slabs; s += kReduceSlabLanes) {
      const float4 p = *reinterpret_cast<const float4*>(partial + static_cast<int64_t>(s) * dim + c);
      sum.x += p.x, sum.y += p.y, sum.z += p.z, sum.w += p.w;
    }
  }
  lane_sums[lane][group] = sum;
  __syncthreads();
  if (lane != 0 || c >= dim) return;
  float4 total = lane_sums[0][group];
  for (int l = 1; l < kReduceSlabLanes; ++l) {
    const float4 p = lane_sums[l][group];
    total.x += p.x, total.y += p.y, total.z += p.z, total.w += p.w;
  }
  if (overwrite) {
    dweight[c] = total.x, dweight[c + 1] = total.y, dweight[c + 2] = total.z, dweight[c + 3] = total.w;
  } else {
    dweight[c] += total.x, dweight[c + 1] += total.y, dweight[c + 2] += total.z, dweight[c + 3] += total.w;
  }
}

void check_dim(const char* op, int64_t n, int64_t dim) {
  TUNA_CHECK(n >= 0 && dim > 0 && dim % 8 == 0, op, ": n ", n, ", dim ", dim, " (dim must be a multiple of 8)");
  if (dim > kMaxDim) fail(op, ": dim ", dim, " exceeds the supported ", kMaxDim, " (", kMaxThreads, " threads x ",
                          kMaxVecs * 8, " columns a row)");
}

template <bool kAmax>
void launch_fwd(const char* op, bf16* out, float* rstd, const bf16* inp, const bf16* weight, int64_t n, int64_t dim,
                double eps, float* amax, cudaStream_t stream) {
  check_dim(op, n, dim);
  if (n == 0) return;
  const RowShape shape = fwd_shape(dim);
  const unsigned grid = static_cast<unsigned>(ceil_div(n, kFwdRowsPerBlock));
  const int d = static_cast<int>(dim);
  const float e = static_cast<float>(eps);
  const auto launch = [&](auto vecs) {
    constexpr int kVecs = decltype(vecs)::value;
    launch_kernel(rmsnorm_fwd_kernel<kVecs, kAmax>, grid, shape.threads, 0, stream, out, rstd, inp, weight, n, d, e,
                  amax);
  };
  if (shape.vecs == 1) launch(std::integral_constant<int, 1>{});
  else if (shape.vecs == 2) launch(std::integral_constant<int, 2>{});
  else launch(std::integral_constant<int, kMaxVecs>{});
  TUNA_CUDA_CHECK_LAUNCH();
}

template <bool kAmax>
void launch_bwd(const char* op, bf16* dinp, float* dweight, const bf16* dout, const bf16* inp, const bf16* weight,
                const float* rstd, float* scratch, int64_t n, int64_t dim, GradWrite dweight_write, float* amax,
                cudaStream_t stream) {
  check_dim(op, n, dim);
  const bool overwrite = dweight_write == GradWrite::Overwrite;
  if (n == 0) {  // a sum over no rows: an overwritten gradient is zero
    if (overwrite && dweight != nullptr)
      TUNA_CUDA_CHECK(cudaMemsetAsync(dweight, 0, static_cast<size_t>(dim) * sizeof(float), stream));
    return;
  }
  const RowShape shape = bwd_shape(dim);
  const int64_t n_slabs = ceil_div(n, kSlabRows);
  TUNA_CHECK(n_slabs < (int64_t(1) << 31), op, ": n ", n);
  const unsigned grid = static_cast<unsigned>(n_slabs);
  const int d = static_cast<int>(dim);
  const auto launch = [&](auto kernel) {
    launch_kernel(kernel, grid, shape.threads, 0, stream, dinp, scratch, dout, inp, weight, rstd, n, d, amax);
  };
  if (shape.vecs == 1) launch(rmsnorm_bwd_kernel<1, 2, kAmax>);
  else if (shape.vecs == 2) launch(rmsnorm_bwd_kernel<2, 4, kAmax>);
  else if (shape.rows == 2) launch(rmsnorm_bwd_kernel<kMaxVecs, 2, kAmax>);
  else launch(rmsnorm_bwd_kernel<kMaxVecs, 1, kAmax>);
  TUNA_CUDA_CHECK_LAUNCH();
  if (dweight == nullptr) return;  // a frozen weight (adapters): the slabs' sums go unused
  launch_kernel(rmsnorm_dweight_kernel, static_cast<unsigned>(ceil_div(dim, kReduceColumnLanes * 4)),
                kReduceColumnLanes * kReduceSlabLanes, 0, stream, dweight, scratch, static_cast<int>(n_slabs), d,
                overwrite);
  TUNA_CUDA_CHECK_LAUNCH();
}

}  // namespace

void rmsnorm_fwd(bf16* out, float* rstd, const bf16* inp, const bf16* weight, int64_t n, int64_t dim, double eps,
                 cudaStream_t stream) {
  launch_fwd</*kAmax=*/false>("rmsnorm_fwd", out, rstd, inp, weight, n, dim, eps, nullptr, stream);
}

void rmsnorm_fwd_amax(bf16* out, float* rstd, const bf16* inp, const bf16* weight, int64_t n, int64_t dim, double eps,
                      float* amax, cudaStream_t stream) {
  TUNA_CHECK(amax != nullptr, "rmsnorm_fwd_amax: no amax (rmsnorm_fwd is the norm alone)");
  launch_fwd</*kAmax=*/true>("rmsnorm_fwd_amax", out, rstd, inp, weight, n, dim, eps, amax, stream);
}

int64_t rmsnorm_bwd_scratch_floats(int64_t n, int64_t dim) {
  static_assert(kSlabRows == gpu_scratch::kRmsnormSlabRows, "kernels/scratch.h sizes the scratch by the slab");
  return gpu_scratch::rmsnorm_bwd_floats(n, dim);
}

void rmsnorm_bwd(bf16* dinp, float* dweight, const bf16* dout, const bf16* inp, const bf16* weight,
                 const float* rstd, float* scratch, int64_t n, int64_t dim, GradWrite dweight_write,
                 cudaStream_t stream) {
  launch_bwd</*kAmax=*/false>("rmsnorm_bwd", dinp, dweight, dout, inp, weight, rstd, scratch, n, dim, dweight_write,
                              nullptr, stream);
}

void rmsnorm_bwd_amax(bf16* dinp, float* dweight, const bf16* dout, const bf16* inp, const bf16* weight,
                      const float* rstd, float* scratch, int64_t n, int64_t dim, GradWrite dweight_write, float* amax,
                      cudaStream_t stream) {
  TUNA_CHECK(amax != nullptr, "rmsnorm_bwd_amax: no amax (rmsnorm_bwd is the norm alone)");
  launch_bwd</*kAmax=*/true>("rmsnorm_bwd_amax", dinp, dweight, dout, inp, weight, rstd, scratch, n, dim,
                             dweight_write, amax, stream);
}

}  // namespace tuna::cuda
