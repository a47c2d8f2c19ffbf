// int8 row-wise dequantization on the GPU, the twin of kernels/cpu/int8_rowwise.cpp (bf16 out):
//   out[r, c] = bf16((q[r, c] * scale[r]) * fp32(1/127))          OUT is OVERWRITTEN
// Both products rounded on their own (__fmul_rn), then to bf16 to nearest even: bit for bit the twin.
// Memory-bound: 1 byte in, 2 bytes out an element. A thread owns kVecs groups of 16 elements (one 16-byte load,
// two 16-byte stores; a group stays inside a row when cols % 16 == 0) and issues its loads before any math. The
// tensors of a layer go in one launch, blockIdx.y picking the tensor.
#include "kernels/int8_rowwise.cuh"

#include <algorithm>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common.cuh"
#include "kernels/cpu/int8_rowwise.h"

namespace tuna::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kVecs = 4;
constexpr int kGroup = 16;

struct Int8Batch {
  Int8Dequant t[kInt8MaxTensors];
  bool vector[kInt8MaxTensors];
};

__device__ __forceinline__ float dequant(int q, float scale) {
  return __fmul_rn(__fmul_rn(static_cast<float>(q), scale), cpu::kInt8InvScale);
}

__global__ void __launch_bounds__(kThreads) int8_rowwise_dequantize_kernel(const __grid_constant__ Int8Batch batch) {
  const Int8Dequant& t = batch.t[blockIdx.y];
  const int64_t n = t.rows * t.cols;
  if (batch.vector[blockIdx.y]) {
    const int64_t groups = n / kGroup;
    int64_t g[kVecs];
    int4 bytes[kVecs];
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      g[k] = (static_cast<int64_t>(blockIdx.x) * kVecs + k) * kThreads + threadIdx.x;
      if (g[k] < groups) bytes[k] = __ldcs(reinterpret_cast<const int4*>(t.q) + g[k]);
    }
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      if (g[k] >= groups) break;
      const float scale = t.scale[g[k] * kGroup / t.cols];
      const uint32_t words[4] = {static_cast<uint32_t>(bytes[k].x), static_cast<uint32_t>(bytes[k].y),
                                 static_cast<uint32_t>(bytes[k].z), static_cast<uint32_t>(bytes[k].w)};
      float lo[8], hi[8];
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int q = static_cast<int8_t>((words[j / 4] >> (8 * (j % 4))) & 0xffu);
        (j < 8 ? lo[j] : hi[j - 8]) = dequant(q, scale);
      }
      bf16* out = t.out + g[k] * kGroup;
      store_packed(out, pack8(lo));
      store_packed(out + 8, pack8(hi));
    }
    return;
  }
  const int64_t threads = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += threads)
    t.out[i] = __float2bfloat16_rn(dequant(t.q[i], t.scale[i / t.cols]));
}

}  // namespace

void int8_rowwise_dequantize(const Int8Dequant* tensors, int count, cudaStream_t stream) {
  TUNA_CHECK(count >= 0 && count <= kInt8MaxTensors, "int8_rowwise_dequantize of ", count, " tensors (at most ",
             kInt8MaxTensors, ")");
  Int8Batch batch{};
  int64_t blocks_x = 0;
  int used = 0;
  for (int i = 0; i < count; ++i) {
    const Int8Dequant& t = tensors[i];
    TUNA_CHECK(t.rows >= 0 && t.cols >= 0, "int8_rowwise_dequantize: tensor ", i, " of ", t.rows, " x ", t.cols);
    const int64_t n = t.rows * t.cols;
    if (n == 0) continue;
    TUNA_CHECK(t.out && t.q && t.scale, "int8_rowwise_dequantize: tensor ", i, " has a null pointer");
    const bool vector = t.cols % kGroup == 0 && aligned16(t.out) && aligned16(t.q);
    const int64_t blocks = vector ? ceil_div(n / kGroup, int64_t{kThreads} * kVecs)
                                  : std::min<int64_t>(ceil_div(n, kThreads), int64_t{1} << 16);
    batch.t[used] = t;
    batch.vector[used] = vector;
    ++used;
    blocks_x = std::max(blocks_x, blocks);
  }
  if (used == 0) return;
  TUNA_CHECK(blocks_x < (int64_t{1} << 31), "int8_rowwise_dequantize: ", blocks_x, " blocks");
  launch_kernel(int8_rowwise_dequantize_kernel, dim3(static_cast<unsigned>(blocks_x), static_cast<unsigned>(used)),
                kThreads, 0, stream, batch);
  TUNA_CUDA_CHECK_LAUNCH();
}

}  // namespace tuna::cuda
