// The Hopper instructions of the host emulator (ptx_sm90.h) against results worked out by hand from the PTX
// ISA's definitions, so that a kernel passing on the emulator passes because it follows the ISA, not because
// the emulator mirrors the kernel: TMA box loads with each swizzle mode against the ISA's swizzle tables
// (transcribed below, not computed), out-of-bounds fill; wgmma with operands laid out by the ISA's
// descriptions (core matrices, its exact-layout examples, TMA-swizzled tiles) against a plain product, its
// accumulator fragment placed per the ISA figure; mbarrier phases and tx-counts; setmaxnreg's register pool;
// elect.sync; named barriers; the flags between blocks; ex2.approx.ftz's special values; and each misuse the
// emulator promises to report.
//
// Built only into build/emulated_gpu_tests (it launches kernels on the emulator directly).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "core/cuda_check.h"
#include "kernels/common.cuh"
#include "tests/kernels/emulator/runtime.h"

namespace tuna::emulator {
namespace {

using namespace tuna::cuda::attention;  // the PTX helpers

// The ISA's swizzle tables (5.5.7): row r of the pattern lists, for each 16-byte cell position of a 128-byte
// row, the index of the source chunk stored there.
constexpr int kSwizzle32[2][8] = {{0, 1, 2, 3, 4, 5, 6, 7}, {1, 0, 3, 2, 5, 4, 7, 6}};
constexpr int kSwizzle64[4][8] = {
    {0, 1, 2, 3, 4, 5, 6, 7}, {1, 0, 3, 2, 5, 4, 7, 6}, {2, 3, 0, 1, 6, 7, 4, 5}, {3, 2, 1, 0, 7, 6, 5, 4}};
constexpr int kSwizzle128[8][8] = {{0, 1, 2, 3, 4, 5, 6, 7}, {1, 0, 3, 2, 5, 4, 7, 6}, {2, 3, 0, 1, 6, 7, 4, 5},
                                   {3, 2, 1, 0, 7, 6, 5, 4}, {4, 5, 6, 7, 0, 1, 2, 3}, {5, 4, 7, 6, 1, 0, 3, 2},
                                   {6, 7, 4, 5, 2, 3, 0, 1}, {7, 6, 5, 4, 3, 2, 1, 0}};

// Where byte `offset` of an unswizzled image (from a pattern-aligned start) lands under `swizzle_bytes`.
uint32_t table_position(uint32_t offset, int swizzle_bytes) {
  const uint32_t row = offset / 128, cell = (offset % 128) / 16;
  int source_cell_at[8];
  for (int p = 0; p < 8; ++p)
    source_cell_at[p] = swizzle_bytes == 128 ? kSwizzle128[row % 8][p]
                        : swizzle_bytes == 64 ? kSwizzle64[row % 4][p]
                        : swizzle_bytes == 32 ? kSwizzle32[row % 2][p]
                                              : p;
  for (int p = 0; p < 8; ++p)
    if (source_cell_at[p] == static_cast<int>(cell)) return row * 128 + p * 16 + offset % 16;
  return ~0u;
}

PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  void* function = nullptr;
  cudaDriverEntryPointQueryResult status;
  TUNA_CUDA_CHECK(
      cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000, cudaEnableDefault, &status));
  TUNA_CHECK(status == cudaDriverEntryPointSuccess && function, "no cuTensorMapEncodeTiled");
  return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function);
}

