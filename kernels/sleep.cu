// sleep_on_stream (kernels/sleep.cuh): one warp of one block reads the global timer (%globaltimer, nanoseconds) and
// sleeps in steps of at most 1 us until the time has passed. Writes nothing.
#include "kernels/sleep.cuh"

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common.cuh"

namespace tuna::cuda {
namespace {

__global__ void sleep_kernel(int64_t nanoseconds) {
#ifndef TUNA_EMULATOR
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < static_cast<uint64_t>(nanoseconds));
#endif
}

}  // namespace

void sleep_on_stream(int64_t nanoseconds, cudaStream_t stream) {
  TUNA_CHECK(nanoseconds >= 0, "sleep of ", nanoseconds, " ns");
  if (nanoseconds == 0) return;
  launch_kernel(sleep_kernel, 1, 32, 0, stream, nanoseconds);
  TUNA_CUDA_CHECK_LAUNCH();
}

}  // namespace tuna::cuda
