// tests/kernels/emulator/runtime.h — the CUDA runtime API on the host, for the emulated build of the kernels'
// launchers (kernels/*.cu compiled as C++ with -DTUNA_EMULATOR), of the GPU model (model/llama_gpu.cpp,
// engine/engine_gpu.cpp) and of the GPU tests (tests/kernels/*_gpu.cpp, tests/model/*_gpu.cpp): the shim/
// headers stand in for <cuda_runtime.h>, <cuda_runtime_api.h> and <cuda_bf16.h> and include this.
//
// One emulated device, H100-like in its description (cudaGetDeviceProperties). "Device" memory is host
// memory (cudaMalloc is an aligned host allocation; emulated kernels read and write it through the same
// pointers), fresh allocations read as 0xff bytes (NaN in bf16 and fp32) as shared memory does, and copies
// are checked against the allocations they name.
//
// Streams, two ways (see "streams" below). In order (the default): every call, launches included, completes
// before it returns, which is one order a device may run streams in; fast, and what most tests need. Concurrent
// (emulated_gpu_tests --streams concurrent, --jitter SEED): each stream's work runs on a host thread of its own,
// as late as the stream allows, and only events, the legacy default stream and the host's synchronizing calls
// order two streams, as on a GPU; a missing cudaStreamWaitEvent then shows in the numbers.
//
// A launch (tuna::emulator::launch, which kernels/common.cuh's launch_kernel calls in this build) reports a
// bad configuration as the runtime does, through cudaGetLastError, so the launchers' TUNA_CUDA_CHECK_LAUNCH
// sees it; what goes wrong while the kernel runs (a deadlock at a barrier, a race of ldmatrix with cp.async,
// a diverged warp collective) throws tuna::Error at once, with what happened, instead of the hardware's
// later "unspecified launch failure".
//
// Host threads. Several threads of one process may drive the device at once (ranks as threads, comm/comm_local.h):
// every piece of work on the emulated device, kernel launches included, holds one process-wide lock, so the
// work of different threads and streams runs one piece at a time, each to completion (one interleaving of their
// streams a device may run). The last error is per host thread, as CUDA's is.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

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
  cudaErrorNotReady = 600,
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

namespace tuna::emulator {
struct Marker;
struct StreamQueue;
}  // namespace tuna::emulator
struct CUstream_st {
  bool blocking = true;  // false: cudaStreamNonBlocking (no implicit order with the legacy default stream)
  tuna::emulator::StreamQueue* queue = nullptr;  // concurrent streams: its thread and queued work; null in order
};
typedef struct CUevent_st* cudaEvent_t;
struct CUevent_st {
  std::shared_ptr<tuna::emulator::Marker> marker;  // the last record's place in its stream; null before any
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
  std::map<uintptr_t, size_t> pinned;       // page-locked host allocations (cudaMallocHost): start -> bytes
  size_t allocated_bytes = 0;
  std::map<const void*, int> max_dynamic_smem;  // per kernel, from cudaFuncSetAttribute
};

inline Runtime& runtime() {
  static Runtime instance;
  return instance;
}

// Held by every piece of work on the emulated device and by the calls that read its state (see the file comment).
// Recursive: an API call may make another. A host thread never waits for a stream while it holds it (the stream's
// thread needs it to run the work waited for): wait_for() checks.
inline std::recursive_mutex& api_lock() {
  static std::recursive_mutex mutex;
  return mutex;
}
inline int& api_lock_depth() {
  static thread_local int depth = 0;
  return depth;
}
class ApiGuard {
 public:
  explicit ApiGuard(std::recursive_mutex& mutex) : mutex_(mutex) { mutex_.lock(), ++api_lock_depth(); }
  ~ApiGuard() { --api_lock_depth(), mutex_.unlock(); }
  ApiGuard(const ApiGuard&) = delete;
  ApiGuard& operator=(const ApiGuard&) = delete;

 private:
  std::recursive_mutex& mutex_;
};

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

// Whether p lies in page-locked host memory (cudaMallocHost): a copy from there reads it when the stream gets to
// the copy, where a copy from pageable memory has read it before the call returns.
inline bool in_pinned_allocation(const void* p) {
  ApiGuard guard(api_lock());
  const auto& pinned = runtime().pinned;
  const auto address = reinterpret_cast<uintptr_t>(p);
  auto next = pinned.upper_bound(address);
  return next != pinned.begin() && address < std::prev(next)->first + std::prev(next)->second;
}

// ---- streams
//
// In order (the default): enqueue() runs the work at once, on the calling thread, so every call has completed when
// it returns. Concurrent (set_stream_order): each stream created meanwhile gets a host thread that runs its queue in
// order, each piece once what it waits for is done (an event's record, or for the legacy default stream and the
// blocking streams, each other's earlier work); the pieces still run one at a time under api_lock, in whatever
// order the threads reach it. With a jitter seed each stream's thread also sleeps a random while (0 to 200 us, half
// the time none, drawn per stream from the seed) before each piece, so that seeds try different interleavings. The
// first exception a piece throws (a kernel's deadlock, a race the checks find, a bad operand) is kept and rethrown
// by the next call that waits for the device, as CUDA reports an asynchronous error late; meanwhile queued work is
// skipped, as a GPU's context is lost. The machinery is runtime.cpp's.
struct Marker {
  bool done = false;
  double milliseconds = 0;  // host time when it was done (cudaEventElapsedTime)
};
using MarkerPtr = std::shared_ptr<Marker>;

