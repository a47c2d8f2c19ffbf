// tests/kernels/emulator/ptx_sm90.h — host versions of the Hopper (sm_90a) PTX helpers of
// kernels/attention_sm90_ptx.cuh, which the sm_90a attention kernels find in its place under TUNA_EMULATOR
// (through the shim's <cuda_bf16.h> and runtime.h, which include this header): mbarriers, TMA tensor loads
// (and the tensor maps cuTensorMapEncodeTiled makes, through the driver entry point of runtime.h), wgmma with shared-memory matrix descriptors and its swizzle modes,
// setmaxnreg, elect.sync, named barriers, proxy fences, ex2.approx.ftz, and the acquire/release flags of the
// backward.
//
// Written from the PTX ISA (9.1: sections 5.5 "Tensors", 9.7.9.27 cp.async.bulk.tensor, 9.7.13.15 mbarrier,
// 9.7.13.14 elect.sync, 9.7.13.1 bar, 9.7.15 wgmma, 9.7.19.5 setmaxnreg) and the CUDA driver API's
// cuTensorMapEncodeTiled, not from the kernels: a kernel built on a wrong reading of a layout, a descriptor or
// a barrier protocol fails here. tests/kernels/emulator/test_ptx_sm90.cpp holds each instruction to
// hand-computed results of the ISA's definitions.
//
// What is modelled (one block at a time, its threads as the fibers of emulator.h):
//   mbarrier   phases, pending arrivals, tx-count (negative allowed, as in the ISA), try_wait.parity on the
//              current or the preceding phase; a waiting thread blocks until the phase completes, so a phase
//              that never completes is a deadlock report, not a hang.
//   TMA        tiled mode, rank 1 to 5, any box, out-of-bounds elements zero-filled, swizzle none / 32B / 64B /
//              128B (16-byte atomicity) as functions of the shared-memory address (the ISA's tables, which start
//              at 256 / 512 / 1024-byte aligned addresses: the emulator requires a destination so aligned). The
//              copy lands (and its bytes complete-tx on the barrier) at issue, or, with --copies at-wait, as late
//              as possible: when a thread waits on the barrier's incomplete phase; its destination reads as 0xff
//              bytes until then.
//   wgmma      m64nNk16, bf16 inputs, fp32 accumulators, A from registers or shared memory, B from shared
//              memory, K-major or MN-major (trans), descriptors decoded per the ISA's canonical layouts for each
//              swizzle mode; the products are exact and summed in double, rounded once to fp32. Computed at issue,
//              or, with --copies at-wait, at the wgmma.wait_group that retires it, reading shared memory then and
//              leaving NaN in the accumulators until then.
//   setmaxnreg the CTA's register pool: .dec returns registers, .inc blocks until the pool has them.
//   named bar  bar.sync / bar.arrive with a thread count; a barrier left with arrivals at the block's end is
//              reported (an unbalanced protocol), and so is one completed by part of a warp (.aligned).
// What is checked, beyond the numbers:
//   - a wgmma reading shared memory that a TMA wrote must be issued by a warpgroup whose every thread has seen
//     (try_wait returned true) the mbarrier phase that copy completed in;
//   - a TMA may not write shared memory that an unretired wgmma reads, that another TMA is still writing, or
//     that holds an mbarrier;
//   - a wgmma's A fragment registers and accumulators may not change between its issue and its retirement;
//   - a wgmma needs a wgmma.fence since its warpgroup's last wgmma.wait_group (the ISA requires one before the
//     first wgmma and between register accesses and a wgmma; this is the part of that rule the emulator sees);
//   - warpgroup instructions (wgmma.*, setmaxnreg) are executed by all 128 threads with the same operands, at the
//     same instruction (CallSite: the same path of call sites from the kernel, not two copies of one wgmma);
//   - the proxies (ISA: the memory model's proxies, wgmma's "async proxy" section, membar/fence's
//     fence.proxy.async): wgmma reads shared memory through the async proxy, threads' stores write it through
//     the generic proxy, and a generic write reaches an async read only through a fence.proxy.async after it. The emulator keeps, per 16-byte chunk, the bytes the async proxy
//     last saw there (a TMA landing, an earlier wgmma read; the 0xff fill at the block's start): a wgmma reading a
//     chunk whose bytes have changed since, with no fence.proxy.async executed in the block since, is a race;
//   - a wgmma's shared operands may not change (by a thread's store) between its issue and its retirement;
//   - nothing is left in flight at the block's end, and every mbarrier's tx-count is back to zero there (the
//     copies' bytes equal the expect_tx announcements).
// Not modelled: which thread executed a proxy fence (any thread's fence since the async proxy last saw a chunk
// counts, so a fence by the wrong thread, or before the stores it should follow, passes here when some fence
// lies between two reads), clusters and multicast, TMA stores and reductions, im2col, interleaved layouts,
// element strides other than 1, the NaN out-of-bounds fill, the fp32 rounding inside the tensor core, timing.
#pragma once

#include <cuda.h>  // the emulator's shim: CUtensorMap and the driver enums

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "tests/kernels/emulator/emulator.h"
#include "tests/kernels/emulator/ptx.h"

