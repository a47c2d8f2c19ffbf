// Linear layers on the GPU through cuBLASLt: bf16 operands, fp32 accumulation, weights in nn.Linear's
// [out_features, in_features] layout. Contract of kernels/cpu/matmul.h, plus a residual epilogue.
#pragma once
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <initializer_list>
#include <utility>
#include <map>
#include <tuple>

#include "core/error.h"  // fail, TUNA_CHECK: check_fp8_shape
#include "kernels/cpu/grad_write.h"

namespace tuna::cuda {

// One per device and stream user: the cuBLASLt handle, its workspace (device memory planned once), and for
// each shape its descriptors and chosen algorithm, made at the shape's first call (the heuristic query costs
// tens of microseconds and the five descriptors a few more; a step or a decoded token calls the same few shapes
// hundreds of times, so a call costs only cublasLtMatmul's own host time). Not thread-safe.
class MatmulContext {
 public:
  explicit MatmulContext(size_t workspace_bytes = size_t(32) << 20);
  // With a workspace the caller owns (a buffer of the engine's planned arena); it must outlive the context.
  MatmulContext(void* workspace, size_t workspace_bytes);
  ~MatmulContext();
  MatmulContext(const MatmulContext&) = delete;
  MatmulContext& operator=(const MatmulContext&) = delete;

  // D[m, n] (column-major) = alpha op(A) op(B) + beta C, the one cuBLASLt call every matmul below makes.
  // a_type/b_type are bf16; c_type/d_type bf16 or fp32; C may differ from D (then with its own type = D's).
  void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const void* a, int64_t lda,
            const void* b, int64_t ldb, float beta, const void* c, void* d, int64_t ldd, cudaDataType_t d_type,
            cudaStream_t stream);

  // The FP8 form: D[m, n] = scale_a scale_b op_T(A) B + beta C, A and B FP8 codes ([k, m] and [k, n] column-major:
  // K-major, the "TN" layout cuBLASLt's FP8 kernels require), scale_a/scale_b fp32 in device memory (cuBLASLt's
  // A/B_SCALE_POINTER), fast_accum: CUBLASLT_MATMUL_DESC_FAST_ACCUM.
  struct Fp8Gemm {
    cudaDataType_t a_type, b_type;  // CUDA_R_8F_E4M3 or CUDA_R_8F_E5M2, not both E5M2
    const float* scale_a;
    const float* scale_b;
    bool fast_accum;
  };
  void gemm_fp8(const Fp8Gemm& fp8, int64_t m, int64_t n, int64_t k, const void* a, const void* b, float beta,
                const void* c, void* d, int64_t ldd, cudaDataType_t d_type, cudaStream_t stream);

  // How each shape's algorithm is chosen at its first call. 1 (the default, and what the trainer uses): the
  // heuristic's first answer, the same in every process, so a resumed run computes the same bits. N > 1: the
  // fastest of the heuristic's first N answers, timed there and then by running the product a few times on the
  // call's own buffers; for benches only (an accumulating product's output is clobbered, and the choice may
  // differ between runs). bench_gemm_gpu reports both, to measure what timing would gain.
  static constexpr int kMaxTimedCandidates = 16;
  void set_timed_candidates(int candidates);

