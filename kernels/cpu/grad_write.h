// How a backward op writes a weight gradient, for the GPU ops and their CPU twins alike (kernels/matmul.cuh,
// kernels/rmsnorm.cuh, kernels/cpu/matmul.h, kernels/cpu/rmsnorm.h).
//
// A step's gradient is a sum over micro-batches (and, within one backward, over the lm_head's row chunks and
// the tied embedding's two uses). The first write of each tensor in a step OVERWRITES, so nobody has to zero
// the gradient first (a memset of 4 bytes per parameter each step); every later write ACCUMULATES. Overwrite
// never reads the destination: it may hold anything, NaN included.
#pragma once

namespace tuna {

enum class GradWrite { Overwrite, Accumulate };

}  // namespace tuna
