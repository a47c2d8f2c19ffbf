// NcclComm: the collectives on device buffers through NCCL, enqueued on one CUDA stream (CUDA builds with
// NCCL only; TUNA_NCCL). The unique id travels from group rank 0 over the host comm (MPI), which also
// creates the sub-groups of split(). Element counts follow shard_range; where NCCL needs equal pieces
// (reduce-scatter, all-gather) the buffers are padded into a scratch buffer of ceil(n / size) * size.
//
// Failure: waits (wait(), barrier(), wait_event()) poll the stream or an event with a deadline and
// ncclCommGetAsyncError; on timeout the communicator is aborted (ncclCommAbort) so that no rank stays
// inside NCCL, and the error names the collective and the rank, as MpiComm's does. wait_event is how the model's
// host waits for its compute stream, where the tp collectives run: a tp peer that hangs stops this rank there.
//
// Set-up: the communicator takes at most NcclOptions::max_ctas CTAs (ncclCommInitRankConfig; the pipeline's comm
// takes few), and the padding scratch is allocated once, at the size the memory plan gives (reserve_scratch); a
// collective that needs more grows it, with a warning, since the cudaFree that growing takes synchronizes the device.
//
// Point to point: send_start/recv_start only queue the call; the queue runs as one NCCL group (ncclGroupStart,
// ncclSend/ncclRecv..., ncclGroupEnd) on the stream at the next wait() or any other call. Run one by one on one
// stream, a pair's send and recv in both directions would each wait for the other's; grouped, NCCL pairs them.
// Each request is an event recorded after the group; wait() polls it like a collective's. NCCL cannot see a count
// mismatch between a send and its recv.
//
// Unverified on this CPU machine: it compiles in CUDA builds; scripts/gpu-check.sh runs it on a GPU.
#if TUNA_NCCL

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <thread>
#include <vector>

#include "core/cuda_check.h"  // TUNA_CUDA_CHECK, TUNA_NCCL_CHECK
#include "core/error.h"
#include "comm/comm.h"

namespace tuna {

namespace {

ncclDataType_t nccl_type(CommType t) {
  switch (t) {
    case CommType::F32: return ncclFloat32;
    case CommType::F64: return ncclFloat64;
    case CommType::I64: return ncclInt64;
    case CommType::BF16: return ncclBfloat16;
  }
  return ncclFloat32;
}

class NcclComm final : public Comm {
 public:
  NcclComm(std::unique_ptr<Comm> host, cudaStream_t stream, double timeout_s, const NcclOptions& options)
      : Comm(host->rank(), host->size()), host_(std::move(host)), stream_(stream), timeout_s_(timeout_s),
        options_(options) {
    ncclUniqueId id;
    if (rank() == 0) TUNA_NCCL_CHECK(ncclGetUniqueId(&id));
    host_->broadcast(&id, sizeof id, 0, "nccl unique id");
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    if (options_.max_ctas > 0) config.minCTAs = 1, config.maxCTAs = options_.max_ctas;
    TUNA_NCCL_CHECK(ncclCommInitRankConfig(&comm_, size(), id, rank(), &config));
  }
  ~NcclComm() override {
    if (scratch_) cudaFree(scratch_);
    for (auto& [_, e] : events_) cudaEventDestroy(e.event);
    if (comm_) ncclCommDestroy(comm_);
  }
  std::string backend() const override { return "nccl"; }

  void all_reduce(void* buf, int64_t n, CommType type, ReduceOp op, const char* what) override {
    flush();
    TUNA_NCCL_CHECK(ncclAllReduce(buf, buf, n, nccl_type(type), op == ReduceOp::Sum ? ncclSum : ncclMax, comm_, stream_));
    last_ = str("all_reduce '", what, "'");
  }

  // bf16 moves as bf16 (ncclBfloat16: half the bytes of fp32). NCCL adds in fp32 and rounds at each step of its
  // ring, so beyond two ranks the sum may differ from the fp32 sum rounded once in its last bit, as its bf16
  // all-reduce does.
  void reduce_scatter(const void* send, void* recv, int64_t n, CommType type, const char* what) override {
    check_reduce_scatter_type(type, what);
    flush();
    const int64_t chunk = (n + size() - 1) / size(), bytes = comm_type_bytes(type);
    const Range mine = shard_range(n, rank(), size());
    // Scratch: the padded input (chunk * size elements), then one padded piece.
    const auto padded = [&] { return reinterpret_cast<char*>(scratch((chunk * (size() + 1) * bytes + 3) / 4)); };
    const void* src = send;
    if (chunk * size() != n) {  // pad the input so every rank sends `chunk` elements per peer
      char* p = padded();
      TUNA_CUDA_CHECK(cudaMemsetAsync(p + n * bytes, 0, (chunk * size() - n) * bytes, stream_));
      TUNA_CUDA_CHECK(cudaMemcpyAsync(p, send, n * bytes, cudaMemcpyDeviceToDevice, stream_));
      src = p;
    }
    void* out = mine.size() == chunk ? recv : padded() + chunk * size() * bytes;
    TUNA_NCCL_CHECK(ncclReduceScatter(src, out, chunk, nccl_type(type), ncclSum, comm_, stream_));
    if (out != recv && mine.size() > 0)
      TUNA_CUDA_CHECK(cudaMemcpyAsync(recv, out, mine.size() * bytes, cudaMemcpyDeviceToDevice, stream_));
    last_ = str("reduce_scatter '", what, "'");
  }

