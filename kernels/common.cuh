// kernels/common.cuh — device helpers shared by the kernels of kernels/*.cu (not a launcher header).
//
// bf16 <-> fp32 conversions, 16-byte vector access, warp and block reductions, stochastic rounding; and
// launch_kernel, through which every launcher launches. Header-only; launchers live in each op's .cu.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace tuna::cuda {

using bf16 = __nv_bfloat16;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// 8 bf16 values moved as one 16-byte access: the unit of every memory-bound kernel here.
struct alignas(16) Bf16x8 {
  bf16 v[8];
};

__device__ __forceinline__ Bf16x8 load8(const bf16* p) {
  const int4 raw = *reinterpret_cast<const int4*>(p);
  return *reinterpret_cast<const Bf16x8*>(&raw);
}
__device__ __forceinline__ void store8(bf16* p, const Bf16x8& x) {
  *reinterpret_cast<int4*>(p) = *reinterpret_cast<const int4*>(&x);
}
// Streaming variants (evict-first): for tensors read or written exactly once.
__device__ __forceinline__ Bf16x8 load8_stream(const bf16* p) {
  const int4 raw = __ldcs(reinterpret_cast<const int4*>(p));
  return *reinterpret_cast<const Bf16x8*>(&raw);
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}
__device__ __forceinline__ double warp_sum(double x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// Sum over the whole block, returned to every thread. `scratch` holds blockDim.x / 32 values. The order of
// additions is fixed by the block shape, so the result is deterministic. Ends with the scratch free again.
template <typename T>
__device__ __forceinline__ T block_sum(T x, T* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
  x = warp_sum(x);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  T total = 0;
  for (int w = 0; w < n_warps; ++w) total += scratch[w];
  return total;
}

// Counter-based hash (a SplitMix-like finalizer over a 32-bit state): the random bits of stochastic
// rounding are a pure function of (seed, index), so a run and its resumed twin round alike.
__device__ __forceinline__ uint32_t hash_u32(uint32_t seed, uint64_t index) {
  uint64_t x = index * 0x9E3779B97F4A7C15ull + seed;
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return static_cast<uint32_t>(x);
}

// Rounds x to bf16 at random, up with probability equal to the dropped fraction: unbiased in expectation,
// so many small AdamW updates are not all lost to round-to-nearest. NaN and inf pass through unchanged.
__device__ __forceinline__ bf16 bf16_stochastic(float x, uint32_t random_bits) {
  uint32_t bits = __float_as_uint(x);
  if ((bits & 0x7f800000u) == 0x7f800000u) return __float2bfloat16_rn(x);
  bits += random_bits & 0xffffu;  // a carry into the kept bits is the round-up
  bits &= 0xffff0000u;
  return __ushort_as_bfloat16(static_cast<unsigned short>(bits >> 16));
}

// kernel<<<grid, block, dynamic_smem, stream>>>(args...), written as a call so that the same launchers also
// compile with g++ against the host emulator of tests/kernels/emulator (built with -DTUNA_EMULATOR), which
// runs the kernel there: CI runs the GPU tests through the real launchers without a GPU. A launcher still
// checks the launch (TUNA_CUDA_CHECK_LAUNCH) after it.
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t dynamic_smem, cudaStream_t stream,
                   Args&&... args) {
#ifdef TUNA_EMULATOR
  tuna::emulator::launch(tuna::emulator::Target::kSm80, kernel, grid, block, dynamic_smem, stream,
                         static_cast<Args&&>(args)...);
#else
  kernel<<<grid, block, dynamic_smem, stream>>>(static_cast<Args&&>(args)...);
#endif
}

// The same for a kernel that exists only in the sm_90a image (wgmma, TMA, setmaxnreg): the host emulator then
// allows it sm_90's shared memory and the Hopper instructions. The caller has checked the device runs sm_90a.
template <typename... Params, typename... Args>
void launch_kernel_sm90a(void (*kernel)(Params...), dim3 grid, dim3 block, size_t dynamic_smem, cudaStream_t stream,
                         Args&&... args) {
#ifdef TUNA_EMULATOR
  tuna::emulator::launch(tuna::emulator::Target::kSm90a, kernel, grid, block, dynamic_smem, stream,
                         static_cast<Args&&>(args)...);
#else
  kernel<<<grid, block, dynamic_smem, stream>>>(static_cast<Args&&>(args)...);
#endif
}

}  // namespace tuna::cuda
