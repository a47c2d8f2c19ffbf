// tests/kernels/emulator/ptx.h — host versions of the PTX helpers of kernels/attention_ptx.cuh
// (smem_address, cp_async16, cp_async4, cp_async_commit, cp_async_wait, ldmatrix_x4, ldmatrix_x4_trans, mma),
// which kernels/attention_kernels.cuh finds in their place under TUNA_EMULATOR (through the shim's <cuda_bf16.h>
// and runtime.h, which include this header); the block's dynamic shared
// memory, and the race check of cp.async against ldmatrix (runtime.h's run of a grid calls it per block). The
// Hopper instructions are in ptx_sm90.h.
//
// Written from the PTX ISA's descriptions (cp.async, ldmatrix, the mma.m16n8k16 fragment figures), not from
// the kernels' comments, so that a kernel built on a wrong reading of a layout fails here.
//
// When a cp.async lands. Anywhere between its issue and the cp.async.wait_group of its thread that retires
// its group. CopyTiming brackets that: kImmediate lands a copy at issue (the earliest), kDeferred at the wait
// (the latest), its destination reading as 0xff bytes (NaN) in between. A kernel that reads a tile too
// early then gets wrong numbers in one mode or the other. Independently of the numbers, a race check flags
// it: each ldmatrix of a 16-byte chunk is logged with its epoch (the count of block barriers completed before
// it), each cp.async with the epochs from its issue to its thread's wait; a read in an epoch where a copy into
// its chunk may still be in flight is a race, even when the data happened to be right. (The dK/dV kernel's
// plain shared loads of lse and delta are not logged: only the numbers of the deferred mode watch them.)
#pragma once

#include <climits>
#include <cstdio>
#include <deque>
#include <string>
#include <vector>

#include "tests/kernels/emulator/emulator.h"

namespace tuna::emulator {

// The most dynamic shared memory a block may have: 163 KiB on sm_80, 227 KiB on sm_90. The kernels built for
// both are held to sm_80's limit (a launch asking for more fails here as it would on an A100); the sm_90a-only
// kernels (launched by launch_kernel_sm90a) to sm_90's.
constexpr int kSm80MaxDynamicSharedBytes = 163 * 1024;
constexpr int kSm90MaxDynamicSharedBytes = 227 * 1024;

}  // namespace tuna::emulator

namespace tuna::cuda::attention {

// The kernels' `extern __shared__ unsigned char smem_bytes[]` (a block-scope extern declaration, thread_local
// here as every __shared__ is: see emulator.h) names this array: the entity of that name in the enclosing
// namespace.
alignas(1024) inline thread_local unsigned char smem_bytes[tuna::emulator::kSm90MaxDynamicSharedBytes];

}  // namespace tuna::cuda::attention

namespace tuna::emulator {

enum class CopyTiming { kImmediate, kDeferred };

struct AsyncCopy {
  uint32_t dst;  // shared-memory offset
  const void* src;
  bool valid;  // false: src-size 0, the destination is zero-filled and nothing is read
  int bytes;
  long issue_epoch;
};
// A copy's possible flight: from the epoch of its issue to the epoch of the wait that retired it.
struct CopyFlight {
  uint32_t chunk;  // 16-byte chunk of shared memory
  long first_epoch, last_epoch;
  int thread;
};
struct ChunkRead {
  uint32_t chunk;
  long epoch;
  int thread;
};

struct SharedMemory {
  CopyTiming timing = CopyTiming::kImmediate;
  uint32_t launch_bytes = 0;  // the launch's dynamic shared memory: every access must fall inside
  struct ThreadCopies {
    std::vector<AsyncCopy> open;                   // issued since the last commit
    std::deque<std::vector<AsyncCopy>> committed;  // groups, oldest first
  } threads[kMaxThreadsPerBlock];
  std::vector<CopyFlight> flights;
  std::vector<ChunkRead> reads;
};
inline SharedMemory g_shared;

inline unsigned char* shared_bytes() { return tuna::cuda::attention::smem_bytes; }

inline void check_shared_access(const char* what, uint32_t offset, int bytes) {
  TUNA_CHECK(offset % bytes == 0, what, " at shared offset ", offset, " is not aligned to ", bytes, " bytes");
  TUNA_CHECK(offset + bytes <= g_shared.launch_bytes, what, " at shared offset ", offset, " past the ",
             g_shared.launch_bytes, " bytes the launch requested");
}

inline void land(const AsyncCopy& copy) {
  if (copy.valid) std::memcpy(shared_bytes() + copy.dst, copy.src, copy.bytes);
  else std::memset(shared_bytes() + copy.dst, 0, copy.bytes);
}

inline void issue_copy(uint32_t dst, const void* src, bool valid, int bytes) {
  check_shared_access("cp.async", dst, bytes);
  TUNA_CHECK(!valid || reinterpret_cast<uintptr_t>(src) % bytes == 0, "cp.async of ", bytes,
             " bytes from a misaligned global address");
  const AsyncCopy copy{dst, src, valid, bytes, g_block_barrier.epoch};
  if (g_shared.timing == CopyTiming::kImmediate) land(copy);
  else std::memset(shared_bytes() + dst, 0xff, bytes);  // in flight: no value a reader could rely on
  g_shared.threads[threadIdx.x].open.push_back(copy);
}

inline uint16_t shared_u16(uint32_t offset) {
  uint16_t bits;
  std::memcpy(&bits, shared_bytes() + offset, 2);
  return bits;
}

// One lane's part of an ldmatrix: the 16-byte row it addresses, checked and logged for the race check.
inline LaneSlot ldmatrix_lane(const char* operation, uint32_t address) {
  check_shared_access(operation, address, 16);
  g_shared.reads.push_back({address / 16, g_block_barrier.epoch, static_cast<int>(threadIdx.x)});
  LaneSlot mine;
  mine.operation = operation;
  mine.words[0] = address;
  return mine;
}

inline float bf16_bits_to_float(uint32_t bits) { return __bfloat162float(__nv_bfloat16{static_cast<uint16_t>(bits)}); }

}  // namespace tuna::emulator

