// NF4 dequantization on the GPU: a decoder layer's frozen NF4 weights (QLoRA) into bf16 for its GEMMs.
// Contract of kernels/cpu/nf4.h (nf4_dequantize to bf16 bits), bit for bit.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace tuna::cuda {

constexpr int kNf4MaxTensors = 8;  // a layer has seven projections

// One tensor's NF4 state on the device (layout: kernels/cpu/nf4.h) and where its bf16 weights go.
struct Nf4Dequant {
  __nv_bfloat16* out = nullptr;       // [n]
  const uint8_t* packed = nullptr;    // [ceil(n / 2)]
  const uint8_t* qabsmax = nullptr;   // [ceil(n / 64)]
  const float* absmax2 = nullptr;     // [ceil(n / 16384)]
  float offset = 0;
  int64_t n = 0;
};

// out[i] = bf16(nf4[code[i]] * absmax[i / 64]), absmax[b] = map[qabsmax[b]] * absmax2[b / 256] + offset, for each
// of `count` tensors (<= kNf4MaxTensors), in one launch. OVERWRITES each out[0, n). A tensor with n % 16 == 0,
// out 16-byte and packed 8-byte aligned takes 16-element vectors; any other takes an element-wise path.
void nf4_dequantize(const Nf4Dequant* tensors, int count, cudaStream_t stream);

}  // namespace tuna::cuda
