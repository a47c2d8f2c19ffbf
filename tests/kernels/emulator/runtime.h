// tests/kernels/emulator/runtime.h — the CUDA runtime API on the host, for the emulated build of the kernels'
// launchers (kernels/*.cu compiled as C++ with -DTUNA_EMULATOR), of the GPU model (model/llama_gpu.cpp,
// engine/engine_gpu.cpp) and of the GPU tests (tests/kernels/*_gpu.cpp, tests/model/*_gpu.cpp): the shim/
// headers stand in for <cuda_runtime.h>, <cuda_runtime_api.h> and <cuda_bf16.h> and include this.
//
// One emulated device, H100-like in its description (cudaGetDeviceProperties). "Device" memory is host
// memory (cudaMalloc is an aligned host allocation; emulated kernels read and write it through the same
// pointers), fresh allocations read as 0xff bytes (NaN in bf16 and fp32) as shared memory does, and copies
// are checked against the allocations they name. Streams and events exist but order nothing: every call,
// launches included, completes before it returns, which is one order a stream may run in.
//
// A launch (tuna::emulator::launch, which kernels/common.cuh's launch_kernel calls in this build) reports a
// bad configuration as the runtime does, through cudaGetLastError, so the launchers' TUNA_CUDA_CHECK_LAUNCH
// sees it; what goes wrong while the kernel runs (a deadlock at a barrier, a race of ldmatrix with cp.async,
// a diverged warp collective) throws tuna::Error at once, with what happened, instead of the hardware's
// later "unspecified launch failure".
//
// Host threads. Several threads of one process may drive the device at once (ranks as threads, comm/comm_local.h):
// every call that touches the emulated device, kernel launches included, holds one process-wide lock, so the
// calls of different threads run one at a time, each to completion (one interleaving of their streams a device
// may run). The last error is per host thread, as CUDA's is.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>

#include "tests/kernels/emulator/emulator.h"
#include "tests/kernels/emulator/ptx.h"
#include "tests/kernels/emulator/ptx_fp8.h"
#include "tests/kernels/emulator/ptx_sm90.h"

// ---- types and constants (the values of CUDA's headers)
enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidPitchValue = 12,
  cudaErrorInvalidDevicePointer = 17,
  cudaErrorInvalidMemcpyDirection = 21,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
};
typedef enum cudaError cudaError_t;

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

enum cudaFuncAttribute {
  cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
};

enum cudaDeviceAttr {
  cudaDevAttrClockRate = 13,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrComputeCapabilityMajor = 75,
  cudaDevAttrComputeCapabilityMinor = 76,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
};

struct CUstream_st {
  int unused;
};
typedef struct CUevent_st* cudaEvent_t;
struct CUevent_st {
  double milliseconds;  // host time at the last record
};

constexpr unsigned cudaStreamNonBlocking = 1;
constexpr unsigned cudaEventDefault = 0;
constexpr unsigned cudaEventDisableTiming = 2;
constexpr unsigned cudaHostAllocDefault = 0;

// The fields tuna reads, and the common ones; an H100 SXM's values.
struct cudaDeviceProp {
  char name[256];
  size_t totalGlobalMem;
  size_t sharedMemPerBlock;
  int regsPerBlock;
  int warpSize;
  int maxThreadsPerBlock;
  int maxThreadsDim[3];
  int maxGridSize[3];
  int clockRate;  // kHz
  int major;
  int minor;
  int multiProcessorCount;
  int memoryClockRate;  // kHz
  int memoryBusWidth;   // bits
  int l2CacheSize;
  int maxThreadsPerMultiProcessor;
  size_t sharedMemPerMultiprocessor;
  size_t sharedMemPerBlockOptin;
};