namespace tuna::emulator {

// Defined in runtime.h: whether [p, p + bytes) lies inside one device allocation.
inline bool in_device_allocation(const void* p, size_t bytes);

constexpr int kWarpGroupSize = 128;
constexpr int kRegisterFile = 65536;  // registers per SM, the most one CTA can own

// ---- the tensor map, as the emulated cuTensorMapEncodeTiled writes it into CUtensorMap's 128 opaque bytes
struct TensorMap {
  static constexpr uint64_t kMagic = 0x54554e4154454e53ull;  // written by the emulator's encoder
  uint64_t magic;
  uint64_t address;
  uint64_t dims[5];
  uint64_t strides[5];  // bytes; strides[0] is the element size
  uint32_t box[5];
  uint32_t rank, element_bytes, swizzle_bytes;  // swizzle_bytes 0 (none), 32, 64 or 128
};
static_assert(sizeof(TensorMap) <= sizeof(CUtensorMap), "the emulated tensor map fits CUtensorMap");

// The swizzle of the ISA's tables as a function of the shared-memory address: within each span of 8 rows of
// 128 bytes, the 16-byte chunk index (address bits 4..6) is XORed with the row index (bits 7..9), all three
// bits for 128B, the low two for 64B, the lowest for 32B (Swizzle<3,4,3>, <2,4,3>, <1,4,3> in the ISA's
// canonical-layout table).
inline uint32_t swizzle_address(uint32_t address, uint32_t swizzle_bytes) {
  const uint32_t mask = swizzle_bytes == 128 ? 7u : swizzle_bytes == 64 ? 3u : swizzle_bytes == 32 ? 1u : 0u;
  return address ^ (((address >> 7) & mask) << 4);
}

// ---- per-block state
struct MBarrier {
  uint32_t expected = 0;
  int64_t pending = 0;
  int64_t tx = 0;
  long phase = 0;  // the number of completed phases; the current phase's parity is phase & 1
  std::vector<int> waiters;
  struct Copy {  // a TMA copy issued but not landed (--copies at-wait)
    uint32_t dst;
    std::vector<unsigned char> bytes;  // the data, read from global memory at issue
  };
  std::vector<Copy> in_flight;
};

struct WgmmaOp {
  int n = 0;
  bool a_in_registers = false, trans_a = false, trans_b = false, accumulate = false, chained = false;
  uint64_t a_desc = 0, b_desc = 0;
  float* acc[kWarpGroupSize] = {};
  const uint32_t* a_registers[kWarpGroupSize] = {};
  std::array<uint32_t, 4> a_snapshot[kWarpGroupSize] = {};
  std::vector<float> input;  // [thread][n / 2]: the accumulators at issue (unless chained)
  std::vector<uint32_t> chunks;  // 16-byte shared chunks it reads
  std::vector<unsigned char> chunk_bytes;  // their bytes at issue, 16 per chunk
};

// The instruction a thread executes a warpgroup instruction at, as the chain of return addresses from the
// emulator's helper up to the thread's entry (the fiber's first frame), and that chain's source: each address's
// function and file:line, with the calls inlined there.
//
// Why a chain: on the device the kernel's helpers and lambdas are inlined, so one warpgroup instruction of the source
// (a wgmma_fence() in a lambda) becomes one instruction per path of calls that reaches it (per instance of a
// template, per call site of the lambda). Here the emulator's helpers are one function each, and a lambda or template
// instance may or may not be inlined: the immediate caller is the same for every path. The chain of call sites is
// the path: two threads that came through different call sites of the source differ in the first frame where they
// part (a call site g++ inlined is a distinct address inside the inlining function, with the inlined call in its
// debug information; one it did not inline is a distinct return address).
// Why the source, and not the addresses alone: g++ may copy code (jump threading copies the blocks after a branch
// into each of its arms), so two threads at one call site of the source can be at two copies of it, at two
// addresses. Equal chains of addresses are the same instruction; unequal ones are compared by their source (the
// function and line of each address, and of every call inlined there: addr2line reads them from the build's debug
// information), which a copy keeps. A divergence is two different source paths.
// What keeps the chain whole in the host binary (the emulated build's flags, Makefile): frame pointers
// (-fno-omit-frame-pointer) so that the frames can be walked; no sibling calls (-fno-optimize-sibling-calls), as a
// tail call would replace the caller's frame and drop its call site from the chain; no cross-jumping or tail
// merging (-fno-crossjumping -fno-tree-tail-merge), which would fold identical code at two call sites into one
// address. The walk must end at the fiber's entry (prepare_stack's null return address) inside the fiber's stack: a
// frame without a frame pointer on the way (a build without the flag) is then an error, not a silently short chain.
// Not told apart: two calls on one line (addr2line gives no column), and threads at one call site at different
// iterations of an unrolled loop (the host loop may be rolled); the operands check sees the latter.
struct CallSite {
  static constexpr int kMaxFrames = 32;
  uintptr_t pc[kMaxFrames] = {};
  int frames = 0;

