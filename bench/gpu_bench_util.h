// Helpers of the GPU benches: CUDA-event timing for Google Benchmark's manual time, device buffers filled
// with random (never zero: METHOD.md) data, and the ceilings results are reported against.
#pragma once

#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>

#include "core/cuda_check.h"
#include "engine/device_gpu.h"  // gpu_peak_bf16_flops
#include "kernels/adamw.cuh"
#include "kernels/init.cuh"

namespace tuna::bench {

// Times `body` (which enqueues work on `stream`) with CUDA events around it; one Google Benchmark iteration.
// Warm-up: the first call of each benchmark runs once untimed (module load, cuBLASLt heuristics).
template <typename Body>
void run_timed(benchmark::State& state, cudaStream_t stream, Body&& body) {
  cudaEvent_t start, stop;
  TUNA_CUDA_CHECK(cudaEventCreate(&start));
  TUNA_CUDA_CHECK(cudaEventCreate(&stop));
  body();
  TUNA_CUDA_CHECK(cudaStreamSynchronize(stream));
  for (auto _ : state) {
    TUNA_CUDA_CHECK(cudaEventRecord(start, stream));
    body();
    TUNA_CUDA_CHECK(cudaEventRecord(stop, stream));
    TUNA_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    TUNA_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    state.SetIterationTime(ms * 1e-3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

// A device allocation, freed on scope exit.
struct DeviceMemory {
  void* ptr = nullptr;
  explicit DeviceMemory(size_t bytes) { TUNA_CUDA_CHECK(cudaMalloc(&ptr, bytes)); }
  ~DeviceMemory() { cudaFree(ptr); }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr);
  }
};

// Random bf16 values in a device buffer (through an fp32 staging fill).
inline void fill_random_bf16(__nv_bfloat16* dst, int64_t n, uint64_t seed, float stddev = 1.0f) {
  DeviceMemory staging(static_cast<size_t>(n) * sizeof(float));
  cuda::fill_normal(staging.as<float>(), n, seed, stddev, nullptr);
  cuda::f32_to_bf16(dst, staging.as<float>(), n, nullptr);
  TUNA_CUDA_CHECK(cudaDeviceSynchronize());
}

// Rate counters: per second of (manual) time, summed over iterations.
inline benchmark::Counter rate(double per_iteration) {
  return benchmark::Counter(per_iteration, benchmark::Counter::kIsIterationInvariantRate);
}

}  // namespace tuna::bench

// main() of a GPU bench: Google Benchmark's, plus the trainer's error convention (a tuna::Error, such as a
// CUDA failure, prints "error: ..." and exits 1 instead of aborting). Without a visible device it says so and
// exits 0, so `make bench` on a CUDA build machine without a GPU still runs the CPU benches. `before` runs after
// flag parsing. A flag Google Benchmark does not know fails (as BENCHMARK_MAIN's does): a misspelled filter
// would otherwise run every benchmark.
#define TUNA_GPU_BENCH_MAIN(before)                          \
  int main(int argc, char** argv) {                          \
    int devices = 0;                                         \
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) { \
      std::printf("%s: no CUDA device visible, skipped\n", argv[0]);   \
      return 0;                                              \
    }                                                        \
    try {                                                    \
      benchmark::Initialize(&argc, argv);                    \
      if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1; \
      before;                                                \
      benchmark::RunSpecifiedBenchmarks();                   \
      benchmark::Shutdown();                                 \
      return 0;                                              \
    } catch (const std::exception& e) {                      \
      std::fprintf(stderr, "error: %s\n", e.what());         \
      return 1;                                              \
    }                                                        \
  }