namespace tuna::emulator {

constexpr size_t kDeviceMemoryBytes = size_t{80} << 30;
constexpr int kDefaultDynamicSharedBytes = 48 * 1024;  // without cudaFuncAttributeMaxDynamicSharedMemorySize
constexpr int kOptInDynamicSharedBytes = 227 * 1024;   // sm_90's opt-in limit (ptx.h holds launches to sm_80's)

struct Runtime {
  int multiprocessors = 132;  // an H100 SXM's; emulated_gpu_tests --sms sets fewer (persistent grids then loop)
  // The order blocks run in: blockIdx order (x fastest, as GPUs dispatch in practice), or last first
  // (emulated_gpu_tests --blocks reversed). CUDA promises no order, so a kernel whose blocks wait on each other
  // must work in both.
  bool blocks_reversed = false;
  std::map<uintptr_t, size_t> allocations;  // device allocations: start -> bytes
  size_t allocated_bytes = 0;
  std::map<const void*, int> max_dynamic_smem;  // per kernel, from cudaFuncSetAttribute
};

inline Runtime& runtime() {
  static Runtime instance;
  return instance;
}

// Held by every call that touches the emulated device (see the file comment). Recursive: an API call may make
// another (cudaMemcpyAsync calls cudaMemcpy).
inline std::recursive_mutex& api_lock() {
  static std::recursive_mutex mutex;
  return mutex;
}
using ApiGuard = std::lock_guard<std::recursive_mutex>;

inline cudaError_t& last_error() {
  static thread_local cudaError_t error = cudaSuccess;
  return error;
}

inline cudaError_t record(cudaError_t error) {
  if (error != cudaSuccess) last_error() = error;
  return error;
}

// Whether [p, p + bytes) lies inside one device allocation.
inline bool in_device_allocation(const void* p, size_t bytes) {
  ApiGuard guard(api_lock());
  const auto& allocations = runtime().allocations;
  const auto address = reinterpret_cast<uintptr_t>(p);
  auto next = allocations.upper_bound(address);
  if (next == allocations.begin()) return false;
  const auto& [start, size] = *std::prev(next);
  return address + bytes <= start + size;
}

// What a launch targets: a kernel built for sm_80 and sm_90a alike (launch_kernel), held to sm_80's limits, or
// an sm_90a-only kernel (launch_kernel_sm90a), which may use sm_90's shared memory and the Hopper instructions.
enum class Target { kSm80, kSm90a };

// Runs kernel() on every block of `grid`, `threads` threads a block and `dynamic_smem` bytes of dynamic shared
// memory, one block after another: in blockIdx order (x fastest, as a GPU dispatches them in practice), or last
// first with Runtime::blocks_reversed. Returns the number of blocks in which the race check of cp.async found a
// race (the Hopper checks of ptx_sm90.h throw at once).
inline int run_grid(dim3 grid, int threads, int dynamic_smem, Target target, const std::function<void()>& kernel) {
  const int limit = target == Target::kSm90a ? kSm90MaxDynamicSharedBytes : kSm80MaxDynamicSharedBytes;
  TUNA_CHECK(dynamic_smem >= 0 && dynamic_smem <= limit, "launch asks for ", dynamic_smem,
             " bytes of dynamic shared memory; an ", target == Target::kSm90a ? "sm_90" : "sm_80",
             " block may have ", limit);
  g_shared.launch_bytes = static_cast<uint32_t>(dynamic_smem);
  gridDim = grid;
  blockDim = dim3{static_cast<unsigned>(threads), 1, 1};
  int blocks_with_races = 0;
  const int64_t n_blocks = int64_t{grid.x} * grid.y * grid.z;
  for (int64_t i = 0; i < n_blocks; ++i) {
    const int64_t linear = runtime().blocks_reversed ? n_blocks - 1 - i : i;
    blockIdx = dim3{static_cast<unsigned>(linear % grid.x), static_cast<unsigned>(linear / grid.x % grid.y),
                    static_cast<unsigned>(linear / (int64_t{grid.x} * grid.y))};
    // Shared memory starts as 0xff bytes (NaN as bf16 or fp32): a read of what nothing wrote shows.
    std::memset(shared_bytes(), 0xff, dynamic_smem);
    for (int t = 0; t < threads; ++t) g_shared.threads[t].open.clear(), g_shared.threads[t].committed.clear();
    g_shared.flights.clear(), g_shared.reads.clear();
    reset_block_barriers(threads);
    reset_sm90_block(threads, target == Target::kSm90a);
    block().run(threads, kernel);
    finish_sm90_block();
    // A copy never waited for may land at any time up to the block's end.
    for (int t = 0; t < threads; ++t) {
      auto& copies = g_shared.threads[t];
      copies.committed.push_back(std::move(copies.open));
      for (const auto& group : copies.committed)
        for (const AsyncCopy& copy : group)
          g_shared.flights.push_back({copy.dst / 16, copy.issue_epoch, LONG_MAX, t});
    }
    if (!g_shared.flights.empty()) blocks_with_races += block_has_race();
  }
  return blocks_with_races;
}

// Runs kernel<<<grid, block, dynamic_smem, stream>>>(args...) on the host, block after block (run_grid above),
// the arguments converted to the kernel's parameter types once and copied into every thread, as CUDA does.
template <typename... Params, typename... Args>
void launch(Target target, void (*kernel)(Params...), dim3 grid, dim3 block, size_t dynamic_smem, cudaStream_t,
            Args&&... args) {
  static_assert(sizeof...(Params) == sizeof...(Args), "a kernel launch with the wrong number of arguments");
  ApiGuard guard(api_lock());
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535 ||
      threads == 0 || threads > 1024 || block.z > 64) {
    record(cudaErrorInvalidConfiguration);
    return;
  }
  const auto attribute = runtime().max_dynamic_smem.find(reinterpret_cast<const void*>(kernel));
  const int allowed = attribute == runtime().max_dynamic_smem.end() ? kDefaultDynamicSharedBytes : attribute->second;
  if (dynamic_smem > static_cast<size_t>(allowed)) {
    record(cudaErrorInvalidValue);
    return;
  }
  TUNA_CHECK(block.y == 1 && block.z == 1, "the emulator runs 1-D blocks; a launch has (", block.x, ", ",
             block.y, ", ", block.z, ")");
  std::tuple<std::decay_t<Params>...> params(std::forward<Args>(args)...);
  const int races = run_grid(grid, static_cast<int>(threads), static_cast<int>(dynamic_smem), target,
                             [&] { std::apply(kernel, params); });
  TUNA_CHECK(races == 0, "race check: ", races, " blocks of a ", grid.x, "x", grid.y, "x", grid.z,
             " grid read shared memory that a cp.async may still be writing (the first is printed above)");
}

}  // namespace tuna::emulator

