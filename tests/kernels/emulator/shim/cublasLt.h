// Stands in for CUDA's <cublasLt.h> in the emulated build only: the status codes that core/cuda_check.h
// names, and the types kernels/matmul.cuh declares MatmulContext with. cuBLASLt itself is not emulated:
// the emulated build links tests/kernels/emulator/matmul_host.cpp, a host test double of kernels/matmul.cu.
#pragma once
#include <cstdint>

typedef enum {
  CUBLAS_STATUS_SUCCESS = 0,
  CUBLAS_STATUS_NOT_INITIALIZED = 1,
  CUBLAS_STATUS_ALLOC_FAILED = 3,
  CUBLAS_STATUS_INVALID_VALUE = 7,
  CUBLAS_STATUS_ARCH_MISMATCH = 8,
  CUBLAS_STATUS_MAPPING_ERROR = 11,
  CUBLAS_STATUS_EXECUTION_FAILED = 13,
  CUBLAS_STATUS_INTERNAL_ERROR = 14,
  CUBLAS_STATUS_NOT_SUPPORTED = 15,
  CUBLAS_STATUS_LICENSE_ERROR = 16,
} cublasStatus_t;

// library_types.h's element types (those matmul.cuh uses), with CUDA's values.
typedef enum cudaDataType_t {
  CUDA_R_32F = 0,
  CUDA_R_16BF = 14,
  CUDA_R_8F_E4M3 = 28,
  CUDA_R_8F_E5M2 = 29,
} cudaDataType_t;

typedef struct cublasLtContext* cublasLtHandle_t;
typedef struct cublasLtMatmulDescOpaque_t* cublasLtMatmulDesc_t;
typedef struct cublasLtMatrixLayoutOpaque_t* cublasLtMatrixLayout_t;
typedef struct {
  uint64_t data[8];
} cublasLtMatmulAlgo_t;
