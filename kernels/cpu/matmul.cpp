// Linear layers through BLAS (OpenBLAS cblas), CPU twin of kernels/matmul.cu. Row-major throughout;
// weights in nn.Linear's [out_features, in_features] layout.
//
//   forward:  out[n, oc]     = inp[n, ic] @ weight[oc, ic]^T          OVERWRITTEN
//   backward: dinp[n, ic]    = or += dout[n, oc] @ weight[oc, ic]     by accumulate_dinp; skipped if null
//             dweight[oc, ic] += dout[n, oc]^T @ inp[n, ic]           always ACCUMULATED (micro-batches)
//
// With beta = 0 BLAS does not read C, so an overwritten output may hold anything (even NaN) beforehand.
#include "kernels/cpu/matmul.h"

#include <cblas.h>

#include <climits>

#include "core/blas.h"
#include "core/error.h"

namespace tuna::cpu {
namespace {

// cblas takes int dimensions; a larger tensor would silently wrap.
int blas_dim(int64_t value, const char* name) {
  TUNA_CHECK(value >= 0 && value <= INT_MAX, name, " = ", value, " does not fit a BLAS int");
  return static_cast<int>(value);
}

void gemm(CBLAS_TRANSPOSE trans_a, CBLAS_TRANSPOSE trans_b, int m, int n, int k, const float* a, int lda,
          const float* b, int ldb, float beta, float* c, int ldc) {
  ensure_blas_kernels();  // done at load already; this keeps the object that does it linked (core/blas.h)
  cblas_sgemm(CblasRowMajor, trans_a, trans_b, m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc);
}

void gemm(CBLAS_TRANSPOSE trans_a, CBLAS_TRANSPOSE trans_b, int m, int n, int k, const double* a, int lda,
          const double* b, int ldb, double beta, double* c, int ldc) {
  ensure_blas_kernels();
  cblas_dgemm(CblasRowMajor, trans_a, trans_b, m, n, k, 1.0, a, lda, b, ldb, beta, c, ldc);
}

}  // namespace

template <typename T>
void matmul_fwd(T* out, const T* inp, const T* weight, int64_t n, int64_t ic, int64_t oc) {
  const int rows = blas_dim(n, "n"), in = blas_dim(ic, "ic"), out_features = blas_dim(oc, "oc");
  if (rows == 0 || out_features == 0) return;
  // lda/ldb/ldc may not be 0 even for empty matrices, hence the max(1, .) on the leading dimensions.
  gemm(CblasNoTrans, CblasTrans, rows, out_features, in, inp, in > 0 ? in : 1, weight, in > 0 ? in : 1,
       T(0), out, out_features);
}

template <typename T>
void matmul_bwd(T* dinp, T* dweight, const T* dout, const T* inp, const T* weight, int64_t n, int64_t ic,
                int64_t oc, bool accumulate_dinp) {
  const int rows = blas_dim(n, "n"), in = blas_dim(ic, "ic"), out_features = blas_dim(oc, "oc");
  if (in == 0) return;
  const int ld_out = out_features > 0 ? out_features : 1;
  if (dinp != nullptr && rows > 0)
    gemm(CblasNoTrans, CblasNoTrans, rows, in, out_features, dout, ld_out, weight, in,
         accumulate_dinp ? T(1) : T(0), dinp, in);
  if (out_features > 0 && rows > 0)
    gemm(CblasTrans, CblasNoTrans, out_features, in, rows, dout, out_features, inp, in, T(1), dweight, in);
}

template void matmul_fwd<float>(float*, const float*, const float*, int64_t, int64_t, int64_t);
template void matmul_fwd<double>(double*, const double*, const double*, int64_t, int64_t, int64_t);
template void matmul_bwd<float>(float*, float*, const float*, const float*, const float*, int64_t, int64_t,
                                int64_t, bool);
template void matmul_bwd<double>(double*, double*, const double*, const double*, const double*, int64_t,
                                 int64_t, int64_t, bool);

}  // namespace tuna::cpu
