// The CUDA device's queries for the engine's banner and log line (engine/device_gpu.h).
#if TUNA_CUDA

#include "engine/device_gpu.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <cmath>
#include <cstdlib>
#include <map>
#include <mutex>

#include "core/cuda_check.h"
#include "core/error.h"

namespace tuna {

GpuInfo gpu_info(int device) {
  cudaDeviceProp prop{};
  TUNA_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  return {prop.name, prop.multiProcessorCount, static_cast<int64_t>(prop.totalGlobalMem)};
}

double gpu_peak_bf16_flops(int device) {
  if (const char* env = std::getenv("TUNA_PEAK_TFLOPS")) return std::atof(env) * 1e12;
  cudaDeviceProp prop{};
  TUNA_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  const double sms = prop.multiProcessorCount;
  if (prop.major == 9) return 989.4e12 * sms / 132.0;  // H100/H200 SXM dense bf16
  if (prop.major == 8 && prop.minor == 0) return 312e12 * sms / 108.0;  // A100
  int clock_khz = 0;
  TUNA_CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device));
  return sms * 1024.0 * clock_khz * 1e3;  // 512 bf16 MACs per SM per clock (sm_86/89 class)
}

GpuMemory gpu_memory(int device) {
  int previous = 0;
  TUNA_CUDA_CHECK(cudaGetDevice(&previous));
  TUNA_CUDA_CHECK(cudaSetDevice(device));
  size_t free_bytes = 0, total_bytes = 0;
  TUNA_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  TUNA_CUDA_CHECK(cudaSetDevice(previous));
  return {static_cast<int64_t>(total_bytes - free_bytes), static_cast<int64_t>(total_bytes)};
}

// NVML's C ABI, the few calls used (nvml.h is not part of the CUDA toolkit here): every call returns 0 on
// success; a device handle is an opaque pointer; utilization is two unsigned percentages.
namespace {
struct NvmlUtilization {
  unsigned int gpu, memory;
};
struct Nvml {
  int (*init)() = nullptr;
  int (*handle_by_pci_bus_id)(const char*, void**) = nullptr;
  int (*utilization_rates)(void*, NvmlUtilization*) = nullptr;
  bool ready = false;
  std::map<int, void*> handles;  // CUDA device index -> NVML handle (matched by PCI bus id, so that
                                 // CUDA_VISIBLE_DEVICES renumbering does not pick the wrong card)
};

Nvml& nvml() {
  static Nvml n = [] {
    Nvml x;
    void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) return x;
    x.init = reinterpret_cast<int (*)()>(dlsym(lib, "nvmlInit_v2"));
    x.handle_by_pci_bus_id = reinterpret_cast<int (*)(const char*, void**)>(dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2"));
    x.utilization_rates = reinterpret_cast<int (*)(void*, NvmlUtilization*)>(dlsym(lib, "nvmlDeviceGetUtilizationRates"));
    x.ready = x.init && x.handle_by_pci_bus_id && x.utilization_rates && x.init() == 0;
    return x;
  }();
  return n;
}
}  // namespace

double gpu_utilization_percent(int device) {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  Nvml& n = nvml();
  if (!n.ready) return NAN;
  auto it = n.handles.find(device);
  if (it == n.handles.end()) {
    char bus_id[32] = {};
    void* handle = nullptr;
    if (cudaDeviceGetPCIBusId(bus_id, sizeof bus_id, device) != cudaSuccess ||
        n.handle_by_pci_bus_id(bus_id, &handle) != 0)
      handle = nullptr;
    it = n.handles.emplace(device, handle).first;
  }
  NvmlUtilization u{};
  if (it->second == nullptr || n.utilization_rates(it->second, &u) != 0) return NAN;
  return u.gpu;
}

}  // namespace tuna

#endif  // TUNA_CUDA
