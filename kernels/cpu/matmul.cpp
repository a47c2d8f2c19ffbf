// Linear layers through BLAS (OpenBLAS cblas), CPU twin of kernels/matmul.cu. Row-major throughout;
// weights in nn.Linear's [out_features, in_features] layout.
//
//   forward:  out[n, oc]     = inp[n, ic] @ weight[oc, ic]^T          OVERWRITTEN
//   backward: dinp[n, ic]    = or += dout[n, oc] @ weight[oc, ic]     by accumulate_dinp; skipped if null
//             dweight[oc, ic] = or += dout[n, oc]^T @ inp[n, ic]      by dweight_write; skipped if null
//   gemm:     c = alpha op(a) op(b) + beta c, with leading dimensions   what the three above are made of
//
// With beta = 0 BLAS does not read C, so an overwritten output may hold anything (even NaN) beforehand.
#include "kernels/cpu/matmul.h"

#include <cblas.h>

#include <omp.h>

#include <algorithm>
#include <atomic>
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

void blas_gemm(CBLAS_TRANSPOSE trans_a, CBLAS_TRANSPOSE trans_b, int m, int n, int k, float alpha, const float* a,
               int lda, const float* b, int ldb, float beta, float* c, int ldc) {
  cblas_sgemm(CblasRowMajor, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void blas_gemm(CBLAS_TRANSPOSE trans_a, CBLAS_TRANSPOSE trans_b, int m, int n, int k, double alpha, const double* a,
               int lda, const double* b, int ldb, double beta, double* c, int ldc) {
  cblas_dgemm(CblasRowMajor, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// Below this many multiply-adds a GEMM runs on one thread as a whole (a parallel region costs more).
constexpr double kMinSplitWork = double(1 << 20);
constexpr int kBlock = 16;  // rows or columns per thread in multiples of the kernels' tile

std::atomic<int64_t> gemm_calls{0}, gemm_multiply_adds{0};

// C split over tuna's OpenMP threads, each running BLAS on its block alone (OpenBLAS's OpenMP build runs
// single-threaded inside a parallel region). OpenBLAS's own threading synchronizes its threads by yielding
// inside every GEMM: at a small model's sizes (1024 x 128 x 128, the demo step) the second core spent most of
// its time in sched_yield and the 2-thread step gained 1.19x over one thread. BLAS copies both operands into panels
// of its own, and each thread copies the operand that is not split whole, so C is split along its longer side: by
// rows when it has at least as many rows as columns, else by columns. Split by rows, the loss head's 85 x 49,152
// logits of a chunk had each thread copy the whole 49,152 x 576 table, and an adapter's 16 x in dA had too few rows to
// split at all (it ran on one thread). An element of C is the same sum over k in the same order however C is split,
// so results stay independent of the thread count.
template <typename T>
void split_gemm(CBLAS_TRANSPOSE trans_a, CBLAS_TRANSPOSE trans_b, int m, int n, int k, T alpha, const T* a, int lda,
                const T* b, int ldb, T beta, T* c, int ldc) {
  ensure_blas_kernels();  // done at load already; this keeps the object that does it linked (core/blas.h)
  gemm_calls.fetch_add(1, std::memory_order_relaxed);
  gemm_multiply_adds.fetch_add(int64_t(m) * n * k, std::memory_order_relaxed);
  const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  const bool by_rows = m >= 2 * kBlock && (m >= n || n < 2 * kBlock);
  if (threads == 1 || double(m) * n * k < kMinSplitWork || (!by_rows && n < 2 * kBlock)) {
    blas_gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  const int extent = by_rows ? m : n, blocks = (extent + kBlock - 1) / kBlock;
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int i0 = std::min(extent, blocks * t / nt * kBlock), i1 = std::min(extent, blocks * (t + 1) / nt * kBlock);
    if (i1 > i0 && by_rows) {
      // op(A)'s row i: row i of A, or column i of A stored transposed.
      const T* a_rows = trans_a == CblasNoTrans ? a + static_cast<int64_t>(i0) * lda : a + i0;
      blas_gemm(trans_a, trans_b, i1 - i0, n, k, alpha, a_rows, lda, b, ldb, beta, c + static_cast<int64_t>(i0) * ldc,
                ldc);
    } else if (i1 > i0) {
      // op(B)'s column j: column j of B, or row j of B stored transposed.
      const T* b_cols = trans_b == CblasNoTrans ? b + i0 : b + static_cast<int64_t>(i0) * ldb;
      blas_gemm(trans_a, trans_b, m, i1 - i0, k, alpha, a, lda, b_cols, ldb, beta, c + i0, ldc);
    }
  }
}

}  // namespace

template <typename T>
void matmul_fwd(T* out, const T* inp, const T* weight, int64_t n, int64_t ic, int64_t oc) {
  const int rows = blas_dim(n, "n"), in = blas_dim(ic, "ic"), out_features = blas_dim(oc, "oc");
  if (rows == 0 || out_features == 0) return;
  // lda/ldb/ldc may not be 0 even for empty matrices, hence the max(1, .) on the leading dimensions.
  split_gemm(CblasNoTrans, CblasTrans, rows, out_features, in, T(1), inp, in > 0 ? in : 1, weight, in > 0 ? in : 1,
             T(0), out, out_features);
}

template <typename T>
void matmul_bwd(T* dinp, T* dweight, const T* dout, const T* inp, const T* weight, int64_t n, int64_t ic,
                int64_t oc, bool accumulate_dinp, GradWrite dweight_write) {
  const int rows = blas_dim(n, "n"), in = blas_dim(ic, "ic"), out_features = blas_dim(oc, "oc");
  if (in == 0) return;
  const int ld_out = out_features > 0 ? out_features : 1;
  if (dinp != nullptr && rows > 0)
    split_gemm(CblasNoTrans, CblasNoTrans, rows, in, out_features, T(1), dout, ld_out, weight, in,
               accumulate_dinp ? T(1) : T(0), dinp, in);
  if (dweight == nullptr || out_features == 0) return;
  const bool overwrite = dweight_write == GradWrite::Overwrite;
  if (rows == 0) {  // a sum over no rows: an overwritten gradient is zero
    if (overwrite) std::fill(dweight, dweight + static_cast<int64_t>(out_features) * in, T(0));
    return;
  }
  split_gemm(CblasTrans, CblasNoTrans, out_features, in, rows, T(1), dout, out_features, inp, in,
             overwrite ? T(0) : T(1), dweight, in);
}

template <typename T>
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
          int64_t ldb, T beta, T* c, int64_t ldc) {
  const int rows = blas_dim(m, "m"), cols = blas_dim(n, "n"), depth = blas_dim(k, "k");
  // Row-major leading dimensions: at least the stored rows' width (and 1 for an empty one, as BLAS requires).
  const int64_t a_width = trans_a ? m : k, b_width = trans_b ? k : n;
  TUNA_CHECK(lda >= std::max<int64_t>(1, a_width) && ldb >= std::max<int64_t>(1, b_width) &&
                 ldc >= std::max<int64_t>(1, n),
             "gemm: lda ", lda, ", ldb ", ldb, ", ldc ", ldc, " for m ", m, ", n ", n, ", k ", k);
  if (rows == 0 || cols == 0) return;
  if (depth == 0) {  // an empty sum: c = beta c (BLAS would do the same; this keeps beta = 0 from reading c)
    for (int64_t i = 0; i < m; i++)
      for (int64_t j = 0; j < n; j++) c[i * ldc + j] = beta == T(0) ? T(0) : beta * c[i * ldc + j];
    return;
  }
  split_gemm(trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, rows, cols, depth, alpha, a,
             blas_dim(lda, "lda"), b, blas_dim(ldb, "ldb"), beta, c, blas_dim(ldc, "ldc"));
}

GemmCount gemm_count() {
  return GemmCount{gemm_calls.load(std::memory_order_relaxed), gemm_multiply_adds.load(std::memory_order_relaxed)};
}

template void matmul_fwd<float>(float*, const float*, const float*, int64_t, int64_t, int64_t);
template void matmul_fwd<double>(double*, const double*, const double*, int64_t, int64_t, int64_t);
template void matmul_bwd<float>(float*, float*, const float*, const float*, const float*, int64_t, int64_t,
                                int64_t, bool, GradWrite);
template void matmul_bwd<double>(double*, double*, const double*, const double*, const double*, int64_t,
                                 int64_t, int64_t, bool, GradWrite);
template void gemm<float>(bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*, int64_t,
                          float, float*, int64_t);
template void gemm<double>(bool, bool, int64_t, int64_t, int64_t, double, const double*, int64_t, const double*,
                           int64_t, double, double*, int64_t);

}  // namespace tuna::cpu
