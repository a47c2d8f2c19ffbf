// The Hopper (sm_90a) PTX the attention kernels of attention_sm90_kernels.cuh issue, each wrapped in a small
// device function: mbarriers, TMA tensor loads, wgmma (warpgroup matrix multiply-accumulate), the register
// budget of warp specialisation (setmaxnreg), elect.sync, named barriers, proxy fences, and the acquire/release
// flags through which the backward orders its dQ accumulation. Internal to kernels/.
//
// As attention_ptx.cuh for the sm_80 kernels: the host emulator (tests/kernels/emulator/ptx_sm90.h) puts host
// versions of exactly these functions in their place, written from the PTX ISA, so that CI runs the Hopper
// kernels through their real launchers without a GPU. Whatever PTX a Hopper kernel needs goes here, with its
// host version there.
//
// Everything here compiles only for sm_90a (wgmma and setmaxnreg are arch-specific): the kernels include this
// header inside `#if TUNA_SM90A_DEVICE` blocks (attention_sm90_kernels.cuh), so the sm_80 image of the
// library carries none of it.
#pragma once

#include <cuda.h>  // CUtensorMap

#include <cstdint>

#include "kernels/attention_ptx.cuh"  // smem_address (and the sm_80 helpers, which sm_90 also runs)

namespace tuna::cuda::attention {

// ---- mbarrier (PTX ISA 9.7.13.15): a phase completes when its pending arrivals and its tx-count reach zero.
__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals));
}
// Makes the initialisation visible to the async proxy (TMA's complete-tx) before any copy uses the barrier.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// expect-tx of `bytes` then arrive-on: the producer's announcement of the bytes its TMA copies will bring.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
// True once the phase of parity `parity` (the current phase or the one before it) has completed.
__device__ __forceinline__ bool mbarrier_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  while (!mbarrier_try_wait(bar, parity)) {
  }
}

// ---- TMA (cp.async.bulk.tensor, PTX ISA 9.7.9.27.1.2): a box of the tensor `map` describes, at the given
// coordinates (innermost first), into shared memory at `dst`; its bytes complete-tx on `bar`. Out-of-bounds
// elements are written as zeros. Issued by one thread.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1,
                                            int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, "
      "%6}], [%2];\n" ::"r"(dst),
      "l"(map), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], "
      "[%2];\n" ::"r"(dst),
      "l"(map), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}
__device__ __forceinline__ void tma_prefetch_descriptor(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(map) : "memory");
}

// Orders this thread's generic-proxy writes to shared memory (plain stores) before later async-proxy reads of
// them (wgmma operands).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// ---- wgmma (PTX ISA 9.7.15): D (64 x N, fp32) = A (64 x 16, bf16) B (16 x N, bf16) + (accumulate ? D : 0),
// issued by a whole warpgroup. A comes from shared memory (a matrix descriptor) or registers; B from shared
// memory. trans = 1 reads that operand MN-major (M or N contiguous) instead of K-major.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// The compiler sees an asm statement's register operands as used when it is issued; the hardware uses them
// until wgmma.wait_group. These empty statements, placed after the wait, keep the registers (accumulators,
// A fragments) where they are and keep their reads from moving above the wait.
template <int kN>
__device__ __forceinline__ void fence_operand(float (&r)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int kN>
__device__ __forceinline__ void fence_operand(uint32_t (&r)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

#define TUNA_WGMMA_D8(i)                                                                                      \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])
#define TUNA_WGMMA_D32(i) TUNA_WGMMA_D8(i), TUNA_WGMMA_D8(i + 8), TUNA_WGMMA_D8(i + 16), TUNA_WGMMA_D8(i + 24)

template <int kN, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_ss(float (&d)[kN / 2], uint64_t a_desc, uint64_t b_desc, bool accumulate);
template <int kN, int kTransB>
__device__ __forceinline__ void wgmma_rs(float (&d)[kN / 2], const uint32_t (&a)[4], uint64_t b_desc,
                                         bool accumulate);

template <int kN, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_ss(float (&d)[kN / 2], uint64_t a_desc, uint64_t b_desc, bool accumulate) {
  static_assert(kN == 64 || kN == 128, "wgmma_ss: N 64 or 128");
  if constexpr (kN == 64) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
        "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, "
        "%33, p, 1, 1, %35, %36;\n}\n"
        : TUNA_WGMMA_D32(0)
        : "l"(a_desc), "l"(b_desc), "r"(static_cast<int>(accumulate)), "n"(kTransA), "n"(kTransB));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
        "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, "
        "%33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, "
        "%54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, %67, %68;\n}\n"
        : TUNA_WGMMA_D32(0), TUNA_WGMMA_D32(32)
        : "l"(a_desc), "l"(b_desc), "r"(static_cast<int>(accumulate)), "n"(kTransA), "n"(kTransB));
  }
}

template <int kN, int kTransB>
__device__ __forceinline__ void wgmma_rs(float (&d)[kN / 2], const uint32_t (&a)[4], uint64_t b_desc,
                                         bool accumulate) {
  static_assert(kN == 64 || kN == 128, "wgmma_rs: N 64 or 128");
  if constexpr (kN == 64) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
        "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, "
        "%33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
        : TUNA_WGMMA_D32(0)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(static_cast<int>(accumulate)), "n"(kTransB));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
        "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, "
        "%33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, "
        "%54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
        : TUNA_WGMMA_D32(0), TUNA_WGMMA_D32(32)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(static_cast<int>(accumulate)), "n"(kTransB));
  }
}

#undef TUNA_WGMMA_D32
#undef TUNA_WGMMA_D8

// ---- warp specialisation
// setmaxnreg (PTX ISA 9.7.19.5): the warpgroup's per-thread register count moves to kRegs, released to (dec)
// or taken from (inc, blocking until available) the CTA's pool.
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
// elect.sync over the whole warp: true in exactly one lane.
__device__ __forceinline__ bool elect_one() {
  uint32_t elected;
  asm volatile(
      "{\n.reg .pred p;\n.reg .b32 lane;\n"
      "elect.sync lane|p, 0xffffffff;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(elected));
  return elected != 0;
}
// bar.sync / bar.arrive on named barrier `id` (1..15; 0 is __syncthreads) completing after `threads` arrivals.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---- ex2.approx.ftz.f32 (PTX ISA, floating-point instructions: ex2): 2^x as one MUFU.EX2, subnormal inputs and
// results flushed to zero. exp2f compiles to the same instruction wrapped in a fix-up for subnormal results (a
// compare and two predicated multiplies per call); a softmax term under 2^-126 is far below what the fp32 row
// sums and the bf16 P resolve, so flushing it is free.
__device__ __forceinline__ float ex2_approx_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ---- flags in global memory between CTAs (the backward's ordered dQ accumulation)
// Spins until *flag == value, then acquires at gpu scope: what the CTA that released `value` wrote before
// releasing it is visible after this returns. The spin reads relaxed (an acquire load invalidates L1 each time);
// one acquire load follows, which sees `value` again: a flag changes only when the waiter itself releases it.
__device__ __forceinline__ void flag_wait(const int* flag, int value) {
  int seen;
  do {
    asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(flag) : "memory");
  } while (seen != value);
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(flag) : "memory");
}
// Stores `value` with release semantics at gpu scope: after this thread's earlier writes (and, through the
// barrier before it, the CTA's) are visible.
__device__ __forceinline__ void flag_release(int* flag, int value) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(flag), "r"(value) : "memory");
}

}  // namespace tuna::cuda::attention
