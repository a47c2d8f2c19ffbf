// Scratch sizes of the GPU ops, in plain C++: the launchers (kernels/*.cu) return these from their
// *_scratch_* functions, and the memory plan (model/memory_plan_gpu.cpp), which runs in every build (build/plan
// prices GPUs on any machine), sizes the same buffers with them, so the plan and the allocation cannot differ.
#pragma once

#include <cstdint>

#include "kernels/attention_path.h"

namespace tuna::gpu_scratch {

// rmsnorm_bwd: per-slab partial sums of dweight, slabs of 32 rows (kernels/rmsnorm.cu says why 32).
constexpr int64_t kRmsnormSlabRows = 32;
inline int64_t rmsnorm_bwd_floats(int64_t n, int64_t dim) {
  return (n + kRmsnormSlabRows - 1) / kRmsnormSlabRows * dim;
}
// attention_bwd: D = rowsum(dout * out), [batch, n_heads, seq_len] (kernels/attention.cu); and for the hopper
// path (kernels/attention_sm90_kernels.cuh) the fp32 dQ accumulator [batch, n_heads, seq_pad, head_dim]
// (seq_pad: seq_len rounded up to its 64-query step), an int flag per (batch, head, query block) ordering
// the additions into it, and after the flags one int: the launch's ticket counter (which CTA does which key
// block). Offsets and the total in floats, each section 256-byte aligned.
struct AttentionBwdScratch {
  static constexpr int64_t kHopperBlockM = 64;  // queries per step of the hopper backward
  int64_t m_blocks, seq_pad, delta, accum, flags, floats;
};
inline AttentionBwdScratch attention_bwd_layout(int64_t batch, int64_t seq_len, int64_t n_heads, int64_t head_dim,
                                                bool hopper) {
  const auto aligned = [](int64_t floats) { return (floats + 63) / 64 * 64; };
  AttentionBwdScratch s;
  s.m_blocks = (seq_len + AttentionBwdScratch::kHopperBlockM - 1) / AttentionBwdScratch::kHopperBlockM;
  s.seq_pad = s.m_blocks * AttentionBwdScratch::kHopperBlockM;
  s.delta = 0;
  s.accum = aligned(batch * n_heads * seq_len);
  s.flags = s.accum + aligned(batch * n_heads * s.seq_pad * head_dim);
  s.floats = hopper ? s.flags + aligned(batch * n_heads * s.m_blocks + 1) : batch * seq_len * n_heads;
  return s;
}
// The hopper parts only where the path may be hopper (attention_path.h) and
// the head dim is one it serves; head_dim 128 (the default) bounds 64.
inline int64_t attention_bwd_floats(int64_t batch, int64_t seq_len, int64_t n_heads, int64_t head_dim = 128,
                                    AttentionPath path = AttentionPath::kDefault) {
  const bool hopper = attention_hopper_possible(path) && (head_dim == 64 || head_dim == 128);
  return attention_bwd_layout(batch, seq_len, n_heads, head_dim, hopper).floats;
}
// sum_of_squares: one double per block of its fixed grid (kernels/adamw.cu).
inline int64_t sum_of_squares_doubles() { return 1024; }

}  // namespace tuna::gpu_scratch
