// Linear layers through cuBLASLt, the twin of kernels/cpu/matmul.cpp.
//
//   forward:  out[n, oc] = inp[n, ic] @ W[oc, ic]^T (matmul_residual_fwd: + residual)   bf16, OVERWRITTEN
//   backward: dinp[n, ic] (=|+=) dout[n, oc] @ W                           bf16
//             dW[oc, ic] (=|+=) dout^T @ inp                                fp32, by dweight_write
//
// cuBLASLt is column-major; a row-major [r, c] matrix is the column-major [c, r] matrix, so each product is
// written transposed:  out^T = W op inp^T  ->  D[oc, n] = op_T(W as [ic, oc]) x inp as [ic, n];
// dinp^T = W^T dout^T  ->  D[ic, n] = (W as [ic, oc]) x (dout as [oc, n]);
// dW^T = inp^T dout    ->  D[ic, oc] = (inp as [ic, n]) x op_T(dout as [oc, n]).
// Compute type fp32 (CUBLAS_COMPUTE_32F) for every product: bf16 inputs, fp32 accumulation; the fp32 weight
// gradient is accumulated with beta = 1 into an fp32 C = D, or overwritten with beta = 0 (the first write of a
// step, kernels/cpu/grad_write.h), where cuBLASLt does not read C, so a stale or NaN gradient cannot leak in.
//
// FP8 (matmul_fp8_*): the same three products with FP8 codes, each operand K-major (cuBLASLt's FP8 kernels on
// Hopper take op(A) = A^T and op(B) = B only), so the backward takes the transposed casts:
//   out^T[oc, n]  = (W codes [ic, oc])^T x (x codes [ic, n])              e4m3 x e4m3, bf16 out, fast accumulation
//   dinp^T[ic, n] = (W^T codes [oc, ic])^T x (dout codes [oc, n])         e4m3 x e5m2, bf16 out
//   dW^T[ic, oc]  = (x^T codes [n, ic])^T x (dout^T codes [n, oc])        e4m3 x e5m2, fp32 out
// (shapes column-major), each scaled by its operands' inverse scales through A/B_SCALE_POINTER:
// D = scale_A scale_B acc + beta C.
#include "kernels/matmul.cuh"

#include <initializer_list>
#include <utility>

#include "core/cuda_check.h"
#include "core/error.h"

namespace tuna::cuda {

MatmulContext::MatmulContext(size_t workspace_bytes) : workspace_bytes_(workspace_bytes) {
  TUNA_CUBLAS_CHECK(cublasLtCreate(&handle_));
  if (workspace_bytes_ > 0) TUNA_CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
}

MatmulContext::MatmulContext(void* workspace, size_t workspace_bytes)
    : workspace_(workspace), workspace_bytes_(workspace_bytes), owns_workspace_(false) {
  TUNA_CUBLAS_CHECK(cublasLtCreate(&handle_));
}

MatmulContext::~MatmulContext() {
  destroy_shapes();
  if (workspace_ != nullptr && owns_workspace_) cudaFree(workspace_);
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

void MatmulContext::destroy_shapes() {
  for (auto& [key, shape] : shapes_) {
    cublasLtMatmulDescDestroy(shape.op);
    for (cublasLtMatrixLayout_t layout : {shape.a, shape.b, shape.c, shape.d}) cublasLtMatrixLayoutDestroy(layout);
  }
  shapes_.clear();
}

namespace {

// RAII for a shape's descriptors while they are made (an error on the way frees them); kept once complete.
struct LtDescriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  ~LtDescriptors() {
    if (op) cublasLtMatmulDescDestroy(op);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (d) cublasLtMatrixLayoutDestroy(d);
  }
};

// Largest power of two (up to 256) dividing the address.
uint32_t pointer_alignment(const void* p) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(p);
  uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

}  // namespace

void MatmulContext::gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const void* a, int64_t lda,
                         const void* b, int64_t ldb, float beta, const void* c, void* d, int64_t ldd,
                         cudaDataType_t d_type, cudaStream_t stream) {
  gemm_any(nullptr, trans_a, trans_b, m, n, k, a, lda, b, ldb, beta, c, d, ldd, d_type, stream);
}

