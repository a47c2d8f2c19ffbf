// The staged device comm (comm/comm.h make_staged_device_comm): device collectives carried by a host comm. Each
// call waits for the stream (the work that produced the device buffers), copies them to pinned host memory,
// runs the host collective, copies the result back and waits again, so when it returns the device buffers hold
// the result and the stream is idle. bf16 sums (all-reduce, reduce-scatter) are widened to fp32 on the host (MPI has
// no bf16 arithmetic) and rounded once. Point to point: a send copies the device buffer to pinned memory of its own
// and starts the host send from there; a recv starts the host recv into pinned memory and copies to the device
// buffer at wait(). On a stream other than the compute's (the pipeline's), the caller orders that stream after the
// compute that wrote a send's buffer (an event); a recv's data is on the device when wait() or wait_on_stream returns.
// CUDA builds only (the emulated build compiles it against the emulator's runtime).
#if TUNA_CUDA

#include <cuda_runtime_api.h>

#include <algorithm>
#include <map>
#include <memory>
#include <vector>

#include "core/cuda_check.h"
#include "core/dtype.h"
#include "core/error.h"
#include "comm/comm.h"

namespace tuna {

namespace {

// A pinned host buffer that grows to the largest request.
class PinnedBuffer {
 public:
  ~PinnedBuffer() {
    if (data_) cudaFreeHost(data_);
  }
  char* get(int64_t bytes) {
    if (bytes > capacity_) {
      if (data_) TUNA_CUDA_CHECK(cudaFreeHost(data_));
      TUNA_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&data_), static_cast<size_t>(bytes)));
      capacity_ = bytes;
    }
    return data_;
  }

 private:
  char* data_ = nullptr;
  int64_t capacity_ = 0;
};

class StagedDeviceComm final : public Comm {
 public:
  StagedDeviceComm(std::unique_ptr<Comm> host, cudaStream_t stream)
      : Comm(host->rank(), host->size()), host_(std::move(host)), stream_(stream) {}
  std::string backend() const override { return "staged " + host_->backend(); }

  void all_reduce(void* buf, int64_t n, CommType type, ReduceOp op, const char* what) override {
    const int64_t bytes = n * comm_type_bytes(type);
    char* staged = to_host(buf, bytes, a_);
    if (type == CommType::BF16) {  // widened: the host comm sums fp32, rounded back to bf16 once
      float* wide = reinterpret_cast<float*>(b_.get(std::max<int64_t>(n, 1) * 4));
      convert_to_f32(staged, DType::BF16, wide, n);
      host_->all_reduce(wide, n, CommType::F32, op, what);
      convert_from_f32(wide, DType::BF16, staged, n);
    } else {
      host_->all_reduce(staged, n, type, op, what);
    }
    to_device(buf, staged, bytes);
  }

  void reduce_scatter(const void* send, void* recv, int64_t n, CommType type, const char* what) override {
    check_reduce_scatter_type(type, what);
    const Range mine = shard_range(n, rank(), size());
    const int64_t bytes = comm_type_bytes(type);
    char* staged = to_host(send, n * bytes, a_);
    float* wide = reinterpret_cast<float*>(staged);
    if (type == CommType::BF16) {  // widened: the host comm sums fp32, this rank's piece rounded back once
      wide = reinterpret_cast<float*>(b_.get(std::max<int64_t>(n, 1) * 4));
      convert_to_f32(staged, DType::BF16, wide, n);
    }
    float* piece = reinterpret_cast<float*>(c_.get(std::max<int64_t>(mine.size(), 1) * 4));
    host_->reduce_scatter(wide, piece, n, what);
    const char* result = reinterpret_cast<const char*>(piece);
    if (type == CommType::BF16) {  // into the staged input, free by now
      convert_from_f32(piece, DType::BF16, staged, mine.size());
      result = staged;
    }
    to_device(recv, result, mine.size() * bytes);
  }

