// core/cuda_check.h — the error idiom of core/error.h, for CUDA, cuBLAS(Lt) and NCCL calls.
//
//   TUNA_CUDA_CHECK(cudaMemcpyAsync(...));     any cudaError_t-returning call
//   TUNA_CUBLAS_CHECK(cublasLtMatmul(...));    any cublasStatus_t-returning call
//   TUNA_NCCL_CHECK(ncclAllReduce(...));       any ncclResult_t-returning call (include <nccl.h> first)
//   TUNA_CUDA_CHECK_LAUNCH();                  after a <<<...>>> launch: the launch's own error
//
// A failure throws tuna::Error whose message names the failing statement, the library's error string, the
// file and the line: "CUDA error: cudaMalloc(&p, bytes) failed: out of memory (kernels/x.cu:42)". These are
// developer-facing failures (a broken precondition, a lost device), so they carry the source location; the
// trainer's main catches tuna::Error like any other. dist/ may prefix the rank when it rethrows.
//
// Plain C++: usable from .cpp files (g++ with -I/usr/local/cuda/include) as well as from .cu files.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "core/error.h"

namespace tuna::detail {

[[noreturn]] inline void cuda_fail(const char* library, const char* statement, const char* message,
                                   const char* file, int line) {
  fail(library, " error: ", statement, " failed: ", message, " (", file, ":", line, ")");
}

inline const char* cublas_status_name(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
    default: return "unknown cublasStatus_t";
  }
}

}  // namespace tuna::detail

#define TUNA_CUDA_CHECK(statement)                                                                    \
  do {                                                                                                \
    const cudaError_t tuna_cuda_status_ = (statement);                                                \
    if (tuna_cuda_status_ != cudaSuccess)                                                             \
      ::tuna::detail::cuda_fail("CUDA", #statement, cudaGetErrorString(tuna_cuda_status_), __FILE__, \
                                __LINE__);                                                            \
  } while (0)

// The launch itself (bad configuration, too much shared memory, no kernel image for this device). Errors
// raised while the kernel runs surface at the next synchronizing call's check.
#define TUNA_CUDA_CHECK_LAUNCH() TUNA_CUDA_CHECK(cudaGetLastError())

#define TUNA_CUBLAS_CHECK(statement)                                                                 \
  do {                                                                                               \
    const cublasStatus_t tuna_cublas_status_ = (statement);                                          \
    if (tuna_cublas_status_ != CUBLAS_STATUS_SUCCESS)                                                \
      ::tuna::detail::cuda_fail("cuBLAS", #statement,                                                \
                                ::tuna::detail::cublas_status_name(tuna_cublas_status_), __FILE__,   \
                                __LINE__);                                                           \
  } while (0)

#define TUNA_NCCL_CHECK(statement)                                                                        \
  do {                                                                                                    \
    const ncclResult_t tuna_nccl_status_ = (statement);                                                   \
    if (tuna_nccl_status_ != ncclSuccess)                                                                 \
      ::tuna::detail::cuda_fail("NCCL", #statement, ncclGetErrorString(tuna_nccl_status_), __FILE__,      \
                                __LINE__);                                                                \
  } while (0)
