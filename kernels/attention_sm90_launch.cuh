// The host side of the sm_90a attention kernels (attention_sm90_kernels.cuh): the tensor maps of their TMA
// copies, the check that this device and this build can run them, and the launch sequences. Included only by
// attention_sm90_{fwd,bwd}_hdNN.cu. Internal to kernels/.
//
// The tensor maps come from the driver's cuTensorMapEncodeTiled, reached through the runtime's driver entry
// point (no link against libcuda); the host emulator answers that entry point with its own encoder.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
#include <tuple>
#include <utility>

#include "core/cuda_check.h"
#include "kernels/attention_kernels.cuh"  // bwd_delta_kernel, shared with the sm_80 path
#include "kernels/attention_sm90_kernels.cuh"

namespace tuna::cuda::attention {

inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
    TUNA_CUDA_CHECK(
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000, cudaEnableDefault, &status));
    TUNA_CHECK(status == cudaDriverEntryPointSuccess && function != nullptr,
               "the CUDA driver has no cuTensorMapEncodeTiled: the sm_90a attention kernels need a CUDA 12+ driver");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function);
  }();
  return encode;
}

// A bf16 [batch, seq, heads, head_dim] tensor as TMA sees it: (head_dim, heads, seq, batch), innermost first,
// boxes of one 64-column panel of `rows` rows of one head, 128B swizzle; rows past seq read as zeros.
inline CUtensorMap rows_tensor_map(const __nv_bfloat16* base, int batch, int seq, int heads, int head_dim, int rows) {
  TUNA_CHECK(reinterpret_cast<uintptr_t>(base) % 16 == 0, "attention tensors must be 16-byte aligned for TMA");
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(seq), static_cast<cuuint64_t>(batch)};
  const cuuint64_t row_bytes = static_cast<cuuint64_t>(heads) * head_dim * 2;
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(head_dim) * 2, row_bytes, row_bytes * seq};
  const cuuint32_t box[4] = {kPanelCols, 1, static_cast<cuuint32_t>(rows), 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  CUtensorMap map;
  const CUresult result = tensor_map_encoder()(
      &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<__nv_bfloat16*>(base), dims, strides, box,
      element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TUNA_CHECK(result == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed (CUresult ", static_cast<int>(result),
             ") for an attention tensor [", batch, ", ", seq, ", ", heads, ", ", head_dim, "]");
  return map;
}

// rows_tensor_map's result for these arguments, encoded once per thread: a map is a pure function of them (the
// address, the shape, the box), so a cached one is the map a new encoding would give, whatever was freed or
// allocated at that address since. Training calls the attention of each layer with the same tensors every step.
inline CUtensorMap cached_rows_tensor_map(const __nv_bfloat16* base, int batch, int seq, int heads, int head_dim,
                                          int rows) {
  using Key = std::tuple<const void*, int, int, int, int, int>;
  thread_local std::map<Key, CUtensorMap> maps;
  const Key key{base, batch, seq, heads, head_dim, rows};
  if (const auto it = maps.find(key); it != maps.end()) return it->second;
  const CUtensorMap map = rows_tensor_map(base, batch, seq, heads, head_dim, rows);
  if (maps.size() >= 4096) maps.clear();  // a bound for callers whose tensors move every call
  maps.emplace(key, map);
  return map;
}

// The sm_90a kernels run only on a compute capability 9.0 device, from a build whose image has sm_90a code
// (SM containing 90a): anything else is an error that says so, never a silent fallback.
template <typename Kernel>
void require_sm90a_image(Kernel* kernel) {
  int device = 0, major = 0, minor = 0;
  TUNA_CUDA_CHECK(cudaGetDevice(&device));
  TUNA_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  TUNA_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  TUNA_CHECK(major == 9 && minor == 0, "the Hopper attention path (--attention hopper) needs an sm_90 GPU; this ",
             "device is sm_", major, minor, " (use --attention mma)");
  cudaFuncAttributes attributes;
  TUNA_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
  TUNA_CHECK(attributes.binaryVersion == 90, "the Hopper attention path needs a build with sm_90a code (make SM=90a, ",
             "or the default SM); this binary runs sm_", attributes.binaryVersion, " code here");
#ifndef TUNA_EMULATOR  // the emulator has no compiled register count; its setmaxnreg model checks the pool itself
  // setmaxnreg moves registers within the CTA's pool, which holds what ptxas gave each of the 384 threads at
  // launch (168 under __launch_bounds__(384, 1)). If the producer's and the consumers' counts did not fit it,
  // the consumers' setmaxnreg.inc would wait forever: a hang on the GPU, so an error here instead.
  constexpr int kPool = kWarpGroupThreads * kProducerRegisters + kConsumerThreads * kConsumerRegisters;
  TUNA_CHECK(attributes.numRegs * kSm90Threads >= kPool, "the Hopper attention kernel was compiled to ",
             attributes.numRegs, " registers a thread: ", kSm90Threads, " threads then own ",
             attributes.numRegs * kSm90Threads, ", fewer than the ", kPool, " its setmaxnreg counts redistribute");
#endif
}

// The forward's tile counter for launches from this thread on `stream` of the current device, when the caller
// passes none (AttentionParams::tile_counter; the model passes its own): one int, zeroed once (in stream order),
// which every launch leaves at 0 again (sm90_fwd_kernel). One per stream, because launches on different streams
// may run at once and must not share it; one per thread as well, so that no lock is needed (two threads launching
// on one stream get two counters, which is as safe). A few bytes a stream, kept for the process's life.
inline int* fwd_tile_counter(cudaStream_t stream) {
  int device = 0;
  TUNA_CUDA_CHECK(cudaGetDevice(&device));
  thread_local std::map<std::pair<int, cudaStream_t>, int*> counters;
  int*& counter = counters[{device, stream}];
  if (counter == nullptr) {
    TUNA_CUDA_CHECK(cudaMalloc(&counter, sizeof(int)));
    TUNA_CUDA_CHECK(cudaMemsetAsync(counter, 0, sizeof(int), stream));
  }
  return counter;
}

inline int multiprocessor_count() {
  int device = 0;
  TUNA_CUDA_CHECK(cudaGetDevice(&device));
  thread_local std::map<int, int> sms_by_device;
  int& sms = sms_by_device[device];
  if (sms == 0) TUNA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

// The checks of require_sm90a_image and the shared-memory attribute, once per thread, device and kernel: both
// hold for the process's life once they have.
template <typename Kernel>
void prepare_sm90a_kernel(Kernel* kernel, int smem_bytes) {
  int device = 0;
  TUNA_CUDA_CHECK(cudaGetDevice(&device));
  thread_local std::set<std::pair<int, const void*>> prepared;
  const std::pair<int, const void*> key{device, reinterpret_cast<const void*>(kernel)};
  if (prepared.count(key) != 0) return;
  require_sm90a_image(kernel);
  TUNA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  prepared.insert(key);
}

// The forward: one persistent CTA per SM (at most one per tile: each CTA's first tile is its blockIdx), the
// later tiles handed out by the counter.
// With documents (p.doc_start) the kernel's instance that skips and masks by them; without, the plain causal one.
template <int kHd>
void launch_sm90_fwd(const AttentionParams& p, cudaStream_t stream) {
  using C = Sm90Fwd<kHd>;
  auto* const kernel = p.doc_start != nullptr ? sm90_fwd_kernel<kHd, true> : sm90_fwd_kernel<kHd, false>;
  prepare_sm90a_kernel(kernel, C::kSmemBytes);
  Sm90Params args{};
  args.p = p;
  args.q_map = cached_rows_tensor_map(p.q, p.batch, p.seq_len, p.n_heads, kHd, C::kBlockM);
  args.k_map = cached_rows_tensor_map(p.k, p.batch, p.seq_len, p.n_kv_heads, kHd, C::kBlockN);
  args.v_map = cached_rows_tensor_map(p.v, p.batch, p.seq_len, p.n_kv_heads, kHd, C::kBlockN);
  const int64_t tiles = ceil_div(p.seq_len, C::kBlockM) * p.batch * p.n_heads;
  TUNA_CHECK(tiles < (int64_t{1} << 31), "attention forward: ", tiles, " tiles");
  args.n_tiles = static_cast<int>(tiles);
  args.tile_counter = p.tile_counter != nullptr ? p.tile_counter : fwd_tile_counter(stream);
  const int grid = static_cast<int>(std::min<int64_t>(tiles, multiprocessor_count()));
  launch_kernel_sm90a(kernel, dim3(grid), dim3(kSm90Threads), C::kSmemBytes, stream, args);
  TUNA_CUDA_CHECK_LAUNCH();
}

// The backward: delta = rowsum(dO * O), the flags and the ticket counter cleared, then one CTA per (key block,
// kv head, batch), each taking its work by ticket (the ordered dQ additions wait only on lower tickets), then dQ
// finished. With documents (p.doc_start) the kernel's instance that skips and masks by them.
template <int kHd>
void launch_sm90_bwd(const AttentionParams& p_in, float* scratch, const float* rope_cos, const float* rope_sin,
                     const int32_t* rope_positions, cudaStream_t stream) {
  using C = Sm90Bwd<kHd>;
  auto* const kernel = p_in.doc_start != nullptr ? sm90_bwd_kernel<kHd, true> : sm90_bwd_kernel<kHd, false>;
  prepare_sm90a_kernel(kernel, C::kSmemBytes);
  const gpu_scratch::AttentionBwdScratch layout =
      gpu_scratch::attention_bwd_layout(p_in.batch, p_in.seq_len, p_in.n_heads, kHd, /*hopper=*/true);
  Sm90Params args{};
  args.p = p_in;
  args.p.delta = scratch + layout.delta;
  args.dq_accum = scratch + layout.accum;
  args.dq_flags = reinterpret_cast<int*>(scratch + layout.flags);
  const int64_t n_flags = static_cast<int64_t>(p_in.batch) * p_in.n_heads * layout.m_blocks;
  args.bwd_tickets = args.dq_flags + n_flags;
  args.rope_cos = rope_cos, args.rope_sin = rope_sin, args.rope_positions = rope_positions;
  const AttentionParams& p = args.p;

  const int64_t rows = static_cast<int64_t>(p.batch) * p.seq_len * p.n_heads;
  launch_kernel(bwd_delta_kernel<kHd>, static_cast<unsigned>(ceil_div(rows, kWarps)), kThreads, 0, stream, p);
  TUNA_CUDA_CHECK_LAUNCH();
  TUNA_CUDA_CHECK(cudaMemsetAsync(args.dq_flags, 0, sizeof(int) * (n_flags + 1), stream));  // flags and tickets

  args.q_map = cached_rows_tensor_map(p.q, p.batch, p.seq_len, p.n_heads, kHd, C::kBlockM);
  args.dout_map = cached_rows_tensor_map(p.dout, p.batch, p.seq_len, p.n_heads, kHd, C::kBlockM);
  args.k_map = cached_rows_tensor_map(p.k, p.batch, p.seq_len, p.n_kv_heads, kHd, C::kBlockN);
  args.v_map = cached_rows_tensor_map(p.v, p.batch, p.seq_len, p.n_kv_heads, kHd, C::kBlockN);
  const dim3 grid(static_cast<unsigned>(ceil_div(p.seq_len, C::kBlockN)), p.n_kv_heads, p.batch);
  launch_kernel_sm90a(kernel, grid, dim3(kSm90Threads), C::kSmemBytes, stream, args);
  TUNA_CUDA_CHECK_LAUNCH();

  const int64_t chunks = rows * (kHd / 16);
  launch_kernel(sm90_dq_finish_kernel<kHd>, static_cast<unsigned>(ceil_div(chunks, 256)), 256, 0, stream, args);
  TUNA_CUDA_CHECK_LAUNCH();
}

}  // namespace tuna::cuda::attention
