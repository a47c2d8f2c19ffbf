// tests/kernels/emulator/emulator.h — CUDA's execution model on the host, enough of it for the device code
// of kernels/*.cu (and the attention kernels' headers) to compile with g++ and run unchanged. The shim/
// headers (cuda_bf16.h, cuda_runtime.h, cuda_runtime_api.h, cublasLt.h, cuda.h, cudaTypedefs.h) stand in for
// CUDA's and include runtime.h (the grid launch), which includes this one; ptx.h adds the PTX helpers of the
// sm_80 kernels (cp.async, ldmatrix, mma), ptx_sm90.h those of the sm_90a ones (TMA, mbarrier, wgmma, ...).
//
// Why it exists: what makes a kernel right or wrong (an index, a barrier, the tensor-core kernels' fragment
// layouts and swizzle, when cp.async data may be read) is invisible to the CPU twin and the CPU build, and CI
// has no GPU. Here the kernels run on the host, block by block, launched by their real launchers from the
// real GPU tests (build/emulated_gpu_tests), against the twins.
//
// Model. One block at a time. Its threads are fibers (a stack each, switched in user space) on one OS
// thread: a thread runs until it blocks at a barrier (__syncthreads, or a warp collective: shuffle, ldmatrix,
// mma) or returns, then the next runnable thread runs. Scheduling is deterministic (a failure replays), a
// barrier costs a user-space context switch instead of futex wake-ups of 128 OS threads, and a barrier that can
// never complete (a __syncthreads some threads skip, a shuffle after part of a warp returned) is reported
// as a deadlock instead of hanging. Warp collectives require all 32 lanes at the same operation with the
// same arguments where the hardware does (the full mask of the kernels' *_sync calls).
//
// Shared memory. Dynamic shared memory is ptx.h's array; a kernel's static `__shared__` variables become
// thread_local, i.e. static storage that all the block's fibers (one OS thread) share, as a block does.
//
// Not modelled: memory ordering between threads beyond barriers, races on plain shared or global stores
// (only cp.async against ldmatrix is checked), warp divergence inside a collective (it is an error here),
// the accuracy of the fast-math intrinsics (__expf, rsqrtf: the host's exact functions here).
#pragma once

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <utility>
#include <vector>

#include "core/error.h"

// ---- the language: qualifiers and built-in variables
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
// Block-scope thread_local is static: one variable for the whole block (see "Shared memory" above).
#define __shared__ thread_local
#define __align__(bytes)

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
};
// threadIdx is the running fiber's: the scheduler sets it before every switch.
inline dim3 threadIdx, blockIdx, blockDim, gridDim;
using std::max;
using std::min;