void MatmulContext::gemm_fp8(const Fp8Gemm& fp8, int64_t m, int64_t n, int64_t k, const void* a, const void* b,
                             float beta, const void* c, void* d, int64_t ldd, cudaDataType_t d_type,
                             cudaStream_t stream) {
  TUNA_CHECK(!(fp8.a_type == CUDA_R_8F_E5M2 && fp8.b_type == CUDA_R_8F_E5M2),
             "an FP8 GEMM of two e5m2 operands (cuBLASLt has no such kernel)");
  gemm_any(&fp8, /*trans_a=*/true, /*trans_b=*/false, m, n, k, a, /*lda=*/k, b, /*ldb=*/k, beta, c, d, ldd, d_type,
           stream);
}

void MatmulContext::gemm_any(const Fp8Gemm* fp8, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                             const void* a, int64_t lda, const void* b, int64_t ldb, float beta, const void* c, void* d,
                             int64_t ldd, cudaDataType_t d_type, cudaStream_t stream) {
  // The heuristic assumes 256-byte aligned pointers unless told otherwise, and may pick a kernel that needs
  // them; views into flat buffers (a tensor at an odd offset, a chunk of logits) are often less aligned.
  const uint32_t align_a = pointer_alignment(a), align_b = pointer_alignment(b), align_c = pointer_alignment(c),
                 align_d = pointer_alignment(d);
  const uint64_t operand_types = fp8 == nullptr ? 0
                                                : uint64_t(fp8->a_type) | (uint64_t(fp8->b_type) << 8) |
                                                      (uint64_t(fp8->fast_accum) << 16) | (uint64_t{1} << 17);
  const Key key{trans_a, trans_b, m, n, k, lda, ldb, ldd, static_cast<int>(d_type), beta != 0.0f,
                align_a | (align_b << 9) | (uint64_t(align_c) << 18) | (uint64_t(align_d) << 27), operand_types};
  const float alpha = 1.0f;
  // The operand scales are per call (each layer's own), set on the shape's cached descriptor before each use.
  const auto set_scales = [&](cublasLtMatmulDesc_t op) {
    if (fp8 == nullptr) return;
    TUNA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &fp8->scale_a,
                                                     sizeof(fp8->scale_a)));
    TUNA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &fp8->scale_b,
                                                     sizeof(fp8->scale_b)));
  };
  auto found = shapes_.find(key);
  if (found == shapes_.end()) {
    LtDescriptors desc;
    TUNA_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    TUNA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
    TUNA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
    if (fp8 != nullptr) {
      const int8_t fast_accum = fp8->fast_accum ? 1 : 0;
      TUNA_CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast_accum, sizeof(fast_accum)));
      set_scales(desc.op);
    }
    const cudaDataType_t a_type = fp8 ? fp8->a_type : CUDA_R_16BF, b_type = fp8 ? fp8->b_type : CUDA_R_16BF;
    // Stored shapes: A is [m, k] (or [k, m] when transposed), B is [k, n] (or [n, k]), column-major.
    TUNA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&desc.a, a_type, trans_a ? k : m, trans_a ? m : k, lda));
    TUNA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&desc.b, b_type, trans_b ? n : k, trans_b ? k : n, ldb));
    TUNA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&desc.c, d_type, m, n, ldd));
    TUNA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&desc.d, d_type, m, n, ldd));

    cublasLtMatmulPreference_t pref = nullptr;
    TUNA_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    TUNA_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                           &workspace_bytes_, sizeof(workspace_bytes_)));
    const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> alignments[] = {
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d}};
    for (const auto& [attribute, bytes] : alignments)
      TUNA_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attribute, &bytes, sizeof(bytes)));
    cublasLtMatmulHeuristicResult_t results[kMaxTimedCandidates] = {};
    int n_results = 0;
    const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle_, desc.op, desc.a, desc.b, desc.c, desc.d,
                                                                 pref, timed_candidates_, results, &n_results);
    cublasLtMatmulPreferenceDestroy(pref);
    TUNA_CUBLAS_CHECK(status);
    if (n_results == 0)
      fail("cuBLASLt has no algorithm for m ", m, " n ", n, " k ", k, " (trans ", trans_a, trans_b, ")");
    // Timed candidates: each runs once to warm up, then kTimedRuns times between two events; the smallest total
    // wins (ties: the heuristic's earlier answer). One that fails to launch is skipped.
    int best = 0;
    if (n_results > 1) {
      constexpr int kTimedRuns = 3;
      cudaEvent_t start = nullptr, stop = nullptr;
      TUNA_CUDA_CHECK(cudaEventCreate(&start));
      TUNA_CUDA_CHECK(cudaEventCreate(&stop));
      float best_ms = -1;
      for (int i = 0; i < n_results; i++) {
        set_scales(desc.op);
        const auto run = [&] {
          return cublasLtMatmul(handle_, desc.op, &alpha, a, desc.a, b, desc.b, &beta, c, desc.c, d, desc.d,
                                &results[i].algo, workspace_, workspace_bytes_, stream);
        };
        if (run() != CUBLAS_STATUS_SUCCESS) continue;
        TUNA_CUDA_CHECK(cudaEventRecord(start, stream));
        for (int r = 0; r < kTimedRuns; r++) TUNA_CUBLAS_CHECK(run());
        TUNA_CUDA_CHECK(cudaEventRecord(stop, stream));
        TUNA_CUDA_CHECK(cudaEventSynchronize(stop));
        float ms = 0;
        TUNA_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
        if (best_ms < 0 || ms < best_ms) best = i, best_ms = ms;
      }
      cudaEventDestroy(start);
      cudaEventDestroy(stop);
    }
    Shape shape{desc.op, desc.a, desc.b, desc.c, desc.d, results[best].algo};
    desc.op = nullptr, desc.a = desc.b = desc.c = desc.d = nullptr;  // the cache owns them now
    found = shapes_.emplace(key, shape).first;
  }
  const Shape& shape = found->second;
  set_scales(shape.op);
  TUNA_CUBLAS_CHECK(cublasLtMatmul(handle_, shape.op, &alpha, a, shape.a, b, shape.b, &beta, c, shape.c, d, shape.d,
                                   &shape.algo, workspace_, workspace_bytes_, stream));
}