  void all_gather(const void* send, void* recv, int64_t n, CommType type, const char* what) override {
    flush();
    const int64_t chunk = (n + size() - 1) / size(), bytes = comm_type_bytes(type);
    const Range mine = shard_range(n, rank(), size());
    if (chunk * size() == n) {
      TUNA_NCCL_CHECK(ncclAllGather(send, recv, chunk, nccl_type(type), comm_, stream_));
    } else {  // gather padded pieces into scratch, then copy the n real elements out
      char* padded = reinterpret_cast<char*>(scratch((chunk * size() * bytes + 3) / 4));
      TUNA_CUDA_CHECK(cudaMemcpyAsync(padded + chunk * rank() * bytes, send, mine.size() * bytes,
                                      cudaMemcpyDeviceToDevice, stream_));
      TUNA_NCCL_CHECK(ncclAllGather(padded + chunk * rank() * bytes, padded, chunk, nccl_type(type), comm_, stream_));
      TUNA_CUDA_CHECK(cudaMemcpyAsync(recv, padded, n * bytes, cudaMemcpyDeviceToDevice, stream_));
    }
    last_ = str("all_gather '", what, "'");
  }

  // Enqueued on the stream like every op; the request is an event the caller's compute waits on.
  CommRequest all_gather_start(const void* send, void* recv, int64_t n, CommType type, const char* what) override {
    all_gather(send, recv, n, type, what);
    Event& e = events_[++next_request_];
    TUNA_CUDA_CHECK(cudaEventCreateWithFlags(&e.event, cudaEventDisableTiming));
    TUNA_CUDA_CHECK(cudaEventRecord(e.event, stream_));
    e.label = last_;
    return next_request_;
  }

  CommRequest send_start(const void* buf, int64_t n, CommType type, int peer, const char* what) override {
    check_peer(peer, n, "send", what);
    queued_.push_back({const_cast<void*>(buf), n, type, peer, false, ++next_request_,
                       str("send '", what, "' (", n, " elements to rank ", peer, ")")});
    return next_request_;
  }

  CommRequest recv_start(void* buf, int64_t n, CommType type, int peer, const char* what) override {
    check_peer(peer, n, "recv", what);
    queued_.push_back({buf, n, type, peer, true, ++next_request_,
                       str("recv '", what, "' (", n, " elements from rank ", peer, ")")});
    return next_request_;
  }

  void wait(CommRequest request) override {
    flush();
    auto it = events_.find(request);
    TUNA_CHECK(it != events_.end(), "unknown or already completed request ", request);
    poll([&] { return cudaEventQuery(it->second.event); }, it->second.label);
    cudaEventDestroy(it->second.event);
    events_.erase(it);
  }