CUtensorMap make_map(void* address, int rank, const uint64_t* dims, const uint64_t* strides, const uint32_t* box,
                     CUtensorMapSwizzle swizzle) {
  CUtensorMap map;
  const uint32_t ones[5] = {1, 1, 1, 1, 1};
  const CUresult r = encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank, address, dims, strides, box, ones,
                               CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_NONE,
                               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TUNA_CHECK(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed: ", static_cast<int>(r));
  return map;
}

// Shared layout of the small test kernels: an mbarrier at 0, data from 1024.
constexpr uint32_t kBar = 0, kData = 1024;

template <typename T>
T* device_copy(const std::vector<T>& host) {
  T* p = nullptr;
  TUNA_CUDA_CHECK(cudaMalloc(&p, host.size() * sizeof(T)));
  TUNA_CUDA_CHECK(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}
template <typename T>
std::vector<T> host_copy(const T* p, size_t n) {
  std::vector<T> host(n);
  TUNA_CUDA_CHECK(cudaMemcpy(host.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return host;
}

// ---------------------------------------------------------------------------------------------------------
// TMA

struct TmaArgs {
  CUtensorMap map;
  int rank;
  int coords[4];
  uint32_t bytes;
  unsigned char* out;  // the shared image, copied out
};

void tma_kernel(const __grid_constant__ TmaArgs args) {
  if (threadIdx.x == 0) {
    mbarrier_init(kBar, 1);
    mbarrier_arrive_expect_tx(kBar, args.bytes);
    if (args.rank == 2) tma_load_2d(kData, &args.map, kBar, args.coords[0], args.coords[1]);
    else tma_load_4d(kData, &args.map, kBar, args.coords[0], args.coords[1], args.coords[2], args.coords[3]);
  }
  __syncthreads();
  mbarrier_wait(kBar, 0);
  for (uint32_t i = threadIdx.x; i < args.bytes; i += blockDim.x) args.out[i] = shared_bytes()[kData + i];
}

std::vector<unsigned char> run_tma(TmaArgs args) {
  unsigned char* out = nullptr;
  TUNA_CUDA_CHECK(cudaMalloc(&out, args.bytes));
  args.out = out;
  cuda::launch_kernel_sm90a(tma_kernel, dim3(1), dim3(64), kData + args.bytes, nullptr, args);
  TUNA_CUDA_CHECK(cudaGetLastError());
  std::vector<unsigned char> image = host_copy(out, args.bytes);
  TUNA_CUDA_CHECK(cudaFree(out));
  return image;
}

// A [20 rows][cols] bf16 tensor of distinct values, boxes of 16 rows from row 10 (rows 20.. out of bounds),
// the box as wide as the swizzle span: the image must be the ISA table's arrangement of the rows, zeros below.
void check_swizzle(CUtensorMapSwizzle mode, int swizzle_bytes, int cols, CopyTiming timing) {
  SCOPED_TRACE("swizzle " + std::to_string(swizzle_bytes) + "B");
  const int rows = 20, box_rows = 16, row0 = 10;
  std::vector<uint16_t> tensor(rows * cols);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) tensor[r * cols + c] = static_cast<uint16_t>(0x1000 + r * 97 + c);
  uint16_t* d_tensor = device_copy(tensor);
  const int box_cols = swizzle_bytes == 0 ? 32 : swizzle_bytes / 2;
  const uint64_t dims[2] = {static_cast<uint64_t>(cols), static_cast<uint64_t>(rows)};
  const uint64_t strides[1] = {static_cast<uint64_t>(cols) * 2};
  const uint32_t box[2] = {static_cast<uint32_t>(box_cols), static_cast<uint32_t>(box_rows)};
  TmaArgs args{};
  args.map = make_map(d_tensor, 2, dims, strides, box, mode);
  args.rank = 2, args.coords[0] = 8, args.coords[1] = row0;  // from column 8: columns past `cols` are zeros too
  args.bytes = box_cols * box_rows * 2;
  const CopyTiming saved = g_shared.timing;
  g_shared.timing = timing;
  const std::vector<unsigned char> image = run_tma(args);
  g_shared.timing = saved;
  for (int r = 0; r < box_rows; ++r)
    for (int c = 0; c < box_cols; ++c) {
      const int gr = row0 + r, gc = 8 + c;
      const uint16_t want = gr < rows && gc < cols ? tensor[gr * cols + gc] : 0;
      const uint32_t at = table_position((r * box_cols + c) * 2, swizzle_bytes);
      const uint16_t got = static_cast<uint16_t>(image[at] | image[at + 1] << 8);
      ASSERT_EQ(got, want) << "box row " << r << " column " << c;
    }
  TUNA_CUDA_CHECK(cudaFree(d_tensor));
}

TEST(EmulatorTma, BoxLoadWithEachSwizzleModeMatchesTheIsaTables) {
  for (CopyTiming timing : {CopyTiming::kImmediate, CopyTiming::kDeferred}) {
    check_swizzle(CU_TENSOR_MAP_SWIZZLE_NONE, 0, 40, timing);
    check_swizzle(CU_TENSOR_MAP_SWIZZLE_32B, 32, 40, timing);
    check_swizzle(CU_TENSOR_MAP_SWIZZLE_64B, 64, 40, timing);
    check_swizzle(CU_TENSOR_MAP_SWIZZLE_128B, 128, 72, timing);
  }
}

TEST(EmulatorTma, FourDimensionalBoxZeroFillsPastEachDimension) {
  // [b=2][s=5][h=3][d=16] as (d, h, s, b), innermost first: box (16, 1, 8, 1) at (0, 1, 2, 1): rows s = 2..9
  // of head 1 of batch 1, s >= 5 zeros.
  const int B = 2, S = 5, H = 3, D = 16;
  std::vector<uint16_t> tensor(B * S * H * D);
  for (size_t i = 0; i < tensor.size(); ++i) tensor[i] = static_cast<uint16_t>(i + 1);
  uint16_t* d_tensor = device_copy(tensor);
  const uint64_t dims[4] = {D, H, S, B};
  const uint64_t strides[3] = {D * 2, H * D * 2, S * H * D * 2};
  const uint32_t box[4] = {D, 1, 8, 1};
  TmaArgs args{};
  args.map = make_map(d_tensor, 4, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_NONE);
  args.rank = 4, args.coords[0] = 0, args.coords[1] = 1, args.coords[2] = 2, args.coords[3] = 1;
  args.bytes = D * 8 * 2;
  const std::vector<unsigned char> image = run_tma(args);
  for (int s = 0; s < 8; ++s)
    for (int d = 0; d < D; ++d) {
      const int gs = 2 + s;
      const uint16_t want = gs < S ? tensor[((1 * S + gs) * H + 1) * D + d] : 0;
      const uint16_t got = static_cast<uint16_t>(image[(s * D + d) * 2] | image[(s * D + d) * 2 + 1] << 8);
      ASSERT_EQ(got, want) << "row " << s << " element " << d;
    }
  TUNA_CUDA_CHECK(cudaFree(d_tensor));
}

TEST(EmulatorTma, EncoderRejectsWhatTheDriverRejects) {
  std::vector<uint16_t> tensor(64 * 64);
  uint16_t* d = device_copy(tensor);
  CUtensorMap map;
  const uint64_t dims[2] = {64, 64}, strides[1] = {128}, bad_strides[1] = {120};
  const uint32_t wide_box[2] = {128, 8}, box[2] = {64, 8}, ones[2] = {1, 1};
  // A box row of 256 bytes does not fit a 128-byte swizzle span; strides must be multiples of 16.
  EXPECT_EQ(encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, d, dims, strides, wide_box, ones,
                      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE,
                      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
            CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, d, dims, bad_strides, box, ones,
                      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE,
                      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
            CUDA_ERROR_INVALID_VALUE);
  TUNA_CUDA_CHECK(cudaFree(d));
}

void misaligned_tma_kernel(const __grid_constant__ CUtensorMap map) {
  if (threadIdx.x == 0) {
    mbarrier_init(kBar, 1);
    mbarrier_arrive_expect_tx(kBar, 64 * 8 * 2);
    tma_load_2d(kData + 128, &map, kBar, 0, 0);  // 128B swizzle needs a 1024-byte aligned destination
    mbarrier_wait(kBar, 0);
  }
}

TEST(EmulatorTma, SwizzledDestinationMustBeAlignedToThePattern) {
  std::vector<uint16_t> tensor(64 * 64);
  uint16_t* d = device_copy(tensor);
  const uint64_t dims[2] = {64, 64}, strides[1] = {128};
  const uint32_t box[2] = {64, 8};
  const CUtensorMap map = make_map(d, 2, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B);
  try {
    cuda::launch_kernel_sm90a(misaligned_tma_kernel, dim3(1), dim3(32), 4096, nullptr, map);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("1024-byte alignment"), std::string::npos) << e.what();
  }
  TUNA_CUDA_CHECK(cudaFree(d));
}

// ---------------------------------------------------------------------------------------------------------
// mbarrier

// 64 threads, a barrier of 64 arrivals. What each thread saw: try_wait with parity 1 during phase 0 asks
// about the phase before it, which counts as complete (+1); phases 0 and 1 complete when all 64 have arrived
// (+10, +100). Thread 0 also records a transaction phase: an arrival with 32 expected bytes leaves the phase
// open (+1000), a complete-tx of 32 bytes closes it (+10000).
void barrier_kernel(int* out) {
  if (threadIdx.x == 0) mbarrier_init(kBar, 64), mbarrier_init(kBar + 8, 1);
  __syncthreads();
  int result = mbarrier_try_wait(kBar, 1) ? 1 : 0;
  mbarrier_arrive(kBar);
  mbarrier_wait(kBar, 0);
  result += 10;
  mbarrier_arrive(kBar);
  mbarrier_wait(kBar, 1);
  result += 100;
  if (threadIdx.x == 0) {
    mbarrier_arrive_expect_tx(kBar + 8, 32);
    const MBarrier& tx = g_sm90.barriers.at(kBar + 8);
    if (tx.phase == 0 && tx.pending == 0 && tx.tx == 32) result += 1000;
    land_tma(kBar + 8, g_sm90.barriers.at(kBar + 8), kData, std::vector<unsigned char>(32, 7));
    if (tx.phase == 1 && tx.pending == 1 && tx.tx == 0) result += 10000;
  }
  out[threadIdx.x] = result;
}

TEST(EmulatorMbarrier, PhasesParityAndTransactionCounts) {
  int* out = nullptr;
  TUNA_CUDA_CHECK(cudaMalloc(&out, 64 * sizeof(int)));
  cuda::launch_kernel_sm90a(barrier_kernel, dim3(1), dim3(64), 2048, nullptr, out);
  TUNA_CUDA_CHECK(cudaGetLastError());
  const std::vector<int> got = host_copy(out, 64);
  EXPECT_EQ(got[0], 11111);
  for (int t = 1; t < 64; ++t) EXPECT_EQ(got[t], 111) << "thread " << t;
  TUNA_CUDA_CHECK(cudaFree(out));
}

// An arrival short: the phase never completes, which the emulator reports instead of hanging.
void short_barrier_kernel() {
  if (threadIdx.x == 0) mbarrier_init(kBar, 33);
  __syncthreads();
  mbarrier_arrive(kBar);
  mbarrier_wait(kBar, 0);
}

TEST(EmulatorMbarrier, PhaseThatNeverCompletesIsADeadlock) {
  try {
    cuda::launch_kernel_sm90a(short_barrier_kernel, dim3(1), dim3(32), 1024, nullptr);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("deadlock"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("mbarrier phase"), std::string::npos) << e.what();
  }
}

// expect_tx announcing one box while two copies complete on the barrier: the first box completes phase 0, the
// second's bytes fall into phase 1, which no expect_tx announced. Nobody waits there, so nothing deadlocks; the
// tx-count left at the block's end shows the mismatch.
void two_boxes_one_announced_kernel(const __grid_constant__ CUtensorMap map, uint32_t box_bytes) {
  if (threadIdx.x == 0) {
    mbarrier_init(kBar, 1);
    mbarrier_arrive_expect_tx(kBar, box_bytes);
    tma_load_2d(kData, &map, kBar, 0, 0);
    tma_load_2d(kData + 1024 * ((box_bytes + 1023) / 1024), &map, kBar, 0, 0);
  }
  __syncthreads();
  mbarrier_wait(kBar, 0);
}

TEST(EmulatorMbarrier, ExpectTxMustEqualTheBytesCopied) {
  std::vector<uint16_t> tensor(64 * 64, 0x3f80);
  uint16_t* d = device_copy(tensor);
  const uint64_t dims[2] = {64, 64}, strides[1] = {128};
  const uint32_t box[2] = {64, 16};
  const CUtensorMap map = make_map(d, 2, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B);
  try {
    cuda::launch_kernel_sm90a(two_boxes_one_announced_kernel, dim3(1), dim3(32), kData + 4096, nullptr, map, 2048u);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ends with tx-count -2048"), std::string::npos) << e.what();
  }
  TUNA_CUDA_CHECK(cudaFree(d));
}

// ---------------------------------------------------------------------------------------------------------
// wgmma

// A descriptor as the ISA's table lays it out (9.7.15.5.1.2.2), encoded here independently of any kernel.
uint64_t descriptor(uint32_t start, uint32_t lbo, uint32_t sbo, int swizzle_bytes) {
  const uint64_t mode = swizzle_bytes == 128 ? 1 : swizzle_bytes == 64 ? 2 : swizzle_bytes == 32 ? 3 : 0;
  return uint64_t{(start >> 4) & 0x3fff} | uint64_t{(lbo >> 4) & 0x3fff} << 16 | uint64_t{(sbo >> 4) & 0x3fff} << 32 |
         mode << 62;
}

uint16_t bf16_of(float x) { return __float2bfloat16_rn(x).bits; }

struct WgmmaArgs {
  const unsigned char* image;  // copied to shared memory at kData
  uint32_t image_bytes;
  uint64_t a_desc, b_desc;
  uint32_t a_step, b_step;  // bytes the descriptors advance per k-step
  int k_steps;
  bool accumulate;           // onto `init` (else D = A B)
  const float* init;         // [128][32] initial accumulators
  const uint32_t* a_regs;    // RS: [k_steps][128][4]
  float* out;                // [128][32]
};

template <int kTransA, int kTransB, bool kRegisterA>
void wgmma_kernel(WgmmaArgs args) {
  for (uint32_t i = threadIdx.x; i < args.image_bytes; i += blockDim.x) shared_bytes()[kData + i] = args.image[i];
  fence_proxy_async_shared();  // the stores (generic proxy) before the tensor cores' reads (async proxy)
  __syncthreads();
  float d[32];
  for (int r = 0; r < 32; ++r) d[r] = args.init[threadIdx.x * 32 + r];
  wgmma_fence();
  for (int s = 0; s < args.k_steps; ++s) {
    const bool accumulate = s > 0 || args.accumulate;
    if constexpr (kRegisterA) {
      uint32_t a[4];
      for (int i = 0; i < 4; ++i) a[i] = args.a_regs[(s * 128 + threadIdx.x) * 4 + i];
      wgmma_rs<64, kTransB>(d, a, args.b_desc + s * (args.b_step >> 4), accumulate);
      wgmma_commit();
      wgmma_wait<0>();  // a[] goes out of scope: retire first
      wgmma_fence();
    } else {
      wgmma_ss<64, kTransA, kTransB>(d, args.a_desc + s * (args.a_step >> 4), args.b_desc + s * (args.b_step >> 4),
                                     accumulate);
    }
  }
  wgmma_commit();
  wgmma_wait<0>();
  for (int r = 0; r < 32; ++r) args.out[threadIdx.x * 32 + r] = d[r];
}

// Where D[row][col] of an m64n64 fp32 accumulator lives (ISA Figure 149): warp row / 16, lane 4 (row % 8) +
// (col % 8) / 2, register 4 (col / 8) + 2 ((row % 16) / 8) + col % 2.
int d_thread(int row, int col) { return 32 * (row / 16) + 4 * (row % 8) + (col % 8) / 2; }
int d_register(int row, int col) { return 4 * (col / 8) + 2 * ((row % 16) / 8) + col % 2; }

// The A fragment of registers (ISA Figure 148, as mma.m16n8k16's A per warp): register i of lane 4g + t of warp
// w holds A[16w + g + 8 (i % 2)][2t + 8 (i / 2) + {0, 1}], the lower column in the low half.
std::vector<uint32_t> a_fragments(const std::vector<float>& a /* 64 x 16 */) {
  std::vector<uint32_t> regs(128 * 4);
  for (int thread = 0; thread < 128; ++thread) {
    const int w = thread / 32, g = (thread % 32) / 4, t = thread % 4;
    for (int i = 0; i < 4; ++i) {
      const int row = 16 * w + g + 8 * (i % 2), col = 2 * t + 8 * (i / 2);
      regs[thread * 4 + i] = bf16_of(a[row * 16 + col]) | uint32_t{bf16_of(a[row * 16 + col + 1])} << 16;
    }
  }
  return regs;
}

// Small integers: every product and sum is exact in fp32.
std::vector<float> small_integers(int count, int seed) {
  std::vector<float> v(count);
  for (int i = 0; i < count; ++i) v[i] = static_cast<float>((i * 7 + seed * 13 + (i / 5) * 3) % 7 - 3);
  return v;
}

void place(std::vector<unsigned char>& image, uint32_t offset, float value) {
  const uint16_t bits = bf16_of(value);
  image[offset] = bits & 0xff, image[offset + 1] = bits >> 8;
}

struct WgmmaRun {
  std::vector<unsigned char> image;
  uint64_t a_desc = 0, b_desc = 0;
  uint32_t a_step = 0, b_step = 0;
  int k_steps = 1;
  bool accumulate = false;
  std::vector<float> init = std::vector<float>(128 * 32, 0.0f);
  std::vector<uint32_t> a_regs = std::vector<uint32_t>(4, 0);
};

template <int kTransA, int kTransB, bool kRegisterA>
std::vector<float> run_wgmma(const WgmmaRun& run) {
  unsigned char* image = device_copy(run.image);
  float* init = device_copy(run.init);
  uint32_t* regs = device_copy(run.a_regs);
  float* out = nullptr;
  TUNA_CUDA_CHECK(cudaMalloc(&out, 128 * 32 * sizeof(float)));
  WgmmaArgs args{image, static_cast<uint32_t>(run.image.size()), run.a_desc, run.b_desc, run.a_step, run.b_step,
                 run.k_steps, run.accumulate, init, regs, out};
  cuda::launch_kernel_sm90a(wgmma_kernel<kTransA, kTransB, kRegisterA>, dim3(1), dim3(128),
                            kData + run.image.size(), nullptr, args);
  TUNA_CUDA_CHECK(cudaGetLastError());
  std::vector<float> got = host_copy(out, 128 * 32);
  for (void* p : {static_cast<void*>(image), static_cast<void*>(init), static_cast<void*>(regs),
                  static_cast<void*>(out)})
    TUNA_CUDA_CHECK(cudaFree(p));
  return got;
}

// D (64 x 64) = A (64 x K) B (K x 64) (+ init), from each thread's registers.
void expect_product(const std::vector<float>& got, const std::vector<float>& a, const std::vector<float>& b, int k,
                    const std::vector<float>* init = nullptr) {
  for (int row = 0; row < 64; ++row)
    for (int col = 0; col < 64; ++col) {
      double want = init ? (*init)[d_thread(row, col) * 32 + d_register(row, col)] : 0.0;
      for (int i = 0; i < k; ++i) want += double(a[row * k + i]) * b[i * 64 + col];
      ASSERT_EQ(got[d_thread(row, col) * 32 + d_register(row, col)], static_cast<float>(want))
          << "D[" << row << "][" << col << "]";
    }
}

// K-major without swizzle, from the ISA's definitions: core matrices of 8 rows x 16 bytes, rows contiguous;
// LBO = the offset between the two 16-byte columns of the 8x2 tile (k 0-7, 8-15), SBO = between 8-row groups.
uint32_t k_major_plain(int mn, int k, uint32_t lbo, uint32_t sbo) {
  return (mn / 8) * sbo + (k / 8) * lbo + (mn % 8) * 16 + (k % 8) * 2;
}

TEST(EmulatorWgmma, KMajorCoreMatricesAndTheAccumulatorFragment) {
  const std::vector<float> a = small_integers(64 * 16, 1), b = small_integers(16 * 64, 2);
  WgmmaRun run;
  const uint32_t a_base = 0, b_base = 4096;  // A: 8 groups of 256 bytes; B likewise
  run.image.assign(8192, 0);
  for (int m = 0; m < 64; ++m)
    for (int k = 0; k < 16; ++k) place(run.image, a_base + k_major_plain(m, k, 128, 256), a[m * 16 + k]);
  for (int k = 0; k < 16; ++k)
    for (int n = 0; n < 64; ++n) place(run.image, b_base + k_major_plain(n, k, 128, 256), b[k * 64 + n]);
  run.a_desc = descriptor(kData + a_base, 128, 256, 0);
  run.b_desc = descriptor(kData + b_base, 128, 256, 0);
  expect_product(run_wgmma<0, 0, false>(run), a, b, 16);
  // The same product onto existing accumulators, and with scale-d false (D = A B) over them.
  run.init = small_integers(128 * 32, 5);
  run.accumulate = true;
  expect_product(run_wgmma<0, 0, false>(run), a, b, 16, &run.init);
  run.accumulate = false;
  expect_product(run_wgmma<0, 0, false>(run), a, b, 16);
}

TEST(EmulatorWgmma, AFromRegistersPerTheFragmentFigure) {
  const std::vector<float> a = small_integers(64 * 16, 3), b = small_integers(16 * 64, 4);
  WgmmaRun run;
  run.image.assign(4096, 0);
  for (int k = 0; k < 16; ++k)
    for (int n = 0; n < 64; ++n) place(run.image, k_major_plain(n, k, 128, 256), b[k * 64 + n]);
  run.b_desc = descriptor(kData, 128, 256, 0);
  run.a_regs = a_fragments(a);
  expect_product(run_wgmma<0, 0, true>(run), a, b, 16);
}

// MN-major B laid out by the ISA's exact-layout examples for bf16, in elements, then swizzled per the tables:
//   64B: Swizzle<2,4,3> o ((8,4,2),(8,2)) : ((1,8,256),(32,512)),  LBO 256, SBO 512 elements
//   32B: the canonical ((T,2,m),(8,k)) : ((1,T,LBO),(2T,SBO)) with m = 4, LBO 512, SBO 256 elements
TEST(EmulatorWgmma, MnMajorOperandsOfTheIsaExamples) {
  const std::vector<float> a = small_integers(64 * 16, 6), b = small_integers(16 * 64, 7);
  struct Case {
    int swizzle_bytes;
    int units;  // 16-byte units along N per swizzle row
    uint32_t lbo, sbo;  // elements
  };
  for (const Case& c : {Case{64, 4, 256, 512}, Case{32, 2, 512, 256}}) {
    SCOPED_TRACE("MN-major " + std::to_string(c.swizzle_bytes) + "B");
    WgmmaRun run;
    const uint32_t b_base = 0, a_base = 8192;
    run.image.assign(12288, 0);
    for (int k = 0; k < 16; ++k)
      for (int n = 0; n < 64; ++n) {
        const uint32_t element = (n % 8) + 8 * ((n / 8) % c.units) + c.lbo * (n / (8 * c.units)) +
                                 8 * c.units * (k % 8) + c.sbo * (k / 8);
        place(run.image, b_base + table_position(element * 2, c.swizzle_bytes), b[k * 64 + n]);
      }
    for (int m = 0; m < 64; ++m)
      for (int k = 0; k < 16; ++k) place(run.image, a_base + k_major_plain(m, k, 128, 256), a[m * 16 + k]);
    run.a_desc = descriptor(kData + a_base, 128, 256, 0);
    run.b_desc = descriptor(kData + b_base, c.lbo * 2, c.sbo * 2, c.swizzle_bytes);
    expect_product(run_wgmma<0, 1, false>(run), a, b, 16);
  }
}

// Tiles as a FlashAttention-style kernel stores them: TMA boxes of 64 bf16 (128 bytes) per row with 128B
// swizzle. Q (64 x 64) and K (64 x 64) K-major: four k-steps, the descriptors advancing 32 bytes inside the
// swizzle atom (SBO 1024: 8 rows of 128 bytes); V (64 x 128) MN-major in two 64-column panels (LBO = the
// panel's 8 KiB, SBO 1024): S = Q K^T and O = S' V with S' the K tile read as a 64 x 64 A.
struct TileArgs {
  CUtensorMap q, k, v;
  float* s_out;  // [128][32]
  float* o_out;  // [128][64]
};

void tile_kernel(const __grid_constant__ TileArgs args) {
  constexpr uint32_t kQ = kData, kK = kData + 8192, kV = kData + 16384;  // V: panels at kV, kV + 8192
  if (threadIdx.x == 0) {
    mbarrier_init(kBar, 1);
    mbarrier_arrive_expect_tx(kBar, 8192 * 4);
    tma_load_2d(kQ, &args.q, kBar, 0, 0);
    tma_load_2d(kK, &args.k, kBar, 0, 0);
    tma_load_2d(kV, &args.v, kBar, 0, 0);
    tma_load_2d(kV + 8192, &args.v, kBar, 64, 0);
  }
  __syncthreads();
  mbarrier_wait(kBar, 0);
  float s[32], o[64];
  wgmma_fence();
  for (int kk = 0; kk < 4; ++kk)
    wgmma_ss<64, 0, 0>(s, descriptor(kQ + 32 * kk, 16, 1024, 128), descriptor(kK + 32 * kk, 16, 1024, 128), kk > 0);
  for (int kk = 0; kk < 4; ++kk)
    wgmma_ss<128, 0, 1>(o, descriptor(kK + 32 * kk, 16, 1024, 128), descriptor(kV + 2048 * kk, 8192, 1024, 128),
                        kk > 0);
  wgmma_commit();
  wgmma_wait<0>();
  for (int r = 0; r < 32; ++r) args.s_out[threadIdx.x * 32 + r] = s[r];
  for (int r = 0; r < 64; ++r) args.o_out[threadIdx.x * 64 + r] = o[r];
}

TEST(EmulatorWgmma, TmaSwizzledTilesKMajorAndMnMajor) {
  for (CopyTiming timing : {CopyTiming::kImmediate, CopyTiming::kDeferred}) {
    SCOPED_TRACE(timing == CopyTiming::kImmediate ? "at issue" : "at wait");
    const std::vector<float> q = small_integers(64 * 64, 8), k = small_integers(64 * 64, 9),
                             v = small_integers(64 * 128, 10);
    const auto bf16s = [](const std::vector<float>& x) {
      std::vector<uint16_t> bits(x.size());
      for (size_t i = 0; i < x.size(); ++i) bits[i] = bf16_of(x[i]);
      return bits;
    };
    uint16_t *d_q = device_copy(bf16s(q)), *d_k = device_copy(bf16s(k)), *d_v = device_copy(bf16s(v));
    const uint64_t dims64[2] = {64, 64}, strides64[1] = {128}, dims128[2] = {128, 64}, strides128[1] = {256};
    const uint32_t box[2] = {64, 64};
    TileArgs args{};
    args.q = make_map(d_q, 2, dims64, strides64, box, CU_TENSOR_MAP_SWIZZLE_128B);
    args.k = make_map(d_k, 2, dims64, strides64, box, CU_TENSOR_MAP_SWIZZLE_128B);
    args.v = make_map(d_v, 2, dims128, strides128, box, CU_TENSOR_MAP_SWIZZLE_128B);
    TUNA_CUDA_CHECK(cudaMalloc(&args.s_out, 128 * 32 * 4));
    TUNA_CUDA_CHECK(cudaMalloc(&args.o_out, 128 * 64 * 4));
    const CopyTiming saved = g_shared.timing;
    g_shared.timing = timing;
    cuda::launch_kernel_sm90a(tile_kernel, dim3(1), dim3(128), kData + 32768, nullptr, args);
    g_shared.timing = saved;
    const std::vector<float> s = host_copy(args.s_out, 128 * 32), o = host_copy(args.o_out, 128 * 64);
    for (int row = 0; row < 64; ++row) {
      for (int col = 0; col < 64; ++col) {
        double want = 0;
        for (int i = 0; i < 64; ++i) want += double(q[row * 64 + i]) * k[col * 64 + i];
        ASSERT_EQ(s[d_thread(row, col) * 32 + d_register(row, col)], static_cast<float>(want))
            << "S " << row << "," << col;
      }
      for (int col = 0; col < 128; ++col) {
        double want = 0;
        for (int i = 0; i < 64; ++i) want += double(k[row * 64 + i]) * v[i * 128 + col];
        ASSERT_EQ(o[d_thread(row, col) * 64 + d_register(row, col)], static_cast<float>(want))
            << "O " << row << "," << col;
      }
    }
    for (void* p : {static_cast<void*>(d_q), static_cast<void*>(d_k), static_cast<void*>(d_v),
                    static_cast<void*>(args.s_out), static_cast<void*>(args.o_out)})
      TUNA_CUDA_CHECK(cudaFree(p));
  }
}

// ---- misuse the emulator must report
enum class Misuse {
  kNoFence,
  kTouchAccumulator,
  kTouchFragment,
  kReadBeforeWait,
  kOverwriteWhileRead,
  kNoRetire,
  kStoreWithoutProxyFence,  // a thread's store into the tile, then a barrier, then the wgmma: no fence.proxy.async
  kStoreWhileRead,          // a thread's store into the tile while the wgmma that reads it is in flight
  kStoreThenProxyFence,     // no misuse: the store, fence.proxy.async by the storing thread, a barrier, the wgmma
};

void misuse_kernel(const __grid_constant__ CUtensorMap map, Misuse misuse) {
  constexpr uint32_t kTile = kData;
  if (threadIdx.x == 0) {
    mbarrier_init(kBar, 1);
    mbarrier_arrive_expect_tx(kBar, 8192);
    tma_load_2d(kTile, &map, kBar, 0, 0);
  }
  __syncthreads();
  if (misuse != Misuse::kReadBeforeWait) mbarrier_wait(kBar, 0);
  if (misuse == Misuse::kStoreWithoutProxyFence || misuse == Misuse::kStoreThenProxyFence) {
    if (threadIdx.x == 5) {
      shared_bytes()[kTile + 2] ^= 0x40;  // row 0, k 1: an operand byte
      if (misuse == Misuse::kStoreThenProxyFence) fence_proxy_async_shared();
    }
    __syncthreads();  // without the fence, this orders the store for the generic proxy only
  }
  float d[32] = {};
  uint32_t a[4] = {0, 0, 0, 0};
  if (misuse != Misuse::kNoFence) wgmma_fence();
  const uint64_t tile = descriptor(kTile, 16, 1024, 128);
  if (misuse == Misuse::kTouchFragment) wgmma_rs<64, 0>(d, a, tile, false);
  else wgmma_ss<64, 0, 0>(d, tile, tile, false);
  wgmma_commit();
  if (misuse == Misuse::kTouchAccumulator) d[3] = 1.0f;
  if (misuse == Misuse::kTouchFragment) a[1] = 5;
  if (misuse == Misuse::kStoreWhileRead && threadIdx.x == 7) shared_bytes()[kTile + 130] ^= 0x40;  // row 1, k 9
  if (misuse == Misuse::kOverwriteWhileRead && threadIdx.x == 0) {
    mbarrier_arrive_expect_tx(kBar, 8192);
    tma_load_2d(kTile, &map, kBar, 0, 0);
  }
  if (misuse != Misuse::kNoRetire) wgmma_wait<0>();
  if (misuse == Misuse::kOverwriteWhileRead) mbarrier_wait(kBar, 1);
  if (misuse == Misuse::kReadBeforeWait) mbarrier_wait(kBar, 0);
}

TEST(EmulatorWgmma, MisuseIsReported) {
  std::vector<uint16_t> tensor(64 * 64, 0x3f80);
  uint16_t* d = device_copy(tensor);
  const uint64_t dims[2] = {64, 64}, strides[1] = {128};
  const uint32_t box[2] = {64, 64};
  const CUtensorMap map = make_map(d, 2, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B);
  const std::pair<Misuse, const char*> cases[] = {
      {Misuse::kNoFence, "without a wgmma.fence"},
      {Misuse::kTouchAccumulator, "changed the accumulator registers"},
      {Misuse::kTouchFragment, "changed the A fragment registers"},
      {Misuse::kReadBeforeWait, "seen only 0 phases"},  // the copy landed (at issue) or is still writing
      {Misuse::kOverwriteWhileRead, "an unretired wgmma reads"},
      {Misuse::kNoRetire, "in flight"},
      {Misuse::kStoreWithoutProxyFence, "with no fence.proxy.async since"},
      {Misuse::kStoreWhileRead, "were overwritten before the wgmma.wait_group"},
  };
  for (const auto& [misuse, message] : cases) {
    SCOPED_TRACE(message);
    try {
      cuda::launch_kernel_sm90a(misuse_kernel, dim3(1), dim3(128), kData + 8192, nullptr, map, misuse);
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  }
  // The store made visible to the async proxy as the ISA asks passes.
  cuda::launch_kernel_sm90a(misuse_kernel, dim3(1), dim3(128), kData + 8192, nullptr, map,
                            Misuse::kStoreThenProxyFence);
  TUNA_CUDA_CHECK(cudaFree(d));
}

// wgmma.* are .aligned: the warpgroup's 128 threads must execute the same instruction, not only the same operation
// with the same operands. The kernel has the shape of the hopper forward's step before its mask choice was made
// uniform: two instances of one generic lambda (a masked and an unmasked step), each with its own wgmma.fence,
// mma_async, commit_group and wait_group, same operands in both, chosen per warp (kPerWarp) or per warpgroup.
template <bool kPerWarp>
void step_instances_kernel(float* out) {
  for (uint32_t i = threadIdx.x; i < 4096; i += blockDim.x) shared_bytes()[kData + i] = 0;
  fence_proxy_async_shared();
  __syncthreads();
  float d[32] = {};
  const auto step = [&](auto masked) {
    wgmma_fence();
    wgmma_ss<64, 0, 0>(d, descriptor(kData, 128, 256, 0), descriptor(kData, 128, 256, 0), false);
    wgmma_commit();
    wgmma_wait<0>();
    if constexpr (decltype(masked)::value) d[0] = -INFINITY;  // the instances differ past their wgmma
  };
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const bool masked = kPerWarp ? warp >= 2 : blockIdx.x == 0;
  if (masked) step(std::true_type{});
  else step(std::false_type{});
  out[threadIdx.x] = d[1];
}

TEST(EmulatorWgmma, WarpgroupMustExecuteTheSameInstruction) {
  float* out = nullptr;
  TUNA_CUDA_CHECK(cudaMalloc(&out, 128 * sizeof(float)));
  // Warpgroup-uniform: one instance for all 128 threads.
  cuda::launch_kernel_sm90a(step_instances_kernel<false>, dim3(1), dim3(128), kData + 4096, nullptr, out);
  TUNA_CUDA_CHECK(cudaGetLastError());
  // Per warp: warps 0-1 in one instance, 2-3 in the other, at the same operation with the same operands.
  try {
    cuda::launch_kernel_sm90a(step_instances_kernel<true>, dim3(1), dim3(128), kData + 4096, nullptr, out);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("warpgroup 0 diverges: its threads 0 and 64 (warps 0 and 2) execute wgmma.fence at two "
                        "different instructions"),
              std::string::npos)
        << what;
  }
  TUNA_CUDA_CHECK(cudaFree(out));
}

// In the at-wait timing the accumulators hold no value until the wait: a kernel that reads them early sees NaN.
void early_read_kernel(float* out) {
  for (uint32_t i = threadIdx.x; i < 4096; i += blockDim.x) shared_bytes()[kData + i] = 0;
  fence_proxy_async_shared();
  __syncthreads();
  float d[32] = {};
  wgmma_fence();
  wgmma_ss<64, 0, 0>(d, descriptor(kData, 128, 256, 0), descriptor(kData, 128, 256, 0), false);
  wgmma_commit();
  out[threadIdx.x] = d[0];  // before the wait: undefined on hardware
  wgmma_wait<0>();
}

TEST(EmulatorWgmma, AccumulatorsReadBeforeTheWaitAreNanWhenComputedAtTheWait) {
  float* out = nullptr;
  TUNA_CUDA_CHECK(cudaMalloc(&out, 128 * sizeof(float)));
  const CopyTiming saved = g_shared.timing;
  g_shared.timing = CopyTiming::kDeferred;
  cuda::launch_kernel_sm90a(early_read_kernel, dim3(1), dim3(128), kData + 4096, nullptr, out);
  g_shared.timing = saved;
  for (float x : host_copy(out, 128)) EXPECT_TRUE(std::isnan(x));
  TUNA_CUDA_CHECK(cudaFree(out));
}

// ---------------------------------------------------------------------------------------------------------
// setmaxnreg, elect.sync, named barriers, flags

// 384 threads start with 168 registers each (64 KiB / 384, a multiple of 8). Warpgroups 1 and 2 ask for 240
// before warpgroup 0 has given any back: they wait until its setmaxnreg.dec to 24 frees exactly what they need.
template <int kConsumerRegs>
void register_kernel(int* out) {
  if (threadIdx.x / 128 == 0) {
    setmaxnreg_dec<24>();
  } else {
    setmaxnreg_inc<kConsumerRegs>();
  }
  out[threadIdx.x] = g_sm90.warpgroups[threadIdx.x / 128].registers;
}

TEST(EmulatorSetmaxnreg, ProducerReleasesWhatConsumersTake) {
  int* out = nullptr;
  TUNA_CUDA_CHECK(cudaMalloc(&out, 384 * sizeof(int)));
  cuda::launch_kernel_sm90a(register_kernel<240>, dim3(1), dim3(384), 0, nullptr, out);
  const std::vector<int> got = host_copy(out, 384);
  for (int t = 0; t < 384; ++t) EXPECT_EQ(got[t], t < 128 ? 24 : 240) << "thread " << t;
  // 2 x 128 x (248 - 168) registers exceed the 128 x 144 the producer frees: the CTA waits forever.
  try {
    cuda::launch_kernel_sm90a(register_kernel<248>, dim3(1), dim3(384), 0, nullptr, out);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("registers for setmaxnreg.inc"), std::string::npos) << e.what();
  }
  TUNA_CUDA_CHECK(cudaFree(out));
}

void elect_kernel(int* out) { out[threadIdx.x] = elect_one() ? 1 : 0; }

TEST(EmulatorElect, OneLeaderPerWarp) {
  int* out = nullptr;
  TUNA_CUDA_CHECK(cudaMalloc(&out, 96 * sizeof(int)));
  cuda::launch_kernel_sm90a(elect_kernel, dim3(1), dim3(96), 0, nullptr, out);
  const std::vector<int> got = host_copy(out, 96);
  for (int w = 0; w < 3; ++w) {
    int leaders = 0;
    for (int l = 0; l < 32; ++l) leaders += got[w * 32 + l];
    EXPECT_EQ(leaders, 1) << "warp " << w;
  }
  TUNA_CUDA_CHECK(cudaFree(out));
}

// Warp 0 produces a value, then bar.arrive; warps 1-2 bar.sync on the same barrier of 96 threads and read it.
// With `balanced` false the producer arrives twice: the second arrival is left over at the block's end.
void named_kernel(int* out, bool balanced) {
  __shared__ int value;
  if (threadIdx.x / 32 == 0) {
    if (threadIdx.x == 0) value = 42;
    named_barrier_arrive(1, 96);
    if (!balanced) named_barrier_arrive(2, 64);
  } else {
    named_barrier_sync(1, 96);
    out[threadIdx.x] = value;
  }
}

TEST(EmulatorNamedBarrier, ArriveOrdersAProducerBeforeTheSyncingConsumers) {
  int* out = nullptr;
  TUNA_CUDA_CHECK(cudaMalloc(&out, 96 * sizeof(int)));
  cuda::launch_kernel_sm90a(named_kernel, dim3(1), dim3(96), 0, nullptr, out, true);
  const std::vector<int> got = host_copy(out, 96);
  for (int t = 32; t < 96; ++t) EXPECT_EQ(got[t], 42);
  try {
    cuda::launch_kernel_sm90a(named_kernel, dim3(1), dim3(96), 0, nullptr, out, false);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("named barrier 2 holding 32"), std::string::npos) << e.what();
  }
  TUNA_CUDA_CHECK(cudaFree(out));
}