  bool operator==(const CallSite& other) const {
    return frames == other.frames && std::memcmp(pc, other.pc, frames * sizeof(uintptr_t)) == 0;
  }
  // The chain's source, innermost first: for each return address, "function (file:line)" of the call and of each
  // call inlined there, through addr2line; empty when addr2line cannot say (then only the addresses compare).
  std::string source() const;
  // The addresses as offsets into the binary that holds them, innermost first.
  std::string addresses() const;
  // The caller's chain. Not inlined: its own frame is the walk's start, its return address the first entry.
  [[gnu::noinline]] static CallSite here();
};

struct WarpGroupState {
  Barrier barrier{kWarpGroupSize};
  struct Slot {
    const char* operation = nullptr;
    uint64_t args[5] = {};
    void* pointer = nullptr;
    const uint32_t* words = nullptr;
    CallSite site;  // set by warpgroup_collective
  } in[kWarpGroupSize];
  bool fenced = false;  // a wgmma.fence since the last wgmma.wait_group
  std::vector<WgmmaOp> uncommitted;
  std::deque<std::vector<WgmmaOp>> committed;
  int registers = 0;  // per thread
};

struct NamedBarrier {
  int count = 0, arrived = 0;
  std::vector<int> waiters;
  std::map<int, int> warp_arrivals;  // warp -> its threads arrived in this use
};

struct Sm90Block {
  bool launched_as_sm90a = false;
  std::map<uint32_t, MBarrier> barriers;  // by shared address
  std::vector<std::map<uint32_t, long>> seen;  // [thread][barrier]: phases this thread has seen complete
  struct Write {
    uint32_t barrier;
    long phase;
  };
  std::unordered_map<uint32_t, Write> tma_writes;       // 16-byte chunk -> the copy that last wrote it
  std::unordered_map<uint32_t, uint32_t> tma_in_flight;  // 16-byte chunk -> the barrier of a copy not landed yet
  std::unordered_map<uint32_t, int> wgmma_reads;        // 16-byte chunk -> unretired wgmma reading it
  // The async proxy's view of shared memory: per 16-byte chunk, the bytes it last saw there and the count of
  // fence.proxy.async the block had executed then (absent: the 0xff fill of the block's start, no fences).
  struct AsyncView {
    std::array<unsigned char, 16> bytes;
    long fences;
  };
  std::unordered_map<uint32_t, AsyncView> async_view;
  long proxy_fences = 0;  // fence.proxy.async executed in this block
  std::unordered_map<const float*, std::vector<uint32_t>> written;  // accumulators -> what the emulator left there
  std::vector<WarpGroupState> warpgroups;
  int register_pool = 0;  // registers released by setmaxnreg.dec, not yet taken
  std::vector<int> register_waiters;
  NamedBarrier named[16];
};
inline Sm90Block g_sm90;

inline void reset_sm90_block(int threads, bool sm90a) {
  g_sm90.launched_as_sm90a = sm90a;
  g_sm90.barriers.clear();
  g_sm90.seen.assign(threads, {});
  g_sm90.tma_writes.clear(), g_sm90.tma_in_flight.clear(), g_sm90.wgmma_reads.clear(), g_sm90.written.clear();
  g_sm90.async_view.clear(), g_sm90.proxy_fences = 0;
  g_sm90.warpgroups = std::vector<WarpGroupState>((threads + kWarpGroupSize - 1) / kWarpGroupSize);
  // The launch's per-thread registers: what a kernel of this block size may have at one CTA per SM, a
  // multiple of 8 (setmaxnreg's unit) and at most 248 (the compiler's limit, 255, rounded down).
  const int per_thread = std::min(248, kRegisterFile / threads / 8 * 8);
  for (WarpGroupState& wg : g_sm90.warpgroups) wg.registers = per_thread;
  g_sm90.register_pool = 0;
  g_sm90.register_waiters.clear();
  for (NamedBarrier& b : g_sm90.named) b = NamedBarrier{};
}

inline void require_sm90a(const char* instruction) {
  TUNA_CHECK(g_sm90.launched_as_sm90a, instruction,
             " needs sm_90a: this kernel was launched as an sm_80 kernel (launch_kernel, not launch_kernel_sm90a)");
}

inline int warpgroup_of_current() { return static_cast<int>(threadIdx.x) / kWarpGroupSize; }

// A warpgroup instruction (.sync.aligned over the warpgroup): every thread of the warpgroup deposits its
// slot; once all 128 have, `combine(slots)` runs once, then all resume. All must be at the same operation
// with the same arguments (args; pointers and words may differ per thread), and at the same instruction
// (CallSite, below).
template <typename Combine>
void warpgroup_collective(const WarpGroupState::Slot& mine, Combine&& combine) {
  const int group = warpgroup_of_current();
  TUNA_CHECK(static_cast<unsigned>((group + 1) * kWarpGroupSize) <= blockDim.x, mine.operation, " in a block of ",
             blockDim.x, " threads: warpgroup ", group, " is not whole");
  WarpGroupState& wg = g_sm90.warpgroups[group];
  WarpGroupState::Slot& slot = wg.in[threadIdx.x % kWarpGroupSize];
  slot = mine;
  slot.site = CallSite::here();
  wg.barrier.arrive_and_wait([&wg, &combine, group] {
    for (int t = 1; t < kWarpGroupSize; ++t) {
      bool same = std::strcmp(wg.in[t].operation, wg.in[0].operation) == 0;
      for (int a = 0; a < 5; ++a) same = same && wg.in[t].args[a] == wg.in[0].args[a];
      TUNA_CHECK(same, "warpgroup ", group, " diverges: thread 0 of it at ", wg.in[0].operation, ", thread ", t,
                 " at ", wg.in[t].operation, " (or with other operands): all 128 threads must execute the same ",
                 "warpgroup instruction");
      if (wg.in[t].site == wg.in[0].site) continue;
      // Two addresses: two copies of one call site of the source (the same source path), or two call sites.
      const std::string first = wg.in[0].site.source(), other = wg.in[t].site.source();
      TUNA_CHECK(!first.empty() && first == other, "warpgroup ", group, " diverges: its threads 0 and ", t,
                 " (warps ", group * 4, " and ", group * 4 + t / 32, ") execute ", wg.in[0].operation,
                 " at two different instructions (the same operation and operands, from different call sites in ",
                 "the kernel): the ISA's .aligned requires all 128 threads of the warpgroup to execute the same ",
                 "instruction, so a branch that reaches it must be uniform across the warpgroup. Thread 0 at ",
                 first.empty() ? wg.in[0].site.addresses() + " (addr2line found no source for them)" : first,
                 "; thread ", t, " at ", other.empty() ? wg.in[t].site.addresses() : other);
    }
    combine(wg.in);
  });
}

// ---- shared-memory checks
inline void check_no_barrier_overlap(const char* what, uint32_t begin, uint32_t end) {
  auto it = g_sm90.barriers.lower_bound(begin >= 7 ? begin - 7 : 0);
  TUNA_CHECK(it == g_sm90.barriers.end() || it->first >= end, what, " writes shared bytes [", begin, ", ", end,
             ") over the mbarrier at ", it->first);
}

inline MBarrier& barrier_at(uint32_t address, const char* what) {
  auto it = g_sm90.barriers.find(address);
  TUNA_CHECK(it != g_sm90.barriers.end(), what, " on shared address ", address,
             ", which holds no initialised mbarrier");
  return it->second;
}

// The phase of `b` completes once its pending arrivals and tx-count are both zero (ISA 9.7.13.15.6): the next
// phase starts with the expected arrivals, and every thread waiting on it resumes. Returns whether it did.
inline bool maybe_complete_phase(MBarrier& b) {
  if (b.pending != 0 || b.tx != 0) return false;
  ++b.phase;
  b.pending = b.expected;
  for (int t : b.waiters) block().wake(t);
  b.waiters.clear();
  return true;
}

// After an arrival that completed a phase, the threads it released run before the arriving thread goes on:
// what the arriving thread does next (say, retire the wgmma that still reads a stage it has just released)
// then comes after what the released threads do (the producer's copy into that stage), one of the orders the
// hardware may take, and the one that shows an early release.
inline void arrived(bool completed_phase) {
  if (completed_phase) block().yield_current();
}

// ---- the proxies
inline std::array<unsigned char, 16> chunk_now(uint32_t chunk) {
  std::array<unsigned char, 16> bytes;
  std::memcpy(bytes.data(), shared_bytes() + chunk * 16, 16);
  return bytes;
}
// The async proxy sees `chunk` as it is now.
inline void note_async_view(uint32_t chunk) { g_sm90.async_view[chunk] = {chunk_now(chunk), g_sm90.proxy_fences}; }

// An async-proxy read (`reader`) of `chunk`: bytes that changed since the async proxy last saw them were written
// by threads (generic proxy), and reach the async proxy only through a fence.proxy.async after the writes.
inline void check_async_read(const char* reader, uint32_t chunk) {
  std::array<unsigned char, 16> seen;
  seen.fill(0xff);  // the block's start (run_grid's fill)
  long fences_then = 0;
  if (const auto it = g_sm90.async_view.find(chunk); it != g_sm90.async_view.end())
    seen = it->second.bytes, fences_then = it->second.fences;
  TUNA_CHECK(chunk_now(chunk) == seen || g_sm90.proxy_fences > fences_then, "RACE: ", reader,
             " (async proxy) reads shared bytes [", chunk * 16, ", ", chunk * 16 + 16,
             ") that threads wrote (generic proxy) with no fence.proxy.async since: the ISA requires the writing ",
             "threads to execute fence.proxy.async.shared::cta after their stores, then a barrier, before the read");
  note_async_view(chunk);
}

// Writes a copy's bytes into shared memory (its destination as the copy saw it: box order, swizzled by
// address) and completes its bytes on the barrier, recording which phase each 16-byte chunk belongs to.
inline void land_tma(uint32_t bar_address, MBarrier& b, uint32_t dst, const std::vector<unsigned char>& data) {
  std::memcpy(shared_bytes() + dst, data.data(), data.size());
  for (uint32_t chunk = dst / 16; chunk < (dst + data.size()) / 16; ++chunk) {
    g_sm90.tma_writes[chunk] = {bar_address, b.phase};
    g_sm90.tma_in_flight.erase(chunk);
    note_async_view(chunk);  // the async proxy wrote it
  }
  b.tx -= static_cast<int64_t>(data.size());
  maybe_complete_phase(b);
}

inline void land_in_flight(uint32_t bar_address, MBarrier& b) {
  std::vector<MBarrier::Copy> copies = std::move(b.in_flight);
  b.in_flight.clear();
  for (const MBarrier::Copy& copy : copies) land_tma(bar_address, b, copy.dst, copy.bytes);
}

// ---- wgmma operands (ISA 9.7.15.5.1): the byte address in shared memory of element (mn, k) of an operand
// described by a matrix descriptor, for bf16 (T = 8 elements of 16 bits per 128-bit unit). Canonical layouts
// (ISA 9.7.15.5.1.2.1.3), in elements, then swizzled by address:
//   K-major,  none: ((8,m),(T,2k)) : ((1T,SBO),(1,LBO))         MN-major, none: ((T,1,m),(8,k)) : ((1,T,SBO),(1T,LBO))
//   K-major,  32B:  ((8,m),(T,2k)) : ((2T,SBO),(1,T))           MN-major, 32B:  ((T,2,m),(8,k)) : ((1,T,LBO),(2T,SBO))
//   K-major,  64B:  ((8,m),(T,2k)) : ((4T,SBO),(1,T))           MN-major, 64B:  ((T,4,m),(8,k)) : ((1,T,LBO),(4T,SBO))
//   K-major, 128B:  ((8,m),(T,2k)) : ((8T,SBO),(1,T))           MN-major, 128B: ((T,8,m),(8,k)) : ((1,T,LBO),(8T,SBO))
// Descriptor (ISA 9.7.15.5.1.2.2): bits 0-13 start address >> 4, 16-29 LBO >> 4, 32-45 SBO >> 4, 49-51 base
// offset, 62-63 swizzle (0 none, 1 128B, 2 64B, 3 32B).
struct MatrixDescriptor {
  uint32_t start, lbo, sbo, swizzle_bytes;
  bool mn_major;

