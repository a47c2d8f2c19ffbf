// LoRA's element-wise kernels (kernels/lora.cuh). One thread an element: both are memory-bound passes over an
// [n, r] or [n, in] bf16 tensor, small beside the GEMMs around them. The keep test is kernels/cpu/lora.h's
// lora_dropout_keeps, restated for the device (that header is host C++); tests/kernels/test_lora_gpu.cpp holds the
// two to the same bits over many indices.
#include "kernels/lora.cuh"

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common.cuh"

namespace tuna::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__device__ __forceinline__ bool keeps(uint64_t stream, int64_t index, double p) {
  const uint64_t bits = mix(stream + 0x9E3779B97F4A7C15ull * (static_cast<uint64_t>(index) + 1));
  return static_cast<double>(bits >> 11) * 0x1.0p-53 >= p;
}

__global__ void lora_dropout_kernel(bf16* dst, const bf16* src, int64_t rows, int64_t in, int64_t global_in,
                                    int64_t col0, uint64_t stream, double p, float keep, bool accumulate) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= rows * in) return;
  const int64_t row = i / in, col = i - row * in;
  const float v = keeps(stream, row * global_in + col0 + col, p) ? __bfloat162float(src[i]) * keep : 0.0f;
  const bf16 rounded = __float2bfloat16_rn(v);
  dst[i] = accumulate ? __float2bfloat16_rn(__bfloat162float(dst[i]) + __bfloat162float(rounded)) : rounded;
}

__global__ void scale_kernel(bf16* x, int64_t count, float s) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < count) x[i] = __float2bfloat16_rn(__bfloat162float(x[i]) * s);
}

}  // namespace

void lora_dropout(bf16* dst, const bf16* src, int64_t rows, int64_t in, int64_t global_in, int64_t col0,
                  uint64_t stream_key, double p, bool accumulate, cudaStream_t stream) {
  TUNA_CHECK(rows >= 0 && in > 0 && global_in >= col0 + in && col0 >= 0, "lora_dropout: rows ", rows, ", in ", in,
             ", columns from ", col0, " of ", global_in);
  TUNA_CHECK(p >= 0 && p < 1, "lora_dropout: probability ", p, " outside [0, 1)");
  TUNA_CHECK(!(accumulate && dst == src), "lora_dropout: accumulating into its own input");
  if (rows == 0) return;
  const float keep = static_cast<float>(1.0 / (1.0 - p));
  launch_kernel(lora_dropout_kernel, static_cast<unsigned>(ceil_div(rows * in, kThreads)), kThreads, 0, stream, dst,
                src, rows, in, global_in, col0, stream_key, p, keep, accumulate);
}

void scale_bf16(bf16* x, int64_t count, float s, cudaStream_t stream) {
  TUNA_CHECK(count >= 0, "scale_bf16: ", count, " elements");
  if (count == 0) return;
  launch_kernel(scale_kernel, static_cast<unsigned>(ceil_div(count, kThreads)), kThreads, 0, stream, x, count, s);
}

}  // namespace tuna::cuda