// ---- bf16 and the intrinsics the kernels and kernels/common.cuh call (same bits as CUDA's)
struct __nv_bfloat16 {
  uint16_t bits;
};
struct __nv_bfloat162 {
  __nv_bfloat16 lo, hi;
};
struct alignas(16) int4 {
  int x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
struct alignas(8) float2 {
  float x, y;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
typedef struct CUstream_st* cudaStream_t;

inline float __bfloat162float(__nv_bfloat16 b) {
  const uint32_t bits = uint32_t{b.bits} << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
// Round to nearest even, NaN kept quiet: the rounding of CUDA's __float2bfloat16_rn (and core/dtype.h's).
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return {static_cast<uint16_t>((bits >> 16) | 0x0040u)};
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return {static_cast<uint16_t>(bits >> 16)};
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
  return {__float2bfloat16_rn(lo), __float2bfloat16_rn(hi)};
}
inline uint32_t __float_as_uint(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return bits;
}
inline float __uint_as_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short bits) { return {bits}; }
template <typename T>
T __ldcs(const T* p) {
  return *p;
}
template <typename T>
T __ldg(const T* p) {
  return *p;
}
// Rounded fp32 arithmetic that nvcc may not fuse into an fma: g++ here targets x86-64 without FMA, so a
// product and a sum are each rounded as written.
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
// The fast-math intrinsics, exact here (the hardware's are within a few ulp).
inline float __expf(float x) { return std::exp(x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float cospif(float x) { return static_cast<float>(std::cos(3.14159265358979323846 * static_cast<double>(x))); }

namespace tuna::emulator {

// The switch between fibers. On x86-64 a few instructions that save and restore the callee-saved registers
// and the stack pointer: swapcontext also saves the signal mask, a system call at every switch, which made
// it most of the emulator's time. Elsewhere, ucontext.
#if defined(__x86_64__)
// switch_stack(save, load): pushes the callee-saved registers, stores the stack pointer in *save, loads `load`
// (a stack that an earlier switch saved, or one that prepare_stack laid out) and pops and returns from it.
// Weak: the definition is in every object that includes this header.
asm(R"(
  .text
  .weak tuna_emulator_switch_stack
  .type tuna_emulator_switch_stack, @function
tuna_emulator_switch_stack:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size tuna_emulator_switch_stack, .-tuna_emulator_switch_stack
)");
extern "C" void tuna_emulator_switch_stack(void** save, void* load);

// Lays out a fresh stack (its top 16-byte aligned) so that switching to it enters entry() as if called: six
// zero registers to pop, entry's address for the ret, and a null return address below which unwinding stops.
inline void* prepare_stack(char* top, void (*entry)()) {
  auto* slot = reinterpret_cast<void**>(top);
  slot[-1] = nullptr;
  slot[-2] = reinterpret_cast<void*>(entry);
  for (int r = 3; r <= 8; ++r) slot[-r] = nullptr;
  return slot - 8;
}
#endif

constexpr int kWarpSize = 32;
constexpr int kMaxThreadsPerBlock = 1024;  // CUDA's limit; stacks are allocated as launches need them

// A barrier of `expected` fibers. The last to arrive runs `on_complete` before any waiter resumes: what the
// hardware does "at the barrier" (a warp's ldmatrix gathering every lane's row) happens there, once.
class Barrier {
 public:
  explicit Barrier(int expected) : expected_(expected) {}
  template <typename OnComplete>
  void arrive_and_wait(OnComplete&& on_complete);
  void reset() { arrived_ = 0, waiting_.clear(); }

 private:
  int expected_;
  int arrived_ = 0;
  std::vector<int> waiting_;  // thread indices
};

// Which runnable thread runs next. Both are schedules the hardware may pick; they differ in how far the warps
// drift apart between block barriers, which decides whether a missing barrier shows in the numbers (the race
// check of ptx.h sees it either way).
enum class Schedule {
  kRoundRobin,   // first blocked, first resumed: the warps advance in near lockstep
  kWarpsInTurn,  // the lowest-numbered runnable thread: warp 0 runs to its next __syncthreads before warp 1 starts
};

// The threads of the running block, as fibers.
class Block {
 public:
  Schedule schedule = Schedule::kRoundRobin;

  Block();
  ~Block();
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;

  // Runs kernel() on `threads` fibers (threadIdx.x 0..threads-1) until all return. Throws what a thread
  // threw, or tuna::Error on a deadlock.
  void run(int threads, const std::function<void()>& kernel);

  int current() const { return current_; }
  // The running thread's stack: [low, high) addresses (ptx_sm90.h walks its frames to name the instruction a
  // warpgroup instruction is executed at).
  std::pair<uintptr_t, uintptr_t> current_stack() const {
    const char* low = fibers_[current_].stack + page_bytes_;
    return {reinterpret_cast<uintptr_t>(low), reinterpret_cast<uintptr_t>(low + kStackBytes)};
  }
  // Suspends the running thread until wake() makes it runnable again. `reason` (what it waits for) names it
  // in the deadlock report.
  void block_current(const char* reason = "a barrier");
  void wake(int thread) { runnable_.push_back(thread); }
  // Lets the other runnable threads go first (the running thread stays runnable): a point where the hardware
  // may switch, made one here where it exposes an ordering bug (after a release that woke someone).
  void yield_current() {
    runnable_.push_back(current_);
    block_current("a yield");
  }

 private:
  struct Fiber {
#if defined(__x86_64__)
    void* stack_pointer;  // where its registers were saved by the last switch away from it
#else
    ucontext_t context;
#endif
    char* stack = nullptr;  // mmap'ed, the lowest page a guard
    bool finished = false;
    const char* waits_for = nullptr;  // while blocked
  };
  static void fiber_main();
  void switch_to(int thread);

  static constexpr size_t kStackBytes = 256 * 1024;  // the deepest kernel frame is a few KiB
  std::vector<Fiber> fibers_;  // grows to the largest block launched
  size_t page_bytes_;
#if defined(__x86_64__)
  void* scheduler_stack_pointer_ = nullptr;
#else
  ucontext_t scheduler_;
#endif
  std::deque<int> runnable_;
  int current_ = -1;
  const std::function<void()>* kernel_ = nullptr;
  std::exception_ptr error_;
};

inline Block& block() {
  static Block instance;
  return instance;
}

template <typename OnComplete>
void Barrier::arrive_and_wait(OnComplete&& on_complete) {
  if (++arrived_ < expected_) {
    waiting_.push_back(block().current());
    block().block_current();
    return;
  }
  on_complete();
  arrived_ = 0;
  for (int thread : waiting_) block().wake(thread);
  waiting_.clear();
}

inline Block::Block() : page_bytes_(static_cast<size_t>(sysconf(_SC_PAGESIZE))) {}

inline Block::~Block() {
  for (Fiber& f : fibers_) munmap(f.stack, kStackBytes + page_bytes_);
}

inline void Block::fiber_main() {
  Block& b = block();
  // Exceptions cannot cross a context switch: the thread's error is kept for run() to rethrow.
  try {
    (*b.kernel_)();
  } catch (...) {
    b.error_ = std::current_exception();
  }
  b.fibers_[b.current_].finished = true;
#if defined(__x86_64__)
  tuna_emulator_switch_stack(&b.fibers_[b.current_].stack_pointer, b.scheduler_stack_pointer_);  // never resumed
#endif
}  // (ucontext) returns to uc_link: the scheduler

inline void Block::switch_to(int thread) {
#if defined(__x86_64__)
  tuna_emulator_switch_stack(&scheduler_stack_pointer_, fibers_[thread].stack_pointer);
#else
  TUNA_CHECK(swapcontext(&scheduler_, &fibers_[thread].context) == 0, "swapcontext");
#endif
}

inline void Block::run(int threads, const std::function<void()>& kernel) {
  TUNA_CHECK(threads > 0 && threads <= kMaxThreadsPerBlock, "block of ", threads, " threads");
  while (static_cast<int>(fibers_.size()) < threads) {
    Fiber f;
    void* memory = mmap(nullptr, kStackBytes + page_bytes_, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
    TUNA_CHECK(memory != MAP_FAILED, "fiber stack of ", kStackBytes, " bytes");
    // A stack overflow then faults instead of silently writing into the neighbouring fiber's stack.
    TUNA_CHECK(mprotect(memory, page_bytes_, PROT_NONE) == 0, "guard page");
    f.stack = static_cast<char*>(memory);
    fibers_.push_back(f);
  }
  kernel_ = &kernel;
  error_ = nullptr;
  runnable_.clear();
  for (int t = 0; t < threads; ++t) {
    Fiber& f = fibers_[t];
    f.finished = false;
#if defined(__x86_64__)
    f.stack_pointer = prepare_stack(f.stack + page_bytes_ + kStackBytes, &Block::fiber_main);
#else
    TUNA_CHECK(getcontext(&f.context) == 0, "getcontext");
    f.context.uc_stack.ss_sp = f.stack + page_bytes_;
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = &scheduler_;
    makecontext(&f.context, &Block::fiber_main, 0);
#endif
    runnable_.push_back(t);
  }
  while (!runnable_.empty() && !error_) {
    const auto next = schedule == Schedule::kRoundRobin ? runnable_.begin()
                                                         : std::min_element(runnable_.begin(), runnable_.end());
    current_ = *next;
    runnable_.erase(next);
    threadIdx = dim3{static_cast<unsigned>(current_), 0, 0};
    switch_to(current_);
  }
  current_ = -1;
  if (error_) std::rethrow_exception(error_);
  for (int t = 0; t < threads; ++t)
    TUNA_CHECK(fibers_[t].finished, "deadlock in block (", blockIdx.x, ", ", blockIdx.y, ", ", blockIdx.z,
               "): thread ", t, " waits at ", fibers_[t].waits_for, " that the other threads never complete");
}

inline void Block::block_current(const char* reason) {
  fibers_[current_].waits_for = reason;
#if defined(__x86_64__)
  tuna_emulator_switch_stack(&fibers_[current_].stack_pointer, scheduler_stack_pointer_);
#else
  TUNA_CHECK(swapcontext(&fibers_[current_].context, &scheduler_) == 0, "swapcontext");
#endif
}

// __syncthreads: every thread of the block. `epoch` counts the barriers the block has completed; two
// accesses in the same epoch are unordered (ptx.h's race check works in epochs).
struct BlockBarrier {
  Barrier barrier{0};
  long epoch = 0;
};
inline BlockBarrier g_block_barrier;

// What each lane brings to a warp collective and what it takes away.
struct LaneSlot {
  const char* operation = nullptr;  // all lanes must be at the same one
  uint32_t words[6] = {};
  float floats[4] = {};
  double value = 0.0;
  int argument = 0;  // must be warp-uniform (a shuffle's lane mask)
};

struct Warp {
  Barrier barrier{kWarpSize};
  LaneSlot in[kWarpSize], out[kWarpSize];
};
inline Warp g_warps[kMaxThreadsPerBlock / kWarpSize];

inline int lane_id() { return static_cast<int>(threadIdx.x) % kWarpSize; }

// A warp collective: each lane deposits `mine`; once all 32 lanes of the warp have, `combine(in, out)` runs
// once and each lane gets its out[lane]. A lane's out slot stays valid until it enters the next collective,
// and combine runs only when all lanes have, so one barrier per collective suffices.
template <typename Combine>
LaneSlot warp_collective(const LaneSlot& mine, Combine&& combine) {
  Warp& warp = g_warps[threadIdx.x / kWarpSize];
  const int lane = lane_id();
  warp.in[lane] = mine;
  warp.barrier.arrive_and_wait([&warp, &combine] {
    for (int l = 1; l < kWarpSize; ++l)
      TUNA_CHECK(std::strcmp(warp.in[l].operation, warp.in[0].operation) == 0 &&
                     warp.in[l].argument == warp.in[0].argument,
                 "warp ", threadIdx.x / kWarpSize, " diverges: lane 0 at ", warp.in[0].operation, " (",
                 warp.in[0].argument, "), lane ", l, " at ", warp.in[l].operation, " (", warp.in[l].argument, ")");
    combine(warp.in, warp.out);
  });
  return warp.out[lane];
}

// Resets the barriers for a block of `threads` threads (whole warps, as the kernels launch).
inline void reset_block_barriers(int threads) {
  TUNA_CHECK(threads % kWarpSize == 0, "block of ", threads, " threads is not whole warps");
  g_block_barrier.barrier = Barrier(threads);
  g_block_barrier.epoch = 0;
  for (Warp& w : g_warps) w.barrier.reset();
}

}  // namespace tuna::emulator

// Memory fences order nothing here: one thread runs at a time and every access is immediate.
inline void __threadfence() {}

// For the same reason a read-modify-write is indivisible as written.
inline int atomicAdd(int* address, int value) {
  const int old = *address;
  *address = old + value;
  return old;
}
inline unsigned atomicMax(unsigned* address, unsigned value) {
  const unsigned old = *address;
  *address = old > value ? old : value;
  return old;
}

inline void __syncthreads() {
  tuna::emulator::g_block_barrier.barrier.arrive_and_wait([] { ++tuna::emulator::g_block_barrier.epoch; });
}

// The kernels shuffle with the full mask only: every lane takes part (the emulator checks that all do).
template <typename T>
T emulated_shfl_xor(unsigned mask, T x, int lane_mask) {
  using tuna::emulator::LaneSlot;
  TUNA_CHECK(mask == 0xffffffffu, "shuffle with a partial mask ", mask);
  LaneSlot mine;
  mine.operation = "shfl.xor";
  mine.argument = lane_mask;
  mine.value = x;
  return static_cast<T>(tuna::emulator::warp_collective(mine, [](const LaneSlot* in, LaneSlot* out) {
                          for (int l = 0; l < tuna::emulator::kWarpSize; ++l) {
                            const int source = l ^ in[0].argument;  // past the warp: the lane's own value
                            out[l].value = in[source < tuna::emulator::kWarpSize ? source : l].value;
                          }
                        }).value);
}
inline float __shfl_xor_sync(unsigned mask, float x, int lane_mask) { return emulated_shfl_xor(mask, x, lane_mask); }
inline double __shfl_xor_sync(unsigned mask, double x, int lane_mask) {
  return emulated_shfl_xor(mask, x, lane_mask);
}
// A 32-bit word travels in the slot's double exactly.
inline unsigned __shfl_xor_sync(unsigned mask, unsigned x, int lane_mask) {
  return emulated_shfl_xor(mask, x, lane_mask);
}

// A broadcast: every lane reads `source_lane`'s x (shfl.sync.idx). The kernels broadcast one lane to the warp
// only, so the source lane must be the same in every lane here (the collective checks it); CUDA allows it to vary.
template <typename T>
T emulated_shfl_idx(unsigned mask, T x, int source_lane) {
  using tuna::emulator::LaneSlot;
  TUNA_CHECK(mask == 0xffffffffu, "shuffle with a partial mask ", mask);
  LaneSlot mine;
  mine.operation = "shfl.idx";
  mine.argument = source_lane;
  mine.value = x;
  return static_cast<T>(tuna::emulator::warp_collective(mine, [](const LaneSlot* in, LaneSlot* out) {
                          const int source = in[0].argument % tuna::emulator::kWarpSize;  // the ISA's lane index
                          for (int l = 0; l < tuna::emulator::kWarpSize; ++l) out[l].value = in[source].value;
                        }).value);
}
inline int __shfl_sync(unsigned mask, int x, int source_lane) { return emulated_shfl_idx(mask, x, source_lane); }
inline float __shfl_sync(unsigned mask, float x, int source_lane) { return emulated_shfl_idx(mask, x, source_lane); }