  static MatrixDescriptor decode(uint64_t desc, bool mn_major) {
    MatrixDescriptor d;
    d.start = static_cast<uint32_t>(desc & 0x3fff) << 4;
    d.lbo = static_cast<uint32_t>((desc >> 16) & 0x3fff) << 4;
    d.sbo = static_cast<uint32_t>((desc >> 32) & 0x3fff) << 4;
    const uint32_t base_offset = static_cast<uint32_t>((desc >> 49) & 7);
    const uint32_t mode = static_cast<uint32_t>(desc >> 62);
    d.swizzle_bytes = mode == 1 ? 128 : mode == 2 ? 64 : mode == 3 ? 32 : 0;
    d.mn_major = mn_major;
    TUNA_CHECK(base_offset == 0, "wgmma descriptor with base offset ", base_offset,
               ": not modelled (the emulator's swizzle patterns start at aligned addresses)");
    return d;
  }
  uint32_t address(int mn, int k) const {
    uint32_t offset;
    if (!mn_major) {
      if (swizzle_bytes == 0) offset = (mn % 8) * 16 + (mn / 8) * sbo + (k % 8) * 2 + (k / 8) * lbo;
      else offset = (mn % 8) * swizzle_bytes + (mn / 8) * sbo + k * 2;  // k < 16: within a 32-byte row at least
    } else {
      if (swizzle_bytes == 0) {
        offset = (mn % 8) * 2 + (mn / 8) * sbo + (k % 8) * 16 + (k / 8) * lbo;
      } else {
        const int units = static_cast<int>(swizzle_bytes) / 16;  // 16-byte units along MN per swizzle row
        offset = (mn % 8) * 2 + ((mn / 8) % units) * 16 + (mn / (8 * units)) * lbo + (k % 8) * swizzle_bytes +
                 (k / 8) * sbo;
      }
    }
    return swizzle_address(start + offset, swizzle_bytes);
  }
};

// The m64 x k16 A operand and k16 x N B operand of `op`, as floats, and the 16-byte chunks they come from.
inline void gather_operands(const WgmmaOp& op, std::vector<float>& a, std::vector<float>& b,
                            std::vector<uint32_t>* chunks) {
  a.assign(64 * 16, 0.0f), b.assign(16 * op.n, 0.0f);
  const auto read = [chunks](uint32_t address) {
    check_shared_access("wgmma operand", address, 2);
    if (chunks) chunks->push_back(address / 16);
    return bf16_bits_to_float(shared_u16(address));
  };
  if (op.a_in_registers) {
    // ISA Figure 148 (m64nNk16 A): warp w of the warpgroup holds rows 16w..16w+15 as mma.m16n8k16's A:
    // register i of lane l = 4g + t holds row g + 8 (i % 2), columns 2t + 8 (i / 2) and the next, low half first.
    for (int thread = 0; thread < kWarpGroupSize; ++thread) {
      const int w = thread / 32, g = (thread % 32) / 4, t = thread % 4;
      for (int i = 0; i < 4; ++i)
        for (int half = 0; half < 2; ++half) {
          const int row = 16 * w + g + 8 * (i % 2), column = 2 * t + 8 * (i / 2) + half;
          a[row * 16 + column] = bf16_bits_to_float((op.a_snapshot[thread][i] >> (16 * half)) & 0xffffu);
        }
    }
  } else {
    const MatrixDescriptor d = MatrixDescriptor::decode(op.a_desc, op.trans_a);
    for (int m = 0; m < 64; ++m)
      for (int k = 0; k < 16; ++k) a[m * 16 + k] = read(d.address(m, k));
  }
  const MatrixDescriptor d = MatrixDescriptor::decode(op.b_desc, op.trans_b);
  for (int n = 0; n < op.n; ++n)
    for (int k = 0; k < 16; ++k) b[k * op.n + n] = read(d.address(n, k));
}

// D = A B (+ C): computes `op` from shared memory as it is now and writes each thread's accumulators (ISA
// Figure 149, m64nNk16 D: lane l = 4g + t of warp w holds, for each 8-column tile i, d[4i], d[4i+1] at row
// 16w + g, columns 8i + 2t, 8i + 2t + 1, and d[4i+2], d[4i+3] at row 16w + g + 8).
inline void compute_wgmma(WgmmaOp& op) {
  std::vector<float> a, b;
  gather_operands(op, a, b, nullptr);
  const int regs = op.n / 2;
  for (int thread = 0; thread < kWarpGroupSize; ++thread) {
    const int w = thread / 32, g = (thread % 32) / 4, t = thread % 4;
    float* d = op.acc[thread];
    for (int r = 0; r < regs; ++r) {
      const int row = 16 * w + g + 8 * ((r / 2) % 2), column = 8 * (r / 4) + 2 * t + r % 2;
      double sum = 0.0;
      if (op.accumulate) sum = op.chained ? d[r] : op.input[thread * regs + r];
      for (int k = 0; k < 16; ++k) sum += static_cast<double>(a[row * 16 + k]) * b[k * op.n + column];
      d[r] = static_cast<float>(sum);
    }
    std::vector<uint32_t>& left = g_sm90.written[d];
    left.resize(regs);
    std::memcpy(left.data(), d, regs * 4);
  }
}

// Retires `op`: checks its registers were left alone while it ran, computes it (if not yet), releases its reads.
inline void retire_wgmma(WgmmaOp& op) {
  const int regs = op.n / 2;
  for (int thread = 0; thread < kWarpGroupSize; ++thread) {
    const std::vector<uint32_t>& left = g_sm90.written[op.acc[thread]];
    TUNA_CHECK(std::memcmp(left.data(), op.acc[thread], regs * 4) == 0, "thread ",
               warpgroup_of_current() * kWarpGroupSize + thread,
               " changed the accumulator registers of a wgmma before a wgmma.wait_group retired it");
    if (op.a_in_registers)
      TUNA_CHECK(std::memcmp(op.a_snapshot[thread].data(), op.a_registers[thread], 16) == 0, "thread ",
                 warpgroup_of_current() * kWarpGroupSize + thread,
                 " changed the A fragment registers of a wgmma before a wgmma.wait_group retired it");
  }
  for (size_t i = 0; i < op.chunks.size(); ++i)
    TUNA_CHECK(std::memcmp(shared_bytes() + op.chunks[i] * 16, op.chunk_bytes.data() + 16 * i, 16) == 0,
               "RACE: shared bytes [", op.chunks[i] * 16, ", ", op.chunks[i] * 16 + 16,
               ") that an unretired wgmma reads were overwritten before the wgmma.wait_group that retires it (the ",
               "tensor cores may read its operands until then)");
  if (g_shared.timing == CopyTiming::kDeferred) compute_wgmma(op);
  for (uint32_t chunk : op.chunks)
    if (--g_sm90.wgmma_reads[chunk] == 0) g_sm90.wgmma_reads.erase(chunk);
}

// The shared chunks of `op` that a TMA wrote must come from mbarrier phases every thread of the issuing
// warpgroup has seen complete.
inline void check_tma_data_seen(const WgmmaOp& op, int group) {
  for (uint32_t chunk : op.chunks) {
    const auto in_flight = g_sm90.tma_in_flight.find(chunk);
    TUNA_CHECK(in_flight == g_sm90.tma_in_flight.end(), "RACE: warpgroup ", group,
               " issues a wgmma reading shared bytes [", chunk * 16, ", ", chunk * 16 + 16,
               ") that a TMA copy towards the mbarrier at ", in_flight->second,
               " is still writing; its threads have seen only ",
               g_sm90.seen[group * kWarpGroupSize].count(in_flight->second)
                   ? g_sm90.seen[group * kWarpGroupSize].at(in_flight->second)
                   : 0,
               " phases of that barrier complete");
    const auto write = g_sm90.tma_writes.find(chunk);
    if (write == g_sm90.tma_writes.end()) continue;
    for (int t = group * kWarpGroupSize; t < (group + 1) * kWarpGroupSize; ++t) {
      const auto seen = g_sm90.seen[t].find(write->second.barrier);
      const long phases_seen = seen == g_sm90.seen[t].end() ? 0 : seen->second;
      TUNA_CHECK(phases_seen > write->second.phase, "RACE: warpgroup ", group, " issues a wgmma reading shared bytes [",
                 chunk * 16, ", ", chunk * 16 + 16, ") that a TMA copy completing phase ", write->second.phase,
                 " of the mbarrier at ", write->second.barrier, " wrote, but its thread ", t, " has seen only ",
                 phases_seen, " phases of that barrier complete");
    }
  }
}

inline void issue_wgmma(WgmmaOp op_template, float* acc, const uint32_t* a_registers) {
  require_sm90a("wgmma.mma_async");
  WarpGroupState::Slot mine;
  mine.operation = "wgmma.mma_async";
  mine.args[0] = static_cast<uint64_t>(op_template.n);
  mine.args[1] = op_template.a_in_registers ? 0 : op_template.a_desc;
  mine.args[2] = op_template.b_desc;
  mine.args[3] = (op_template.accumulate ? 1 : 0) | (op_template.trans_a ? 2 : 0) | (op_template.trans_b ? 4 : 0) |
                 (op_template.a_in_registers ? 8 : 0);
  mine.pointer = acc;
  mine.words = a_registers;
  const int group = warpgroup_of_current();
  warpgroup_collective(mine, [&op_template, group](WarpGroupState::Slot* slots) {
    WarpGroupState& wg = g_sm90.warpgroups[group];
    TUNA_CHECK(wg.fenced, "warpgroup ", group, " issues a wgmma without a wgmma.fence since its last ",
               "wgmma.wait_group (the ISA requires one before the first wgmma and after register accesses)");
    WgmmaOp op = op_template;
    const int regs = op.n / 2;
    for (int t = 0; t < kWarpGroupSize; ++t) {
      op.acc[t] = static_cast<float*>(slots[t].pointer);
      if (op.a_in_registers) {
        op.a_registers[t] = slots[t].words;
        std::memcpy(op.a_snapshot[t].data(), slots[t].words, 16);
      }
    }
    // Accumulators that an earlier, unretired wgmma of this warpgroup writes: this one accumulates onto its
    // result (the ISA orders accumulator accesses across wgmmas of the same shape).
    const auto pending_on = [&wg](const float* acc) {
      for (const WgmmaOp& o : wg.uncommitted)
        if (o.acc[0] == acc) return true;
      for (const auto& group_ops : wg.committed)
        for (const WgmmaOp& o : group_ops)
          if (o.acc[0] == acc) return true;
      return false;
    };
    op.chained = pending_on(op.acc[0]);
    if (!op.chained) {
      op.input.resize(kWarpGroupSize * regs);
      for (int t = 0; t < kWarpGroupSize; ++t) std::memcpy(&op.input[t * regs], op.acc[t], regs * 4);
    }
    std::vector<float> a, b;
    gather_operands(op, a, b, &op.chunks);
    std::sort(op.chunks.begin(), op.chunks.end());
    op.chunks.erase(std::unique(op.chunks.begin(), op.chunks.end()), op.chunks.end());
    check_tma_data_seen(op, group);
    op.chunk_bytes.resize(16 * op.chunks.size());
    for (size_t i = 0; i < op.chunks.size(); ++i) {
      check_async_read("a wgmma", op.chunks[i]);
      std::memcpy(op.chunk_bytes.data() + 16 * i, shared_bytes() + op.chunks[i] * 16, 16);
      ++g_sm90.wgmma_reads[op.chunks[i]];
    }
    if (g_shared.timing == CopyTiming::kImmediate) {
      compute_wgmma(op);
    } else {  // in flight: no value a reader could rely on until the wait
      for (int t = 0; t < kWarpGroupSize; ++t) {
        std::fill(op.acc[t], op.acc[t] + regs, std::nanf(""));
        std::vector<uint32_t>& left = g_sm90.written[op.acc[t]];
        left.resize(regs);
        std::memcpy(left.data(), op.acc[t], regs * 4);
      }
    }
    wg.uncommitted.push_back(std::move(op));
  });
}

}  // namespace tuna::emulator