void MatmulContext::set_timed_candidates(int candidates) {
  TUNA_CHECK(candidates >= 1 && candidates <= kMaxTimedCandidates, "timed candidates ", candidates, ", expected 1 to ",
             kMaxTimedCandidates);
  timed_candidates_ = candidates;
  destroy_shapes();
}

void matmul_fwd(MatmulContext& ctx, __nv_bfloat16* out, const __nv_bfloat16* inp, const __nv_bfloat16* weight,
                int64_t n, int64_t ic, int64_t oc, cudaStream_t stream) {
  TUNA_CHECK(n >= 0 && ic > 0 && oc > 0, "n ", n, ", ic ", ic, ", oc ", oc);
  if (n == 0) return;
  ctx.gemm(/*trans_a=*/true, /*trans_b=*/false, oc, n, ic, weight, ic, inp, ic, /*beta=*/0.0f, /*c=*/out, out, oc,
           CUDA_R_16BF, stream);
}

void matmul_residual_fwd(MatmulContext& ctx, __nv_bfloat16* out, const __nv_bfloat16* inp,
                         const __nv_bfloat16* weight, const __nv_bfloat16* residual, int64_t n, int64_t ic, int64_t oc,
                         cudaStream_t stream) {
  TUNA_CHECK(n >= 0 && ic > 0 && oc > 0, "n ", n, ", ic ", ic, ", oc ", oc);
  TUNA_CHECK(residual != nullptr, "matmul_residual_fwd: no residual (matmul_fwd is the product alone)");
  if (n == 0) return;
  ctx.gemm(/*trans_a=*/true, /*trans_b=*/false, oc, n, ic, weight, ic, inp, ic, /*beta=*/1.0f, /*c=*/residual, out,
           oc, CUDA_R_16BF, stream);
}

