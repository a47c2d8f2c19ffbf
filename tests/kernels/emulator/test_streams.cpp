// The emulator's concurrent streams (runtime.h, emulated_gpu_tests --streams concurrent): work runs when its stream
// gets to it, not at the call; an event orders two streams and nothing else does; the legacy default stream waits for
// the blocking streams and they for it, the non-blocking ones not; copies from pageable memory are read at the call,
// from pinned memory when the copy runs; a failure of queued work comes back at the next synchronizing call. Each
// test holds a stream (hold_stream) to make one order certain instead of likely.
//
// Built only into build/emulated_gpu_tests.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "core/cuda_check.h"
#include "core/error.h"
#include "tests/kernels/emulator/runtime.h"

namespace tuna::emulator {
namespace {

// One warp (the emulator runs whole warps), thread 0 writing.
__global__ void write_value(int* x, int value) {
  if (threadIdx.x == 0) *x = value;
}
__global__ void add_one(int* x) {
  if (threadIdx.x == 0) *x += 1;
}

void launch_write(int* x, int value, cudaStream_t stream) {
  launch(Target::kSm80, write_value, dim3(1), dim3(32), 0, stream, x, value);
}
void launch_add_one(int* x, cudaStream_t stream) { launch(Target::kSm80, add_one, dim3(1), dim3(32), 0, stream, x); }

// Streams made in a test run concurrently (with jitter, as the out-of-order runs do), whatever the binary's mode.
class EmulatorStreams : public testing::Test {
 protected:
  void SetUp() override {
    was_ = stream_order();
    set_stream_order(/*concurrent=*/true, /*jitter=*/true, /*jitter_seed=*/5);
    TUNA_CUDA_CHECK(cudaMalloc(&x_, sizeof(int)));
    TUNA_CUDA_CHECK(cudaMemset(x_, 0, sizeof(int)));
    TUNA_CUDA_CHECK(cudaDeviceSynchronize());
  }
  void TearDown() override {
    TUNA_CUDA_CHECK(cudaFree(x_));
    set_stream_order(was_.concurrent, was_.jitter, was_.jitter_seed);
  }
  // The device int, read on the host as the emulated device memory it is (a GPU's would need a copy).
  int peek() const { return *x_; }

