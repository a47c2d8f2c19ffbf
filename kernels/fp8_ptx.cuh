// The PTX of the FP8 casts (kernels/fp8.cu): cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32, two fp32 values into a pair of
// FP8 codes, each wrapped in a one-line device function. Internal to kernels/.
//
// As attention_ptx.cuh: the host emulator (tests/kernels/emulator/ptx_fp8.h) puts host versions of exactly these
// functions in their place, written from the PTX ISA's cvt, so CI runs the casts through their real
// launchers; whatever FP8 PTX a kernel needs goes here, with its host version there.
//
// The instruction exists from sm_89: the sm_80 image (SM="90a 80") gets a trap in its place, and the FP8 path is
// refused before launch on a device without it (what runs where: engine/support).
#pragma once

#include <cstdint>

namespace tuna::cuda::fp8 {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define TUNA_FP8_CVT(format, hi, lo)                                                                         \
  uint16_t d;                                                                                                \
  asm("cvt.rn.satfinite." format "x2.f32 %0, %1, %2;\n" : "=h"(d) : "f"(hi), "f"(lo));                     \
  return d
#else
#define TUNA_FP8_CVT(format, hi, lo) \
  __trap();                          \
  return 0
#endif

// The codes of hi and lo, hi in the upper byte, lo in the lower (the ISA: input a to the upper half of d): the pair
// of elements (x[2i], x[2i + 1]) as they lie in memory is cvt(x[2i + 1], x[2i]).
__device__ __forceinline__ uint16_t cvt_e4m3x2(float hi, float lo) { TUNA_FP8_CVT("e4m3", hi, lo); }
__device__ __forceinline__ uint16_t cvt_e5m2x2(float hi, float lo) { TUNA_FP8_CVT("e5m2", hi, lo); }

#undef TUNA_FP8_CVT

}  // namespace tuna::cuda::fp8
