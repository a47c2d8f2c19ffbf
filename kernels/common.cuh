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

// Whether a pointer can take the 16-byte Packed8 accesses below (host side: a launcher's choice of its vector
// path or an element-wise one).
inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The same 8 bf16 values as four 32-bit words, two values a word (element 2k in the low half of word k):
// the form in which a kernel caches a row in registers. Held as a Bf16x8, the compiler splits the struct
// into eight 16-bit values, one register each; as words, 8 values take 4 registers, and each converts to
// fp32 with one integer op (bf16 is the high half of an fp32).
struct alignas(16) Packed8 {
  uint32_t w[4];
};
__device__ __forceinline__ Packed8 load_packed(const bf16* p) {
  const int4 raw = *reinterpret_cast<const int4*>(p);
  return {{static_cast<uint32_t>(raw.x), static_cast<uint32_t>(raw.y), static_cast<uint32_t>(raw.z),
           static_cast<uint32_t>(raw.w)}};
}
// Evict-first: for tensors read exactly once.
__device__ __forceinline__ Packed8 load_packed_stream(const bf16* p) {
  const int4 raw = __ldcs(reinterpret_cast<const int4*>(p));
  return {{static_cast<uint32_t>(raw.x), static_cast<uint32_t>(raw.y), static_cast<uint32_t>(raw.z),
           static_cast<uint32_t>(raw.w)}};
}
__device__ __forceinline__ void store_packed(bf16* p, const Packed8& x) {
  int4 raw;
  raw.x = static_cast<int>(x.w[0]), raw.y = static_cast<int>(x.w[1]), raw.z = static_cast<int>(x.w[2]),
  raw.w = static_cast<int>(x.w[3]);
  *reinterpret_cast<int4*>(p) = raw;
}
__device__ __forceinline__ Packed8 zeros_packed() { return {{0u, 0u, 0u, 0u}}; }
// Element j (a compile-time index in the kernels' unrolled loops) as fp32.
__device__ __forceinline__ float unpack(const Packed8& x, int j) {
  const uint32_t word = x.w[j / 2];
  return __uint_as_float(j % 2 == 0 ? word << 16 : word & 0xffff0000u);
}
// Rounds 8 fp32 values to bf16 (to nearest even) into words.
__device__ __forceinline__ Packed8 pack8(const float (&v)[8]) {
  Packed8 x;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
    x.w[k] = *reinterpret_cast<const uint32_t*>(&pair);
  }
  return x;
}
// Keeps a vector packed across a phase of a kernel: an empty asm that "may modify" its words makes the
// compiler forget the fp32 values it already unpacked from them, so a row cached in registers across a
// reduction holds 4 registers per 8 values, not 8 (the values are unpacked again after it, one integer op
// each). Without it the compiler keeps both forms alive and a 16384-wide row spills.
__device__ __forceinline__ void keep_packed(Packed8& x) {
#pragma unroll
  for (int k = 0; k < 4; ++k) asm volatile("" : "+r"(x.w[k]));
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

// Sums each of kValues per-thread values over the whole block, every total returned to every thread, with ONE
// barrier: the memory-bound kernels batch the reductions of several rows into one call instead of a barrier
// pair per row. `scratch` holds 2 * kValues * (blockDim.x / 32) values; successive calls of a loop pass
// parity 0, 1, 0, ... so that a call writes the half the previous call did not read (a thread can only write
// half p again after every thread passed the barrier of the call in between, hence finished reading it).
// Fixed order (butterfly in the warp, then warps 0, 1, ... in turn): deterministic for a given block shape.
// A one-warp block needs no shared memory and no barrier.
template <int kValues>
__device__ __forceinline__ void block_sum_batched(float (&x)[kValues], float* scratch, int parity) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
#pragma unroll
  for (int i = 0; i < kValues; ++i) x[i] = warp_sum(x[i]);
  if (n_warps == 1) return;
  float* half = scratch + parity * kValues * n_warps;
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < kValues; ++i) half[i * n_warps + warp] = x[i];
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kValues; ++i) {
    float total = half[i * n_warps];
    for (int w = 1; w < n_warps; ++w) total += half[i * n_warps + w];
    x[i] = total;
  }
}

// ---- FP8 amax (kernels/fp8.cuh): the largest |x| of a tensor, folded into one fp32 in device memory by atomicMax on
// its bits. A non-negative float orders as its bits do as an unsigned integer, and a NaN's bits (sign cleared) exceed
// every number's, so one NaN makes the amax NaN, as torch.max(torch.abs(x)) does.
__device__ __forceinline__ uint32_t abs_bits(float x) { return __float_as_uint(x) & 0x7fffffffu; }
// The largest |value| of 8 packed bf16 values, as such bits (a bf16 is the high half of its fp32).
__device__ __forceinline__ uint32_t abs_max_bits(const Packed8& x) {
  uint32_t m = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) m = max(m, max((x.w[k] << 16) & 0x7fff0000u, x.w[k] & 0x7fff0000u));
  return m;
}
// Folds every thread's bits into *amax: the block's maximum (one barrier), then one atomicMax a block. Every thread
// of the block calls it, once, at the kernel's end.
__device__ __forceinline__ void fold_amax(float* amax, uint32_t bits) {
  __shared__ uint32_t warp_bits[32];
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, offset));
  if (threadIdx.x % 32 == 0) warp_bits[threadIdx.x / 32] = bits;
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (unsigned w = 1; w < blockDim.x / 32; ++w) bits = max(bits, warp_bits[w]);
  atomicMax(reinterpret_cast<unsigned*>(amax), bits);
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

// The block's dynamic shared memory (the launch's dynamic_smem bytes, 16-byte aligned). In the emulated build
// the emulator's array, which it fills with 0xff bytes before each block, as the tests' poison does.
__device__ __forceinline__ unsigned char* dynamic_shared_memory() {
#ifdef TUNA_EMULATOR
  return tuna::emulator::shared_bytes();
#else
  extern __shared__ __align__(16) unsigned char tuna_dynamic_shared[];
  return tuna_dynamic_shared;
#endif
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