// Half of warp 1 and half of warp 2 make up the second warp's worth of a 64-thread barrier: the count is
// reached, but bar.sync is .aligned (whole warps), so the emulator reports it.
void partial_warp_barrier_kernel() {
  if (threadIdx.x < 32 || threadIdx.x % 32 < 16) named_barrier_sync(3, 64);
}

TEST(EmulatorNamedBarrier, WholeWarpsOnly) {
  try {
    cuda::launch_kernel_sm90a(partial_warp_barrier_kernel, dim3(1), dim3(96), 0, nullptr);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("16 of warp 1's 32 threads"), std::string::npos) << e.what();
  }
}

// Each block takes a ticket t (atomicAdd), waits until the flag reads t + offset, then releases t + 1: in
// whatever order the blocks run, each wait is for a block that took a lower ticket and so is running already.
// Waiting for a flag no block that ran earlier released is an error here (a hang, or reliance on scheduling, on
// a GPU).
void flag_kernel(int* flag, int* tickets, int offset) {
  if (threadIdx.x == 0) {
    const int ticket = atomicAdd(tickets, 1);
    flag_wait(flag, ticket + offset);
    flag_release(flag, ticket + 1);
  }
}

// The same chain by blockIdx instead of tickets: it holds only while blocks run in blockIdx order.
void flag_kernel_by_block_index(int* flag) {
  if (threadIdx.x == 0) {
    flag_wait(flag, static_cast<int>(blockIdx.x));
    flag_release(flag, static_cast<int>(blockIdx.x) + 1);
  }
}