namespace tuna::cuda::attention {

inline uint32_t smem_address(const void* p) {
  const auto* byte = static_cast<const unsigned char*>(p);
  TUNA_CHECK(byte >= smem_bytes && byte <= smem_bytes + sizeof(smem_bytes), "smem_address of a non-shared pointer");
  return static_cast<uint32_t>(byte - smem_bytes);
}

inline void cp_async16(uint32_t dst, const void* src, bool valid) { tuna::emulator::issue_copy(dst, src, valid, 16); }
inline void cp_async4(uint32_t dst, const void* src, bool valid) { tuna::emulator::issue_copy(dst, src, valid, 4); }

inline void cp_async_commit() {
  auto& mine = tuna::emulator::g_shared.threads[threadIdx.x];
  mine.committed.push_back(std::move(mine.open));
  mine.open.clear();
}

// Retires this thread's groups until at most kPending remain (cp.async.wait_group kPending).
template <int kPending>
void cp_async_wait() {
  using namespace tuna::emulator;
  auto& mine = g_shared.threads[threadIdx.x];
  while (static_cast<int>(mine.committed.size()) > kPending) {
    for (const AsyncCopy& copy : mine.committed.front()) {
      if (g_shared.timing == CopyTiming::kDeferred) land(copy);
      g_shared.flights.push_back(
          {copy.dst / 16, copy.issue_epoch, g_block_barrier.epoch, static_cast<int>(threadIdx.x)});
    }
    mine.committed.pop_front();
  }
}

// ldmatrix.sync.aligned.m8n8.x4.shared.b16: lanes 8i..8i+7 address the 8 rows of matrix i; lane l receives, of
// each matrix i, row l/4, columns 2(l%4) and 2(l%4)+1 (the lower column in the low half) in r[i].
inline void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  using namespace tuna::emulator;
  const LaneSlot got = warp_collective(ldmatrix_lane("ldmatrix.x4", address), [](const LaneSlot* in, LaneSlot* out) {
    for (int l = 0; l < kWarpSize; ++l)
      for (int i = 0; i < 4; ++i) {
        const uint32_t row = in[8 * i + l / 4].words[0], column = 2 * (l % 4);
        out[l].words[i] = shared_u16(row + 2 * column) | uint32_t{shared_u16(row + 2 * (column + 1))} << 16;
      }
  });
  for (int i = 0; i < 4; ++i) r[i] = got.words[i];
}

