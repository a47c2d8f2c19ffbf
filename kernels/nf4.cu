// NF4 dequantization on the GPU, the twin of kernels/cpu/nf4.cpp's nf4_dequantize (bf16 out): for each element,
//   absmax = map[qabsmax[i / 64]] * absmax2[i / 16384] + offset;  out[i] = bf16(nf4[code(i)] * absmax)
// code(i) the high nibble of packed[i / 2] for even i, the low one for odd i. OUT is OVERWRITTEN.
//
// Bit for bit with the CPU twin: both products and the sum are rounded on their own (__fmul_rn / __fadd_rn keep
// nvcc from fusing them into an fma, which bitsandbytes and the twin do not do), then rounded to bf16 to nearest
// even. Memory-bound: 0.5 byte in and 2 bytes out an element. A thread owns kVecs groups of 16 elements (8 packed
// bytes in one 8-byte load, 32 bytes out in two 16-byte stores; a group never crosses a 64-block) and issues its
// loads before any math. The seven tensors of a layer go in one launch (blockIdx.y picks the tensor; blocks past
// a smaller tensor's end return at once); the NF4 values and the 256-value absmax map travel in the kernel's
// parameters and are staged in shared memory.
#include "kernels/nf4.cuh"

#include <algorithm>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common.cuh"
#include "kernels/cpu/nf4.h"

namespace tuna::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kVecs = 4;
constexpr int kGroup = 16;  // elements per vector group

struct Nf4Batch {
  Nf4Dequant t[kNf4MaxTensors];
  bool vector[kNf4MaxTensors];  // the 16-element path (else element-wise)
  float nf4[16];
  float map[256];
};

__device__ __forceinline__ float block_absmax(const Nf4Dequant& t, const float* map, int64_t block) {
  return __fadd_rn(__fmul_rn(map[t.qabsmax[block]], t.absmax2[block / 256]), t.offset);
}

__global__ void __launch_bounds__(kThreads) nf4_dequantize_kernel(const __grid_constant__ Nf4Batch batch) {
  __shared__ float nf4[16];
  __shared__ float map[256];
  for (int i = threadIdx.x; i < 256; i += kThreads) map[i] = batch.map[i];
  if (threadIdx.x < 16) nf4[threadIdx.x] = batch.nf4[threadIdx.x];
  __syncthreads();
  const Nf4Dequant& t = batch.t[blockIdx.y];
  if (batch.vector[blockIdx.y]) {
    const int64_t groups = t.n / kGroup;
    int64_t g[kVecs];
    uint2 bytes[kVecs];
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      g[k] = (static_cast<int64_t>(blockIdx.x) * kVecs + k) * kThreads + threadIdx.x;
      if (g[k] < groups) bytes[k] = __ldcs(reinterpret_cast<const uint2*>(t.packed) + g[k]);
    }
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      if (g[k] >= groups) break;
      const float absmax = block_absmax(t, map, g[k] * kGroup / 64);
      float v[kGroup];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const uint32_t word = j < 4 ? bytes[k].x : bytes[k].y;
        const uint32_t byte = (word >> (8 * (j % 4))) & 0xffu;
        v[2 * j] = __fmul_rn(nf4[byte >> 4], absmax);
        v[2 * j + 1] = __fmul_rn(nf4[byte & 15u], absmax);
      }
      float lo[8], hi[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) lo[j] = v[j], hi[j] = v[8 + j];
      bf16* out = t.out + g[k] * kGroup;
      store_packed(out, pack8(lo));
      store_packed(out + 8, pack8(hi));
    }
    return;
  }
  const int64_t threads = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < t.n; i += threads) {
    const uint32_t byte = t.packed[i / 2];
    const uint32_t code = i % 2 == 0 ? byte >> 4 : byte & 15u;
    t.out[i] = __float2bfloat16_rn(__fmul_rn(nf4[code], block_absmax(t, map, i / 64)));
  }
}

}  // namespace

void nf4_dequantize(const Nf4Dequant* tensors, int count, cudaStream_t stream) {
  TUNA_CHECK(count >= 0 && count <= kNf4MaxTensors, "nf4_dequantize of ", count, " tensors (at most ",
             kNf4MaxTensors, ")");
  Nf4Batch batch{};
  std::copy(cpu::nf4_values().begin(), cpu::nf4_values().end(), batch.nf4);
  std::copy(cpu::dynamic_map().begin(), cpu::dynamic_map().end(), batch.map);
  int64_t blocks_x = 0;
  int used = 0;
  for (int i = 0; i < count; ++i) {
    const Nf4Dequant& t = tensors[i];
    TUNA_CHECK(t.n >= 0, "nf4_dequantize: tensor ", i, " of ", t.n, " elements");
    if (t.n == 0) continue;
    TUNA_CHECK(t.out && t.packed && t.qabsmax && t.absmax2, "nf4_dequantize: tensor ", i, " has a null pointer");
    const bool vector = t.n % kGroup == 0 && aligned16(t.out) && reinterpret_cast<uintptr_t>(t.packed) % 8 == 0;
    const int64_t blocks = vector ? ceil_div(t.n / kGroup, int64_t{kThreads} * kVecs)
                                  : std::min<int64_t>(ceil_div(t.n, kThreads), int64_t{1} << 16);
    batch.t[used] = t;
    batch.vector[used] = vector;
    ++used;
    blocks_x = std::max(blocks_x, blocks);
  }
  if (used == 0) return;
  TUNA_CHECK(blocks_x < (int64_t{1} << 31), "nf4_dequantize: ", blocks_x, " blocks");
  launch_kernel(nf4_dequantize_kernel, dim3(static_cast<unsigned>(blocks_x), static_cast<unsigned>(used)), kThreads, 0,
                stream, batch);
  TUNA_CUDA_CHECK_LAUNCH();
}

}  // namespace tuna::cuda
