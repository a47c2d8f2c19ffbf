// Scratch sizes of the GPU ops, in plain C++: the launchers (kernels/*.cu) return these from their
// *_scratch_* functions, and the memory plan (model/memory_plan_gpu.cpp), which runs in every build (build/plan
// prices GPUs on any machine), sizes the same buffers with them, so the plan and the allocation cannot differ.
#pragma once

#include <cstdint>

namespace tuna::gpu_scratch {

// rmsnorm_bwd: per-slab partial sums of dweight, slabs of 32 rows (kernels/rmsnorm.cu says why 32).
constexpr int64_t kRmsnormSlabRows = 32;
inline int64_t rmsnorm_bwd_floats(int64_t n, int64_t dim) {
  return (n + kRmsnormSlabRows - 1) / kRmsnormSlabRows * dim;
}
// attention_bwd: D = rowsum(dout * out), [batch, n_heads, seq_len] (kernels/attention.cu).
inline int64_t attention_bwd_floats(int64_t batch, int64_t seq_len, int64_t n_heads) {
  return batch * seq_len * n_heads;
}
// sum_of_squares: one double per block of its fixed grid (kernels/adamw.cu).
inline int64_t sum_of_squares_doubles() { return 1024; }

}  // namespace tuna::gpu_scratch