// The .trans form: lane l receives, of each matrix i, column l/4 of rows 2(l%4) and 2(l%4)+1.
inline void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
  using namespace tuna::emulator;
  const LaneSlot got =
      warp_collective(ldmatrix_lane("ldmatrix.x4.trans", address), [](const LaneSlot* in, LaneSlot* out) {
        for (int l = 0; l < kWarpSize; ++l)
          for (int i = 0; i < 4; ++i) {
            const uint32_t row0 = in[8 * i + 2 * (l % 4)].words[0], row1 = in[8 * i + 2 * (l % 4) + 1].words[0];
            const uint32_t column = l / 4;
            out[l].words[i] = shared_u16(row0 + 2 * column) | uint32_t{shared_u16(row1 + 2 * column)} << 16;
          }
      });
  for (int i = 0; i < 4; ++i) r[i] = got.words[i];
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, D = A B + C, with the PTX ISA's fragments
// (g = lane / 4, t = lane % 4; each 32-bit register holds two bf16, the lower-indexed one in the low half):
//   A 16x16: a0,a1 (row g, cols 2t, 2t+1)  a2,a3 (row g+8, same cols)  a4,a5 (row g, cols 2t+8, 2t+9)  a6,a7 (row g+8)
//   B 16x8:  b0,b1 (rows 2t, 2t+1, col g)  b2,b3 (rows 2t+8, 2t+9, col g)
//   C, D:    c0,c1 (row g, cols 2t, 2t+1)  c2,c3 (row g+8, same cols)
// The products are exact and summed in double, then rounded once: at least as accurate as the tensor core.
inline void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  using namespace tuna::emulator;
  LaneSlot mine;
  mine.operation = "mma.m16n8k16";
  for (int i = 0; i < 4; ++i) mine.words[i] = a[i], mine.floats[i] = c[i];
  mine.words[4] = b0, mine.words[5] = b1;
  const LaneSlot got = warp_collective(mine, [](const LaneSlot* in, LaneSlot* out) {
    float A[16][16], B[16][8];
    for (int l = 0; l < kWarpSize; ++l) {
      const int g = l / 4, t = l % 4;
      for (int e = 0; e < 8; ++e) {  // a_e: register e / 2, half e % 2
        const int row = g + ((e / 2) % 2 == 1 ? 8 : 0), column = 2 * t + e % 2 + (e >= 4 ? 8 : 0);
        A[row][column] = bf16_bits_to_float((in[l].words[e / 2] >> (16 * (e % 2))) & 0xffffu);
      }
      for (int e = 0; e < 4; ++e) {  // b_e: register 4 + e / 2, half e % 2
        const int row = 2 * t + e % 2 + (e >= 2 ? 8 : 0);
        B[row][g] = bf16_bits_to_float((in[l].words[4 + e / 2] >> (16 * (e % 2))) & 0xffffu);
      }
    }
    for (int l = 0; l < kWarpSize; ++l) {
      const int g = l / 4, t = l % 4;
      for (int e = 0; e < 4; ++e) {
        const int row = g + (e >= 2 ? 8 : 0), column = 2 * t + e % 2;
        double sum = in[l].floats[e];
        for (int k = 0; k < 16; ++k) sum += static_cast<double>(A[row][k]) * B[k][column];
        out[l].floats[e] = static_cast<float>(sum);
      }
    }
  });
  for (int i = 0; i < 4; ++i) c[i] = got.floats[i];
}

}  // namespace tuna::cuda::attention

namespace tuna::emulator {

// Race reports printed per process at most, so that a broken kernel does not flood the log.
constexpr int kMaxRaceReports = 8;
inline int g_race_reports = 0;

// The race check of one block (see the top of this file); returns whether it found any, reporting the first.
inline bool block_has_race() {
  std::vector<std::vector<const CopyFlight*>> flights_of_chunk(g_shared.launch_bytes / 16);
  for (const CopyFlight& f : g_shared.flights) flights_of_chunk[f.chunk].push_back(&f);
  for (const ChunkRead& read : g_shared.reads)
    for (const CopyFlight* f : flights_of_chunk[read.chunk])
      if (f->first_epoch <= read.epoch && read.epoch <= f->last_epoch) {
        if (g_race_reports++ < kMaxRaceReports)
          std::printf("RACE in block (%u, %u, %u): thread %d reads shared bytes [%u, %u) by ldmatrix after %ld "
                      "barriers, while thread %d's cp.async into them, issued after %ld, may land until its "
                      "wait after %s barriers\n",
                      blockIdx.x, blockIdx.y, blockIdx.z, read.thread, read.chunk * 16, read.chunk * 16 + 16,
                      read.epoch, f->thread, f->first_epoch,
                      f->last_epoch == LONG_MAX ? "(never waited)" : std::to_string(f->last_epoch).c_str());
        return true;
      }
  return false;
}

}  // namespace tuna::emulator