// Runs f with the emulated blocks in the given order, then restores the run's order.
template <typename F>
void with_blocks_reversed(bool reversed, F f) {
  const bool saved = emulator::runtime().blocks_reversed;
  emulator::runtime().blocks_reversed = reversed;
  try {
    f();
  } catch (...) {
    emulator::runtime().blocks_reversed = saved;
    throw;
  }
  emulator::runtime().blocks_reversed = saved;
}

TEST(EmulatorFlags, ReleasedByBlocksThatRanEarlier) {
  for (const bool reversed : {false, true}) {
    int* flag = device_copy(std::vector<int>{0, 0});
    with_blocks_reversed(reversed, [&] {
      cuda::launch_kernel_sm90a(flag_kernel, dim3(5), dim3(32), 0, nullptr, flag, flag + 1, 0);
      EXPECT_EQ(host_copy(flag, 1)[0], 5);
      try {
        cuda::launch_kernel_sm90a(flag_kernel, dim3(2), dim3(32), 0, nullptr, flag, flag + 1, 2);  // waits for 7
        ADD_FAILURE() << "no error";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("no block that ran earlier released it"), std::string::npos) << e.what();
      }
    });
    TUNA_CUDA_CHECK(cudaFree(flag));
  }
}

// CUDA does not promise blockIdx order: with the blocks last first, a chain by blockIdx fails at its first wait.
TEST(EmulatorFlags, BlockIndexOrderIsNotPromised) {
  int* flag = device_copy(std::vector<int>{0});
  with_blocks_reversed(false, [&] {
    cuda::launch_kernel_sm90a(flag_kernel_by_block_index, dim3(3), dim3(32), 0, nullptr, flag);
  });
  EXPECT_EQ(host_copy(flag, 1)[0], 3);
  TUNA_CUDA_CHECK(cudaMemset(flag, 0, sizeof(int)));
  with_blocks_reversed(true, [&] {
    try {
      cuda::launch_kernel_sm90a(flag_kernel_by_block_index, dim3(3), dim3(32), 0, nullptr, flag);
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("flag_wait for value 2"), std::string::npos) << e.what();
    }
  });
  TUNA_CUDA_CHECK(cudaFree(flag));
}