  int* x_ = nullptr;
  StreamOrder was_;
};

TEST_F(EmulatorStreams, WorkRunsWhenItsStreamGetsThere) {
  cudaStream_t s;
  TUNA_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const MarkerPtr gate = hold_stream(s);
  launch_write(x_, 7, s);
  EXPECT_EQ(cudaStreamQuery(s), cudaErrorNotReady);
  EXPECT_EQ(peek(), 0) << "the kernel ran at its launch";
  release(gate);
  TUNA_CUDA_CHECK(cudaStreamSynchronize(s));
  EXPECT_EQ(peek(), 7);
  TUNA_CUDA_CHECK(cudaStreamDestroy(s));
}

// b's kernel is queued after a's, but only an event orders them: without one, a held stream lets b run first; with
// a wait on the event recorded after a's kernel, b's runs after it whatever is held.
TEST_F(EmulatorStreams, OnlyAnEventOrdersTwoStreams) {
  cudaStream_t a, b;
  TUNA_CUDA_CHECK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  TUNA_CUDA_CHECK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  cudaEvent_t written;
  TUNA_CUDA_CHECK(cudaEventCreateWithFlags(&written, cudaEventDisableTiming));

  MarkerPtr gate = hold_stream(a);
  launch_write(x_, 1, a);
  launch_add_one(x_, b);
  TUNA_CUDA_CHECK(cudaStreamSynchronize(b));  // b did not wait for a
  EXPECT_EQ(peek(), 1);
  release(gate);
  TUNA_CUDA_CHECK(cudaStreamSynchronize(a));
  EXPECT_EQ(peek(), 1) << "a's write lands after b's add";

  gate = hold_stream(a);
  launch_write(x_, 10, a);
  TUNA_CUDA_CHECK(cudaEventRecord(written, a));
  TUNA_CUDA_CHECK(cudaStreamWaitEvent(b, written, 0));
  launch_add_one(x_, b);
  EXPECT_EQ(cudaEventQuery(written), cudaErrorNotReady);
  release(gate);
  TUNA_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(peek(), 11);

  TUNA_CUDA_CHECK(cudaEventDestroy(written));
  TUNA_CUDA_CHECK(cudaStreamDestroy(a));
  TUNA_CUDA_CHECK(cudaStreamDestroy(b));
}

// cudaMemset runs on the legacy default stream: after a blocking stream's earlier work, not after a non-blocking one's.
TEST_F(EmulatorStreams, TheLegacyStreamWaitsForBlockingStreamsOnly) {
  cudaStream_t blocking, non_blocking;
  TUNA_CUDA_CHECK(cudaStreamCreate(&blocking));
  TUNA_CUDA_CHECK(cudaStreamCreateWithFlags(&non_blocking, cudaStreamNonBlocking));
  MarkerPtr gate = hold_stream(non_blocking);
  launch_write(x_, 3, non_blocking);
  TUNA_CUDA_CHECK(cudaMemset(x_, 0, sizeof(int)));
  TUNA_CUDA_CHECK(cudaStreamSynchronize(nullptr));
  release(gate);
  TUNA_CUDA_CHECK(cudaStreamSynchronize(non_blocking));
  EXPECT_EQ(peek(), 3) << "the memset waited for a non-blocking stream";

  gate = hold_stream(blocking);
  launch_write(x_, 4, blocking);
  TUNA_CUDA_CHECK(cudaMemset(x_, 0, sizeof(int)));
  EXPECT_EQ(cudaStreamQuery(nullptr), cudaErrorNotReady);
  release(gate);
  TUNA_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(peek(), 0) << "the memset ran before the blocking stream's earlier kernel";
  TUNA_CUDA_CHECK(cudaStreamDestroy(blocking));
  TUNA_CUDA_CHECK(cudaStreamDestroy(non_blocking));
}

// A copy from pageable memory reads it before the call returns; from pinned memory, when the copy runs.
TEST_F(EmulatorStreams, PageableCopiesAreReadAtTheCallPinnedOnesWhenTheyRun) {
  cudaStream_t s;
  TUNA_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int pageable = 5;
  int* pinned = nullptr;
  TUNA_CUDA_CHECK(cudaMallocHost(&pinned, sizeof(int)));
  *pinned = 6;

  MarkerPtr gate = hold_stream(s);
  TUNA_CUDA_CHECK(cudaMemcpyAsync(x_, &pageable, sizeof(int), cudaMemcpyHostToDevice, s));
  pageable = 50;
  release(gate);
  TUNA_CUDA_CHECK(cudaStreamSynchronize(s));
  EXPECT_EQ(peek(), 5);

  gate = hold_stream(s);
  TUNA_CUDA_CHECK(cudaMemcpyAsync(x_, pinned, sizeof(int), cudaMemcpyHostToDevice, s));
  *pinned = 60;
  release(gate);
  TUNA_CUDA_CHECK(cudaStreamSynchronize(s));
  EXPECT_EQ(peek(), 60);

  // Device to host lands when the stream gets there: the host synchronizes before it reads.
  gate = hold_stream(s);
  int back = -1;
  TUNA_CUDA_CHECK(cudaMemcpyAsync(&back, x_, sizeof(int), cudaMemcpyDeviceToHost, s));
  EXPECT_EQ(back, -1);
  release(gate);
  TUNA_CUDA_CHECK(cudaStreamSynchronize(s));
  EXPECT_EQ(back, 60);
  TUNA_CUDA_CHECK(cudaFreeHost(pinned));
  TUNA_CUDA_CHECK(cudaStreamDestroy(s));
}

// A kernel that fails (here, a bad operand of queued host work) fails the next call that waits for the device, once.
TEST_F(EmulatorStreams, AFailureOfQueuedWorkComesBackAtTheNextSynchronize) {
  cudaStream_t s;
  TUNA_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  enqueue(s, [] { fail("a queued piece of work failed"); });
  try {
    TUNA_CUDA_CHECK(cudaStreamSynchronize(s));
    ADD_FAILURE() << "the failure did not come back";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("a queued piece of work failed"), std::string::npos) << e.what();
  }
  TUNA_CUDA_CHECK(cudaStreamSynchronize(s));
  TUNA_CUDA_CHECK(cudaStreamDestroy(s));
}

}  // namespace
}  // namespace tuna::emulator