// A concurrent stream's queue, or null for a stream that runs in order.
StreamQueue* make_stream_queue(bool blocking);
void destroy_stream_queue(StreamQueue* queue);  // after its work
// Queues `work` (empty: nothing but a place in the stream, an event's record) on `stream` after `waits`, and
// returns the marker done when it has run. In order: runs it now.
MarkerPtr enqueue(cudaStream_t stream, std::function<void()> work, std::vector<MarkerPtr> waits = {});
// Blocks the host until every marker (null: none) is done; then reports (rethrows) the first failure of queued
// work, unless `quietly` (destructors and frees, which return no error).
void wait_for(const std::vector<MarkerPtr>& markers, bool quietly = false);
bool is_done(const MarkerPtr& marker);  // null: done
MarkerPtr stream_tail(cudaStream_t stream);  // the last piece queued on it (null: none, or in order)
std::vector<MarkerPtr> every_stream_tail();  // what cudaDeviceSynchronize waits for

// How streams created from now on run (and the legacy default stream): in order, or concurrent with or without
// jitter. Streams created before keep their way; the legacy default stream's earlier work finishes first.
struct StreamOrder {
  bool concurrent = false, jitter = false;
  uint64_t jitter_seed = 0;
};
void set_stream_order(bool concurrent, bool jitter = false, uint64_t jitter_seed = 0);
StreamOrder stream_order();
// For the emulator's own tests: `stream`'s later work waits until release(gate).
MarkerPtr hold_stream(cudaStream_t stream);
void release(const MarkerPtr& gate);

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
// the arguments converted to the kernel's parameter types once, at the launch, and copied into every thread, as
// CUDA does. A bad configuration is reported at the launch; the kernel runs when its stream gets to it.
template <typename... Params, typename... Args>
void launch(Target target, void (*kernel)(Params...), dim3 grid, dim3 block, size_t dynamic_smem, cudaStream_t stream,
            Args&&... args) {
  static_assert(sizeof...(Params) == sizeof...(Args), "a kernel launch with the wrong number of arguments");
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535 ||
      threads == 0 || threads > 1024 || block.z > 64) {
    record(cudaErrorInvalidConfiguration);
    return;
  }
  int allowed = kDefaultDynamicSharedBytes;
  {
    ApiGuard guard(api_lock());
    const auto attribute = runtime().max_dynamic_smem.find(reinterpret_cast<const void*>(kernel));
    if (attribute != runtime().max_dynamic_smem.end()) allowed = attribute->second;
  }
  if (dynamic_smem > static_cast<size_t>(allowed)) {
    record(cudaErrorInvalidValue);
    return;
  }
  TUNA_CHECK(block.y == 1 && block.z == 1, "the emulator runs 1-D blocks; a launch has (", block.x, ", ",
             block.y, ", ", block.z, ")");
  auto params = std::make_shared<std::tuple<std::decay_t<Params>...>>(std::forward<Args>(args)...);
  enqueue(stream, [=] {
    const int races = run_grid(grid, static_cast<int>(threads), static_cast<int>(dynamic_smem), target,
                               [&] { std::apply(kernel, *params); });
    TUNA_CHECK(races == 0, "race check: ", races, " blocks of a ", grid.x, "x", grid.y, "x", grid.z,
               " grid read shared memory that a cp.async may still be writing (the first is printed above)");
  });
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
    case cudaErrorNotReady: return "device not ready";
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
    case cudaErrorNotReady: return "cudaErrorNotReady";
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
inline cudaError_t cudaDeviceSynchronize() {
  tuna::emulator::wait_for(tuna::emulator::every_stream_tail());
  return cudaSuccess;
}
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
// As CUDA's, synchronizes the device first: queued work may still use the allocation.
inline cudaError_t cudaFree(void* p) {
  if (p == nullptr) return cudaSuccess;
  tuna::emulator::wait_for(tuna::emulator::every_stream_tail(), /*quietly=*/true);
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
  const size_t rounded = (std::max<size_t>(bytes, 1) + 255) / 256 * 256;
  *p = std::aligned_alloc(256, rounded);
  if (*p == nullptr) return tuna::emulator::record(cudaErrorMemoryAllocation);
  tuna::emulator::ApiGuard guard(tuna::emulator::api_lock());
  tuna::emulator::runtime().pinned[reinterpret_cast<uintptr_t>(*p)] = rounded;
  return cudaSuccess;
}
template <typename T>
cudaError_t cudaMallocHost(T** p, size_t bytes) {
  return cudaMallocHost(reinterpret_cast<void**>(p), bytes);
}
inline cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned) { return cudaMallocHost(p, bytes); }
inline cudaError_t cudaFreeHost(void* p) {
  if (p == nullptr) return cudaSuccess;
  tuna::emulator::wait_for(tuna::emulator::every_stream_tail(), /*quietly=*/true);
  tuna::emulator::ApiGuard guard(tuna::emulator::api_lock());
  tuna::emulator::runtime().pinned.erase(reinterpret_cast<uintptr_t>(p));
  std::free(p);
  return cudaSuccess;
}

