// int8 row-wise dequantization on the GPU: a decoder layer's frozen int8 weights (--base_quant int8) into bf16 for
// its GEMMs. Contract of kernels/cpu/int8_rowwise.h (int8_rowwise_dequantize to bf16 bits), bit for bit.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace tuna::cuda {

constexpr int kInt8MaxTensors = 8;  // a layer has seven projections

// One weight [rows, cols] in int8 with a scale per row, on the device, and where its bf16 values go.
struct Int8Dequant {
  __nv_bfloat16* out = nullptr;  // [rows, cols]
  const int8_t* q = nullptr;     // [rows, cols]
  const float* scale = nullptr;  // [rows]
  int64_t rows = 0, cols = 0;
};

// out[r, c] = bf16((q[r, c] * scale[r]) * fp32(1/127)) for each of `count` tensors (<= kInt8MaxTensors), in one
// launch. OVERWRITES each out. cols % 16 == 0 with 16-byte aligned out and q takes 16-element vectors; any other
// shape an element-wise path.
void int8_rowwise_dequantize(const Int8Dequant* tensors, int count, cudaStream_t stream);

}  // namespace tuna::cuda