// ---- the runtime API
inline const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidPitchValue: return "invalid pitch argument";
    case cudaErrorInvalidDevicePointer: return "invalid device pointer";
    case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
  }
  return "unknown error";
}
inline const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidPitchValue: return "cudaErrorInvalidPitchValue";
    case cudaErrorInvalidDevicePointer: return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection: return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
  }
  return "cudaErrorUnknown";
}
inline cudaError_t cudaGetLastError() {
  const cudaError_t error = tuna::emulator::last_error();
  tuna::emulator::last_error() = cudaSuccess;
  return error;
}
inline cudaError_t cudaPeekAtLastError() { return tuna::emulator::last_error(); }

// ---- the device
inline cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int device) {
  return device == 0 ? cudaSuccess : tuna::emulator::record(cudaErrorInvalidDevice);
}
inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
inline cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (device != 0) return tuna::emulator::record(cudaErrorInvalidDevice);
  *prop = cudaDeviceProp{};
  std::strcpy(prop->name, "tuna host emulator (H100-like)");
  prop->totalGlobalMem = tuna::emulator::kDeviceMemoryBytes;
  prop->sharedMemPerBlock = tuna::emulator::kDefaultDynamicSharedBytes;
  prop->regsPerBlock = 65536;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->maxThreadsDim[0] = 1024, prop->maxThreadsDim[1] = 1024, prop->maxThreadsDim[2] = 64;
  prop->maxGridSize[0] = 0x7fffffff, prop->maxGridSize[1] = 65535, prop->maxGridSize[2] = 65535;
  prop->clockRate = 1980000;
  prop->major = 9, prop->minor = 0;
  prop->multiProcessorCount = tuna::emulator::runtime().multiprocessors;
  prop->memoryClockRate = 2619000;
  prop->memoryBusWidth = 5120;
  prop->l2CacheSize = 50 * 1024 * 1024;
  prop->maxThreadsPerMultiProcessor = 2048;
  prop->sharedMemPerMultiprocessor = 228 * 1024;
  prop->sharedMemPerBlockOptin = tuna::emulator::kOptInDynamicSharedBytes;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int device) {
  cudaDeviceProp prop;
  if (const cudaError_t error = cudaGetDeviceProperties(&prop, device); error != cudaSuccess) return error;
  switch (attribute) {
    case cudaDevAttrClockRate: *value = prop.clockRate; return cudaSuccess;
    case cudaDevAttrMultiProcessorCount: *value = prop.multiProcessorCount; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMajor: *value = prop.major; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor: *value = prop.minor; return cudaSuccess;
    // What a kernel built for both targets may ask for: run_grid holds their launches to sm_80's limit, so
    // that kernels sized by this attribute (the classifier's row cache) run on both targets.
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = tuna::emulator::kSm80MaxDynamicSharedBytes; return cudaSuccess;
  }
  return tuna::emulator::record(cudaErrorInvalidValue);
}
// "domain:bus:device.function" as the driver writes it; NVML (absent here) would match it to a card.
inline cudaError_t cudaDeviceGetPCIBusId(char* bus_id, int length, int device) {
  if (device != 0) return tuna::emulator::record(cudaErrorInvalidDevice);
  if (length < 13) return tuna::emulator::record(cudaErrorInvalidValue);
  std::strcpy(bus_id, "0000:00:00.0");
  return cudaSuccess;
}
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
inline cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  tuna::emulator::ApiGuard guard(tuna::emulator::api_lock());
  *total_bytes = tuna::emulator::kDeviceMemoryBytes;
  *free_bytes = tuna::emulator::kDeviceMemoryBytes - tuna::emulator::runtime().allocated_bytes;
  return cudaSuccess;
}
template <typename T>
cudaError_t cudaFuncSetAttribute(T* kernel, cudaFuncAttribute attribute, int value) {
  tuna::emulator::ApiGuard guard(tuna::emulator::api_lock());
  if (attribute != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 ||
      value > tuna::emulator::kOptInDynamicSharedBytes)
    return tuna::emulator::record(cudaErrorInvalidValue);
  tuna::emulator::runtime().max_dynamic_smem[reinterpret_cast<const void*>(kernel)] = value;
  return cudaSuccess;
}

