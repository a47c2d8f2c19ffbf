// FP8 casts on the GPU, the twin of kernels/cpu/fp8.cpp (fp8_amax, fp8_cast, fp8_cast_transpose):
//
//   amax:            *amax = max(*amax, max |x|)                                    ACCUMULATES (atomicMax on bits)
//   cast:            out[r, c] = cvt(fp32(x[r, c] * scale))                           out, *inv_scale OVERWRITTEN
//   cast_transpose:  out_t[c, r] = the same code (and out[r, c] when asked)           out_t, out, *inv_scale OVERWRITTEN
//   scale = fp32(max / max(double(*amax), 1e-12)), every thread computing it from *amax (one division in float64 a
//   thread, nothing next to the bytes it moves); *inv_scale = fp32(1 / scale), written by one thread.
//
// Bit for bit the twin: x * scale is one fp32 product (__fmul_rn: nvcc may not fuse it), the conversion the PTX
// cvt.rn.satfinite of kernels/fp8_ptx.cuh. Memory-bound (2 bytes in, 1 or 2 out an element): 16-byte loads of 8
// bf16 where the rows allow (cols and ld multiples of 8, x 16-byte aligned), else element-wise.
// The transposing cast goes through 64 x 64 tiles in shared memory: a thread reads 16 consecutive elements of one
// row and writes their codes to out (one 16-byte store where aligned), then 16 consecutive rows of one column to
// out_t; the tile's pitch of 65 bytes spreads a column's bytes over the banks.
#include "kernels/fp8.cuh"

#include <algorithm>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common.cuh"
// Under TUNA_EMULATOR, <cuda_bf16.h> (through common.cuh) is the emulator's and declares host versions of these.
#ifndef TUNA_EMULATOR
#include "kernels/fp8_ptx.cuh"  // cvt_e4m3x2, cvt_e5m2x2
#endif

namespace tuna::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kTile = 64;
constexpr int kTilePitch = kTile + 1;
constexpr int kSegment = 16;  // elements a thread converts in the transposing cast
static_assert(kTile * kTile == kThreads * kSegment, "a block's threads cover its tile");

template <Fp8Format kFormat>
__device__ __forceinline__ uint16_t cvt_pair(float hi, float lo) {
  if constexpr (kFormat == Fp8Format::E4M3) return fp8::cvt_e4m3x2(hi, lo);
  else return fp8::cvt_e5m2x2(hi, lo);
}

template <Fp8Format kFormat>
__device__ __forceinline__ float scale_of(const float* amax) {
  double floor_amax = static_cast<double>(*amax);
  if (floor_amax < cpu::kFp8AmaxFloor) floor_amax = cpu::kFp8AmaxFloor;  // a NaN stays NaN
  constexpr double kMax = kFormat == Fp8Format::E4M3 ? cpu::kE4M3Max : cpu::kE5M2Max;
  return static_cast<float>(kMax / floor_amax);
}

// The codes of 8 packed bf16 values, element j in byte j (little-endian: the pair (2k, 2k + 1) is cvt(2k + 1, 2k)).
template <Fp8Format kFormat>
__device__ __forceinline__ uint2 cast8(const Packed8& x, float scale) {
  uint32_t words[2];
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const uint32_t lo = cvt_pair<kFormat>(__fmul_rn(unpack(x, 4 * k + 1), scale), __fmul_rn(unpack(x, 4 * k), scale));
    const uint32_t hi =
        cvt_pair<kFormat>(__fmul_rn(unpack(x, 4 * k + 3), scale), __fmul_rn(unpack(x, 4 * k + 2), scale));
    words[k] = lo | (hi << 16);
  }
  return uint2{words[0], words[1]};
}

template <Fp8Format kFormat>
__device__ __forceinline__ uint8_t cast1(bf16 x, float scale) {
  return static_cast<uint8_t>(cvt_pair<kFormat>(0.0f, __fmul_rn(__bfloat162float(x), scale)) & 0xffu);
}