namespace tuna::cuda::attention {

// ---- mbarrier
inline void mbarrier_init(uint32_t bar, uint32_t arrivals) {
  using namespace tuna::emulator;
  require_sm90a("mbarrier.init");
  check_shared_access("mbarrier.init", bar, 8);
  TUNA_CHECK(arrivals >= 1 && arrivals < (1u << 20), "mbarrier.init with ", arrivals,
             " arrivals: the ISA's range is 1 .. 2^20 - 1");
  TUNA_CHECK(!g_sm90.barriers.count(bar), "mbarrier.init on shared address ", bar,
             ", which holds a valid mbarrier (undefined without mbarrier.inval first)");
  MBarrier& b = g_sm90.barriers[bar];
  b.expected = arrivals;
  b.pending = arrivals;
}
inline void fence_mbarrier_init() { tuna::emulator::require_sm90a("fence.mbarrier_init"); }

inline void mbarrier_arrive(uint32_t bar) {
  using namespace tuna::emulator;
  require_sm90a("mbarrier.arrive");
  MBarrier& b = barrier_at(bar, "mbarrier.arrive");
  --b.pending;
  arrived(maybe_complete_phase(b));
}

inline void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  using namespace tuna::emulator;
  require_sm90a("mbarrier.arrive.expect_tx");
  MBarrier& b = barrier_at(bar, "mbarrier.arrive.expect_tx");
  b.tx += bytes;
  TUNA_CHECK(b.tx < (int64_t{1} << 20), "mbarrier tx-count ", b.tx, " past the ISA's 2^20 - 1");
  --b.pending;
  arrived(maybe_complete_phase(b));
}