// What the emulated device's "image" of a kernel is: every kernel compiles for it, the sm_90a ones included
// (binaryVersion 90, as on an H100 running a build with sm_90a code).
struct cudaFuncAttributes {
  size_t sharedSizeBytes;
  size_t constSizeBytes;
  size_t localSizeBytes;
  int maxThreadsPerBlock;
  int numRegs;
  int ptxVersion;
  int binaryVersion;
  int cacheModeCA;
  int maxDynamicSharedSizeBytes;
};
template <typename T>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attributes, T* kernel) {
  *attributes = cudaFuncAttributes{};
  attributes->maxThreadsPerBlock = 1024;
  attributes->ptxVersion = 90;
  attributes->binaryVersion = 90;
  const auto& set = tuna::emulator::runtime().max_dynamic_smem;
  const auto it = set.find(reinterpret_cast<const void*>(kernel));
  attributes->maxDynamicSharedSizeBytes = it == set.end() ? tuna::emulator::kDefaultDynamicSharedBytes : it->second;
  return cudaSuccess;
}

// ---- memory
inline cudaError_t cudaMalloc(void** p, size_t bytes) {
  tuna::emulator::ApiGuard guard(tuna::emulator::api_lock());
  auto& rt = tuna::emulator::runtime();
  if (bytes > tuna::emulator::kDeviceMemoryBytes - rt.allocated_bytes)
    return tuna::emulator::record(cudaErrorMemoryAllocation);
  const size_t rounded = (std::max<size_t>(bytes, 1) + 255) / 256 * 256;  // cudaMalloc aligns to 256 bytes
  *p = std::aligned_alloc(256, rounded);
  if (*p == nullptr) return tuna::emulator::record(cudaErrorMemoryAllocation);
  std::memset(*p, 0xff, rounded);
  rt.allocations[reinterpret_cast<uintptr_t>(*p)] = bytes;
  rt.allocated_bytes += bytes;
  return cudaSuccess;
}
template <typename T>
cudaError_t cudaMalloc(T** p, size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(p), bytes);
}
inline cudaError_t cudaFree(void* p) {
  if (p == nullptr) return cudaSuccess;
  tuna::emulator::ApiGuard guard(tuna::emulator::api_lock());
  auto& rt = tuna::emulator::runtime();
  const auto it = rt.allocations.find(reinterpret_cast<uintptr_t>(p));
  if (it == rt.allocations.end()) return tuna::emulator::record(cudaErrorInvalidDevicePointer);
  rt.allocated_bytes -= it->second;
  rt.allocations.erase(it);
  std::free(p);
  return cudaSuccess;
}
inline cudaError_t cudaMallocHost(void** p, size_t bytes) {
  *p = std::aligned_alloc(256, (std::max<size_t>(bytes, 1) + 255) / 256 * 256);
  return *p != nullptr ? cudaSuccess : tuna::emulator::record(cudaErrorMemoryAllocation);
}
template <typename T>
cudaError_t cudaMallocHost(T** p, size_t bytes) {
  return cudaMallocHost(reinterpret_cast<void**>(p), bytes);
}
inline cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned) { return cudaMallocHost(p, bytes); }
inline cudaError_t cudaFreeHost(void* p) {
  std::free(p);
  return cudaSuccess;
}

