// What the CUDA engine asks of its device for the banner, MFU and the log line: its name and size, its dense bf16
// peak, the memory in use and how busy it is. Only in CUDA builds (TUNA_CUDA).
#pragma once

#if TUNA_CUDA

#include <cstdint>
#include <string>

namespace tuna {

// The device's name, multiprocessor count and memory.
struct GpuInfo {
  std::string name;
  int multiprocessors = 0;
  int64_t memory_bytes = 0;
};
GpuInfo gpu_info(int device = 0);

// Dense bf16 tensor-core peak of a device in FLOP/s, for MFU: TUNA_PEAK_TFLOPS when set (the bench measures
// and reports its own), else the datasheet figure scaled by the multiprocessor count (sm_90: 989 TFLOP/s at
// 132 SMs; sm_80: 312 at 108), else a clock x SM estimate.
double gpu_peak_bf16_flops(int device = 0);

// Device memory for the log line: in use now (cudaMemGetInfo: total - free, all processes) and the card's total.
// LlamaGpu allocates everything at construction, so its peak equals its use after construction.
struct GpuMemory {
  int64_t used_bytes = 0, total_bytes = 0;
};
GpuMemory gpu_memory(int device = 0);

// Percent of the last sample period (about 1/6 s to 1 s, driver-chosen) in which a kernel ran on the device,
// from NVML; NaN where NVML is not available. NVML is loaded at run time (libnvidia-ml.so.1 comes with the
// driver), so binaries still start on machines without one.
double gpu_utilization_percent(int device = 0);


}  // namespace tuna

#endif  // TUNA_CUDA