// try_wait.parity: true when the phase of parity `parity` is the one before the current phase (complete);
// when it is the current phase, the thread is suspended until it completes (the ISA lets try_wait return
// false after a time limit instead; the kernels loop either way), landing first any copies still in flight
// towards it (the latest moment they may land).
inline bool mbarrier_try_wait(uint32_t bar, uint32_t parity) {
  using namespace tuna::emulator;
  require_sm90a("mbarrier.try_wait");
  TUNA_CHECK(parity <= 1, "mbarrier.try_wait.parity with parity ", parity);
  for (;;) {
    MBarrier& b = barrier_at(bar, "mbarrier.try_wait");
    if (static_cast<uint32_t>(b.phase & 1) != parity) {
      long& seen = g_sm90.seen[threadIdx.x][bar];
      seen = std::max(seen, b.phase);
      return true;
    }
    if (!b.in_flight.empty()) {
      land_in_flight(bar, b);
      continue;
    }
    b.waiters.push_back(static_cast<int>(threadIdx.x));
    block().block_current("an mbarrier phase");
  }
}
inline void mbarrier_wait(uint32_t bar, uint32_t parity) {
  while (!mbarrier_try_wait(bar, parity)) {
  }
}

// ---- TMA
inline void tma_prefetch_descriptor(const CUtensorMap*) { tuna::emulator::require_sm90a("prefetch.tensormap"); }

