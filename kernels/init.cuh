// Device-side parameter fills (training from scratch and benches: no host round trip of a billion floats).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace tuna::cuda {

// x[i] = stddev * N(0, 1), the normal draw a pure function of (seed, i) (Box-Muller over a counter hash).
// OVERWRITES x. Not the CPU backend's random stream: a run initialized here is reproducible on the GPU only.
void fill_normal(float* x, int64_t n, uint64_t seed, float stddev, cudaStream_t stream);

// x[i] = value. OVERWRITES x.
void fill_constant(float* x, int64_t n, float value, cudaStream_t stream);

}  // namespace tuna::cuda