namespace tuna::emulator {

// A copy of height rows of width bytes, dpitch and spitch bytes apart, queued on `stream` (runtime.cpp); as CUDA, a
// row wider than a pitch is refused, and the arguments are checked at the call. What the host side of it does, by
// CUDA's rules for copies (its "API synchronization behavior"): a source in pageable host memory is read before the
// call returns (staged); a destination in host memory is written when the stream gets there, so the host
// synchronizes before it reads, and with `synchronous` (cudaMemcpy, on the legacy default stream) the call waits for
// that unless the copy is device to device or from pageable memory to the device, which cudaMemcpy may leave queued.
cudaError_t copy_2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                    cudaMemcpyKind kind, cudaStream_t stream, bool synchronous);
// cudaMemset's on `stream`: asynchronous for device memory, even the synchronous cudaMemset (legacy stream).
cudaError_t set_bytes(void* p, int value, size_t bytes, cudaStream_t stream);

}  // namespace tuna::emulator

inline cudaError_t cudaMemcpy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                                cudaMemcpyKind kind) {
  return tuna::emulator::copy_2d(dst, dpitch, src, spitch, width, height, kind, nullptr, /*synchronous=*/true);
}
inline cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  return cudaMemcpy2D(dst, bytes, src, bytes, bytes, 1, kind);
}
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                                   cudaStream_t stream = nullptr) {
  return tuna::emulator::copy_2d(dst, bytes, src, bytes, bytes, 1, kind, stream, /*synchronous=*/false);
}
inline cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                                     size_t height, cudaMemcpyKind kind, cudaStream_t stream = nullptr) {
  return tuna::emulator::copy_2d(dst, dpitch, src, spitch, width, height, kind, stream, /*synchronous=*/false);
}
inline cudaError_t cudaMemset(void* p, int value, size_t bytes) {
  return tuna::emulator::set_bytes(p, value, bytes, nullptr);
}
inline cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t stream = nullptr) {
  return tuna::emulator::set_bytes(p, value, bytes, stream);
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

// ---- streams and events (see "streams" above): in order, everything has completed by the time a call returns
inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned flags) {
  *stream = new CUstream_st{};
  (*stream)->blocking = (flags & cudaStreamNonBlocking) == 0;
  (*stream)->queue = tuna::emulator::make_stream_queue((*stream)->blocking);
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreate(cudaStream_t* stream) { return cudaStreamCreateWithFlags(stream, 0); }
// Waits for the stream's work (CUDA returns at once and lets it finish; nothing here outlives it either way).
inline cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  if (stream == nullptr) return tuna::emulator::record(cudaErrorInvalidResourceHandle);
  if (stream->queue != nullptr) tuna::emulator::destroy_stream_queue(stream->queue);
  delete stream;
  return cudaSuccess;
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  tuna::emulator::wait_for({tuna::emulator::stream_tail(stream)});
  return cudaSuccess;
}
inline cudaError_t cudaStreamQuery(cudaStream_t stream) {
  return tuna::emulator::is_done(tuna::emulator::stream_tail(stream)) ? cudaSuccess : cudaErrorNotReady;
}
// A wait on an event never recorded does nothing, as in CUDA; otherwise the stream's later work waits for the
// event's last record as of this call.
inline cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned = 0) {
  if (event == nullptr) return tuna::emulator::record(cudaErrorInvalidResourceHandle);
  if (event->marker != nullptr) tuna::emulator::enqueue(stream, {}, {event->marker});
  return cudaSuccess;
}
inline cudaError_t cudaEventCreate(cudaEvent_t* event) {
  *event = new CUevent_st{};
  return cudaSuccess;
}
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned) { return cudaEventCreate(event); }
inline cudaError_t cudaEventDestroy(cudaEvent_t event) {
  delete event;  // queued waits hold its marker
  return cudaSuccess;
}
inline cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream = nullptr) {
  if (event == nullptr) return tuna::emulator::record(cudaErrorInvalidResourceHandle);
  event->marker = tuna::emulator::enqueue(stream, {});
  return cudaSuccess;
}
inline cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  tuna::emulator::wait_for({event->marker});
  return cudaSuccess;
}
inline cudaError_t cudaEventQuery(cudaEvent_t event) {
  return tuna::emulator::is_done(event->marker) ? cudaSuccess : cudaErrorNotReady;
}
inline cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  if (start->marker == nullptr || end->marker == nullptr) return tuna::emulator::record(cudaErrorInvalidResourceHandle);
  if (!tuna::emulator::is_done(start->marker) || !tuna::emulator::is_done(end->marker)) return cudaErrorNotReady;
  *ms = static_cast<float>(end->marker->milliseconds - start->marker->milliseconds);
  return cudaSuccess;
}