void matmul_add_fwd(MatmulContext& ctx, __nv_bfloat16* out, int64_t ld_out, const __nv_bfloat16* inp,
                    const __nv_bfloat16* weight, int64_t n, int64_t ic, int64_t oc, cudaStream_t stream) {
  TUNA_CHECK(n >= 0 && ic > 0 && oc > 0 && ld_out >= oc, "n ", n, ", ic ", ic, ", oc ", oc, ", ld_out ", ld_out);
  if (n == 0) return;
  ctx.gemm(/*trans_a=*/true, /*trans_b=*/false, oc, n, ic, weight, ic, inp, ic, /*beta=*/1.0f, /*c=*/out, out, ld_out,
           CUDA_R_16BF, stream);
}

void matmul_bwd(MatmulContext& ctx, __nv_bfloat16* dinp, float* dweight, const __nv_bfloat16* dout,
                const __nv_bfloat16* inp, const __nv_bfloat16* weight, int64_t n, int64_t ic, int64_t oc,
                bool accumulate_dinp, GradWrite dweight_write, cudaStream_t stream) {
  matmul_bwd_strided(ctx, dinp, dweight, dout, oc, inp, weight, n, ic, oc, accumulate_dinp, dweight_write, stream);
}

void matmul_bwd_strided(MatmulContext& ctx, __nv_bfloat16* dinp, float* dweight, const __nv_bfloat16* dout,
                        int64_t ld_dout, const __nv_bfloat16* inp, const __nv_bfloat16* weight, int64_t n, int64_t ic,
                        int64_t oc, bool accumulate_dinp, GradWrite dweight_write, cudaStream_t stream) {
  TUNA_CHECK(n >= 0 && ic > 0 && oc > 0 && ld_dout >= oc, "n ", n, ", ic ", ic, ", oc ", oc, ", ld_dout ", ld_dout);
  const bool overwrite_dweight = dweight_write == GradWrite::Overwrite;
  if (n == 0) {  // a sum over no rows: an overwritten gradient is zero
    if (dweight != nullptr && overwrite_dweight)
      TUNA_CUDA_CHECK(cudaMemsetAsync(dweight, 0, static_cast<size_t>(oc * ic) * sizeof(float), stream));
    return;
  }
  if (dinp != nullptr)
    ctx.gemm(/*trans_a=*/false, /*trans_b=*/false, ic, n, oc, weight, ic, dout, ld_dout, accumulate_dinp ? 1.0f : 0.0f,
             dinp, dinp, ic, CUDA_R_16BF, stream);
  if (dweight != nullptr)
    ctx.gemm(/*trans_a=*/false, /*trans_b=*/true, ic, oc, n, inp, ic, dout, ld_dout, overwrite_dweight ? 0.0f : 1.0f,
             dweight, dweight, ic, CUDA_R_32F, stream);
}

}  // namespace tuna::cuda

