// Linear layers through BLAS (OpenBLAS cblas), CPU twin of kernels/matmul.cu. Row-major throughout;
// weights in nn.Linear's [out_features, in_features] layout.
//
//   forward:  out[n, oc]     = inp[n, ic] @ weight[oc, ic]^T          OVERWRITTEN
//   backward: dinp[n, ic]    = or += dout[n, oc] @ weight[oc, ic]     by accumulate_dinp; skipped if null
//             dweight[oc, ic] = or += dout[n, oc]^T @ inp[n, ic]      by dweight_write; skipped if null
//
// With beta = 0 BLAS does not read C, so an overwritten output may hold anything (even NaN) beforehand.
#include "kernels/cpu/matmul.h"

#include <cblas.h>

#include <omp.h>

#include <algorithm>
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

void blas_gemm(CBLAS_TRANSPOSE trans_a, CBLAS_TRANSPOSE trans_b, int m, int n, int k, const float* a, int lda,
               const float* b, int ldb, float beta, float* c, int ldc) {
  cblas_sgemm(CblasRowMajor, trans_a, trans_b, m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc);
}

void blas_gemm(CBLAS_TRANSPOSE trans_a, CBLAS_TRANSPOSE trans_b, int m, int n, int k, const double* a, int lda,
               const double* b, int ldb, double beta, double* c, int ldc) {
  cblas_dgemm(CblasRowMajor, trans_a, trans_b, m, n, k, 1.0, a, lda, b, ldb, beta, c, ldc);
}

// Below this many multiply-adds a GEMM runs on one thread as a whole (a parallel region costs more).
constexpr double kMinSplitWork = double(1 << 20);
constexpr int kRowAlign = 16;  // rows per thread in multiples of the kernels' row tile

// C's rows split over tuna's OpenMP threads, each running BLAS on its rows alone (OpenBLAS's OpenMP build runs
// single-threaded inside a parallel region). OpenBLAS's own threading synchronizes its threads by yielding
// inside every GEMM: at a small model's sizes (1024 x 128 x 128, the demo step) the second core spent most of
// its time in sched_yield and the 2-thread step gained 1.19x over one thread. An element of C is the same sum
// over k in the same order however the rows are split, so results stay independent of the thread count.
template <typename T>
void gemm(CBLAS_TRANSPOSE trans_a, CBLAS_TRANSPOSE trans_b, int m, int n, int k, const T* a, int lda, const T* b,
          int ldb, T beta, T* c, int ldc) {
  ensure_blas_kernels();  // done at load already; this keeps the object that does it linked (core/blas.h)
  const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  if (threads == 1 || m < 2 * kRowAlign || double(m) * n * k < kMinSplitWork) {
    blas_gemm(trans_a, trans_b, m, n, k, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  const int blocks = (m + kRowAlign - 1) / kRowAlign;
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int row0 = std::min(m, blocks * t / nt * kRowAlign), row1 = std::min(m, blocks * (t + 1) / nt * kRowAlign);
    if (row1 > row0) {
      // op(A)'s row r: row r of A, or column r of A stored transposed.
      const T* a_rows = trans_a == CblasNoTrans ? a + static_cast<int64_t>(row0) * lda : a + row0;
      blas_gemm(trans_a, trans_b, row1 - row0, n, k, a_rows, lda, b, ldb, beta, c + static_cast<int64_t>(row0) * ldc,
                ldc);
    }
  }
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
                int64_t oc, bool accumulate_dinp, GradWrite dweight_write) {
  const int rows = blas_dim(n, "n"), in = blas_dim(ic, "ic"), out_features = blas_dim(oc, "oc");
  if (in == 0) return;
  const int ld_out = out_features > 0 ? out_features : 1;
  if (dinp != nullptr && rows > 0)
    gemm(CblasNoTrans, CblasNoTrans, rows, in, out_features, dout, ld_out, weight, in,
         accumulate_dinp ? T(1) : T(0), dinp, in);
  if (dweight == nullptr || out_features == 0) return;
  const bool overwrite = dweight_write == GradWrite::Overwrite;
  if (rows == 0) {  // a sum over no rows: an overwritten gradient is zero
    if (overwrite) std::fill(dweight, dweight + static_cast<int64_t>(out_features) * in, T(0));
    return;
  }
  gemm(CblasTrans, CblasNoTrans, out_features, in, rows, dout, out_features, inp, in, overwrite ? T(0) : T(1),
       dweight, in);
}

template void matmul_fwd<float>(float*, const float*, const float*, int64_t, int64_t, int64_t);
template void matmul_fwd<double>(double*, const double*, const double*, int64_t, int64_t, int64_t);
template void matmul_bwd<float>(float*, float*, const float*, const float*, const float*, int64_t, int64_t,
                                int64_t, bool, GradWrite);
template void matmul_bwd<double>(double*, double*, const double*, const double*, const double*, int64_t,
                                 int64_t, int64_t, bool, GradWrite);

}  // namespace tuna::cpu
