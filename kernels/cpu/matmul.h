// Linear layers through BLAS, weights in nn.Linear's [out_features, in_features] layout.
// CPU twin of kernels/matmul.cuh (cuBLASLt).
#pragma once
#include <cstdint>

#include "kernels/cpu/grad_write.h"

namespace tuna::cpu {

// out[n, oc] = inp[n, ic] @ weight[oc, ic]^T. Overwrites out.
template <typename T>
void matmul_fwd(T* out, const T* inp, const T* weight, int64_t n, int64_t ic, int64_t oc);

// dinp[n, ic] (= or +=, by accumulate_dinp) dout[n, oc] @ weight[oc, ic]; skipped when dinp is null.
// dweight[oc, ic] (= or +=, by dweight_write) dout^T @ inp; skipped when dweight is null. Overwrite
// (kernels/cpu/grad_write.h) never reads dweight, and with n == 0 writes zeros.
template <typename T>
void matmul_bwd(T* dinp, T* dweight, const T* dout, const T* inp, const T* weight, int64_t n,
                int64_t ic, int64_t oc, bool accumulate_dinp, GradWrite dweight_write);

// c[m, n] (rows ldc apart) = alpha op(a) op(b) + beta c, row-major, op(x) = x or x^T (a: [m, k] or [k, m], lda
// apart; b: [k, n] or [n, k], ldb apart): the one product every function here makes, for products over column
// blocks of wider matrices and with a scale folded in (the adapters' stacked rank-r intermediates, model/llama.cpp).
// beta = 0 never reads c. CPU twin of cuda::MatmulContext::gemm (kernels/matmul.cuh), in row-major terms.
template <typename T>
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
          int64_t ldb, T beta, T* c, int64_t ldc);

// GEMMs this process has run (calls of the functions above with a non-empty product) and their multiply-adds (m n k
// each), counted from the start: what a step computes, asserted by tests (a frozen weight has no weight gradient).
struct GemmCount {
  int64_t calls = 0;
  int64_t multiply_adds = 0;
};
GemmCount gemm_count();

}  // namespace tuna::cpu