inline void tma_load(uint32_t dst, const CUtensorMap* map, uint32_t bar, const int* coords, int rank) {
  using namespace tuna::emulator;
  require_sm90a("cp.async.bulk.tensor");
  TensorMap m;
  std::memcpy(&m, map, sizeof(m));
  TUNA_CHECK(m.magic == TensorMap::kMagic,
             "cp.async.bulk.tensor with a tensor map cuTensorMapEncodeTiled did not make");
  TUNA_CHECK(static_cast<int>(m.rank) == rank, "cp.async.bulk.tensor.", rank, "d with a rank-", m.rank, " tensor map");
  const uint32_t alignment = m.swizzle_bytes == 0 ? 128 : m.swizzle_bytes * 8;
  TUNA_CHECK(dst % alignment == 0, "cp.async.bulk.tensor into shared address ", dst, ": needs ", alignment,
             "-byte alignment with ", m.swizzle_bytes, "B swizzle");
  uint64_t elements = 1;
  for (int i = 0; i < rank; ++i) elements *= m.box[i];
  const uint32_t bytes = static_cast<uint32_t>(elements * m.element_bytes);
  check_shared_access("cp.async.bulk.tensor", dst, 16);
  TUNA_CHECK(dst + bytes <= g_shared.launch_bytes, "cp.async.bulk.tensor of ", bytes, " bytes at shared address ",
             dst, " past the ", g_shared.launch_bytes, " bytes the launch requested");
  check_no_barrier_overlap("cp.async.bulk.tensor", dst, dst + bytes);
  MBarrier& b = barrier_at(bar, "cp.async.bulk.tensor's complete_tx");
  for (uint32_t chunk = dst / 16; chunk < (dst + bytes) / 16; ++chunk) {
    TUNA_CHECK(!g_sm90.wgmma_reads.count(chunk), "RACE: a TMA copy writes shared bytes [", chunk * 16, ", ",
               chunk * 16 + 16, ") that an unretired wgmma reads");
    const auto other = g_sm90.tma_in_flight.find(chunk);
    TUNA_CHECK(other == g_sm90.tma_in_flight.end(), "RACE: a TMA copy writes shared bytes [", chunk * 16, ", ",
               chunk * 16 + 16, ") that another TMA copy (mbarrier ", other->second, ") is still writing");
  }
  // The box, in its order in shared memory (dimension 0 fastest), each element placed at its swizzled address.
  std::vector<unsigned char> image(bytes);
  std::vector<int64_t> index(rank, 0);
  for (uint64_t e = 0; e < elements; ++e) {
    bool inside = true;
    const auto* source = reinterpret_cast<const unsigned char*>(m.address);
    for (int i = 0; i < rank; ++i) {
      const int64_t c = static_cast<int64_t>(coords[i]) + index[i];
      inside = inside && c >= 0 && c < static_cast<int64_t>(m.dims[i]);
      source += c * static_cast<int64_t>(m.strides[i]);
    }
    const uint32_t address = swizzle_address(dst + static_cast<uint32_t>(e * m.element_bytes), m.swizzle_bytes);
    unsigned char* out = image.data() + (address - dst);
    if (inside) {
      TUNA_CHECK(in_device_allocation(source, m.element_bytes),
                 "cp.async.bulk.tensor reads outside a device allocation");
      std::memcpy(out, source, m.element_bytes);
    } else {
      std::memset(out, 0, m.element_bytes);  // out of bounds: zero fill
    }
    for (int i = 0; i < rank && ++index[i] == m.box[i]; ++i) index[i] = 0;
  }
  if (g_shared.timing == CopyTiming::kImmediate) {
    land_tma(bar, b, dst, image);
  } else {
    std::memset(shared_bytes() + dst, 0xff, bytes);  // in flight
    for (uint32_t chunk = dst / 16; chunk < (dst + bytes) / 16; ++chunk) g_sm90.tma_in_flight[chunk] = bar;
    b.in_flight.push_back({dst, std::move(image)});
  }
}
inline void tma_load_4d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1, int c2, int c3) {
  const int coords[4] = {c0, c1, c2, c3};
  tma_load(dst, map, bar, coords, 4);
}
inline void tma_load_2d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1) {
  const int coords[2] = {c0, c1};
  tma_load(dst, map, bar, coords, 2);
}

inline void fence_proxy_async_shared() {
  tuna::emulator::require_sm90a("fence.proxy.async");
  ++tuna::emulator::g_sm90.proxy_fences;
}

// ---- wgmma
inline void wgmma_fence() {
  using namespace tuna::emulator;
  require_sm90a("wgmma.fence");
  WarpGroupState::Slot mine;
  mine.operation = "wgmma.fence";
  const int group = warpgroup_of_current();
  warpgroup_collective(mine, [group](WarpGroupState::Slot*) { g_sm90.warpgroups[group].fenced = true; });
}
inline void wgmma_commit() {
  using namespace tuna::emulator;
  require_sm90a("wgmma.commit_group");
  WarpGroupState::Slot mine;
  mine.operation = "wgmma.commit_group";
  const int group = warpgroup_of_current();
  warpgroup_collective(mine, [group](WarpGroupState::Slot*) {
    WarpGroupState& wg = g_sm90.warpgroups[group];
    wg.committed.push_back(std::move(wg.uncommitted));
    wg.uncommitted.clear();
  });
}
template <int kPending>
void wgmma_wait() {
  using namespace tuna::emulator;
  require_sm90a("wgmma.wait_group");
  WarpGroupState::Slot mine;
  mine.operation = "wgmma.wait_group";
  mine.args[0] = kPending;
  const int group = warpgroup_of_current();
  warpgroup_collective(mine, [group](WarpGroupState::Slot*) {
    WarpGroupState& wg = g_sm90.warpgroups[group];
    while (static_cast<int>(wg.committed.size()) > kPending) {
      for (WgmmaOp& op : wg.committed.front()) retire_wgmma(op);
      wg.committed.pop_front();
    }
    wg.fenced = false;
  });
}
template <int kN>
void fence_operand(float (&)[kN]) {}
template <int kN>
void fence_operand(uint32_t (&)[kN]) {}

template <int kN, int kTransA, int kTransB>
void wgmma_ss(float (&d)[kN / 2], uint64_t a_desc, uint64_t b_desc, bool accumulate) {
  tuna::emulator::WgmmaOp op;
  op.n = kN, op.a_desc = a_desc, op.b_desc = b_desc, op.accumulate = accumulate;
  op.trans_a = kTransA != 0, op.trans_b = kTransB != 0;
  tuna::emulator::issue_wgmma(std::move(op), d, nullptr);
}
template <int kN, int kTransB>
void wgmma_rs(float (&d)[kN / 2], const uint32_t (&a)[4], uint64_t b_desc, bool accumulate) {
  tuna::emulator::WgmmaOp op;
  op.n = kN, op.b_desc = b_desc, op.accumulate = accumulate, op.a_in_registers = true;
  op.trans_b = kTransB != 0;
  tuna::emulator::issue_wgmma(std::move(op), d, a);
}

// ---- warp specialisation
template <bool kIncrease>
void setmaxnreg(int registers) {
  using namespace tuna::emulator;
  require_sm90a("setmaxnreg");
  TUNA_CHECK(registers >= 24 && registers <= 256 && registers % 8 == 0, "setmaxnreg ", registers,
             ": the ISA's range is 24 .. 256, a multiple of 8");
  WarpGroupState::Slot mine;
  mine.operation = kIncrease ? "setmaxnreg.inc" : "setmaxnreg.dec";
  mine.args[0] = static_cast<uint64_t>(registers);
  const int group = warpgroup_of_current();
  warpgroup_collective(mine, [group, registers](WarpGroupState::Slot*) {
    WarpGroupState& wg = g_sm90.warpgroups[group];
    TUNA_CHECK(kIncrease ? wg.registers <= registers : wg.registers >= registers, "setmaxnreg.",
               kIncrease ? "inc" : "dec", " to ", registers, " registers from ", wg.registers, " (undefined)");
    if (!kIncrease) {
      g_sm90.register_pool += (wg.registers - registers) * kWarpGroupSize;
      wg.registers = registers;
      for (int t : g_sm90.register_waiters) block().wake(t);
      g_sm90.register_waiters.clear();
    }
  });
  if (!kIncrease) return;
  // .inc blocks until the pool holds the registers; the warpgroup's thread 0 takes them for all 128, and
  // the others wait for it at a second rendezvous.
  if (threadIdx.x % kWarpGroupSize == 0) {
    WarpGroupState& wg = g_sm90.warpgroups[group];
    const int needed = (registers - wg.registers) * kWarpGroupSize;
    while (g_sm90.register_pool < needed) {
      g_sm90.register_waiters.push_back(static_cast<int>(threadIdx.x));
      block().block_current("registers for setmaxnreg.inc");
    }
    g_sm90.register_pool -= needed;
    g_sm90.warpgroups[group].registers = registers;
  }
  WarpGroupState::Slot taken;
  taken.operation = "setmaxnreg.inc (registers granted)";
  warpgroup_collective(taken, [](WarpGroupState::Slot*) {});
}
template <int kRegs>
void setmaxnreg_inc() {
  setmaxnreg<true>(kRegs);
}
template <int kRegs>
void setmaxnreg_dec() {
  setmaxnreg<false>(kRegs);
}