  // The stream waits for the request's event; the event stays for wait(), whose bounded poll the caller still runs.
  void wait_on_stream(CommRequest request, void* stream) override {
    flush();
    auto it = events_.find(request);
    TUNA_CHECK(it != events_.end(), "unknown or already completed request ", request);
    TUNA_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), it->second.event, 0));
  }

  // Enqueues the queued sends and recvs as one group, and an event per request after it.
  void flush() override {
    if (queued_.empty()) return;
    std::vector<P2p> group;
    group.swap(queued_);
    TUNA_NCCL_CHECK(ncclGroupStart());
    for (const P2p& p : group) {
      if (p.is_recv) TUNA_NCCL_CHECK(ncclRecv(p.buf, p.n, nccl_type(p.type), p.peer, comm_, stream_));
      else TUNA_NCCL_CHECK(ncclSend(p.buf, p.n, nccl_type(p.type), p.peer, comm_, stream_));
    }
    TUNA_NCCL_CHECK(ncclGroupEnd());
    std::string labels;
    for (const P2p& p : group) labels += str(labels.empty() ? "" : ", ", p.label);
    for (const P2p& p : group) {
      Event& e = events_[p.request];
      TUNA_CUDA_CHECK(cudaEventCreateWithFlags(&e.event, cudaEventDisableTiming));
      TUNA_CUDA_CHECK(cudaEventRecord(e.event, stream_));
      e.label = group.size() == 1 ? labels : str(p.label, " (in a group with ", labels, ")");
    }
    last_ = labels;
  }

  void broadcast(void* buf, int64_t bytes, int root, const char* what) override {
    flush();
    TUNA_NCCL_CHECK(ncclBroadcast(buf, buf, bytes, ncclUint8, root, comm_, stream_));
    last_ = str("broadcast '", what, "'");
  }

  bool wait_event(void* cuda_event, const char* what) override {
    flush();
    poll([&] { return cudaEventQuery(static_cast<cudaEvent_t>(cuda_event)); },
         str(what, " (this group's last call: ", last_.empty() ? "none" : last_, ")"));
    return true;
  }

  void reserve_scratch(int64_t bytes) override {
    reserved_ = true;
    if (bytes > 0) scratch((bytes + 3) / 4);
  }

  void barrier(const char* what) override {
    flush();
    // A one-element all-reduce on a private device word, then a bounded wait for the stream.
    float* word = scratch(1);
    TUNA_NCCL_CHECK(ncclAllReduce(word, word, 1, ncclFloat32, ncclSum, comm_, stream_));
    poll([&] { return cudaStreamQuery(stream_); }, str("barrier '", what, "'"));
  }

  std::unique_ptr<Comm> split(int color, int key) override {
    flush();
    return std::make_unique<NcclComm>(host_->split(color, key), stream_, timeout_s_, options_);
  }

 private:
  struct Event {
    cudaEvent_t event = nullptr;
    std::string label;
  };

  struct P2p {
    void* buf;
    int64_t n;
    CommType type;
    int peer;
    bool is_recv;
    CommRequest request;
    std::string label;
  };

  float* scratch(int64_t n) {
    if (n > scratch_n_) {
      if (reserved_)
        std::fprintf(stderr, "warning: rank %d of %d (nccl): the padding scratch grows from %lld to %lld bytes in the "
                     "middle of a pass (a device-wide synchronization); the memory plan's 'NCCL padding scratch' row "
                     "undercounts this comm's largest padded collective (%s)\n", rank(), size(),
                     static_cast<long long>(scratch_n_ * 4), static_cast<long long>(n * 4), last_.c_str());
      TUNA_CUDA_CHECK(cudaStreamSynchronize(stream_));
      if (scratch_) TUNA_CUDA_CHECK(cudaFree(scratch_));
      TUNA_CUDA_CHECK(cudaMalloc(&scratch_, n * sizeof(float)));
      scratch_n_ = n;
    }
    return scratch_;
  }

  template <typename Query>
  void poll(Query query, const std::string& label) {
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      cudaError_t rc = query();
      if (rc == cudaSuccess) return;
      if (rc != cudaErrorNotReady) TUNA_CUDA_CHECK(rc);
      ncclResult_t async = ncclSuccess;
      TUNA_NCCL_CHECK(ncclCommGetAsyncError(comm_, &async));
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (async != ncclSuccess || (timeout_s_ > 0 && waited > timeout_s_)) {
        ncclCommAbort(comm_);
        comm_ = nullptr;
        std::fprintf(stderr, "error: rank %d of %d (nccl): %s did not complete within %.0f s (--comm_timeout)%s%s\n",
                     rank(), size(), label.c_str(), waited, async != ncclSuccess ? ": " : "",
                     async != ncclSuccess ? ncclGetErrorString(async) : "");
        std::fflush(stderr);
        abort_job(1);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  std::unique_ptr<Comm> host_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_;
  double timeout_s_;
  NcclOptions options_;
  float* scratch_ = nullptr;
  int64_t scratch_n_ = 0;
  bool reserved_ = false;  // reserve_scratch sized it
  std::map<CommRequest, Event> events_;
  std::vector<P2p> queued_;  // send/recv started, not yet enqueued (flush)
  CommRequest next_request_ = 0;
  std::string last_;
};

}  // namespace

std::unique_ptr<Comm> make_nccl_comm(std::unique_ptr<Comm> host, void* stream, double timeout_s,
                                     const NcclOptions& options) {
  TUNA_CHECK(options.max_ctas >= 0, "NcclOptions::max_ctas ", options.max_ctas);
  return std::make_unique<NcclComm>(std::move(host), static_cast<cudaStream_t>(stream), timeout_s, options);
}

}  // namespace tuna

#endif  // TUNA_NCCL
