// Helpers of the GPU benches: CUDA-event timing for Google Benchmark's manual time, device buffers filled
// with random (never zero: METHOD.md) data, and the ceilings results are reported against.
#pragma once

#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <map>
#include <string>
#include <vector>

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

namespace tuna::bench {

// main() of a GPU bench: Google Benchmark's, plus the trainer's error convention (a tuna::Error, such as a
// CUDA failure, prints "error: ..." and exits 1 instead of aborting). Without a visible device it says so and
// exits 0, so `make bench` on a CUDA build machine without a GPU still runs the CPU benches; listing the benchmarks
// (--benchmark_list_tests) needs none. `before` runs after flag parsing. A flag Google Benchmark does not know
// fails (as BENCHMARK_MAIN's does): a misspelled filter would otherwise run every benchmark.
inline int run_gpu_bench(int argc, char** argv, void (*before)()) {
  bool listing = false;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    listing = listing || flag == "--benchmark_list_tests" || flag == "--benchmark_list_tests=true";
  }
  int devices = 0;
  if (!listing && (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0)) {
    std::printf("%s: no CUDA device visible, skipped\n", argv[0]);
    return 0;
  }
  try {
    benchmark::Initialize(&argc, argv);
    if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
    if (!listing) before();
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}

// The gpu-check build links the GPU benches into one binary, gpu_benches (bench/gpu_benches.cpp), so that the device
// code, the CUDA runtime and the library it sends to the GPU machine are in it once, not once per bench; each bench
// file is compiled for it with TUNA_GPU_BENCH_NAME ("attention", ...). There its benchmarks are kept under that name
// instead of registered, and its main is the `before` kept beside them: `gpu_benches NAME [flags]` registers NAME's
// benchmarks alone and runs them as bench_NAME_gpu would. (Google Benchmark registers every BENCHMARK of a binary at
// start-up and has no way to drop some: a filter could not tell one bench's benchmarks from another's.)
struct GpuBench {
  std::vector<benchmark::internal::Benchmark*> benchmarks;
  void (*before)() = nullptr;
};
std::map<std::string, GpuBench>& gpu_benches();  // bench/gpu_benches.cpp
inline benchmark::internal::Benchmark* keep_benchmark(const char* bench, benchmark::internal::Benchmark* b) {
  gpu_benches()[bench].benchmarks.push_back(b);
  return b;
}
inline int keep_before(const char* bench, void (*before)()) {
  gpu_benches()[bench].before = before;
  return 0;
}

}  // namespace tuna::bench

#ifdef TUNA_GPU_BENCH_NAME
#undef BENCHMARK
#define BENCHMARK(...)                                                                                 \
  BENCHMARK_PRIVATE_DECLARE(_benchmark_) = ::tuna::bench::keep_benchmark(                              \
      TUNA_GPU_BENCH_NAME, new ::benchmark::internal::FunctionBenchmark(#__VA_ARGS__, &__VA_ARGS__))
#define TUNA_GPU_BENCH_MAIN(before) \
  static const int tuna_gpu_bench_before = ::tuna::bench::keep_before(TUNA_GPU_BENCH_NAME, [] { before; });
#else
#define TUNA_GPU_BENCH_MAIN(before) \
  int main(int argc, char** argv) { return ::tuna::bench::run_gpu_bench(argc, argv, [] { before; }); }
#endif