// elect.sync with the full mask: the leader is the lowest lane (the ISA only promises a deterministic choice).
inline bool elect_one() {
  using namespace tuna::emulator;
  require_sm90a("elect.sync");
  LaneSlot mine;
  mine.operation = "elect.sync";
  return warp_collective(mine, [](const LaneSlot*, LaneSlot* out) {
           for (int l = 0; l < kWarpSize; ++l) out[l].argument = l == 0;
         }).argument != 0;
}

// bar.sync / bar.arrive: barrier `id` completes when `threads` threads have arrived; bar.sync waits for it.
inline void named_barrier(int id, int threads, bool wait) {
  using namespace tuna::emulator;
  TUNA_CHECK(id >= 1 && id < 16, "named barrier ", id, ": ids 1..15 (0 is __syncthreads)");
  TUNA_CHECK(threads > 0 && threads % kWarpSize == 0 && threads <= static_cast<int>(blockDim.x), "named barrier ",
             id, " with ", threads, " threads: a multiple of 32, at most the block's ", blockDim.x);
  NamedBarrier& b = g_sm90.named[id];
  TUNA_CHECK(b.arrived == 0 || b.count == threads, "named barrier ", id, " used with ", threads,
             " threads while ", b.arrived, " arrived expecting ", b.count);
  b.count = threads;
  ++b.warp_arrivals[static_cast<int>(threadIdx.x) / kWarpSize];
  if (++b.arrived == b.count) {
    // bar.sync and bar.arrive are barrier.*.aligned (ISA 9.7.13.1): every thread of a warp executes the same
    // barrier instruction, and the hardware counts the warp's threads together; a warp partly at it is undefined.
    for (const auto& [warp, arrived] : b.warp_arrivals) {
      const int warp_threads = std::min<int>(kWarpSize, static_cast<int>(blockDim.x) - warp * kWarpSize);
      TUNA_CHECK(arrived == warp_threads, "named barrier ", id, " completed with ", arrived, " of warp ", warp,
                 "'s ", warp_threads, " threads at it: bar.sync / bar.arrive are .aligned, whole warps only");
    }
    b.warp_arrivals.clear();
    for (int t : b.waiters) block().wake(t);
    b.waiters.clear();
    b.arrived = 0;
    arrived(/*completed_phase=*/true);
    return;
  }
  if (!wait) return;
  b.waiters.push_back(static_cast<int>(threadIdx.x));
  block().block_current("a named barrier");
}
inline void named_barrier_sync(int id, int threads) { named_barrier(id, threads, true); }
inline void named_barrier_arrive(int id, int threads) { named_barrier(id, threads, false); }

// ---- ex2.approx.ftz.f32: 2^x with subnormal inputs read as zero (so 2^x = 1) and subnormal results written as
// +0; -inf gives +0, +inf +inf, NaN NaN. The hardware's approximation may differ from the host's exp2f in the
// last bits (the ISA bounds only its relative error): the kernels' tolerances, not exact values, must cover it.
inline float ex2_approx_ftz(float x) {
  if (std::fpclassify(x) == FP_SUBNORMAL) x = 0.0f;
  const float y = std::exp2f(x);
  return std::fpclassify(y) == FP_SUBNORMAL ? 0.0f : y;
}

// ---- flags between blocks. The emulator runs blocks one at a time, in blockIdx order or last first
// (runtime.h, --blocks): a flag can only be waited for if a block that ran earlier released it; otherwise the GPU
// would spin on it forever or until a later block ran, which the kernels must not rely on.
inline void flag_wait(const int* flag, int value) {
  TUNA_CHECK(*flag == value, "flag_wait for value ", value, " at ", static_cast<const void*>(flag), ", which holds ",
             *flag, ": no block that ran earlier released it (blocks run one at a time here, one after another)");
}
inline void flag_release(int* flag, int value) { *flag = value; }

}  // namespace tuna::cuda::attention

namespace tuna::emulator {

// After a block: nothing of the Hopper machinery may be left running.
inline void finish_sm90_block() {
  for (size_t g = 0; g < g_sm90.warpgroups.size(); ++g) {
    const WarpGroupState& wg = g_sm90.warpgroups[g];
    TUNA_CHECK(wg.uncommitted.empty() && wg.committed.empty(), "block (", blockIdx.x, ", ", blockIdx.y, ", ",
               blockIdx.z, ") ends with wgmma of warpgroup ", g, " in flight (no wgmma.wait_group retired them)");
  }
  for (const auto& [address, b] : g_sm90.barriers) {
    TUNA_CHECK(b.in_flight.empty(), "block (", blockIdx.x, ", ", blockIdx.y, ", ", blockIdx.z,
               ") ends with TMA copies towards the mbarrier at ", address, " that no thread waited for");
    // A phase completes when the tx-count is zero, so the bytes of each phase's copies must equal what its
    // expect_tx announced (TMA counts a box's whole bytes, out-of-bounds ones included): a remainder at the end
    // is a mismatch, the bytes of one phase counted in another.
    TUNA_CHECK(b.tx == 0, "block (", blockIdx.x, ", ", blockIdx.y, ", ", blockIdx.z, ") ends with tx-count ", b.tx,
               " on the mbarrier at ", address, ": its expect_tx announced ", b.tx > 0 ? "more" : "fewer",
               " bytes than its copies completed");
  }
  for (int id = 1; id < 16; ++id)
    TUNA_CHECK(g_sm90.named[id].arrived == 0, "block (", blockIdx.x, ", ", blockIdx.y, ", ", blockIdx.z,
               ") ends with named barrier ", id, " holding ", g_sm90.named[id].arrived, " of its ",
               g_sm90.named[id].count, " arrivals");
}

}  // namespace tuna::emulator