 private:
  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  int timed_candidates_ = 1;
  bool owns_workspace_ = true;
  // key: trans_a, trans_b, m, n, k, lda, ldb, ldd, d_type, beta != 0, pointer alignments (packed), operand types
  // and fast accumulation (packed: 0 for bf16 products)
  using Key =
      std::tuple<bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, bool, uint64_t, uint64_t>;
  struct Shape {  // made at a shape's first call, destroyed with the context
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  std::map<Key, Shape> shapes_;
  void destroy_shapes();
  // gemm and gemm_fp8: fp8 null for bf16 operands.
  void gemm_any(const Fp8Gemm* fp8, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const void* a,
                int64_t lda, const void* b, int64_t ldb, float beta, const void* c, void* d, int64_t ldd,
                cudaDataType_t d_type, cudaStream_t stream);
};

// out[n, oc] = inp[n, ic] @ weight[oc, ic]^T. OVERWRITES out.
void matmul_fwd(MatmulContext& ctx, __nv_bfloat16* out, const __nv_bfloat16* inp, const __nv_bfloat16* weight,
                int64_t n, int64_t ic, int64_t oc, cudaStream_t stream);

// out[n, oc] = inp[n, ic] @ weight[oc, ic]^T + residual[n, oc]: the residual add of a LLaMA block in the GEMM's
// epilogue, which saves a pass over the residual stream. OVERWRITES out; out may equal residual.
void matmul_residual_fwd(MatmulContext& ctx, __nv_bfloat16* out, const __nv_bfloat16* inp,
                         const __nv_bfloat16* weight, const __nv_bfloat16* residual, int64_t n, int64_t ic, int64_t oc,
                         cudaStream_t stream);

// dinp[n, ic] (= or +=, by accumulate_dinp) dout[n, oc] @ weight[oc, ic]; skipped when dinp is null.
// dweight[oc, ic] (= or +=, by dweight_write) dout^T @ inp in fp32; skipped when dweight is null. Overwrite
// (kernels/cpu/grad_write.h) never reads dweight, and with n == 0 writes zeros.
void matmul_bwd(MatmulContext& ctx, __nv_bfloat16* dinp, float* dweight, const __nv_bfloat16* dout,
                const __nv_bfloat16* inp, const __nv_bfloat16* weight, int64_t n, int64_t ic, int64_t oc,
                bool accumulate_dinp, GradWrite dweight_write, cudaStream_t stream);

// out[n, oc] += inp[n, ic] @ weight[oc, ic]^T with out's rows ld_out apart (ld_out >= oc): a product added into a
// column block of a wider output (an adapter's B product into the fused q|k|v or gate|up rows), in the GEMM's
// epilogue (one rounding of product + out, as matmul_residual_fwd with out as its residual).
void matmul_add_fwd(MatmulContext& ctx, __nv_bfloat16* out, int64_t ld_out, const __nv_bfloat16* inp,
                    const __nv_bfloat16* weight, int64_t n, int64_t ic, int64_t oc, cudaStream_t stream);
// matmul_bwd with dout's rows ld_dout apart (ld_dout >= oc): the gradient of a column block of a wider output.
void matmul_bwd_strided(MatmulContext& ctx, __nv_bfloat16* dinp, float* dweight, const __nv_bfloat16* dout,
                        int64_t ld_dout, const __nv_bfloat16* inp, const __nv_bfloat16* weight, int64_t n, int64_t ic,
                        int64_t oc, bool accumulate_dinp, GradWrite dweight_write, cudaStream_t stream);

// ---- FP8 (--fp8 tensorwise; sm_89 and later): the projections' three GEMMs with FP8 operands, each an operand's
// codes and the inverse of its per-tensor scale in device memory (kernels/fp8.cuh writes both), fp32 accumulation.
// Contract of kernels/cpu/fp8.h's fp8_gemm: out = (inv_scale_a * inv_scale_b) * sum of exact products (+ C). Every
// operand is K-major, so the backward reads the transposed casts of dout, the input and the weight. cuBLASLt's FP8
// kernels need 16-byte aligned codes and scales, and n, ic, oc multiples of 16: the launchers refuse anything else.
// (A scale 4 or 8 bytes past a 16-byte boundary: cuBLASLt 13.1's heuristic offers algorithms that cublasLtMatmul
// then refuses with CUBLAS_STATUS_NOT_SUPPORTED, on an H200, 2026-12-04.)
struct Fp8Operand {
  const uint8_t* codes = nullptr;
  const float* inv_scale = nullptr;  // device, fp32, 16-byte aligned
};

// The shape and alignment cuBLASLt's FP8 kernels need, refused by name: what matmul_fp8_* (and the emulator's host
// double of them) check before any product.
inline void check_fp8_shape(const char* op, int64_t n, int64_t ic, int64_t oc,
                            std::initializer_list<std::pair<const char*, const void*>> operands) {
  TUNA_CHECK(n >= 0 && ic > 0 && oc > 0, op, ": n ", n, ", ic ", ic, ", oc ", oc);
  if (n % 16 != 0 || ic % 16 != 0 || oc % 16 != 0)
    fail(op, ": n ", n, ", ic ", ic, ", oc ", oc, "; cuBLASLt's FP8 GEMMs need each a multiple of 16");
  for (const auto& [name, p] : operands)
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0)
      fail(op, ": ", name, " at ", p, " is not 16-byte aligned (cuBLASLt's FP8 GEMMs need it)");
}

// out[n, oc] = inp[n, ic] @ weight[oc, ic]^T, both e4m3; bf16, OVERWRITES out. Fast accumulation, as torchao's and
// Transformer Engine's forward (the backward's products accumulate in full fp32).
void matmul_fp8_fwd(MatmulContext& ctx, __nv_bfloat16* out, Fp8Operand inp, Fp8Operand weight, int64_t n, int64_t ic,
                    int64_t oc, cudaStream_t stream);
// The same + residual[n, oc] in the epilogue (one rounding); out may equal residual.
void matmul_fp8_residual_fwd(MatmulContext& ctx, __nv_bfloat16* out, Fp8Operand inp, Fp8Operand weight,
                             const __nv_bfloat16* residual, int64_t n, int64_t ic, int64_t oc, cudaStream_t stream);

// dinp[n, ic] (= or +=, by accumulate_dinp) dout[n, oc] @ weight_t[ic, oc]^T, dout e5m2, weight_t the weight's
// transposed e4m3 cast; bf16; skipped when dinp is null.
// dweight[oc, ic] (= or +=, by dweight_write) dout_t[oc, n] @ inp_t[ic, n]^T, dout_t e5m2 and inp_t e4m3 (the
// transposed casts); fp32; skipped when dweight is null. Overwrite never reads dweight, and with n == 0 writes zeros.
void matmul_fp8_bwd(MatmulContext& ctx, __nv_bfloat16* dinp, float* dweight, Fp8Operand dout, Fp8Operand dout_t,
                    Fp8Operand inp_t, Fp8Operand weight_t, int64_t n, int64_t ic, int64_t oc, bool accumulate_dinp,
                    GradWrite dweight_write, cudaStream_t stream);

}  // namespace tuna::cuda