namespace tuna::cuda {
namespace {

void check_scales(const char* op, std::initializer_list<std::pair<const char*, Fp8Operand>> operands) {
  for (const auto& [name, operand] : operands)
    TUNA_CHECK(operand.codes != nullptr && operand.inv_scale != nullptr, op, ": ", name, " has no codes or no scale");
}

void fp8_product_fwd(MatmulContext& ctx, __nv_bfloat16* out, Fp8Operand inp, Fp8Operand weight, const __nv_bfloat16* residual, int64_t n,
                     int64_t ic, int64_t oc, cudaStream_t stream) {
  // out^T[oc, n] = W (codes [oc, ic] row-major: K-major [ic, oc]) op_T x (codes [n, ic]: K-major [ic, n]).
  const MatmulContext::Fp8Gemm fp8{CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, weight.inv_scale, inp.inv_scale,
                                   /*fast_accum=*/true};
  ctx.gemm_fp8(fp8, oc, n, ic, weight.codes, inp.codes, residual ? 1.0f : 0.0f, residual ? residual : out, out, oc,
               CUDA_R_16BF, stream);
}

}  // namespace

void matmul_fp8_fwd(MatmulContext& ctx, __nv_bfloat16* out, Fp8Operand inp, Fp8Operand weight, int64_t n, int64_t ic,
                    int64_t oc, cudaStream_t stream) {
  check_fp8_shape("matmul_fp8_fwd", n, ic, oc,
                  {{"out", out}, {"inp", inp.codes}, {"weight", weight.codes}, {"inp's scale", inp.inv_scale},
                   {"weight's scale", weight.inv_scale}});
  check_scales("matmul_fp8_fwd", {{"inp", inp}, {"weight", weight}});
  if (n == 0) return;
  fp8_product_fwd(ctx, out, inp, weight, nullptr, n, ic, oc, stream);
}

void matmul_fp8_residual_fwd(MatmulContext& ctx, __nv_bfloat16* out, Fp8Operand inp, Fp8Operand weight, const __nv_bfloat16* residual,
                             int64_t n, int64_t ic, int64_t oc, cudaStream_t stream) {
  TUNA_CHECK(residual != nullptr, "matmul_fp8_residual_fwd: no residual (matmul_fp8_fwd is the product alone)");
  check_fp8_shape("matmul_fp8_residual_fwd", n, ic, oc,
                  {{"out", out}, {"inp", inp.codes}, {"weight", weight.codes}, {"residual", residual},
                   {"inp's scale", inp.inv_scale}, {"weight's scale", weight.inv_scale}});
  check_scales("matmul_fp8_residual_fwd", {{"inp", inp}, {"weight", weight}});
  if (n == 0) return;
  fp8_product_fwd(ctx, out, inp, weight, residual, n, ic, oc, stream);
}

void matmul_fp8_bwd(MatmulContext& ctx, __nv_bfloat16* dinp, float* dweight, Fp8Operand dout, Fp8Operand dout_t,
                    Fp8Operand inp_t, Fp8Operand weight_t, int64_t n, int64_t ic, int64_t oc, bool accumulate_dinp,
                    GradWrite dweight_write, cudaStream_t stream) {
  check_fp8_shape("matmul_fp8_bwd", n, ic, oc,
                  {{"dinp", dinp}, {"dweight", dweight}, {"dout", dinp ? dout.codes : nullptr},
                   {"dout_t", dweight ? dout_t.codes : nullptr}, {"inp_t", dweight ? inp_t.codes : nullptr},
                   {"weight_t", dinp ? weight_t.codes : nullptr}, {"dout's scale", dinp ? dout.inv_scale : nullptr},
                   {"dout_t's scale", dweight ? dout_t.inv_scale : nullptr},
                   {"inp_t's scale", dweight ? inp_t.inv_scale : nullptr},
                   {"weight_t's scale", dinp ? weight_t.inv_scale : nullptr}});
  const bool overwrite_dweight = dweight_write == GradWrite::Overwrite;
  if (n == 0) {  // a sum over no rows: an overwritten gradient is zero
    if (dweight != nullptr && overwrite_dweight)
      TUNA_CUDA_CHECK(cudaMemsetAsync(dweight, 0, static_cast<size_t>(oc * ic) * sizeof(float), stream));
    return;
  }
  if (dinp != nullptr) {
    check_scales("matmul_fp8_bwd", {{"dout", dout}, {"weight_t", weight_t}});
    // dinp^T[ic, n] = W^T (codes [ic, oc]: K-major [oc, ic]) op_T dout (codes [n, oc]: K-major [oc, n]).
    const MatmulContext::Fp8Gemm fp8{CUDA_R_8F_E4M3, CUDA_R_8F_E5M2, weight_t.inv_scale, dout.inv_scale,
                                     /*fast_accum=*/false};
    ctx.gemm_fp8(fp8, ic, n, oc, weight_t.codes, dout.codes, accumulate_dinp ? 1.0f : 0.0f, dinp, dinp, ic,
                 CUDA_R_16BF, stream);
  }
  if (dweight != nullptr) {
    check_scales("matmul_fp8_bwd", {{"dout_t", dout_t}, {"inp_t", inp_t}});
    // dW^T[ic, oc] (dW row-major [oc, ic]) = x^T (codes [ic, n]: K-major [n, ic]) op_T dout^T (codes [oc, n]).
    const MatmulContext::Fp8Gemm fp8{CUDA_R_8F_E4M3, CUDA_R_8F_E5M2, inp_t.inv_scale, dout_t.inv_scale,
                                     /*fast_accum=*/false};
    ctx.gemm_fp8(fp8, ic, oc, n, inp_t.codes, dout_t.codes, overwrite_dweight ? 0.0f : 1.0f, dweight, dweight, ic,
                 CUDA_R_32F, stream);
  }
}

}  // namespace tuna::cuda
