// A stream held for a while on the device: what the jittered device comm of the tests queues between the pipeline's
// transfers and passes (tests/comm/jittered_comm.h), so that one GPU runs them in orders other than the one the host
// queued them in. No CPU twin: it computes nothing.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace tuna::cuda {

// Queues on `stream` one warp that spins on the device's clock (__nanosleep between reads) until `nanoseconds` have
// passed, so that the stream's later work starts that much later. The host does not wait. On the host emulator the
// kernel returns at once (its concurrent streams draw their own delays).
void sleep_on_stream(int64_t nanoseconds, cudaStream_t stream);

}  // namespace tuna::cuda
