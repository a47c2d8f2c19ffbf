// The GPU side of --fp8 tensorwise (model/fp8.h): a projection group's FP8 GEMMs on the device, through
// kernels/fp8.cuh's casts and kernels/matmul.cuh's FP8 products. The CUDA twin of Fp8GroupCpu, with the GPU model's
// fused weight blocks (q|k|v and gate|up are one GEMM each, so one weight [rows, in]). Only in CUDA builds.
//
// What the model hands it: device buffers of its planned arena (no allocation here), and each activation's amax
// already folded by the kernel that wrote it (rmsnorm_*_amax, swiglu_*_amax, or fp8_amax) and reduced over tp where
// model/fp8.h says so. The weights' casts are the model's to schedule: once per step, or once per run for a frozen
// base, or at every gather under ZeRO-3.
#pragma once

#include <cstdint>

namespace tuna {
// Floats between two scales an FP8 GEMM reads (16 bytes); in every build, for the memory plan.
inline constexpr int64_t kFp8ScaleStride = 4;
// A decoder layer's FP8 GEMM groups, in forward order: the fused q|k|v, o_proj, the fused gate|up, down_proj. The
// model keeps one weight cast, one input amax and one output-gradient amax per group, indexed so.
enum class Fp8Group { Qkv, O, GateUp, Down };
inline constexpr int kFp8Groups = 4;
// Whether group g's input (output_gradient false) or output gradient covers a tensor split over tp, so that its amax
// is the maximum over the tp group (model/fp8.h): the row-parallel groups' (o, down) inputs and the column-parallel
// groups' (q|k|v, gate|up) output gradients are split by columns; with sequence parallelism the others too, by rows
// (the normed inputs and the residual gradient, each rank's rows before their gather).
inline bool fp8_operand_split(Fp8Group g, bool output_gradient, bool sp) {
  const bool row_parallel = g == Fp8Group::O || g == Fp8Group::Down;
  return row_parallel != output_gradient || sp;
}
}  // namespace tuna

#if TUNA_CUDA

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>


#include "kernels/cpu/grad_write.h"

namespace tuna {

class Comm;
namespace cuda {
class MatmulContext;
}

// A group's weight [rows, in], cast: the e4m3 codes in both layouts the GEMMs read, and the scale's inverse.
struct Fp8GpuWeight {
  uint8_t* codes = nullptr;    // [rows, in]: the forward's operand
  uint8_t* codes_t = nullptr;  // [in, rows]: the input gradient's
  float* amax = nullptr;       // device fp32
  float* inv_scale = nullptr;  // device fp32, 16-byte aligned (kernels/matmul.cuh: cuBLASLt needs it)
  int64_t rows = 0, in = 0;
  // --fp8_weight_codes forward: codes_t is one group's buffer, shared, written by fp8_cast_weight_transposed before
  // each backward use; fp8_cast_weight writes the forward's codes only.
  bool codes_t_at_use = false;
};
// Casts `w` (bf16 [rows, in], device) into `c`: its amax, the maximum over `tp` (a weight is split there whenever
// tp > 1; null or size 1: none), then both layouts (the forward's alone when codes_t_at_use).
void fp8_cast_weight(Fp8GpuWeight& c, const __nv_bfloat16* w, Comm* tp, cudaStream_t stream);
// With codes_t_at_use: w's transposed codes into c.codes_t, with the amax fp8_cast_weight took (the same codes a cast
// of both layouts writes). Without, nothing (they are kept).
void fp8_cast_weight_transposed(const Fp8GpuWeight& c, const __nv_bfloat16* w, cudaStream_t stream);

// One pass's operand codes, reused group after group: scratch of the model's arena.
struct Fp8GpuScratch {
  uint8_t* x = nullptr;     // [n, in] in the forward; x^T [in, n] in the backward
  uint8_t* dy = nullptr;    // [n, rows]
  uint8_t* dy_t = nullptr;  // [rows, n]
  float* inv = nullptr;     // device fp32 [2 * kFp8ScaleStride], 16-byte aligned: x's inverse scale at 0, dy's at
                            // kFp8ScaleStride (each scale 16-byte aligned, as cuBLASLt's FP8 GEMMs need)
};

// The forward's input codes: x [n, in] (bf16) cast with the scale of *amax_x into s.x.
void fp8_cast_input(Fp8GpuScratch& s, const __nv_bfloat16* x, int64_t n, int64_t in, const float* amax_x,
                    cudaStream_t stream);
// out[rows_n, w.rows] = x[row0 .., :] @ W^T through FP8 from the codes fp8_cast_input left in s (rows row0 ..
// row0 + rows_n of them): OVERWRITES out, or with a residual, out = residual + the product (one rounding; out may
// equal residual).
void fp8_linear_fwd(cuda::MatmulContext& ctx, __nv_bfloat16* out, const __nv_bfloat16* residual, const Fp8GpuWeight& w,
                    const Fp8GpuScratch& s, int64_t row0, int64_t rows_n, cudaStream_t stream);
// The backward of out = x @ W^T over n rows: dy [n, w.rows] (bf16) cast to e5m2 with *amax_dy (both layouts), x
// cast again with *amax_x (the forward's amax: the same codes, transposed), then
//   dx[n, in] (= or +=, by accumulate_dx) dy @ W   (bf16; skipped when dx is null)
//   dweight[rows, in] (= or +=, by dweight_write) dy^T @ x   (fp32; skipped when dweight is null: a frozen base).
void fp8_linear_bwd(cuda::MatmulContext& ctx, __nv_bfloat16* dx, float* dweight, const __nv_bfloat16* dy,
                    const float* amax_dy, const __nv_bfloat16* x, const float* amax_x, const Fp8GpuWeight& w, int64_t n,
                    bool accumulate_dx, GradWrite dweight_write, Fp8GpuScratch& s, cudaStream_t stream);

}  // namespace tuna

#endif  // TUNA_CUDA