// Where the element-wise kernels work: rows x cols, rows ld apart; `per_row` items a row (8-wide vectors or
// elements). Contiguous rows are one long row, so no item needs a division to find its row.
struct Items {
  int64_t rows, cols, ld, per_row, total;
  bool vectors;
};
Items items_of(int64_t rows, int64_t cols, int64_t ld, bool vectors) {
  if (ld == cols) cols *= rows, rows = rows > 0 ? 1 : 0, ld = cols;
  Items it{rows, cols, ld, vectors ? cols / 8 : cols, 0, vectors};
  it.total = rows * it.per_row;
  return it;
}
__device__ __forceinline__ int64_t item_offset(const Items& it, int64_t i, int64_t* out_offset) {
  const int64_t r = it.rows == 1 ? 0 : i / it.per_row, c = (i - r * it.per_row) * (it.vectors ? 8 : 1);
  *out_offset = r * it.cols + c;
  return r * it.ld + c;
}

unsigned grid_of(const Items& it) {
  return static_cast<unsigned>(std::clamp<int64_t>(ceil_div(it.total, kThreads), 1, int64_t{4} << 10));
}

__global__ void __launch_bounds__(kThreads) fp8_amax_kernel(float* amax, const bf16* x, Items it) {
  uint32_t m = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < it.total; i += stride) {
    int64_t unused;
    const int64_t at = item_offset(it, i, &unused);
    m = max(m, it.vectors ? abs_max_bits(load_packed_stream(x + at)) : abs_bits(__bfloat162float(x[at])));
  }
  fold_amax(amax, m);
}

template <Fp8Format kFormat>
__global__ void __launch_bounds__(kThreads)
    fp8_cast_kernel(uint8_t* out, float* inv_scale, const bf16* x, Items it, const float* amax) {
  const float scale = scale_of<kFormat>(amax);
  if (blockIdx.x == 0 && threadIdx.x == 0) *inv_scale = 1.0f / scale;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < it.total; i += stride) {
    int64_t o;
    const int64_t at = item_offset(it, i, &o);
    if (it.vectors) *reinterpret_cast<uint2*>(out + o) = cast8<kFormat>(load_packed_stream(x + at), scale);
    else out[o] = cast1<kFormat>(x[at], scale);
  }
}

template <Fp8Format kFormat>
__global__ void __launch_bounds__(kThreads)
    fp8_cast_transpose_kernel(uint8_t* out, uint8_t* out_t, float* inv_scale, const bf16* x, int64_t rows, int64_t cols,
                              int64_t ld, const float* amax, bool vector_loads, bool vector_out, bool vector_out_t) {
  __shared__ uint8_t tile[kTile * kTilePitch];
  const float scale = scale_of<kFormat>(amax);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *inv_scale = 1.0f / scale;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile, c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  // Row-major: this thread's 16 elements of one row.
  {
    const int tr = static_cast<int>(threadIdx.x) / (kTile / kSegment);
    const int tc = static_cast<int>(threadIdx.x) % (kTile / kSegment) * kSegment;
    const int64_t r = r0 + tr, c = c0 + tc;
    uint8_t codes[kSegment];
    const bool whole = r < rows && c + kSegment <= cols;
    if (whole && vector_loads) {
      const uint2 lo = cast8<kFormat>(load_packed_stream(x + r * ld + c), scale);
      const uint2 hi = cast8<kFormat>(load_packed_stream(x + r * ld + c + 8), scale);
      const uint32_t words[4] = {lo.x, lo.y, hi.x, hi.y};
#pragma unroll
      for (int j = 0; j < kSegment; ++j) codes[j] = static_cast<uint8_t>(words[j / 4] >> (8 * (j % 4)));
      if (out != nullptr && vector_out) {
        *reinterpret_cast<int4*>(out + r * cols + c) = int4{static_cast<int>(words[0]), static_cast<int>(words[1]),
                                                            static_cast<int>(words[2]), static_cast<int>(words[3])};
      } else if (out != nullptr) {
#pragma unroll
        for (int j = 0; j < kSegment; ++j) out[r * cols + c + j] = codes[j];
      }
    } else {
#pragma unroll
      for (int j = 0; j < kSegment; ++j) {
        const bool inside = r < rows && c + j < cols;
        codes[j] = inside ? cast1<kFormat>(x[r * ld + c + j], scale) : uint8_t{0};
        if (inside && out != nullptr) out[r * cols + c + j] = codes[j];
      }
    }
#pragma unroll
    for (int j = 0; j < kSegment; ++j) tile[tr * kTilePitch + tc + j] = codes[j];
  }
  __syncthreads();
  // Transposed: 16 consecutive rows of one column, a run of out_t's row.
  const int tc = static_cast<int>(threadIdx.x) / (kTile / kSegment);
  const int tr = static_cast<int>(threadIdx.x) % (kTile / kSegment) * kSegment;
  const int64_t c = c0 + tc, r = r0 + tr;
  if (c >= cols) return;
  uint32_t words[4] = {0, 0, 0, 0};
#pragma unroll
  for (int j = 0; j < kSegment; ++j) words[j / 4] |= uint32_t{tile[(tr + j) * kTilePitch + tc]} << (8 * (j % 4));
  uint8_t* dst = out_t + c * rows + r;
  if (vector_out_t && r + kSegment <= rows) {
    *reinterpret_cast<int4*>(dst) = int4{static_cast<int>(words[0]), static_cast<int>(words[1]),
                                         static_cast<int>(words[2]), static_cast<int>(words[3])};
    return;
  }
  for (int j = 0; j < kSegment && r + j < rows; ++j) dst[j] = static_cast<uint8_t>(words[j / 4] >> (8 * (j % 4)));
}

