// The element-wise parts of a LoRA adapter on the GPU (model/lora.h), twins of kernels/cpu/lora.h: PEFT's dropout
// on the adapter's input, drawn from the counter-based stream of model/lora.h (so a mask here is bit-equal to the
// CPU model's, and the backward regenerates the forward's instead of keeping it), and the alpha / r scale of the
// r-wide intermediate. The adapter's GEMMs are kernels/matmul.cuh's.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace tuna::cuda {

// dst[row, j] (= or +=, by accumulate) keep(row * global_in + col0 + j) ? src[row, j] / (1 - p) : 0, for rows x in
// elements, both contiguous [rows, in]. keep is lora_dropout_keeps(stream, index, p) (model/lora.h); col0 and
// global_in place this tensor-parallel rank's columns in the whole layer's input. The product src / (1 - p) is
// taken in fp32 and rounded once; accumulating adds it to dst in fp32 and rounds once more. dst may equal src
// (then accumulate is false).
void lora_dropout(__nv_bfloat16* dst, const __nv_bfloat16* src, int64_t rows, int64_t in, int64_t global_in,
                  int64_t col0, uint64_t stream_key, double p, bool accumulate, cudaStream_t stream);

// x[i] = bf16(s * x[i]) for count elements, in fp32.
void scale_bf16(__nv_bfloat16* x, int64_t count, float s, cudaStream_t stream);

}  // namespace tuna::cuda