  void all_gather(const void* send, void* recv, int64_t n, CommType type, const char* what) override {
    const int64_t bytes = comm_type_bytes(type);
    const Range mine = shard_range(n, rank(), size());
    char* whole = a_.get(std::max<int64_t>(n * bytes, 1));
    sync();
    if (mine.size() > 0)
      TUNA_CUDA_CHECK(cudaMemcpyAsync(whole + mine.begin * bytes, send, mine.size() * bytes, cudaMemcpyDeviceToHost,
                                      stream_));
    sync();
    host_->all_gather(whole + mine.begin * bytes, whole, n, type, what);
    to_device(recv, whole, n * bytes);
  }

  CommRequest all_gather_start(const void* send, void* recv, int64_t n, CommType type, const char* what) override {
    all_gather(send, recv, n, type, what);  // complete on return (see the file comment)
    return 0;
  }

  CommRequest send_start(const void* buf, int64_t n, CommType type, int peer, const char* what) override {
    check_peer(peer, n, "send", what);
    P2p& p = p2p_[++next_request_];
    p.staging = std::make_unique<PinnedBuffer>();
    char* host = to_host(buf, n * comm_type_bytes(type), *p.staging);
    p.host_request = host_->send_start(host, n, type, peer, what);
    return next_request_;
  }

  CommRequest recv_start(void* buf, int64_t n, CommType type, int peer, const char* what) override {
    check_peer(peer, n, "recv", what);
    P2p& p = p2p_[++next_request_];
    p.staging = std::make_unique<PinnedBuffer>();
    p.bytes = n * comm_type_bytes(type);
    p.device = buf;
    p.host_request = host_->recv_start(p.staging->get(std::max<int64_t>(p.bytes, 1)), n, type, peer, what);
    return next_request_;
  }

  void wait(CommRequest request) override {
    auto it = p2p_.find(request);
    if (it == p2p_.end()) return;  // a collective's: complete when started
    host_->wait(it->second.host_request);
    if (it->second.device) to_device(it->second.device, it->second.staging->get(1), it->second.bytes);
    p2p_.erase(it);
  }

  // Completes the request on the host: a recv's data is on the device (the stream of this comm synchronized) before
  // anything queued on `stream` after this call.
  void wait_on_stream(CommRequest request, void*) override { wait(request); }

  void broadcast(void* buf, int64_t bytes, int root, const char* what) override {
    char* staged = to_host(buf, bytes, a_);
    host_->broadcast(staged, bytes, root, what);
    to_device(buf, staged, bytes);
  }

  void barrier(const char* what) override {
    sync();
    host_->barrier(what);
  }

  std::unique_ptr<Comm> split(int color, int key) override {
    return std::make_unique<StagedDeviceComm>(host_->split(color, key), stream_);
  }

 private:
  void sync() { TUNA_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

  char* to_host(const void* device, int64_t bytes, PinnedBuffer& buffer) {
    char* host = buffer.get(std::max<int64_t>(bytes, 1));
    sync();  // the stream's work on the buffer is done, and the last collective's copies have landed
    if (bytes > 0) TUNA_CUDA_CHECK(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream_));
    sync();
    return host;
  }

  void to_device(void* device, const void* host, int64_t bytes) {
    if (bytes > 0) TUNA_CUDA_CHECK(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream_));
    sync();  // the staging is free for the next call, and the caller may read the result at once
  }

  struct P2p {
    std::unique_ptr<PinnedBuffer> staging;  // the message on the host, until wait()
    CommRequest host_request = 0;
    void* device = nullptr;  // a recv's destination
    int64_t bytes = 0;
  };

  std::unique_ptr<Comm> host_;
  cudaStream_t stream_;
  PinnedBuffer a_, b_, c_;
  std::map<CommRequest, P2p> p2p_;
  CommRequest next_request_ = 0;
};

}  // namespace

std::unique_ptr<Comm> make_staged_device_comm(std::unique_ptr<Comm> host, void* stream) {
  return std::make_unique<StagedDeviceComm>(std::move(host), static_cast<cudaStream_t>(stream));
}

}  // namespace tuna

#endif  // TUNA_CUDA
