// A device comm with jitter: every call forwarded to the comm it wraps, and random-length sleep kernels
// (kernels/sleep.cuh) queued on the comm's stream before each send and recv, and on the stream handed to
// wait_on_stream (the compute) before it waits. On one GPU the pipeline's transfers and passes then run in orders
// other than the host queued them in: a transfer late against the pass after it, a pass late against the transfer
// that reads what it writes. A missing event shows as wrong numbers, as it would across GPUs. The delays are drawn
// from a seed (a seed is one schedule to try); on the host emulator the kernels return at once, and its concurrent
// streams draw their own delays (emulated_gpu_tests --jitter).
#pragma once

#if TUNA_CUDA

#include <cuda_runtime_api.h>

#include <memory>
#include <random>
#include <string>

#include "comm/comm.h"
#include "kernels/sleep.cuh"

namespace tuna::testing_util {

// A comm that forwards every call to the comm it wraps: the base of test decorators that watch or delay calls.
class ForwardingComm : public Comm {
 public:
  explicit ForwardingComm(std::unique_ptr<Comm> inner) : Comm(inner->rank(), inner->size()), inner_(std::move(inner)) {}
  std::string backend() const override { return inner_->backend(); }
  void all_reduce(void* buf, int64_t n, CommType type, ReduceOp op, const char* what) override {
    inner_->all_reduce(buf, n, type, op, what);
  }
  void reduce_scatter(const void* send, void* recv, int64_t n, CommType type, const char* what) override {
    inner_->reduce_scatter(send, recv, n, type, what);
  }
  void all_gather(const void* send, void* recv, int64_t n, CommType type, const char* what) override {
    inner_->all_gather(send, recv, n, type, what);
  }
  CommRequest all_gather_start(const void* send, void* recv, int64_t n, CommType type, const char* what) override {
    return inner_->all_gather_start(send, recv, n, type, what);
  }
  void wait(CommRequest request) override { inner_->wait(request); }
  void broadcast(void* buf, int64_t bytes, int root, const char* what) override {
    inner_->broadcast(buf, bytes, root, what);
  }
  void barrier(const char* what) override { inner_->barrier(what); }
  std::unique_ptr<Comm> split(int color, int key) override { return inner_->split(color, key); }
  void flush() override { inner_->flush(); }
  bool wait_event(void* cuda_event, const char* what) override { return inner_->wait_event(cuda_event, what); }
  void reserve_scratch(int64_t bytes) override { inner_->reserve_scratch(bytes); }
  CommRequest send_start(const void* buf, int64_t n, CommType type, int peer, const char* what) override {
    return inner_->send_start(buf, n, type, peer, what);
  }
  CommRequest recv_start(void* buf, int64_t n, CommType type, int peer, const char* what) override {
    return inner_->recv_start(buf, n, type, peer, what);
  }
  void wait_on_stream(CommRequest request, void* stream) override { inner_->wait_on_stream(request, stream); }

 protected:
  std::unique_ptr<Comm> inner_;
};

class JitteredComm final : public ForwardingComm {
 public:
  // stream: the comm's own; max_ns: the longest sleep, each uniform in [0, max_ns], none a third of the time.
  JitteredComm(std::unique_ptr<Comm> inner, void* stream, uint64_t seed, int64_t max_ns = 300000)
      : ForwardingComm(std::move(inner)), stream_(static_cast<cudaStream_t>(stream)),
        random_(seed * 0x9E3779B97F4A7C15ull + rank()), max_ns_(max_ns) {}
  std::string backend() const override { return inner_->backend() + " (jittered)"; }
  std::unique_ptr<Comm> split(int color, int key) override {
    return std::make_unique<JitteredComm>(inner_->split(color, key), stream_, random_(), max_ns_);
  }
  CommRequest send_start(const void* buf, int64_t n, CommType type, int peer, const char* what) override {
    cuda::sleep_on_stream(draw(), stream_);
    return inner_->send_start(buf, n, type, peer, what);
  }
  CommRequest recv_start(void* buf, int64_t n, CommType type, int peer, const char* what) override {
    cuda::sleep_on_stream(draw(), stream_);
    return inner_->recv_start(buf, n, type, peer, what);
  }
  void wait_on_stream(CommRequest request, void* stream) override {
    cuda::sleep_on_stream(draw(), static_cast<cudaStream_t>(stream));
    inner_->wait_on_stream(request, stream);
  }

 private:
  int64_t draw() {
    const int64_t x = std::uniform_int_distribution<int64_t>(-max_ns_ / 2, max_ns_)(random_);
    return x > 0 ? x : 0;
  }

  cudaStream_t stream_;
  std::mt19937_64 random_;
  int64_t max_ns_;
};

}  // namespace tuna::testing_util

#endif  // TUNA_CUDA