void check_operand(const char* op, int64_t rows, int64_t cols, int64_t ld) {
  TUNA_CHECK(rows >= 0 && cols >= 0 && ld >= cols, op, " of ", rows, " x ", cols, " with rows ", ld, " apart");
}

bool vector_rows(const bf16* x, int64_t cols, int64_t ld) { return aligned16(x) && cols % 8 == 0 && ld % 8 == 0; }

}  // namespace

void fp8_amax(float* amax, const bf16* x, int64_t rows, int64_t cols, int64_t ld, cudaStream_t stream) {
  check_operand("fp8_amax", rows, cols, ld);
  const Items it = items_of(rows, cols, ld, vector_rows(x, cols, ld));
  if (it.total == 0) return;
  launch_kernel(fp8_amax_kernel, grid_of(it), kThreads, 0, stream, amax, x, it);
  TUNA_CUDA_CHECK_LAUNCH();
}

void fp8_cast(uint8_t* out, float* inv_scale, const bf16* x, int64_t rows, int64_t cols, int64_t ld,
              const float* amax, Fp8Format format, cudaStream_t stream) {
  check_operand("fp8_cast", rows, cols, ld);
  const bool vectors = vector_rows(x, cols, ld) && reinterpret_cast<uintptr_t>(out) % 8 == 0;
  const Items it = items_of(rows, cols, ld, vectors);
  const unsigned grid = grid_of(it);  // at least one block: *inv_scale is written even for an empty tensor
  if (format == Fp8Format::E4M3)
    launch_kernel(fp8_cast_kernel<Fp8Format::E4M3>, grid, kThreads, 0, stream, out, inv_scale, x, it, amax);
  else launch_kernel(fp8_cast_kernel<Fp8Format::E5M2>, grid, kThreads, 0, stream, out, inv_scale, x, it, amax);
  TUNA_CUDA_CHECK_LAUNCH();
}

void fp8_cast_transpose(uint8_t* out, uint8_t* out_t, float* inv_scale, const bf16* x, int64_t rows, int64_t cols,
                        int64_t ld, const float* amax, Fp8Format format, cudaStream_t stream) {
  check_operand("fp8_cast_transpose", rows, cols, ld);
  const int64_t grid_y = std::max<int64_t>(1, ceil_div(rows, kTile)), grid_x = std::max<int64_t>(1, ceil_div(cols, kTile));
  TUNA_CHECK(grid_y <= 65535 && grid_x < (int64_t{1} << 31), "fp8_cast_transpose of ", rows, " x ", cols);
  const bool vector_loads = vector_rows(x, cols, ld);
  const bool vector_out = out != nullptr && aligned16(out) && cols % kSegment == 0;
  const bool vector_out_t = aligned16(out_t) && rows % kSegment == 0;
  const dim3 grid(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y));
  const auto launch = [&](auto kernel) {
    launch_kernel(kernel, grid, kThreads, 0, stream, out, out_t, inv_scale, x, rows, cols, ld, amax, vector_loads,
                  vector_out, vector_out_t);
  };
  if (format == Fp8Format::E4M3) launch(fp8_cast_transpose_kernel<Fp8Format::E4M3>);
  else launch(fp8_cast_transpose_kernel<Fp8Format::E5M2>);
  TUNA_CUDA_CHECK_LAUNCH();
}

}  // namespace tuna::cuda
