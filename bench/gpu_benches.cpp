// gpu_benches NAME [Google Benchmark flags]: the GPU benches of the gpu-check build in one binary (see
// gpu_bench_util.h): the device code, the CUDA runtime and the library once instead of once per bench, in what the
// GPU machine is sent. `gpu_benches attention --benchmark_filter=...` runs as bench_attention_gpu does, and
// build/gpu-check/bin/bench_NAME_gpu are scripts that run it so. Not part of the regular build, whose benches are
// one binary each (make bench).
#include <cstdio>
#include <map>
#include <string>

#include "bench/gpu_bench_util.h"

namespace tuna::bench {

std::map<std::string, GpuBench>& gpu_benches() {
  static std::map<std::string, GpuBench> benches;
  return benches;
}

}  // namespace tuna::bench

int main(int argc, char** argv) {
  const auto& benches = tuna::bench::gpu_benches();
  const auto known = [&] {
    std::string names;
    for (const auto& [name, bench] : benches) names += (names.empty() ? "" : ", ") + name;
    return names;
  };
  if (argc < 2 || !benches.count(argv[1])) {
    std::fprintf(stderr, "usage: gpu_benches NAME [Google Benchmark flags]: NAME one of %s%s%s\n", known().c_str(),
                 argc < 2 ? "" : ", not ", argc < 2 ? "" : argv[1]);
    return 1;
  }
  const tuna::bench::GpuBench& bench = benches.at(argv[1]);
  if (bench.before == nullptr) {
    std::fprintf(stderr, "gpu_benches: bench %s has no TUNA_GPU_BENCH_MAIN\n", argv[1]);
    return 1;
  }
  for (benchmark::internal::Benchmark* b : bench.benchmarks) benchmark::internal::RegisterBenchmarkInternal(b);
  // The bench's own name in argv[0] (its messages, and Google Benchmark's), NAME dropped.
  std::string program = std::string("bench_") + argv[1] + "_gpu";
  argv[1] = program.data();
  return tuna::bench::run_gpu_bench(argc - 1, argv + 1, bench.before);
}