// height rows of width bytes, dpitch and spitch bytes apart; as CUDA, a row wider than a pitch is refused.
inline cudaError_t cudaMemcpy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                                cudaMemcpyKind kind) {
  using tuna::emulator::in_device_allocation;
  tuna::emulator::ApiGuard guard(tuna::emulator::api_lock());
  const bool dst_device = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool src_device = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if (kind < cudaMemcpyHostToHost || kind > cudaMemcpyDefault)
    return tuna::emulator::record(cudaErrorInvalidMemcpyDirection);
  if (width > dpitch || width > spitch) return tuna::emulator::record(cudaErrorInvalidPitchValue);
  if (width == 0 || height == 0) return cudaSuccess;
  if ((dst_device && !in_device_allocation(dst, (height - 1) * dpitch + width)) ||
      (src_device && !in_device_allocation(src, (height - 1) * spitch + width)))
    return tuna::emulator::record(cudaErrorInvalidValue);
  for (size_t r = 0; r < height; ++r)
    std::memmove(static_cast<char*>(dst) + r * dpitch, static_cast<const char*>(src) + r * spitch, width);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  return cudaMemcpy2D(dst, bytes, src, bytes, bytes, 1, kind);
}
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                                   cudaStream_t = nullptr) {
  return cudaMemcpy(dst, src, bytes, kind);
}
inline cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                                     size_t height, cudaMemcpyKind kind, cudaStream_t = nullptr) {
  return cudaMemcpy2D(dst, dpitch, src, spitch, width, height, kind);
}
inline cudaError_t cudaMemset(void* p, int value, size_t bytes) {
  if (bytes == 0) return cudaSuccess;
  tuna::emulator::ApiGuard guard(tuna::emulator::api_lock());
  if (!tuna::emulator::in_device_allocation(p, bytes)) return tuna::emulator::record(cudaErrorInvalidValue);
  std::memset(p, value, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t = nullptr) {
  return cudaMemset(p, value, bytes);
}

// ---- the driver entry point and the tensor maps of TMA (cp.async.bulk.tensor, ptx_sm90.h)
enum cudaDriverEntryPointQueryResult {
  cudaDriverEntryPointSuccess = 0,
  cudaDriverEntryPointSymbolNotFound = 1,
  cudaDriverEntryPointVersionNotSufficent = 2,
};
constexpr unsigned long long cudaEnableDefault = 0;

namespace tuna::emulator {

// cuTensorMapEncodeTiled with the requirements of CUDA's documentation (cuda.h): CUDA_ERROR_INVALID_VALUE for
// what the driver rejects; a tuna::Error for what the driver accepts but the emulator's TMA does not model
// (interleaved layouts, element strides other than 1, the 32B/64B-atom 128B swizzles, the NaN fill).
inline CUresult encode_tensor_map_tiled(CUtensorMap* tensor_map, CUtensorMapDataType data_type, cuuint32_t rank,
                                        void* address, const cuuint64_t* dims, const cuuint64_t* strides,
                                        const cuuint32_t* box, const cuuint32_t* element_strides,
                                        CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
                                        CUtensorMapL2promotion, CUtensorMapFloatOOBfill oob_fill) {
  uint32_t element_bytes = 0;
  switch (data_type) {
    case CU_TENSOR_MAP_DATA_TYPE_UINT8: element_bytes = 1; break;
    case CU_TENSOR_MAP_DATA_TYPE_UINT16: case CU_TENSOR_MAP_DATA_TYPE_FLOAT16: case CU_TENSOR_MAP_DATA_TYPE_BFLOAT16:
      element_bytes = 2; break;
    case CU_TENSOR_MAP_DATA_TYPE_UINT32: case CU_TENSOR_MAP_DATA_TYPE_INT32: case CU_TENSOR_MAP_DATA_TYPE_FLOAT32:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT32_FTZ: case CU_TENSOR_MAP_DATA_TYPE_TFLOAT32:
    case CU_TENSOR_MAP_DATA_TYPE_TFLOAT32_FTZ:
      element_bytes = 4; break;
    case CU_TENSOR_MAP_DATA_TYPE_UINT64: case CU_TENSOR_MAP_DATA_TYPE_INT64: case CU_TENSOR_MAP_DATA_TYPE_FLOAT64:
      element_bytes = 8; break;
    default: return CUDA_ERROR_INVALID_VALUE;
  }
  if (reinterpret_cast<uintptr_t>(tensor_map) % 64 != 0 || rank < 1 || rank > 5 ||
      reinterpret_cast<uintptr_t>(address) % 16 != 0)
    return CUDA_ERROR_INVALID_VALUE;
  TUNA_CHECK(interleave == CU_TENSOR_MAP_INTERLEAVE_NONE,
             "cuTensorMapEncodeTiled: interleaved layouts are not modelled");
  TUNA_CHECK(oob_fill == CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE, "cuTensorMapEncodeTiled: the NaN fill is not modelled");
  uint32_t swizzle_bytes = 0;
  switch (swizzle) {
    case CU_TENSOR_MAP_SWIZZLE_NONE: swizzle_bytes = 0; break;
    case CU_TENSOR_MAP_SWIZZLE_32B: swizzle_bytes = 32; break;
    case CU_TENSOR_MAP_SWIZZLE_64B: swizzle_bytes = 64; break;
    case CU_TENSOR_MAP_SWIZZLE_128B: swizzle_bytes = 128; break;
    default: fail("cuTensorMapEncodeTiled: swizzle mode ", static_cast<int>(swizzle), " is not modelled");
  }
  TensorMap m{};
  m.magic = TensorMap::kMagic;
  m.address = reinterpret_cast<uintptr_t>(address);
  m.rank = rank, m.element_bytes = element_bytes, m.swizzle_bytes = swizzle_bytes;
  m.strides[0] = element_bytes;
  for (uint32_t i = 0; i < rank; ++i) {
    if (dims[i] == 0 || dims[i] > (uint64_t{1} << 32) || box[i] == 0 || box[i] > 256 || element_strides[i] == 0 ||
        element_strides[i] > 8)
      return CUDA_ERROR_INVALID_VALUE;
    TUNA_CHECK(element_strides[i] == 1 || i == 0,
               "cuTensorMapEncodeTiled: element strides other than 1 are not modelled");
    m.dims[i] = dims[i], m.box[i] = box[i];
    if (i > 0) {
      if (strides[i - 1] % 16 != 0 || strides[i - 1] >= (uint64_t{1} << 40)) return CUDA_ERROR_INVALID_VALUE;
      m.strides[i] = strides[i - 1];
    }
  }
  const uint64_t inner_bytes = uint64_t{box[0]} * element_bytes;
  if (inner_bytes % 16 != 0 || (swizzle_bytes != 0 && inner_bytes > swizzle_bytes)) return CUDA_ERROR_INVALID_VALUE;
  std::memset(tensor_map, 0, sizeof(CUtensorMap));
  std::memcpy(tensor_map, &m, sizeof(m));
  return CUDA_SUCCESS;
}

}  // namespace tuna::emulator

// The driver's cuTensorMapEncodeTiled, the one symbol tuna asks for (version 12000, the first with it).
inline cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** function, unsigned int version,
                                                    unsigned long long,
                                                    cudaDriverEntryPointQueryResult* status = nullptr) {
  const bool found = std::strcmp(symbol, "cuTensorMapEncodeTiled") == 0;
  if (status) *status = !found ? cudaDriverEntryPointSymbolNotFound
                        : version < 12000 ? cudaDriverEntryPointVersionNotSufficent
                                          : cudaDriverEntryPointSuccess;
  *function = found && version >= 12000 ? reinterpret_cast<void*>(&tuna::emulator::encode_tensor_map_tiled) : nullptr;
  return cudaSuccess;
}

// ---- streams and events: everything has completed by the time a call returns
inline cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  *stream = new CUstream_st{};
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned) { return cudaStreamCreate(stream); }
inline cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  delete stream;
  return cudaSuccess;
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned = 0) { return cudaSuccess; }
inline cudaError_t cudaEventCreate(cudaEvent_t* event) {
  *event = new CUevent_st{};
  return cudaSuccess;
}
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned) { return cudaEventCreate(event); }
inline cudaError_t cudaEventDestroy(cudaEvent_t event) {
  delete event;
  return cudaSuccess;
}
inline cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t = nullptr) {
  event->milliseconds =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
  return cudaSuccess;
}
inline cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
inline cudaError_t cudaEventQuery(cudaEvent_t) { return cudaSuccess; }
inline cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  *ms = static_cast<float>(end->milliseconds - start->milliseconds);
  return cudaSuccess;
}