// ex2.approx.ftz.f32 per the ISA's table of special values and its .ftz rule: subnormal inputs count as zero,
// subnormal results are flushed to +0 (2^-126 is the smallest normal result, 2^-127 a subnormal one).
TEST(EmulatorEx2, FlushesSubnormalsAndFollowsTheSpecialValues) {
  EXPECT_EQ(ex2_approx_ftz(3.0f), 8.0f);
  EXPECT_EQ(ex2_approx_ftz(-126.0f), std::ldexp(1.0f, -126));
  EXPECT_EQ(ex2_approx_ftz(-127.0f), 0.0f);
  EXPECT_EQ(ex2_approx_ftz(-140.5f), 0.0f);
  EXPECT_FALSE(std::signbit(ex2_approx_ftz(-127.0f)));
  EXPECT_EQ(ex2_approx_ftz(std::ldexp(1.0f, -140)), 1.0f);   // a subnormal input reads as +0
  EXPECT_EQ(ex2_approx_ftz(-std::ldexp(1.0f, -140)), 1.0f);  // and -0
  EXPECT_EQ(ex2_approx_ftz(-0.0f), 1.0f);
  EXPECT_EQ(ex2_approx_ftz(-INFINITY), 0.0f);
  EXPECT_FALSE(std::signbit(ex2_approx_ftz(-INFINITY)));
  EXPECT_EQ(ex2_approx_ftz(INFINITY), INFINITY);
  EXPECT_EQ(ex2_approx_ftz(200.0f), INFINITY);
  EXPECT_TRUE(std::isnan(ex2_approx_ftz(NAN)));
  EXPECT_NEAR(ex2_approx_ftz(0.5f), 1.41421356f, 1.41421356f * 0x1p-22f);
  EXPECT_NEAR(ex2_approx_ftz(-10.25f), 0.000821187906f, 0.000821187906f * 0x1p-22f);
}

TEST(EmulatorSm90, HopperInstructionsNeedAnSm90aLaunch) {
  int* out = nullptr;
  TUNA_CUDA_CHECK(cudaMalloc(&out, 32 * sizeof(int)));
  try {
    cuda::launch_kernel(elect_kernel, dim3(1), dim3(32), 0, nullptr, out);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("needs sm_90a"), std::string::npos) << e.what();
  }
  TUNA_CUDA_CHECK(cudaFree(out));
}

}  // namespace
}  // namespace tuna::emulator
