// A projection group's FP8 GEMMs on the device (contract: model/fp8_gpu.h), the order of its kernels:
//   weights (once per step):  amax -> [tp max] -> cast_transpose (codes, codes_t), or cast (codes) and, with
//                             --fp8_weight_codes forward, cast_transpose (codes_t) again before each backward
//   forward:                  cast x (amax folded by x's producer) -> FP8 GEMM (+ residual)
//   backward:                 cast_transpose dy (e5m2) -> cast x^T (the forward's amax) -> FP8 dX and dW GEMMs
#if TUNA_CUDA

#include "model/fp8_gpu.h"

#include "comm/comm.h"
#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/fp8.cuh"
#include "kernels/matmul.cuh"

namespace tuna {

using cpu::Fp8Format;

void fp8_cast_weight(Fp8GpuWeight& c, const __nv_bfloat16* w, Comm* tp, cudaStream_t stream) {
  TUNA_CHECK(c.codes && c.codes_t && c.amax && c.inv_scale && c.rows > 0 && c.in > 0, "fp8_cast_weight of ", c.rows,
             " x ", c.in, " without its buffers");
  TUNA_CUDA_CHECK(cudaMemsetAsync(c.amax, 0, sizeof(float), stream));
  cuda::fp8_amax(c.amax, w, c.rows, c.in, c.in, stream);
  if (tp != nullptr && tp->size() > 1) tp->all_reduce(c.amax, 1, CommType::F32, ReduceOp::Max, "fp8 weight amax");
  if (c.codes_t_at_use) return cuda::fp8_cast(c.codes, c.inv_scale, w, c.rows, c.in, c.in, c.amax, Fp8Format::E4M3, stream);
  cuda::fp8_cast_transpose(c.codes, c.codes_t, c.inv_scale, w, c.rows, c.in, c.in, c.amax, Fp8Format::E4M3, stream);
}

void fp8_cast_weight_transposed(const Fp8GpuWeight& c, const __nv_bfloat16* w, cudaStream_t stream) {
  if (!c.codes_t_at_use) return;
  cuda::fp8_cast_transpose(nullptr, c.codes_t, c.inv_scale, w, c.rows, c.in, c.in, c.amax, Fp8Format::E4M3, stream);
}

void fp8_cast_input(Fp8GpuScratch& s, const __nv_bfloat16* x, int64_t n, int64_t in, const float* amax_x,
                    cudaStream_t stream) {
  cuda::fp8_cast(s.x, s.inv, x, n, in, in, amax_x, Fp8Format::E4M3, stream);
}

void fp8_linear_fwd(cuda::MatmulContext& ctx, __nv_bfloat16* out, const __nv_bfloat16* residual, const Fp8GpuWeight& w,
                    const Fp8GpuScratch& s, int64_t row0, int64_t rows_n, cudaStream_t stream) {
  const cuda::Fp8Operand x{s.x + row0 * w.in, s.inv}, weight{w.codes, w.inv_scale};
  if (residual != nullptr) cuda::matmul_fp8_residual_fwd(ctx, out, x, weight, residual, rows_n, w.in, w.rows, stream);
  else cuda::matmul_fp8_fwd(ctx, out, x, weight, rows_n, w.in, w.rows, stream);
}

void fp8_linear_bwd(cuda::MatmulContext& ctx, __nv_bfloat16* dx, float* dweight, const __nv_bfloat16* dy,
                    const float* amax_dy, const __nv_bfloat16* x, const float* amax_x, const Fp8GpuWeight& w, int64_t n,
                    bool accumulate_dx, GradWrite dweight_write, Fp8GpuScratch& s, cudaStream_t stream) {
  cuda::fp8_cast_transpose(s.dy, s.dy_t, s.inv + kFp8ScaleStride, dy, n, w.rows, w.rows, amax_dy, Fp8Format::E5M2, stream);
  if (dweight != nullptr)
    cuda::fp8_cast_transpose(nullptr, s.x, s.inv, x, n, w.in, w.in, amax_x, Fp8Format::E4M3, stream);
  const cuda::Fp8Operand g{s.dy, s.inv + kFp8ScaleStride}, g_t{s.dy_t, s.inv + kFp8ScaleStride}, x_t{s.x, s.inv}, w_t{w.codes_t, w.inv_scale};
  cuda::matmul_fp8_bwd(ctx, dx, dweight, g, g_t, x_t, w_t, n, w.in, w.rows, accumulate_dx, dweight_write, stream);
}

}  // namespace tuna

#endif  // TUNA_CUDA
